"""The resident gVisor sandbox (``gvisor.resident`` + ``gvisor.inside``, issue 14): one
long-lived ``runsc run`` per sandbox, commands through the in-sandbox helper.

The tier's own tests (``test_gvisor.py``, the conformance, isolation and drill suites) run
through it; these drive it directly and hold the per-command guarantees it keeps, in a real
gVisor sandbox built on a real Corral sandbox's pieces
(network namespace, workspace, rootfs): every command filtered and unprivileged, its own
``/tmp`` and PID namespace, its tree gone on return and on timeout. Bounded: a timeout on every
command, one resident sandbox per test, closed and checked for leftovers afterwards.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from corral._backends.gvisor import GvisorBackend
from corral._backends.gvisor import resident as resident_mod
from corral._backends.gvisor.bundle import build_config, runtime_uid
from corral._backends.gvisor.launcher import reap_orphans
from corral._backends.gvisor.resident import OnDemand, Resident, ensure_launcher
from corral._control.manager import Manager
from corral._core.privileged import privileged_env
from corral._core.resources import get_tier
from corral._settings import Settings
from corral.backends import SandboxSpec
from corral.errors import BackendError

from .hostprocs import host_procs_of_uid

pytestmark = pytest.mark.needs_root

_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/workspace"}
# gVisor's view of the process asking: its filter mode, no_new_privs (gVisor's status file
# lacks the line: PR_GET_NO_NEW_PRIVS), capabilities, ids, and whether unshare(CLONE_NEWUSER),
# refused by Corral's filter, goes through.
_PROBE = ("import ctypes,os;l=ctypes.CDLL(None,use_errno=True);r=l.unshare(0x10000000);"
          "s=dict(x.split(':\\t',1) for x in open('/proc/self/status').read().splitlines());"
          "print(s['Seccomp'], l.prctl(39, 0, 0, 0, 0), s['CapEff'], s['CapBnd'], os.getuid(), "
          "os.getgid(), 'allowed' if r == 0 else 'refused', "
          # clone3 and netlink sockets: the namespace tier's own answers (ENOSYS so that libc
          # falls back to clone; EAFNOSUPPORT), which the OCI profile cannot give in gVisor.
          "l.syscall(435, 0, 0) == -1 and ctypes.get_errno(), "
          "l.socket(16, 2, 0) == -1 and ctypes.get_errno())")


@pytest.fixture(scope="module")
def backend(settings: Settings, manager: Manager,
            gvisor_problems: list[str]) -> Iterator[GvisorBackend]:
    if gvisor_problems:
        pytest.skip("the gVisor tier cannot run on this host: " + "; ".join(gvisor_problems))
    # Its own residents off: these tests start the ones they look at, on the backend's pieces.
    gvisor = GvisorBackend(settings.model_copy(update={"gvisor_resident": False}))
    yield gvisor
    gvisor.remove_instance()
    gvisor.close()


@dataclass
class Pieces:
    """A fresh Corral sandbox's pieces and a way to start resident sandboxes on them."""

    start: Callable[[], Resident]
    workspace: Path
    uid: int


@pytest.fixture
def pieces(backend: GvisorBackend, settings: Settings) -> Iterator[Pieces]:
    uid = settings.uid_start + settings.uid_count - 40 - secrets.randbelow(20)
    spec = SandboxSpec(id=f"sbx_gr{secrets.token_hex(5)}", uid=uid, template="base",
                       tier=get_tier("small"))
    backend.create(spec)
    launcher = backend._ready()
    workspace = backend._ensure_runtime(spec)
    template = backend._template(spec.template)
    netns_path = backend._netns_path(spec.id)
    config = build_config(
        rootfs=backend._rootfs_for(template), template=template, workspace=workspace,
        netns=netns_path, uid=uid, argv=["true"], cwd="/workspace", env=_ENV,
        tmp_bytes=spec.tier.tmp_bytes, pids=spec.tier.pids, terminal=False)
    container_id = f"{spec.id}.resident"
    made: list[Resident] = []

    def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
        return launcher.spawner.run(netns_path, lambda: subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=privileged_env(), cwd="/"))

    def start() -> Resident:
        made.append(Resident(launcher.runsc, backend._bundles / container_id, container_id,
                             config, ensure_launcher(backend._dir), spawn))
        return made[-1]

    try:
        yield Pieces(start, workspace, uid)
    finally:
        for resident in made:
            resident.close()  # idempotent
        reap_orphans(runtime_uid(uid))
        backend.destroy(spec)
        assert [pid for pid, _ in host_procs_of_uid(runtime_uid(uid), zombies=True)] == []
        assert not list((backend._bundles).glob(f"{spec.id}*"))
        assert launcher.runsc.state_entries().get(container_id) is None


@pytest.fixture
def resident(pieces: Pieces) -> tuple[Resident, Path, int]:
    """(a resident sandbox, its host workspace, the sandbox uid)."""
    return pieces.start(), pieces.workspace, pieces.uid


def test_every_command_is_filtered_and_unprivileged(
        resident: tuple[Resident, Path, int]) -> None:
    sandbox, _, _ = resident
    for _ in range(2):  # the helper's filter goes into each command, not just the first
        result = sandbox.run(["python3", "-c", _PROBE], env=_ENV, timeout=60)
        assert result.exit_code == 0, result.stderr
        seccomp, nnp, cap_eff, cap_bnd, uid, gid, unshare, clone3, netlink = (
            result.stdout.decode().split())
        assert (seccomp, nnp, uid, gid, unshare) == ("2", "1", "1000", "1000", "refused")
        assert (int(clone3), int(netlink)) == (errno.ENOSYS, errno.EAFNOSUPPORT)
        assert int(cap_eff, 16) == 0 and int(cap_bnd, 16) == 0


def test_each_command_has_its_own_pid_namespace_and_the_residents_tmp(
        resident: tuple[Resident, Path, int]) -> None:
    sandbox, workspace, _ = resident
    first = sandbox.run(["sh", "-c", "echo one > /tmp/mark; echo $$; ls /tmp"], env=_ENV)
    assert first.stdout.split() == [b"2", b"mark"]  # the command is 2, its init 1
    second = sandbox.run(["sh", "-c", "ls -A /tmp | wc -l; echo $$"], env=_ENV)
    # a fresh PID namespace; the /tmp is the bundle's, a tmpfs of its own here (a sandbox's
    # binds its host tmpfs, which lives as long as the sandbox)
    assert second.stdout.split() == [b"1", b"2"]
    made = sandbox.run(["sh", "-c", "echo hi > /workspace/out"], env=_ENV)
    assert made.exit_code == 0
    assert (workspace / "out").read_text() == "hi\n"


def test_the_command_cannot_reach_into_its_namespace_init(
        resident: tuple[Resident, Path, int]) -> None:
    # init is the command's effective uid and filtered like it, made before the command
    # (run.c): it must still be out of the command's reach: not traceable, its memory and its
    # status pipe not to be opened (non-dumpable), and not to be signalled. gVisor does not
    # shield a namespace's init from signals sent inside it and lets a process signal any
    # whose real or saved uid is its own: init keeps real and saved uid 0 (and no capability),
    # so a stop or a kill of it fails with EPERM, and the command ends as it would.
    sandbox, _, _ = resident
    probe = textwrap.dedent("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print("ptrace", libc.ptrace(16, 1, 0, 0) == -1 and ctypes.get_errno())
        for path in ("/proc/1/mem", "/proc/1/fd/3"):
            try:
                os.close(os.open(path, os.O_RDWR))
                print(path, "opened")
            except OSError as exc:
                print(path, exc.errno)
    """)
    result = sandbox.run(["python3", "-c", probe], env=_ENV, timeout=60)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    found = dict(line.split(" ", 1) for line in result.stdout.decode().splitlines())
    assert int(found["ptrace"]) == errno.EPERM, found
    assert int(found["/proc/1/mem"]) == errno.EACCES, found
    assert int(found["/proc/1/fd/3"]) == errno.EACCES, found
    signals = sandbox.run(["sh", "-c", "kill -STOP 1; echo $?; kill -KILL 1; echo $?; "
                           "echo after"], env=_ENV, timeout=60)
    assert (signals.exit_code, signals.stdout, signals.timed_out) == (
        0, b"1\n1\nafter\n", False), signals
    assert signals.stderr.count(b"Operation not permitted") == 2, signals.stderr
    assert sandbox.run(["sh", "-c", "echo fine"], env=_ENV).stdout == b"fine\n"


def test_exit_codes_and_streams(resident: tuple[Resident, Path, int]) -> None:
    sandbox, _, _ = resident
    result = sandbox.run(["sh", "-c", "echo out; echo err >&2; exit 3"], env=_ENV)
    assert (result.exit_code, result.stdout, result.stderr) == (3, b"out\n", b"err\n")
    assert sandbox.run(["sh", "-c", "kill -9 $$"], env=_ENV).exit_code == 137
    missing = sandbox.run(["no-such-program-here"], env=_ENV)
    assert (missing.exit_code, missing.exec_errno) == (127, errno.ENOENT)
    not_runnable = sandbox.run(["/etc/hostname"], env=_ENV)
    assert (not_runnable.exit_code, not_runnable.exec_errno) == (126, errno.EACCES)
    with pytest.raises(Exception, match="chdir: No such file or directory"):
        sandbox.run(["true"], env=_ENV, cwd="/workspace/none")
    assert sandbox.run(["true"], env=_ENV).exit_code == 0  # the helper is still serving


def test_the_tree_dies_on_return_and_on_timeout(
        resident: tuple[Resident, Path, int]) -> None:
    sandbox, workspace, _ = resident
    # A background child that would write after its command returned.
    result = sandbox.run(["sh", "-c", "(sleep 1; echo alive > /workspace/late) & echo started"],
                         env=_ENV)
    assert result.stdout == b"started\n"
    started = time.monotonic()
    timed_out = sandbox.run(["sh", "-c", "(sleep 2; echo alive > /workspace/late2) & sleep 60"],
                            env=_ENV, timeout=1)
    assert (timed_out.exit_code, timed_out.timed_out) == (137, True)
    assert time.monotonic() - started < 10
    time.sleep(2.5)
    assert not (workspace / "late").exists()
    assert not (workspace / "late2").exists()


def test_concurrent_commands_and_usage(resident: tuple[Resident, Path, int]) -> None:
    sandbox, _, _ = resident
    busy = "import time; t = time.process_time() + 0.3\nwhile time.process_time() < t: pass"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = pool.submit(sandbox.run, ["python3", "-c", busy], env=_ENV, timeout=60)
        quick = [sandbox.run(["sh", "-c", f"echo {n}"], env=_ENV) for n in range(3)]
        result = slow.result(timeout=90)
    assert [r.stdout for r in quick] == [b"0\n", b"1\n", b"2\n"]
    assert result.exit_code == 0, result.stderr
    assert result.cpu_s >= 0.25
    assert result.peak_rss_bytes > 1 << 20


def test_a_dead_sentry_fails_its_commands_within_a_deadline(
        resident: tuple[Resident, Path, int]) -> None:
    sandbox, _, uid = resident
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(sandbox.run, ["sleep", "60"], env=_ENV, timeout=90)
        time.sleep(1)
        # What the OOM killer or a crash of gVisor does: every gVisor process of this sandbox.
        for pid, _ in host_procs_of_uid(runtime_uid(uid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(BackendError, match="died"):
            pending.result(timeout=30)
    assert time.monotonic() - started < 15


# A helper gone hostile (what code that took it over could send): ready, then at the first
# request LINE, then nothing more until it is killed.
_HOSTILE_HELPER = """
import sys, time
out = sys.stdout.buffer
out.write(b'{"ready": true}\\n'); out.flush()
sys.stdin.buffer.readline()
out.write(LINE); out.flush()
time.sleep(600)
"""


@pytest.mark.parametrize("line", ["b'x' * (4 << 20)", "b'[1]\\n'", "b'{\"id\": [1]}\\n'"],
                         ids=["too-long", "not-an-object", "bad-id"])
def test_a_helper_that_breaks_its_protocol_ends_its_resident(
        pieces: Pieces, monkeypatch: pytest.MonkeyPatch, line: str) -> None:
    # The helper runs in the sandbox: what it sends is bounded and checked. A line past the
    # limit (4 MiB without a newline), or one that is not its protocol, stops the resident at
    # once (the host holds at most 1 MiB of it): its command fails then, not at its timeout.
    monkeypatch.setattr(resident_mod, "_HELPER_SOURCE", _HOSTILE_HELPER.replace("LINE", line))
    sandbox = pieces.start()
    with pytest.raises(BackendError, match="broke the protocol"):
        sandbox.run(["true"], env=_ENV, timeout=50)
    assert not sandbox.alive


def test_on_demand_stops_when_idle_and_restarts(pieces: Pieces) -> None:
    runtime = runtime_uid(pieces.uid)
    holder = OnDemand(pieces.start, idle_s=1.0)
    try:
        assert holder.run(["true"], env=_ENV).exit_code == 0
        assert holder.running and host_procs_of_uid(runtime)
        deadline = time.monotonic() + 15
        while holder.running and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not holder.running
        reap_orphans(runtime)
        assert host_procs_of_uid(runtime, zombies=True) == []  # idle: no process at all
        assert holder.run(["sh", "-c", "echo again"], env=_ENV).stdout == b"again\n"
        assert holder.starts == 2
        # A dead sandbox (its Sentry killed) is replaced by the next command.
        for pid, _ in host_procs_of_uid(runtime):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while host_procs_of_uid(runtime) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        assert holder.run(["true"], env=_ENV).exit_code == 0
        assert holder.starts == 3
    finally:
        holder.close()


def test_a_crashed_owner_leaves_no_resident_behind(
        backend: GvisorBackend, home: str, settings: Settings, manager: Manager) -> None:
    """The resident path in another process, SIGKILLed mid-command:
    its resident sandbox dies with it, and the next start's sweep removes its group and runsc
    state; the sandbox itself stays usable."""
    env = {**os.environ, "CORRAL_HOME": str(settings.home), "CORRAL_GVISOR_RESIDENT": "1",
           "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    code = textwrap.dedent("""
        from corral import Sandbox
        from corral._control.manager import get_manager
        sb = Sandbox.create(isolation="gvisor")
        assert sb.commands.run("echo warm").stdout == "warm\\n"
        print(sb.id, get_manager().store.get(sb.id).uid, flush=True)
        sb.commands.run("sleep 300", timeout=60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.communicate(timeout=30)[1]
        sandbox_id, uid_text = line.split()
        runtime = runtime_uid(int(uid_text))
        assert host_procs_of_uid(runtime), "no resident sandbox is running"
        time.sleep(1)  # the `sleep 300` is in flight
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    deadline = time.monotonic() + 15
    while host_procs_of_uid(runtime) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert host_procs_of_uid(runtime) == []  # pdeathsig: runsc, and its Sentry with it
    removed = manager.recover()
    assert any(item.startswith(f"command {sandbox_id}/") and "resident-" in item
               for item in removed), removed
    assert any(item.startswith(f"runsc {sandbox_id}.") for item in removed), removed
    assert not [p for p in (settings.home / "gvisor" / "state").iterdir()
                if p.name.startswith((sandbox_id, f"runsc-{sandbox_id}"))]
    from corral import Sandbox
    sb = Sandbox.connect(sandbox_id, home=home)
    try:
        assert sb.commands.run("echo works").stdout == "works\n"
    finally:
        sb.kill()


def test_a_resident_is_pinned_to_its_tiers_cpus(home: str, gvisor_problems: list[str]) -> None:
    """Settings.gvisor_pin_cpus (on by default): once up, every thread of a small sandbox's
    resident (runsc, gofer, Sentry, the stubs that run its code) runs on one host CPU; a new
    process started inside later (a new address space, a new stub) inherits it."""
    if gvisor_problems:
        pytest.skip("the gVisor tier cannot run on this host: " + "; ".join(gvisor_problems))
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a host with one CPU: nothing to choose")
    from corral import Sandbox

    from .hostprocs import host_uid

    with Sandbox.create(isolation="gvisor", home=home) as sb:  # "small": one CPU
        assert sb.commands.run("true").exit_code == 0
        assert sb.commands.run("sh -c 'sleep 0.2 & wait'").exit_code == 0
        masks = set()
        for pid, _ in host_procs_of_uid(runtime_uid(host_uid(sb.id))):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    masks.add(frozenset(os.sched_getaffinity(int(tid))))
        assert len(masks) == 1 and len(next(iter(masks))) == 1, masks
