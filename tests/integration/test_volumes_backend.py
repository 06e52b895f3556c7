"""Volumes and data mounts on the host tiers (namespace and gVisor), through the backend alone.

Each tier gets a data directory of its own (with an operator's data directory and a secret file
beside it) and sandboxes built from a ``SandboxSpec`` as the control plane would build them.
What is checked: a volume outlives its sandboxes and reads the same under every host uid (files
on disk belong to uid 1000, the sandbox user's uid inside), a full volume is ENOSPC, read-only
is EROFS, a data mount is read-only and its symlinks resolve inside the sandbox, refusals leave
nothing, destroy and sweep detach only the sandbox's binds, and everything is rebuilt after a
simulated reboot. Writes are bounded by construction (at most a little more than a volume's
size), and everything a test makes (sandboxes, mounts, loop devices, cgroups) is removed.
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from corral._backends._linux import loop
from corral._backends._linux.host import HostBackedBackend
from corral._backends._linux.storage import is_mount, mounts_under
from corral._backends._linux.template import BaseTemplate
from corral._backends.namespace.bwrap import BwrapFds, build_options
from corral._core import linux
from corral._core.resources import get_tier
from corral._settings import Settings
from corral.backends import ExecOutcome, ExecRequest, Mount, SandboxSpec, VolumeStorage
from corral.errors import (
    ConfigError,
    FileError,
    UsageError,
    VolumeError,
    VolumeInUse,
    VolumeNotFound,
)

pytestmark = pytest.mark.needs_root

MiB = 1 << 20
SECRET = "corral-volume-test-secret-" + secrets.token_hex(8)


@dataclass
class Rig:
    """One tier's backend on a data directory of its own."""

    tier: str
    settings: Settings
    backend: HostBackedBackend
    data: Path
    secret: Path
    uids: Iterator[int]
    made: list[SandboxSpec] = field(default_factory=list)

    def spec(self, *mounts: Mount, uid: int | None = None) -> SandboxSpec:
        return SandboxSpec(id=f"sbx_vol{secrets.token_hex(5)}",
                           uid=next(self.uids) if uid is None else uid, template="base",
                           tier=get_tier("small"), mounts=mounts)

    def create(self, *mounts: Mount) -> SandboxSpec:
        spec = self.spec(*mounts)
        self.made.append(spec)
        self.backend.create(spec)
        return spec

    def destroy(self, spec: SandboxSpec) -> None:
        self.backend.destroy(spec)
        if spec in self.made:
            self.made.remove(spec)

    def volume(self, size: int = 16 * MiB) -> str:
        volume_id = f"vol_{secrets.token_hex(6)}"
        self.backend.create_volume(volume_id, size)
        return volume_id

    def volume_mount(self, volume_id: str) -> Path:
        return self.settings.home / "volumes" / volume_id / "mnt"

    def volume_image(self, volume_id: str) -> Path:
        return self.settings.home / "volumes" / volume_id / "volume.img"


def _private_home(prefix: str) -> Path:
    # Every parent traversable by others (bwrap runs as the sandbox's uid, gVisor's file
    # server as its runtime uid); mkdtemp makes the directory itself 0700.
    path = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(path, 0o711)
    return path


@pytest.fixture(scope="module", params=["namespace", "gvisor"])
def rig(request: pytest.FixtureRequest, gvisor_problems: list[str]) -> Iterator[Rig]:
    if request.param == "gvisor" and gvisor_problems:
        pytest.skip("the gVisor tier cannot run on this host: " + "; ".join(gvisor_problems))
    outside = _private_home("corral-test-vol-outside-")
    home = outside / "home"
    home.mkdir(mode=0o711)
    data = outside / "data"
    (data / "sub").mkdir(parents=True)
    (data / "hello.txt").write_text("hello from the operator\n")
    (data / "sub" / "deeper.txt").write_text("deeper\n")
    # A secret of the host's, readable by anyone on the host: only the mount may stop it.
    secret = outside / "secret.txt"
    secret.write_text(SECRET + "\n")
    os.symlink(str(secret), data / "abs-link")
    os.symlink(os.path.relpath(secret, data), data / "rel-link")
    os.symlink("../../../../../../../../" + str(secret).lstrip("/"), data / "deep-link")
    for path in (outside, data, data / "sub"):
        os.chmod(path, 0o755)
    for path in (secret, data / "hello.txt", data / "sub" / "deeper.txt"):
        os.chmod(path, 0o644)
    start = 2_130_000_000 + secrets.randbelow(10_000) * 100
    settings = Settings(home=home, uid_start=start, uid_count=100,
                        data_mounts={"ops": data, "gone": outside / "no-such-dir"})
    backend: HostBackedBackend
    if request.param == "namespace":
        from corral._backends.namespace import NamespaceBackend

        backend = NamespaceBackend(settings)
    else:
        from corral._backends.gvisor import GvisorBackend

        backend = GvisorBackend(settings)
    made = Rig(request.param, settings, backend, data, secret, iter(range(start, start + 100)))
    try:
        yield made
    finally:
        for spec in list(made.made):
            backend.destroy(spec)
        backend.sweep(set())
        for volume_id in backend.volume_ids():
            backend.remove_volume(volume_id)
        backend.remove_instance()
        backend.close()
        left = mounts_under(home)
        shutil.rmtree(outside, ignore_errors=True)
        assert left == [], left


def sandbox_mounts(rig: Rig) -> list[Path]:
    """Mounts under the sandboxes' directories; the ready workspaces made ahead of creates
    (``.ready.*``, ``.making.*``) are the backend's until it closes, checked there."""
    root = rig.settings.home / "sandboxes"
    return [p for p in mounts_under(root) if not p.relative_to(root).parts[0].startswith(".")]


@pytest.fixture
def tier(rig: Rig) -> Iterator[Rig]:
    """The rig, with every sandbox a test made destroyed after it and nothing left mounted
    but volumes' own mounts."""
    yield rig
    for spec in list(rig.made):
        rig.destroy(spec)
    assert sandbox_mounts(rig) == []


def run(rig: Rig, spec: SandboxSpec, cmd: str, *, timeout: float = 60,
        **kwargs: Any) -> ExecOutcome:
    request = ExecRequest(argv=["bash", "-c", cmd], cwd=kwargs.pop("cwd", "/workspace"),
                          env={}, timeout_s=timeout, command_id=f"cmd_{secrets.token_hex(6)}",
                          **kwargs)
    return rig.backend.exec(spec, request)


def ok(rig: Rig, spec: SandboxSpec, cmd: str) -> str:
    out = run(rig, spec, cmd)
    assert out.exit_code == 0, (rig.tier, cmd, out.stdout, out.stderr)
    return out.stdout


_ERRNO_OF = """python3 -c '
import errno, sys
try:
    open(sys.argv[1], "w").write("x")
except OSError as exc:
    print(errno.errorcode[exc.errno])
else:
    print("WROTE")
' """


def _owners(root: Path) -> set[tuple[int, int]]:
    found = set()
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        found.add((st.st_uid, st.st_gid))
    return found


def _binds(spec: SandboxSpec, rig: Rig) -> list[Path]:
    return mounts_under(rig.settings.home / "sandboxes" / spec.id / "mounts")


# -- volumes -------------------------------------------------------------------------------------


def test_a_volume_is_a_capability_of_the_host_tiers(tier: Rig) -> None:
    assert isinstance(tier.backend, VolumeStorage)


def test_a_volume_outlives_its_sandbox_and_belongs_to_whichever_uid_mounts_it(
        tier: Rig) -> None:
    volume_id = tier.volume()
    assert volume_id in tier.backend.volume_ids()
    first = tier.create(Mount("volume", volume_id, "/mnt/vol", read_only=False))
    assert ok(tier, first, "stat -c '%U %a' /mnt/vol; ls -A /mnt/vol") == "user 700\n"
    ok(tier, first, "echo one > /mnt/vol/a.txt && mkdir /mnt/vol/sub && "
                    "echo two > /mnt/vol/sub/b.txt && ln -s a.txt /mnt/vol/link")
    tier.destroy(first)
    # On disk, every file is the sandbox user's uid inside, never a host uid of a sandbox.
    disk = tier.backend._volumes.ensure_mounted(volume_id)  # type: ignore[attr-defined]
    assert _owners(disk) == {(1000, 1000)}
    assert (disk / "sub" / "b.txt").read_text() == "two\n"

    # Another host uid, under /workspace this time: the same files, as its own.
    second = tier.create(Mount("volume", volume_id, "/workspace/data", read_only=False))
    assert second.uid != first.uid
    out = ok(tier, second, "id -u; stat -c '%U:%u %n' /workspace/data/a.txt "
                           "/workspace/data/sub/b.txt; cat /workspace/data/link; "
                           "echo more >> /workspace/data/a.txt && echo new > /workspace/data/c "
                           "&& rm /workspace/data/sub/b.txt && cat /workspace/data/a.txt; "
                           "cat /home/user/data/c")
    assert out.splitlines() == ["1000", "user:1000 /workspace/data/a.txt",
                                "user:1000 /workspace/data/sub/b.txt", "one", "one", "more",
                                "new"], out
    # The mount point in the workspace is the user's, as if it had made it itself.
    workspace = tier.backend.workspace_root(second)
    assert (os.stat(workspace / "data").st_uid, os.stat(workspace / "data").st_gid) == (
        second.uid, second.uid)
    tier.destroy(second)
    assert _owners(disk) == {(1000, 1000)}
    assert sorted(p.name for p in disk.iterdir()) == ["a.txt", "c", "link", "sub"]
    assert tier.backend.volume_usage(volume_id) > 0


def test_a_full_volume_is_enospc_inside(tier: Rig) -> None:
    volume_id = tier.volume(16 * MiB)
    spec = tier.create(Mount("volume", volume_id, "/mnt/small", read_only=False))
    empty = tier.backend.volume_usage(volume_id)
    # At most 20 MiB are written into a 16 MiB volume: bounded whatever the quota did.
    out = run(tier, spec, "head -c 20M /dev/zero > /mnt/small/fill; echo rc=$?; "
                          "stat -c %s /mnt/small/fill")
    lines = out.stdout.splitlines()
    assert "No space left on device" in out.stderr, (out.stdout, out.stderr)
    assert lines[0] == "rc=1" and int(lines[1]) <= 16 * MiB, out.stdout
    full = tier.backend.volume_usage(volume_id)
    assert full > 12 * MiB > empty, (empty, full)
    assert os.stat(tier.volume_image(volume_id)).st_blocks * 512 < 24 * MiB  # sparse, bounded
    ok(tier, spec, "rm /mnt/small/fill && echo fits > /mnt/small/after")
    assert tier.backend.volume_usage(volume_id) < 2 * MiB


def test_a_read_only_mount_is_erofs_and_sees_the_writers_files(tier: Rig) -> None:
    volume_id = tier.volume()
    writer = tier.create(Mount("volume", volume_id, "/mnt/v", read_only=False))
    ok(tier, writer, "echo written > /mnt/v/f")
    tier.destroy(writer)
    reader = tier.create(Mount("volume", volume_id, "/mnt/v", read_only=True))
    assert ok(tier, reader, "cat /mnt/v/f; stat -c %U /mnt/v/f") == "written\nuser\n"
    assert ok(tier, reader, _ERRNO_OF + "/mnt/v/new") == "EROFS\n"
    assert ok(tier, reader, _ERRNO_OF + "/mnt/v/f") == "EROFS\n"
    out = run(tier, reader, "rm -f /mnt/v/f; mkdir /mnt/v/d")
    assert out.exit_code != 0 and "Read-only file system" in out.stderr, out
    # Read-only on the host too: the sandbox's bind itself refuses writes.
    (bind,) = _binds(reader, tier)
    assert os.statvfs(bind).f_flag & os.ST_RDONLY
    assert (tier.volume_mount(volume_id) / "f").read_text() == "written\n"


def test_a_volume_and_a_data_mount_nest_in_the_order_given(tier: Rig) -> None:
    volume_id = tier.volume()
    spec = tier.create(Mount("volume", volume_id, "/workspace/proj", read_only=False),
                       Mount("data", "ops", "/workspace/proj/ref"),
                       Mount("data", "ops", "/mnt/a/b/ops"))
    out = ok(tier, spec, "cat /workspace/proj/ref/hello.txt /home/user/proj/ref/sub/deeper.txt "
                         "/mnt/a/b/ops/hello.txt; echo mine > /workspace/proj/own; ls /mnt")
    assert out == "hello from the operator\ndeeper\nhello from the operator\na\n", out
    # The mount point inside the volume was made as the volume's user.
    disk = tier.volume_mount(volume_id)
    assert sorted(p.name for p in disk.iterdir()) == ["own", "ref"]
    assert _owners(disk) == {(1000, 1000)}


def test_a_terminal_command_sees_the_mounts_too(tier: Rig) -> None:
    """gVisor runs a terminal in a sandbox of its own (not the resident one): same mounts."""
    volume_id = tier.volume()
    spec = tier.create(Mount("volume", volume_id, "/mnt/v", read_only=False),
                       Mount("data", "ops", "/workspace/ops"))
    out = run(tier, spec, "echo typed > /mnt/v/t && cat /mnt/v/t /workspace/ops/hello.txt",
              pty=(24, 80))
    assert out.exit_code == 0 and "typed" in out.stdout, out
    assert "hello from the operator" in out.stdout, out
    assert (tier.volume_mount(volume_id) / "t").stat().st_uid == 1000


# -- data mounts ---------------------------------------------------------------------------------


def test_a_data_mount_is_readable_not_writable_and_its_links_stay_inside(tier: Rig) -> None:
    before = sorted(p.name for p in tier.data.iterdir())
    spec = tier.create(Mount("data", "ops", "/mnt/ops"))
    out = ok(tier, spec, "cat /mnt/ops/hello.txt /mnt/ops/sub/deeper.txt; "
                         "readlink /mnt/ops/abs-link; stat -c %u /mnt/ops/hello.txt")
    assert out.splitlines() == ["hello from the operator", "deeper", str(tier.secret),
                                "65534"], out
    for name in ("new.txt", "hello.txt", "sub/new.txt"):
        assert ok(tier, spec, _ERRNO_OF + f"/mnt/ops/{name}") in ("EROFS\n", "EACCES\n")
    # The links name a host file anyone on the host may read; inside, they resolve in the
    # sandbox's own root, where nothing is there.
    for link in ("abs-link", "rel-link", "deep-link"):
        out = run(tier, spec, f"cat /mnt/ops/{link}; head -c 200 /mnt/ops/{link}")
        assert out.exit_code != 0, (link, out)
        assert SECRET not in out.stdout + out.stderr, link
    # The host's read of the same links reaches the secret: the test would catch a leak.
    assert (tier.data / "abs-link").read_text().strip() == SECRET
    assert sorted(p.name for p in tier.data.iterdir()) == before
    assert tier.secret.read_text() == SECRET + "\n"


def test_a_data_mount_leaves_out_what_is_mounted_below_it_on_the_host(tier: Rig) -> None:
    below = tier.data / "sub"
    linux.mount("tmpfs", str(below), "tmpfs", 0, "size=1m,mode=0755")
    try:
        (below / "hidden.txt").write_text("mounted below\n")
        os.chmod(below / "hidden.txt", 0o644)
        spec = tier.create(Mount("data", "ops", "/mnt/ops"))
        # The sandbox sees the directory itself: the tmpfs over sub/ stays the host's.
        assert ok(tier, spec, "ls /mnt/ops/sub") == "deeper.txt\n"
        tier.destroy(spec)
    finally:
        linux.umount(str(below))


# -- refusals ------------------------------------------------------------------------------------


def _no_trace(rig: Rig, spec: SandboxSpec) -> None:
    assert not (rig.settings.home / "sandboxes" / spec.id).exists()
    assert sandbox_mounts(rig) == []
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        assert not (hierarchy / f"corral-{rig.settings.instance}" / spec.id).exists()
    assert not os.path.lexists(rig.settings.run_dir / f"corral-{rig.settings.instance}-{spec.id}")


@pytest.mark.parametrize(("mount", "error", "words"), [
    (Mount("data", "nope", "/mnt/x"), ConfigError, "no data mount is named 'nope'"),
    (Mount("data", "gone", "/mnt/x"), ConfigError, "no-such-dir is missing"),
    (Mount("volume", "vol_missing", "/mnt/x", read_only=False), VolumeNotFound,
     "vol_missing does not exist"),
    (Mount("volume", "../escape", "/mnt/x"), UsageError, "volume id"),
    (Mount("data", "ops", "/etc/x"), UsageError, "under /mnt/ or /workspace/"),
    (Mount("data", "ops", "/workspace"), UsageError, "under /mnt/ or /workspace/"),
    (Mount("data", "ops", "/mnt/"), UsageError, "under /mnt/ or /workspace/"),
    (Mount("data", "ops", "/mnt/a/../../etc"), UsageError, "without '..'"),
    (Mount("data", "ops", "mnt/x"), UsageError, "absolute"),
])
def test_a_mount_that_cannot_be_made_is_refused_and_leaves_nothing(
        tier: Rig, mount: Mount, error: type[Exception], words: str) -> None:
    spec = tier.spec(mount)
    with pytest.raises(error, match=words.replace("(", r"\(").replace(".", r"\.")):
        tier.backend.create(spec)
    _no_trace(tier, spec)


def test_mounts_under_a_read_only_one_need_their_mount_point(tier: Rig) -> None:
    spec = tier.spec(Mount("data", "ops", "/mnt/ops"), Mount("data", "ops", "/mnt/ops/new"))
    with pytest.raises(FileError, match="mounted read-only above it"):
        tier.backend.create(spec)
    _no_trace(tier, spec)
    twice = tier.spec(Mount("data", "ops", "/mnt/ops"), Mount("data", "ops", "/mnt/ops"))
    with pytest.raises(UsageError, match="two mounts at /mnt/ops"):
        tier.backend.create(twice)


def test_volume_storage_refuses_what_it_cannot_do(tier: Rig) -> None:
    volume_id = tier.volume()
    with pytest.raises(VolumeError, match="already exists"):
        tier.backend.create_volume(volume_id, 16 * MiB)
    with pytest.raises(UsageError, match="at least"):
        tier.backend.create_volume("vol_tiny", 1024)
    with pytest.raises(UsageError, match="volume id"):
        tier.backend.create_volume("a/b", 16 * MiB)
    with pytest.raises(VolumeNotFound):
        tier.backend.volume_usage("vol_never")
    assert "vol_tiny" not in tier.backend.volume_ids()
    assert [p.name for p in (tier.settings.home / "volumes").iterdir()
            if p.name.startswith(".")] == []
    spec = tier.create(Mount("volume", volume_id, "/mnt/v", read_only=False))
    with pytest.raises(VolumeInUse, match=spec.id):
        tier.backend.remove_volume(volume_id)
    assert tier.backend.volume_usage(volume_id) >= 0  # still there, still mounted
    tier.destroy(spec)
    tier.backend.remove_volume(volume_id)
    tier.backend.remove_volume(volume_id)  # idempotent
    assert volume_id not in tier.backend.volume_ids()
    assert not (tier.settings.home / "volumes" / volume_id).exists()


def test_a_copy_of_the_hosts_mounts_in_another_namespace_does_not_keep_a_volume(
        tier: Rig) -> None:
    # Any process that makes a mount namespace of its own (unshare -m, a template build's
    # mmdebstrap) while a volume is mounted holds a copy of that mount; the host's mounts are
    # private here, so the host's umount does not reach it. Removal still goes through, and
    # the loop device goes with it while that process lives on.
    volume_id = tier.volume()
    image = tier.volume_image(volume_id)
    tier.backend.volume_usage(volume_id)  # mounts it on the host
    assert is_mount(tier.volume_mount(volume_id))
    found = loop.attached(str(image))
    assert found is not None
    os.close(found[0])
    backing = Path("/sys/block", os.path.basename(found[1]), "loop", "backing_file")

    def still_backed() -> bool:
        try:
            return backing.read_text().startswith(str(image))  # " (deleted)" once unlinked
        except OSError:
            return False  # cleared

    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--",
                               "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{holder.pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt"):
            assert time.monotonic() < deadline, "unshare never made its mount namespace"
            time.sleep(0.01)
        tier.backend.remove_volume(volume_id)
        assert holder.poll() is None
        deadline = time.monotonic() + 5  # the kernel clears an autoclear device a moment after
        while still_backed():
            assert time.monotonic() < deadline, f"{found[1]} still backed by the removed image"
            time.sleep(0.02)
        assert not (tier.settings.home / "volumes" / volume_id).exists()
    finally:
        holder.kill()
        holder.wait()


# -- clean-up and rebuilds -----------------------------------------------------------------------


def test_destroy_and_sweep_detach_the_binds_and_keep_the_volume(tier: Rig) -> None:
    volume_id = tier.volume()
    swept = tier.create(Mount("volume", volume_id, "/mnt/v", read_only=False),
                        Mount("data", "ops", "/mnt/ops"))
    ok(tier, swept, "echo kept > /mnt/v/kept; cat /mnt/ops/hello.txt")
    assert len(_binds(swept, tier)) == 2
    # A crash left it without a record: the sweep removes it as it would any leftover.
    if tier.tier == "gvisor":
        tier.backend._close_resident(swept.id, forget=True)  # type: ignore[attr-defined]
    removed = tier.backend.sweep(lambda sandbox_id: sandbox_id != swept.id)
    assert any(item.kind == "workspace" and item.sandbox_id == swept.id for item in removed)
    tier.made.remove(swept)
    assert _binds(swept, tier) == []
    assert not (tier.settings.home / "sandboxes" / swept.id).exists()
    assert (tier.volume_mount(volume_id) / "kept").read_text() == "kept\n"
    assert (tier.data / "hello.txt").read_text() == "hello from the operator\n"

    again = tier.create(Mount("volume", volume_id, "/mnt/v", read_only=False))
    assert ok(tier, again, "cat /mnt/v/kept") == "kept\n"
    tier.destroy(again)
    tier.backend.destroy(again)  # idempotent
    assert _binds(again, tier) == []
    assert (tier.volume_mount(volume_id) / "kept").read_text() == "kept\n"
    # Removing the volume releases its loop device.
    tier.backend.remove_volume(volume_id)
    assert not (tier.settings.home / "volumes" / volume_id).exists()


def test_everything_is_rebuilt_after_a_reboot(tier: Rig) -> None:
    volume_id = tier.volume()
    spec = tier.create(Mount("volume", volume_id, "/mnt/v", read_only=False),
                       Mount("data", "ops", "/workspace/ops"))
    ok(tier, spec, "echo before > /mnt/v/f")
    # A reboot: nothing runs and nothing is mounted (the resident gVisor sandbox goes too).
    if tier.tier == "gvisor":
        tier.backend._close_resident(spec.id)  # type: ignore[attr-defined]
    for point in mounts_under(tier.settings.home / "sandboxes" / spec.id):
        linux.umount(str(point))
    linux.umount(str(tier.volume_mount(volume_id)))
    assert not is_mount(tier.volume_mount(volume_id))
    # Two commands at once find nothing mounted: each piece is mounted once, not twice.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: run(tier, spec, "cat /mnt/v/f /workspace/ops/hello.txt"),
                             range(2)))
    assert [o.stdout for o in outs] == ["before\nhello from the operator\n"] * 2, outs
    ok(tier, spec, "echo after >> /mnt/v/f")
    assert len(_binds(spec, tier)) == 2 and is_mount(tier.volume_mount(volume_id))
    assert len(mounts_under(tier.volume_mount(volume_id))) == 1
    assert (tier.volume_mount(volume_id) / "f").read_text() == "before\nafter\n"
    found = loop.attached(str(tier.volume_image(volume_id)))
    assert found is not None
    os.close(found[0])


def test_a_resident_whose_mounts_went_away_is_stopped_before_they_are_mounted_again(
        tier: Rig) -> None:
    volume_id = tier.volume()
    spec = tier.create(Mount("volume", volume_id, "/mnt/v", read_only=False))
    # Two commands: from the second on, the sandbox's resident helper holds its mounts.
    ok(tier, spec, "echo one > /mnt/v/f")
    ok(tier, spec, "echo two >> /mnt/v/f; echo ws > /workspace/w")
    holder = tier.backend._holder(spec.id)  # type: ignore[attr-defined]
    assert holder is not None and holder.running
    # An operator's umount of the host's side while the resident lives on with its copies.
    for point in mounts_under(tier.settings.home / "sandboxes" / spec.id):
        linux.umount(str(point), linux.MNT_DETACH)
    linux.umount(str(tier.volume_mount(volume_id)), linux.MNT_DETACH)
    assert ok(tier, spec, "cat /mnt/v/f /workspace/w") == "one\ntwo\nws\n"
    assert not holder.running  # stopped first, then everything mounted once again
    ok(tier, spec, "echo three >> /mnt/v/f")
    assert (tier.volume_mount(volume_id) / "f").read_text() == "one\ntwo\nthree\n"
    assert len(mounts_under(tier.volume_mount(volume_id))) == 1


def test_a_volume_detached_but_alive_is_mounted_again_on_its_own_device(tier: Rig) -> None:
    """Two filesystems on one image would corrupt it: a volume whose mount lives on somewhere
    (here: a bind the host still holds) is mounted again through the same loop device."""
    volume_id = tier.volume()
    spec = tier.create(Mount("volume", volume_id, "/mnt/v", read_only=False))
    ok(tier, spec, "echo x > /mnt/v/f")
    if tier.tier == "gvisor":
        tier.backend._close_resident(spec.id)  # type: ignore[attr-defined]
    first = loop.attached(str(tier.volume_image(volume_id)))
    assert first is not None
    os.close(first[0])
    # The volume's own mount goes; the sandbox's bind (the same superblock) stays.
    linux.umount(str(tier.volume_mount(volume_id)), linux.MNT_DETACH)
    ok(tier, spec, "echo y >> /mnt/v/f")
    again = loop.attached(str(tier.volume_image(volume_id)))
    assert again is not None
    os.close(again[0])
    assert again[1] == first[1]
    assert (tier.volume_mount(volume_id) / "f").read_text() == "x\ny\n"


# -- what never gets mounts ----------------------------------------------------------------------


def test_an_image_build_step_never_gets_the_mounts() -> None:
    template = BaseTemplate(etc=Path("/nonexistent/etc"), system=(), writable=True)
    options = build_options(template=template, workspace=Path("/nonexistent/ws"),
                            tmp_bytes=MiB, cwd="/", env={}, fds=BwrapFds(3, 4, 5),
                            mounts=[("/host/volume-bind", "/mnt/v", False)])
    assert "/host/volume-bind" not in options
    plain = build_options(template=BaseTemplate(etc=Path("/nonexistent/etc"), system=()),
                          workspace=Path("/nonexistent/ws"), tmp_bytes=MiB, cwd="/", env={},
                          fds=BwrapFds(3, 4, 5),
                          mounts=[("/host/a", "/workspace/a", False), ("/host/b", "/mnt/b", True)])
    binds = [options for options in zip(plain, plain[1:], plain[2:], strict=False)
             if options[1].startswith("/host/")]
    assert binds == [("--bind", "/host/a", "/workspace/a"), ("--bind", "/host/a", "/home/user/a"),
                     ("--ro-bind", "/host/b", "/mnt/b")]
    # After the workspace's binds, before the root goes read-only.
    assert plain.index("/host/a") > plain.index("/home/user") and plain.index(
        "/host/b") < plain.index("--remount-ro", plain.index("/tmp"))

