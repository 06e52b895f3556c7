"""The gVisor tier, directly through its backend and through the SDK.

The backend tests build a sandbox from a ``SandboxSpec`` as the control plane would (uids from the
top of the session's range, which the store hands out last) and check, after each, that nothing
is left: processes of the sandbox's uid or runtime uid, cgroups, the network namespace, mounts,
runsc state and bundles. Attacks are bounded by construction: capped loops and sizes, loopback
only, and a timeout on every command.

The isolation suite (test_isolation.py) runs on this tier too; these tests cover what is the
tier's own: the command's life (streams, stdin, terminal, timeout, kill, pause), the runtime uid,
the gateway's listener, limits, clean-up and host checks.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral import BackendUnavailable, Sandbox
from corral._backends.gvisor import GvisorBackend
from corral._backends.gvisor import backend as backend_mod
from corral._backends.gvisor import hostcheck as hostcheck_mod
from corral._backends.gvisor.bundle import runtime_uid
from corral._control.manager import Manager
from corral._control.validate import MAX_STDIN_BYTES
from corral._core.resources import get_tier
from corral._settings import Settings
from corral.backends import ExecOutcome, ExecRequest, ProcessIO, SandboxSpec

from .hostprocs import host_procs_of_uid, not_resident

pytestmark = pytest.mark.needs_root

_taken = itertools.count(1)


@pytest.fixture(scope="module")
def backend(settings: Settings, manager: Manager,
            gvisor_problems: list[str]) -> Iterator[GvisorBackend]:
    """A backend of its own on the session's data directory (which the manager set up)."""
    if gvisor_problems:
        pytest.skip("the gVisor tier cannot run on this host: " + "; ".join(gvisor_problems))
    gvisor = GvisorBackend(settings)
    yield gvisor
    # Pieces of sandboxes only this backend knew (the store never heard of them).
    assert gvisor.sweep(lambda sandbox_id: manager.store.get(sandbox_id) is not None) == []
    gvisor.remove_instance()
    gvisor.close()


def _leftovers(settings: Settings, spec: SandboxSpec) -> list[str]:
    found = [f"process {pid} of uid {uid}" for uid in (spec.uid, runtime_uid(spec.uid))
             for pid, _ in host_procs_of_uid(uid, zombies=True)]
    netns = settings.run_dir / f"corral-{settings.instance}-{spec.id}"
    if os.path.lexists(netns):
        found.append(str(netns))
    with open("/proc/self/mountinfo") as f:
        found += [line.strip() for line in f if spec.id in line]
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        group = hierarchy / f"corral-{settings.instance}" / spec.id
        if group.exists():
            found.append(str(group))
    for directory in ("state", "bundles"):
        path = settings.home / "gvisor" / directory
        if path.is_dir():
            found += [str(p) for p in path.iterdir() if spec.id in p.name]
    if (settings.home / "sandboxes" / spec.id).exists():
        found.append(f"workspace of {spec.id}")
    return found


@pytest.fixture
def spec(backend: GvisorBackend, settings: Settings) -> Iterator[SandboxSpec]:
    """A sandbox built by the backend alone, destroyed and checked for leftovers afterwards."""
    uid = settings.uid_start + settings.uid_count - next(_taken)
    made = SandboxSpec(id=f"sbx_gv{secrets.token_hex(5)}", uid=uid, template="base",
                       tier=get_tier("small"))
    backend.create(made)
    try:
        yield made
    finally:
        backend.destroy(made)
        assert _leftovers(settings, made) == []


def run(backend: GvisorBackend, spec: SandboxSpec, cmd: str | list[str], *,
        timeout: float = 30, **kwargs: Any) -> ExecOutcome:
    argv = ["bash", "-c", cmd] if isinstance(cmd, str) else cmd
    request = ExecRequest(argv=argv, cwd=kwargs.pop("cwd", "/workspace"),
                          env=kwargs.pop("env", {}), timeout_s=timeout,
                          command_id=kwargs.pop("command_id", f"cmd_{secrets.token_hex(6)}"),
                          **kwargs)
    return backend.exec(spec, request)


# -- running a command ---------------------------------------------------------------------------


def test_runs_as_1000_inside_and_files_belong_to_the_sandbox_uid(
    backend: GvisorBackend, spec: SandboxSpec
) -> None:
    out = run(backend, spec, "id -u; id -g; id -G; echo data > made.txt; mkdir sub; ls -ln")
    assert out.exit_code == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:3] == ["1000", "1000", "1000"], out.stdout
    assert " 1000 1000 " in lines[-1], out.stdout
    root = backend.workspace_root(spec)
    for name in ("made.txt", "sub"):
        st = os.stat(root / name)
        assert (st.st_uid, st.st_gid) == (spec.uid, spec.uid), name
    # And a file the host writes as the sandbox's uid (the files API) is the command's own.
    (root / "from-host.txt").write_text("host\n")
    os.chown(root / "from-host.txt", spec.uid, spec.uid)
    out = run(backend, spec, "cat from-host.txt && echo more >> from-host.txt && stat -c %u "
                             "from-host.txt")
    assert out.stdout == "host\n1000\n", (out.stdout, out.stderr)


def test_exit_codes_signals_and_streams(backend: GvisorBackend, spec: SandboxSpec) -> None:
    out = run(backend, spec, "echo to-out; echo to-err >&2; exit 42")
    assert (out.exit_code, out.stdout, out.stderr, out.timed_out) == (
        42, "to-out\n", "to-err\n", False)
    assert run(backend, spec, "kill -TERM $$").exit_code == 128 + 15
    assert run(backend, spec, "kill -KILL $$").exit_code == 128 + 9
    missing = run(backend, spec, ["/no/such/program"])
    assert missing.exit_code == 127 and "/no/such/program" in missing.stderr, missing
    assert run(backend, spec, ["/etc/passwd"]).exit_code == 126


def test_environment_is_built_from_scratch(
    backend: GvisorBackend, spec: SandboxSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORRAL_TEST_HOST_SECRET", "s3cr3t")
    out = run(backend, spec, "env | sort", env={"GREETING": "hello world", "HOME": "/tmp"})
    env = dict(line.split("=", 1) for line in out.stdout.splitlines())
    assert "s3cr3t" not in out.stdout
    assert env["GREETING"] == "hello world" and env["HOME"] == "/tmp"  # the request wins
    assert env["USER"] == "user" and env["CORRAL_SANDBOX_ID"] == spec.id
    assert env["PATH"].startswith("/usr/local/bin:/usr/bin")


def test_stdin_cwd_and_large_input(backend: GvisorBackend, spec: SandboxSpec) -> None:
    run(backend, spec, "mkdir -p a/b")
    data = b"x" * (5 * 1024 * 1024)
    out = run(backend, spec, "pwd; wc -c", stdin=data, cwd="/workspace/a/b")
    assert out.stdout.split() == ["/workspace/a/b", str(len(data))], out
    # The most a command may be given: one 85 MiB line of base64 to the helper, which read it
    # in quadratic time (32 MiB took 14 s here; now ~1 s).
    data = b"y" * MAX_STDIN_BYTES
    out = run(backend, spec, "wc -c", stdin=data, timeout=60)
    assert out.stdout.split() == [str(len(data))], out


def test_output_is_capped_and_counted(backend: GvisorBackend, spec: SandboxSpec) -> None:
    streamed: list[str] = []
    out = run(backend, spec, "head -c 300000 /dev/zero | tr '\\0' a; echo; echo e >&2",
              output_limit_bytes=1000, on_stdout=streamed.append)
    assert out.exit_code == 0
    assert out.stdout.startswith("a" * 1000) and "truncated" in out.stdout
    assert out.stdout_truncated == 300001 - 1000
    assert out.stderr == "e\n" and out.stderr_truncated == 0
    # The cut is said live, the moment it happens, in the words of the result.
    marker = "[corral: stdout truncated after 1000 bytes; the rest is dropped]\n"
    assert "".join(streamed) == out.stdout == "a" * 1000 + "\n" + marker


def test_workspace_and_tmp_persist_and_dev_shm_is_fresh(backend: GvisorBackend,
                                                        spec: SandboxSpec) -> None:
    first = run(backend, spec, "echo kept > keep; echo kept > /tmp/t; echo gone > /dev/shm/s")
    assert first.exit_code == 0, first.stderr
    out = run(backend, spec, "cat keep; ls -A /tmp /dev/shm")
    assert out.stdout.split() == ["kept", "/dev/shm:", "/tmp:", "t"], out.stdout


def test_timeout_kills_the_whole_tree(backend: GvisorBackend, spec: SandboxSpec) -> None:
    script = ("sleep 300 & setsid bash -c 'sleep 300' </dev/null >/dev/null 2>&1 & "
              "python3 -c 'import os; os.fork() or os.setsid(); import time; time.sleep(300)' & "
              "echo started; wait")
    started = time.monotonic()
    out = run(backend, spec, script, timeout=2)
    assert out.timed_out and out.exit_code == 124, out
    assert out.stdout == "started\n"
    assert time.monotonic() - started < 10
    # On the host only the resident gVisor sandbox stays (until it is idle); inside it, nothing
    # of the command's tree is left: the next command sees its own processes only.
    assert not_resident(host_procs_of_uid(runtime_uid(spec.uid), zombies=True)) == []
    left = run(backend, spec, "echo next; ps -eo comm= > /tmp/ps; sort /tmp/ps | tr '\\n' ' '")
    assert left.stdout == "next\nbash ps run ", left  # (ps alone: a pipeline races it)


# -- terminals, interaction, kill and pause ------------------------------------------------------


def test_given_stdin_larger_than_a_pipe_and_one_that_is_never_read(
    backend: GvisorBackend, spec: SandboxSpec
) -> None:
    """Given stdin reaches the command whole, then EOF; a command that never reads 1 MiB of
    it does not hold up the resident sandbox's helper: a command beside it runs, and both end."""
    data = bytes(range(256)) * 4096  # 1 MiB, sixteen pipe buffers
    out = run(backend, spec, "sha256sum", stdin=data)
    assert out.stdout.split()[0] == hashlib.sha256(data).hexdigest(), out
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ignoring = pool.submit(run, backend, spec, "sleep 1; echo ignored", stdin=data)
        time.sleep(0.3)
        assert run(backend, spec, "echo beside", timeout=10).stdout == "beside\n"
        assert ignoring.result(timeout=30).stdout == "ignored\n"
    assert run(backend, spec, "cat", stdin=None).stdout == ""  # no stdin: EOF at once


def test_interactive_stdin(backend: GvisorBackend, spec: SandboxSpec) -> None:
    def on_start(io: ProcessIO) -> None:
        io.write(b"one\n")
        io.write(b"two\n")
        io.close_stdin()

    out = run(backend, spec, "cat; echo done", interactive=True, on_start=on_start)
    assert out.stdout == "one\ntwo\ndone\n", out


def test_pty_is_the_controlling_terminal(backend: GvisorBackend, spec: SandboxSpec) -> None:
    """A terminal: its size, input, SIGWINCH on resize and Ctrl-C to the foreground group."""
    ios: list[ProcessIO] = []
    probe = (
        "import fcntl, os, signal, struct, sys, termios\n"
        "size = lambda: struct.unpack('HHHH', fcntl.ioctl(0, termios.TIOCGWINSZ, b'0' * 8))[:2]\n"
        "signal.signal(signal.SIGWINCH, lambda *a: print('winch', *size(), flush=True))\n"
        "print('tty', os.isatty(0), os.tcgetpgrp(0) == os.getpgrp(), *size(), flush=True)\n"
        "print('read', sys.stdin.readline().strip(), flush=True)\n"
        "try:\n"
        "    print('waiting', flush=True)\n"
        "    while True:\n"
        "        signal.pause()\n"  # returns after SIGWINCH's handler too
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
    )
    seen: list[str] = []
    ready = threading.Event()

    def on_stdout(text: str) -> None:
        seen.append(text)
        if "tty" in "".join(seen):
            ready.set()

    def drive() -> None:
        assert ready.wait(20)
        ios[0].write(b"hello\n")
        while "read hello" not in "".join(seen):
            time.sleep(0.02)
        while "waiting" not in "".join(seen):
            time.sleep(0.02)
        ios[0].resize(40, 120)
        while "winch" not in "".join(seen):
            time.sleep(0.02)
        ios[0].write(b"\x03")

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(drive)
        out = run(backend, spec, ["python3", "-c", probe], pty=(24, 80), on_start=ios.append,
                  on_stdout=on_stdout, env={"TERM": "xterm"}, timeout=30)
        future.result(timeout=5)
    text = out.stdout.replace("\r", "")
    assert "tty True True 24 80" in text, text
    assert "read hello" in text and "winch 40 120" in text and "interrupted" in text, text
    assert out.exit_code == 0 and not out.timed_out, out


def test_kill_command_and_busy(backend: GvisorBackend, spec: SandboxSpec) -> None:
    assert not backend.busy(spec)
    assert backend.kill_command(spec, "cmd_notrunning") is False
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(run, backend, spec, "echo up; sleep 300", command_id="cmd_victim",
                             timeout=60)
        deadline = time.monotonic() + 20
        while not backend.busy(spec) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)
        assert backend.busy(spec)
        assert backend.kill_command(spec, "cmd_victim") is True
        out = future.result(timeout=20)
    assert out.exit_code == 128 + 9 and not out.timed_out, out
    assert not backend.busy(spec)


def test_pause_freezes_and_resume_continues(backend: GvisorBackend, spec: SandboxSpec) -> None:
    ticker = "for i in $(seq 100); do echo $i > tick; sleep 0.05; done; echo finished"
    root = backend.workspace_root(spec)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(run, backend, spec, ticker, timeout=60)
        deadline = time.monotonic() + 20
        while not (root / "tick").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        backend.pause(spec, True)
        try:
            frozen = (root / "tick").read_text()
            time.sleep(0.5)
            assert (root / "tick").read_text() == frozen, "the command kept running while paused"
        finally:
            backend.pause(spec, False)
        out = future.result(timeout=30)
    assert out.stdout == "finished\n" and out.exit_code == 0, out
    assert (root / "tick").read_text() == "100\n"


def test_pause_right_after_create_waits_for_the_resident_start(
    backend: GvisorBackend, settings: Settings
) -> None:
    """A pause that comes while the resident is still starting (ahead, from create) lets the
    start finish first: frozen mid-start it would time out, and destroy would wait for it."""
    made = SandboxSpec(id=f"sbx_gq{secrets.token_hex(5)}",
                       uid=settings.uid_start + settings.uid_count - next(_taken),
                       template="base", tier=get_tier("small"))
    backend.create(made)
    try:
        started = time.monotonic()
        backend.pause(made, True)
        try:
            holder = backend._holder(made.id)
            assert holder is not None and holder.running  # up before anything froze
        finally:
            backend.pause(made, False)
        assert time.monotonic() - started < 10
        assert run(backend, made, "echo up", timeout=20).stdout == "up\n"
    finally:
        backend.destroy(made)
        assert _leftovers(settings, made) == []


# -- network ------------------------------------------------------------------------------------


def test_only_the_listener_is_reachable(backend: GvisorBackend, spec: SandboxSpec) -> None:
    """The gateway's listener, bound in the sandbox's namespace, answers at 127.0.0.1 inside;
    a listener on the host's own loopback does not."""
    endpoint = backend.egress_endpoint(spec)
    listener = endpoint.listener
    assert endpoint.proxy_url == f"http://127.0.0.1:{listener.getsockname()[1]}"
    host = socket.create_server(("127.0.0.1", 0))
    try:
        listener.setblocking(True)
        listener.settimeout(20)
        port, host_port = listener.getsockname()[1], host.getsockname()[1]

        def serve() -> bytes:
            conn, _ = listener.accept()
            with conn:
                data = conn.recv(100)
                conn.sendall(b"pong")
            return data

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            served = pool.submit(serve)
            out = run(backend, spec, f"exec 3<>/dev/tcp/127.0.0.1/{port}; echo ping >&3; "
                                     f"head -c 4 <&3; echo; "
                                     f"exec 4<>/dev/tcp/127.0.0.1/{host_port}; echo rc=$?")
            assert served.result(timeout=20) == b"ping\n"
        assert out.stdout.startswith("pong\n"), (out.stdout, out.stderr)
        assert "rc=1" in out.stdout and "Connection refused" in out.stderr, out
        # Nothing but lo, no route, no resolver.
        out = run(backend, spec, "cat /proc/net/dev | tail -n +3 | cut -d: -f1; "
                                 "getent hosts example.com; echo rc=$?")
        assert out.stdout.split() == ["lo", "rc=2"], out
    finally:
        listener.close()
        host.close()


# -- limits and usage ---------------------------------------------------------------------------


def test_usage_and_memory_limit(backend: GvisorBackend, spec: SandboxSpec) -> None:
    # 0.3 s of CPU, not of wall time (a loaded host gives a wall-time loop a fraction of it).
    out = run(backend, spec, "python3 -c \"b = bytearray(60 << 20); import time\n"
                             "t = time.process_time()\n"
                             "while time.process_time() - t < 0.3: pass\"")
    assert out.exit_code == 0, out.stderr
    assert out.usage.peak_memory_bytes >= 60 << 20 and out.usage.cpu_s >= 0.25, out.usage
    assert not out.usage.oom_killed
    bomb = run(backend, spec, ["python3", "-c", (
        "chunks = []\n"
        "for i in range(32):\n"  # 32 x 64 MiB = 2 GiB at most
        "    chunks.append(b'\\x01' * (64 << 20)); print('allocated', i + 1, flush=True)\n"
        "print('survived')")], timeout=60)
    assert "survived" not in bomb.stdout and not bomb.timed_out, bomb
    # The host's OOM killer acts in the command's cgroup; what the command sees depends on what
    # it hit: the Sentry killed (137), or an allocation refused inside (MemoryError, exit 1).
    assert bomb.usage.oom_killed and bomb.exit_code in (1, 128 + 9), bomb
    allocated = [int(line.split()[1]) for line in bomb.stdout.splitlines()
                 if line.startswith("allocated")]
    assert max(allocated, default=0) * 64 << 20 <= spec.tier.memory_bytes, allocated
    assert bomb.usage.peak_memory_bytes <= spec.tier.memory_bytes + (1 << 20)
    assert run(backend, spec, "echo ok").stdout == "ok\n"


def test_a_memory_bomb_beside_a_command_in_the_resident(
    backend: GvisorBackend, spec: SandboxSpec
) -> None:
    """The price of one gVisor kernel per sandbox, as documented: when a command exhausts the
    sandbox's memory, gVisor may refuse its allocation (MemoryError, exit 1) or the host's OOM
    killer takes the resident's Sentry; the command beside it then either goes on or ends
    OOM-killed too (137, ``oom_killed``). Never a hang or a made-up result, and the next command
    gets a working sandbox."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(run, backend, spec, "sleep 5; echo beside", timeout=60)
        time.sleep(0.5)
        bomb = run(backend, spec, ["python3", "-c", (
            "chunks = []\n"
            "for i in range(32):\n"  # 32 x 64 MiB = 2 GiB at most
            "    chunks.append(b'\\x01' * (64 << 20))")], timeout=60)
        assert bomb.usage.oom_killed and bomb.exit_code in (1, 128 + 9), bomb
        other = beside.result(timeout=30)
    assert ((other.exit_code, other.stdout) == (0, "beside\n")
            or (other.exit_code == 128 + 9 and other.usage.oom_killed)), other
    assert run(backend, spec, "echo ok").stdout == "ok\n"


def test_process_limit(backend: GvisorBackend, spec: SandboxSpec) -> None:
    """The tier's pid limit, enforced inside gVisor (RLIMIT_NPROC): fork fails with EAGAIN.
    Children are spawned (vfork + exec of sleep), not forked Pythons: a forked Python costs gVisor
    ~3 MiB of host memory, so 128 of them meet the memory limit first (also contained)."""
    out = run(backend, spec, ["python3", "-c", (
        "import os\n"
        "n = 0\n"
        "for _ in range(1000):\n"  # bounded even without a limit; children leave by themselves
        "    try:\n"
        "        os.posix_spawn('/bin/sleep', ['sleep', '20'], {})\n"
        "    except OSError as e:\n"
        "        print('error', e.strerror); break\n"
        "    n += 1\n"
        "print('children', n)")], timeout=60)
    assert "Resource temporarily unavailable" in out.stdout, out
    children = int(out.stdout.split("children")[1])
    assert spec.tier.pids // 2 < children < spec.tier.pids, children
    assert run(backend, spec, "echo ok").stdout == "ok\n"


# -- clean-up and host checks --------------------------------------------------------------------


def test_a_gvisor_sandbox_per_command_when_the_resident_is_off(
    backend: GvisorBackend, settings: Settings
) -> None:
    """``gvisor_resident=False``: every command in a gVisor sandbox of its own (the path a
    terminal always takes), with the same results, and what only it gives: a memory bomb ends
    its own command, not one running beside it."""
    gvisor = GvisorBackend(settings.model_copy(update={"gvisor_resident": False}))
    made = SandboxSpec(id=f"sbx_gp{secrets.token_hex(5)}",
                       uid=settings.uid_start + settings.uid_count - next(_taken),
                       template="base", tier=get_tier("small"))
    gvisor.create(made)
    try:
        # ps alone: a pipeline's other members may not have started when it looks.
        out = run(gvisor, made, "ps -eo comm= > /tmp/ps; sort /tmp/ps | tr '\\n' ' '; cat; exit 3",
                  stdin=b"in")
        assert (out.exit_code, out.stdout) == (3, "bash ps in"), out  # no launcher init
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            beside = pool.submit(run, gvisor, made, "sleep 3; echo beside", timeout=60)
            bomb = run(gvisor, made, ["python3", "-c", (
                "chunks = []\n"
                "for i in range(32):\n"  # 32 x 64 MiB = 2 GiB at most
                "    chunks.append(b'\\x01' * (64 << 20))")], timeout=60)
            assert bomb.usage.oom_killed, bomb
            assert beside.result(timeout=60).stdout == "beside\n"
        late = run(gvisor, made, "sleep 30 & echo started; wait", timeout=2)
        assert late.timed_out and late.stdout == "started\n"
        assert host_procs_of_uid(runtime_uid(made.uid), zombies=True) == []  # nothing kept
    finally:
        gvisor.destroy(made)
        assert _leftovers(settings, made) == []
        gvisor.close()


def test_sweep_removes_runsc_leftovers(
    backend: GvisorBackend, spec: SandboxSpec, settings: Settings
) -> None:
    """What a killed Corral leaves (runsc state files, a bundle) goes at the next sweep; the
    state of a live sandbox's running command stays."""
    state, bundles = settings.home / "gvisor" / "state", settings.home / "gvisor" / "bundles"
    gone = "sbx_gone00000000.0123456789ab"
    dead = f"{spec.id}.ba9876543210"  # a live sandbox, but no command cgroup of that name
    for container_id in (gone, dead):
        (state / f"{container_id}_sandbox:{container_id}.state").write_text("{}")
        (state / f"runsc-{container_id}.sock").touch()
        (bundles / container_id).mkdir()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(run, backend, spec, "touch started; sleep 2; echo survived")
        root = backend.workspace_root(spec)
        deadline = time.monotonic() + 20
        while not (root / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        removed = backend.sweep({spec.id})
        assert running.result(timeout=30).stdout == "survived\n"
    assert {f"runsc {gone}", f"runsc {dead}"} <= set(map(str, removed)), removed
    assert not any(p.name.startswith((gone, dead, f"runsc-{gone}", f"runsc-{dead}"))
                   for p in state.iterdir())
    assert not (bundles / gone).exists() and not (bundles / dead).exists()


def test_host_check_lines(backend: GvisorBackend) -> None:
    checks = {c.name: c for c in backend.check_host()}
    assert {"root", "runsc", "gvisor platform", "gvisor sandbox", "cgroups"} <= set(checks)
    assert "bwrap" not in checks  # commands never run through bwrap here
    assert all(c.ok for c in checks.values()), [c for c in checks.values() if not c.ok]
    assert "systrap" in checks["gvisor platform"].detail
    assert "20" in checks["runsc"].detail  # the build date


def test_refuses_without_runsc_and_never_runs_weaker(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hostcheck_mod, "find_runsc", lambda: None)
    monkeypatch.setattr(backend_mod, "find_runsc", lambda: None)
    gvisor = GvisorBackend(settings)
    checks = {c.name: c for c in gvisor.check_host()}
    assert not checks["runsc"].ok and "bookworm-backports" in checks["runsc"].fix
    assert not checks["gvisor sandbox"].ok
    # A uid of this module's own: another file's sandbox may still hold uid_start + 1.
    uid = settings.uid_start + settings.uid_count - next(_taken)
    made = SandboxSpec(id=f"sbx_gv{secrets.token_hex(5)}", uid=uid, template="base",
                       tier=get_tier("small"))
    with pytest.raises(BackendUnavailable, match="gVisor") as raised:
        gvisor.create(made)
    assert "corral doctor" in str(raised.value) and "runsc" in str(raised.value)
    assert _leftovers(settings, made) == []


def test_doctor_reports_every_tier(settings: Settings) -> None:
    env = {**os.environ, "CORRAL_HOME": str(settings.home)}
    done = subprocess.run([sys.executable, "-m", "corral", "doctor", "--json"], env=env,
                          capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout)
    assert done.returncode == 0, done.stderr
    assert report["ok"] is True
    tiers = report["tiers"]
    assert set(tiers) == {"namespace", "gvisor", "microvm"}
    assert tiers["gvisor"]["supported"] is True and tiers["namespace"]["supported"] is True
    names = {c["name"] for c in tiers["gvisor"]["checks"]}
    assert {"runsc", "gvisor sandbox"} <= names
    # The default tier's checks stay where they were.
    assert {c["name"] for c in report["checks"]} >= {"bwrap", "seccomp", "cgroups", "root"}


# -- through the SDK -----------------------------------------------------------------------------


@pytest.fixture
def gsandbox(home: str, gvisor_problems: list[str]) -> Iterator[Sandbox]:
    if gvisor_problems:
        pytest.skip("the gVisor tier cannot run on this host: " + "; ".join(gvisor_problems))
    sb = Sandbox.create(home=home, isolation="gvisor")
    yield sb
    sb.kill()


def test_sdk_commands_files_env_and_timeout(gsandbox: Sandbox) -> None:
    assert gsandbox.get_info().isolation == "gvisor"
    assert gsandbox.commands.run(["echo", "a b", "$HOME"]).stdout == "a b $HOME\n"
    result = gsandbox.commands.run("echo out; echo err >&2; exit 3", envs={"X": "y"})
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert gsandbox.commands.run("echo $X", envs={"X": "y"}).stdout == "y\n"
    gsandbox.files.write("hello.py", "print('hi from gvisor')")
    assert gsandbox.commands.run("python3 hello.py").stdout == "hi from gvisor\n"
    gsandbox.commands.run("echo made > made.txt")
    assert gsandbox.files.read("made.txt") == "made\n"
    slow = gsandbox.commands.run("sleep 30", timeout=1)
    assert slow.timed_out and slow.exit_code == 124
    assert gsandbox.commands.run("echo alive").stdout == "alive\n"


def test_sdk_egress_goes_through_the_gateway_only(home: str, gvisor_problems: list[str]) -> None:
    if gvisor_problems:
        pytest.skip("the gVisor tier cannot run on this host: " + "; ".join(gvisor_problems))
    with Sandbox.create(home=home, isolation="gvisor", network={"allow": ["api.test"]}) as sb:
        # Through the proxy: the gateway answers (403, no rule allows this host).
        out = sb.commands.run("curl -sS -m 10 -o /dev/null -w '%{http_code}' "
                              "http://not-allowed.test/", timeout=30)
        assert out.stdout == "403", (out.stdout, out.stderr)
        # Around it: nothing.
        out = sb.commands.run("env -u HTTP_PROXY -u http_proxy -u ALL_PROXY -u all_proxy curl "
                              "-sS -m 5 http://not-allowed.test/; echo rc=$?; curl -sS -m 5 "
                              "--noproxy '*' http://127.0.0.1:9/; echo rc=$?", timeout=30)
        assert "rc=0" not in out.stdout, (out.stdout, out.stderr)
    with Sandbox.create(home=home, isolation="gvisor") as sb:  # network "none": one that refuses
        out = sb.commands.run("curl -sS -m 10 http://not-allowed.test/", timeout=30)
        assert "refused by Corral's network policy" in out.stdout, (out.stdout, out.stderr)


def test_sdk_background_server_reachable_from_the_next_command(gsandbox: Sandbox) -> None:
    """Commands of one sandbox share its loopback, as in the namespace tier: a declared
    background process serving on 127.0.0.1 answers the next command."""
    gsandbox.files.write("serve.py", (
        "import socket\n"
        "s = socket.create_server(('127.0.0.1', 8765))\n"
        "open('ready', 'w').close()\n"
        "c, _ = s.accept(); c.sendall(b'hello from the server'); c.close()\n"
        "print('served')\n"))
    server = gsandbox.processes.start("python3 serve.py")
    deadline = time.monotonic() + 20
    while not gsandbox.files.exists("ready") and time.monotonic() < deadline:
        time.sleep(0.05)
    out = gsandbox.commands.run("exec 3<>/dev/tcp/127.0.0.1/8765; cat <&3")
    assert out.stdout == "hello from the server", (out.stdout, out.stderr)
    info = server.wait(timeout=20)
    assert info["state"] == "exited" and info["exit_code"] == 0, info


def test_sdk_concurrent_commands(gsandbox: Sandbox) -> None:
    """Each command is a gVisor sandbox of its own; several run at once in one Corral sandbox."""
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(
            lambda n: gsandbox.commands.run(f"sleep 0.5; echo {n}; ps -e | wc -l"), range(3)))
    for n, result in enumerate(results):
        assert result.exit_code == 0, result
        # Its own PID namespace: bash, sleep's gone, ps and wc (no neighbour's processes).
        assert result.stdout.split()[0] == str(n) and int(result.stdout.split()[1]) <= 5, result
