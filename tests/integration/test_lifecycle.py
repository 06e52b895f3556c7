"""Lifetimes, restarts and crashes: nothing outlives its limits, nothing leaks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from corral import Sandbox, SandboxExpired, SandboxNotFound
from corral._control.manager import Manager
from corral._settings import Settings

from .hostprocs import host_procs_of_uid, host_uid

pytestmark = pytest.mark.needs_root


def _runtime_pieces(settings: Settings, sandbox_id: str) -> dict[str, bool]:
    """Which host-side pieces of a sandbox exist right now."""
    tag = f"corral-{settings.instance}"
    netns = Path("/run/netns") / f"{tag}-{sandbox_id}"
    workspace = settings.home / "sandboxes" / sandbox_id / "workspace"
    with open("/proc/mounts") as f:
        mounted = any(line.split()[1] == str(workspace) for line in f)
    cgroups = [p for p in Path("/sys/fs/cgroup").glob(f"*/{tag}/{sandbox_id}")]
    return {"netns": netns.exists(), "mount": mounted, "cgroup": bool(cgroups),
            "dir": workspace.parent.exists()}


def _uid_processes(uid: int) -> list[int]:
    """Live (not zombie) processes running as host ``uid``."""
    return [pid for pid, _ in host_procs_of_uid(uid)]


def _python(settings: Settings, code: str) -> subprocess.Popen[str]:
    """Another process using the same data directory, as a second CLI or agent would."""
    env = {**os.environ, "CORRAL_HOME": str(settings.home),
           "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_destroy_removes_every_runtime_piece_and_frees_the_uid(
    home: str, settings: Settings
) -> None:
    sb = Sandbox.create(home=home)
    uid = host_uid(sb.id)
    sb.commands.run("echo hi > f")
    assert all(_runtime_pieces(settings, sb.id).values())
    sb.kill()
    assert not any(_runtime_pieces(settings, sb.id).values())
    assert _uid_processes(uid) == []
    again = Sandbox.create(home=home)
    try:
        assert host_uid(again.id) == uid  # released, so the lowest free uid is reused
    finally:
        again.kill()


def test_each_sandbox_gets_its_own_uid(home: str) -> None:
    first, second = Sandbox.create(home=home), Sandbox.create(home=home)
    try:
        assert host_uid(first.id) != host_uid(second.id)
        assert first.commands.run(["id", "-u"]).stdout == "1000\n"  # mapped inside
    finally:
        first.kill()
        second.kill()


def test_expired_sandbox_is_destroyed_on_next_access(home: str, settings: Settings) -> None:
    sb = Sandbox.create(home=home, timeout=1)
    time.sleep(1.2)
    with pytest.raises(SandboxExpired, match="lifetime"):
        Sandbox.connect(sb.id, home=home)
    assert not any(_runtime_pieces(settings, sb.id).values())
    assert sb.id not in {i.id for i in Sandbox.list(home=home)}


def test_a_command_never_outlives_its_sandbox(home: str) -> None:
    sb = Sandbox.create(home=home, timeout=2)
    try:
        started = time.monotonic()
        result = sb.commands.run("sleep 30", timeout=30)
        assert result.timed_out
        assert time.monotonic() - started < 5
    finally:
        sb.kill()


def test_set_timeout_extends_the_lifetime(home: str) -> None:
    sb = Sandbox.create(home=home, timeout=1)
    try:
        sb.set_timeout(60)
        time.sleep(1.2)
        assert sb.commands.run("echo alive").stdout == "alive\n"
    finally:
        sb.kill()


def test_sandboxes_survive_a_restart_of_the_process(home: str, settings: Settings) -> None:
    proc = _python(settings, """
        from corral import Sandbox
        from corral._control.manager import get_manager
        sb = Sandbox.create()
        sb.files.write("kept.txt", "from the first process")
        sb.commands.run("echo more >> kept.txt")
        print(sb.id)
    """)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    sandbox_id = out.strip()
    sb = Sandbox.connect(sandbox_id, home=home)
    try:
        assert sb.files.read("kept.txt") == "from the first processmore\n"
        assert sb.commands.run("cat kept.txt").exit_code == 0
    finally:
        sb.kill()


def test_sigkill_during_a_command_leaves_nothing_the_next_start_does_not_clean(
    home: str, settings: Settings, manager: Manager
) -> None:
    proc = _python(settings, """
        import sys
        from corral import Sandbox
        from corral._control.manager import get_manager
        sb = Sandbox.create()
        sb.files.write("before.txt", "safe")
        print(sb.id, get_manager().store.get(sb.id).uid, flush=True)
        sb.commands.run("sleep 300 & sleep 300; echo never", timeout=60)
    """)
    assert proc.stdout is not None
    sandbox_id, uid_text = proc.stdout.readline().split()
    uid = int(uid_text)
    deadline = time.monotonic() + 20
    while len(_uid_processes(uid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _uid_processes(uid), "the command never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    assert proc.stderr is not None
    proc.stderr.close()

    # The sandbox's processes die with the process that ran them (bwrap --die-with-parent).
    deadline = time.monotonic() + 10
    while _uid_processes(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _uid_processes(uid) == []

    # What the crash left (the command's cgroup, owned by a dead process) is swept at start-up,
    # and the sandbox itself is intact and usable.
    removed = manager.recover()
    assert any(item.startswith(f"command {sandbox_id}/") for item in removed), removed
    tag = f"corral-{settings.instance}"
    assert list(Path("/sys/fs/cgroup/freezer", tag, sandbox_id).iterdir()) == [] or all(
        not p.is_dir() for p in Path("/sys/fs/cgroup/freezer", tag, sandbox_id).iterdir()
    )
    sb = Sandbox.connect(sandbox_id, home=home)
    try:
        assert sb.files.read("before.txt") == "safe"
        assert sb.commands.run("echo works").stdout == "works\n"
    finally:
        sb.kill()


def test_orphaned_runtime_pieces_are_swept(home: str, settings: Settings, manager: Manager) -> None:
    """A crash between building a sandbox's runtime and recording it leaves pieces with no row."""
    from corral._core.resources import get_tier
    from corral.backends import SandboxSpec

    spec = SandboxSpec(id="sbx_orphan000001", uid=settings.uid_start + settings.uid_count - 1,
                       template="base", tier=get_tier("small"))
    manager.backend.create(spec)
    assert all(_runtime_pieces(settings, spec.id).values())
    removed = manager.recover()
    assert {f"workspace {spec.id}", f"cgroup {spec.id}"} <= set(removed)
    assert not any(_runtime_pieces(settings, spec.id).values())


def test_a_create_whose_workspace_fails_leaves_no_network_namespace_or_cgroup(
    home: str, settings: Settings, manager: Manager
) -> None:
    """The network namespace is made beside the workspace; a workspace that fails still
    finds it made, and the create's clean-up removes it with the rest."""
    from corral._core.resources import get_tier
    from corral.backends import SandboxSpec

    spec = SandboxSpec(id="sbx_failcreate001", uid=settings.uid_start + settings.uid_count - 2,
                       template="base", tier=get_tier("small"))
    (settings.home / "sandboxes" / spec.id).mkdir(parents=True)  # a stale directory
    with pytest.raises(FileExistsError):
        manager.backend.create(spec)
    assert not any(_runtime_pieces(settings, spec.id).values())


def test_interrupted_create_and_destroy_are_finished_at_start(
    home: str, settings: Settings, manager: Manager
) -> None:
    sb = Sandbox.create(home=home)
    manager.store.set_state(sb.id, "destroying")  # as if the process died mid-destroy
    with pytest.raises(SandboxNotFound):
        Sandbox.connect(sb.id, home=home)
    manager.recover()
    assert manager.store.get(sb.id) is None
    assert not any(_runtime_pieces(settings, sb.id).values())


@pytest.mark.parametrize("isolation_", ["namespace", "gvisor"])
def test_a_command_whose_cgroup_is_removed_as_it_ends_still_has_a_result(
    home: str, manager: Manager, isolation_: str, gvisor_problems: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sandbox destroyed while a command (a terminal's shell, say) is finishing loses its
    cgroups between the command's exit and the read of its usage. The command must end with
    its result on every tier, not with FileNotFoundError from the removed cgroup. The window
    is opened deterministically: the real group is killed and removed right before the real
    usage read, as a concurrent destroy does."""
    from corral.backends import ExecRequest

    if isolation_ == "gvisor" and gvisor_problems:
        pytest.skip("the gVisor tier cannot run on this host: " + "; ".join(gvisor_problems))
    sb = Sandbox.create(home=home, isolation=isolation_)
    try:
        backend = manager.backend_for(isolation_)
        spec = manager._spec(manager.get(sb.id))
        driver = backend.cgroups  # type: ignore[attr-defined]
        real_usage = driver.usage

        def usage_after_a_concurrent_destroy(group: str) -> object:
            driver.kill(group)
            driver.remove(group)
            return real_usage(group)

        monkeypatch.setattr(driver, "usage", usage_after_a_concurrent_destroy)
        outcome = backend.exec(spec, ExecRequest(argv=["echo", "up"], cwd="/workspace", env={},
                                                 timeout_s=60))
        assert (outcome.exit_code, outcome.stdout) == (0, "up\n")
        if isolation_ == "gvisor":
            # The resident gVisor sandbox measures a command inside (its init's wait4), not in
            # the cgroup: the usage is real; the removed group reads as "not OOM-killed".
            assert outcome.usage.peak_memory_bytes > 0 and not outcome.usage.oom_killed
        else:
            assert outcome.usage.peak_memory_bytes == 0  # unknown, not made up
    finally:
        monkeypatch.undo()
        sb.kill()
