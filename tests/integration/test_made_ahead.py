"""What a host backend makes ahead of the creates that take it, and what a destroy leaves
behind it, through the namespace backend alone on a data directory of its own.

Made ahead (``_linux/ready.py``, ``netns.SpareNamespaces``): from a process's second plain
create, workspaces (a disk image, its loop device, the ext4 and overlay mounts) and network
namespaces wait for the next creates. What is checked: a claimed workspace is the sandbox's
alone (its uid owns and writes it, another sandbox's uid cannot enter it, and while it waited
no sandbox's uid could), the sandbox is as isolated as one made at its create, a spare is
never renamed over a directory that exists, a dead process's spares are swept with their
mounts and loop devices, and ``close`` removes a live one's. A destroy returns once nothing
in the mount tree names the sandbox; its loop device is released behind it, within seconds.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from corral._backends._linux import netns
from corral._backends._linux.storage import mounts_under
from corral._backends.namespace import NamespaceBackend
from corral._core import linux
from corral._core.resources import get_tier
from corral._settings import Settings
from corral.backends import ExecOutcome, ExecRequest, SandboxSpec
from corral.errors import BackendError

pytestmark = pytest.mark.needs_root


def _wait_for(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.05)


def _loop_backings() -> list[str]:
    """Every configured loop device's backing file (" (deleted)" once it is unlinked)."""
    found = []
    for device in Path("/sys/block").glob("loop*"):
        try:
            found.append((device / "loop" / "backing_file").read_text().strip())
        except OSError:
            continue  # not configured
    return found


class Host:
    """A namespace backend on a data directory of its own, with the specs it made."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.backend = NamespaceBackend(settings)
        self.uids = iter(range(settings.uid_start, settings.uid_start + settings.uid_count))
        self.made: list[SandboxSpec] = []

    @property
    def sandboxes(self) -> Path:
        return self.settings.home / "sandboxes"

    def spares(self, pid: int | None = None) -> list[str]:
        """The spare workspaces waiting (``pid``'s only, if given)."""
        if not self.sandboxes.exists():
            return []
        prefix = ".ready." if pid is None else f".ready.{pid}."
        return sorted(p.name for p in self.sandboxes.iterdir() if p.name.startswith(prefix))

    def loops(self) -> list[str]:
        return [b for b in _loop_backings() if b.startswith(str(self.sandboxes) + "/")]

    def create(self) -> SandboxSpec:
        spec = SandboxSpec(id=f"sbx_ahd{secrets.token_hex(5)}", uid=next(self.uids),
                           template="base", tier=get_tier("small"))
        self.made.append(spec)
        self.backend.create(spec)
        return spec

    def destroy(self, spec: SandboxSpec) -> None:
        self.backend.destroy(spec)
        self.made.remove(spec)

    def run(self, spec: SandboxSpec, cmd: str) -> ExecOutcome:
        return self.backend.exec(spec, ExecRequest(
            argv=["bash", "-c", cmd], cwd="/workspace", env={}, timeout_s=60,
            command_id=f"cmd_{secrets.token_hex(6)}"))

    def warm(self) -> None:
        """Two creates (the second starts the refill), then spares waiting."""
        for _ in range(2):
            self.destroy(self.create())
        _wait_for("two spare workspaces", lambda: len(self.spares(os.getpid())) == 2)


@pytest.fixture
def host() -> Iterator[Host]:
    outside = Path(tempfile.mkdtemp(prefix="corral-test-ahead-"))
    os.chmod(outside, 0o711)  # bwrap runs as the sandbox's uid and must reach the workspace
    start = 2_140_000_000 + secrets.randbelow(10_000) * 100
    made = Host(Settings(home=outside / "home", uid_start=start, uid_count=100))
    os.chmod(made.settings.home, 0o711)
    try:
        yield made
    finally:
        for spec in list(made.made):
            made.backend.destroy(spec)
        made.backend.sweep(set())
        made.backend.remove_instance()
        made.backend.close()
        left = mounts_under(made.settings.home)
        _wait_for("loop devices released", lambda: made.loops() == [], timeout=30)
        shutil.rmtree(outside, ignore_errors=True)
        assert left == [], left


def test_destroy_leaves_no_mount_or_directory_and_its_loop_device_goes_behind(
    host: Host,
) -> None:
    spec = host.create()
    assert host.run(spec, "echo hi > /workspace/f && cat /workspace/f").stdout == "hi\n"
    assert any(b.startswith(str(host.sandboxes / spec.id)) for b in host.loops())
    host.destroy(spec)
    with open("/proc/self/mountinfo") as f:
        assert [line for line in f if spec.id in line] == []
    assert not (host.sandboxes / spec.id).exists()
    _wait_for("the loop device released",
              lambda: not any(spec.id in b for b in host.loops()), timeout=30)


def test_a_claimed_workspace_is_the_sandboxs_alone(host: Host) -> None:
    host.warm()
    # While it waits, a spare is root's: no sandbox's uid can enter it.
    spare = host.sandboxes / host.spares()[0] / "workspace"
    assert (spare.stat().st_uid, spare.stat().st_mode & 0o777) == (0, 0o700)
    first, second = host.create(), host.create()
    for spec in (first, second):
        root = host.backend._store.mount_point(spec.id)
        assert (root.stat().st_uid, root.stat().st_gid) == (spec.uid, spec.uid)
        out = host.run(spec, "echo mine > /workspace/mine && stat -c '%u %a' /workspace "
                             "&& ls -A /workspace && df --output=size -B1M /workspace | tail -1")
        assert out.exit_code == 0, out.stderr
        owner, listing, size = out.stdout.split("\n", 2)
        # The sandbox sees itself as uid 1000 (the user inside); the disk is the tier's size.
        assert owner == "1000 700"
        assert listing.split() == ["mine"]
        assert abs(int(size) - get_tier("small").disk_bytes / (1 << 20)) < 0.1 * int(size)
    # Another sandbox's uid cannot enter it from the host.
    other = host.backend._store.mount_point(first.id)
    peek = subprocess.run(["setpriv", f"--reuid={second.uid}", f"--regid={second.uid}",
                           "--clear-groups", "ls", str(other)], capture_output=True, text=True)
    assert peek.returncode != 0 and "Permission denied" in peek.stderr
    # The workspaces are two disks, not one shared.
    assert host.run(second, "ls -A /workspace").stdout == "mine\n"
    assert host.run(first, "cat /workspace/mine").stdout == "mine\n"


def test_a_spare_is_never_renamed_over_a_directory_that_exists(host: Host) -> None:
    host.warm()
    before = host.spares()
    spec = SandboxSpec(id=f"sbx_ahd{secrets.token_hex(5)}", uid=next(host.uids),
                       template="base", tier=get_tier("small"))
    (host.sandboxes / spec.id).mkdir()
    (host.sandboxes / spec.id / "kept").write_text("an operator's file\n")
    with pytest.raises((BackendError, OSError)):
        host.backend.create(spec)
    # The spare was neither moved into it nor spent: the next create takes it.
    assert host.spares() == before
    with open("/proc/self/mountinfo") as f:
        assert [line for line in f if spec.id in line] == []
    taken = host.create()
    assert host.run(taken, "ls -A /workspace").stdout == ""


_DIES_WITH_SPARES = textwrap.dedent("""
    import os, secrets, sys, time
    from pathlib import Path
    from corral._backends.namespace import NamespaceBackend
    from corral._core.resources import get_tier
    from corral._settings import Settings
    from corral.backends import SandboxSpec
    home, start = Path(sys.argv[1]), int(sys.argv[2])
    backend = NamespaceBackend(Settings(home=home, uid_start=start, uid_count=100))
    for uid in (start + 50, start + 51):
        spec = SandboxSpec(id="sbx_ahd" + secrets.token_hex(5), uid=uid, template="base",
                           tier=get_tier("small"))
        backend.create(spec)
        backend.destroy(spec)
    deadline = time.monotonic() + 60
    while len(list((home / "sandboxes").glob(".ready.*"))) < 2:
        assert time.monotonic() < deadline, "no spares"
        time.sleep(0.05)
    print("ready", flush=True)
    time.sleep(120)  # killed here
""")


def test_a_dead_processs_spares_are_swept_with_their_mounts_and_loop_devices(
    host: Host,
) -> None:
    home = host.settings.home
    child = subprocess.Popen([sys.executable, "-c", _DIES_WITH_SPARES, str(home),
                              str(host.settings.uid_start)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
    theirs = host.spares()
    assert len(theirs) == 2 and host.spares(child.pid) == theirs
    assert len(host.loops()) == 2 and mounts_under(host.sandboxes) != []
    # A live owner's are left alone: ours, made here, are not swept.
    host.warm()
    ours = host.spares(os.getpid())
    swept = host.backend.sweep(set())
    assert sorted(left.name for left in swept if left.kind == "spare") == theirs
    assert host.spares() == ours
    assert [m for m in mounts_under(host.sandboxes) if any(t in str(m) for t in theirs)] == []
    _wait_for("the dead process's loop devices released",
              lambda: not any(t in b for t in theirs for b in host.loops()), timeout=30)
    # close removes this process's own.
    host.backend.close()
    assert host.spares() == [] and mounts_under(host.sandboxes) == []


def _net_fds() -> set[str]:
    found = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("net:"):
            found.add(fd.name)
    return found


def test_a_spare_network_namespace_has_only_lo_and_close_lets_go_of_the_rest() -> None:
    before = _net_fds()
    spares = netns.SpareNamespaces()
    run_dir = Path(tempfile.mkdtemp(prefix="corral-test-ahead-netns-"))
    paths = [run_dir / "run" / f"ns{i}" for i in range(3)]
    listeners = []  # each namespace comes with a listener bound in it (its first egress's)
    try:
        for path in paths[:2]:
            listeners.append(spares.start(path)())
        _wait_for("two spare network namespaces", lambda: len(_net_fds() - before) == 2)
        listeners.append(spares.start(paths[2])())  # from a spare
        assert netns.is_pinned(paths[2])
        assert all(sock is not None and sock.getsockname()[0] == "127.0.0.1"
                   for sock in listeners)
        links = subprocess.run(["nsenter", f"--net={paths[2]}", "ip", "-o", "link"],
                               capture_output=True, text=True, check=True).stdout
        assert [line.split(":")[1].strip() for line in links.splitlines()] == ["lo"]
        assert "UP" in links.split("<", 1)[1].split(">", 1)[0]
        # Every namespace is a new one: none is the host's, and no two are the same.
        inodes = {os.stat(p).st_ino for p in paths}
        assert len(inodes) == 3 and os.stat("/proc/self/ns/net").st_ino not in inodes
    finally:
        for sock in listeners:
            if sock is not None:
                sock.close()
        spares.close()
        for path in paths:
            netns.remove_netns(path)
        linux.umount(str(run_dir / "run"))  # made a mount point of its own, as `ip netns` does
        shutil.rmtree(run_dir)
    _wait_for("the spares' descriptors closed", lambda: _net_fds() - before == set(), timeout=5)
