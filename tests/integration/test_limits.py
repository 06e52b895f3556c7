"""Resource limits, proven against real sandboxes (tier ``small``): every attack is contained,
reported in the result, and leaves the host and the sandbox's next command unaffected.

Every attack is bounded on its own, so that a broken limit costs a slow test, not a host: the
fork bomb forks at most 2000 children that exit after 30 s, the memory bomb allocates at most
2 GiB, the fill tests write at most 2 GiB, the output flood writes 50 MB, and every command has a
timeout.
"""

from __future__ import annotations

import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from corral import Sandbox

from .hostprocs import host_procs_of_uid, host_uid, not_resident, status_field

pytestmark = pytest.mark.needs_root

MiB = 1024 * 1024
GiB = 1024 * MiB

# The small tier's numbers (src/corral/_core/resources.py).
SMALL_MEMORY = 512 * MiB
SMALL_PIDS = 128
SMALL_DISK = 1 * GiB
SMALL_TMP = 64 * MiB
SMALL_OUTPUT = 1 * MiB


def live_host_procs_of_uid(uid: int) -> list[str]:
    """Host processes (not zombies) running as ``uid``: "pid name state", but the sandbox's
    resident helper (kept until it is idle, in groups of its own: ``hostprocs.not_resident``)."""
    return [f"{pid} {status_field(st, 'Name')} {status_field(st, 'State')}"
            for pid, st in not_resident(host_procs_of_uid(uid))]


def assert_host_and_sandbox_fine(sb: Sandbox) -> None:
    """Nothing of the sandbox still runs on the host, the host can start processes, and the
    sandbox's next command works."""
    assert live_host_procs_of_uid(host_uid(sb.id)) == []
    host = subprocess.run(["sh", "-c", "echo host-ok"], capture_output=True, text=True, timeout=10)
    assert host.stdout == "host-ok\n"
    started = time.monotonic()
    r = sb.commands.run("echo ok", timeout=10)
    assert (r.exit_code, r.stdout, r.timed_out) == (0, "ok\n", False), r
    assert not r.usage.oom_killed
    assert time.monotonic() - started < 10


def py(sb: Sandbox, code: str, *, timeout: float = 30):  # type: ignore[no-untyped-def]
    return sb.commands.run(["python3", "-c", textwrap.dedent(code)], timeout=timeout)


# -- processes ------------------------------------------------------------------------------------


def test_fork_bomb_hits_the_pids_limit(sandbox: Sandbox) -> None:
    started = time.monotonic()
    r = py(sandbox, """
        import os, sys, time
        children = 0
        error = None
        for _ in range(2000):           # bounded even without a pids limit
            try:
                pid = os.fork()
            except OSError as e:
                error = e
                break
            if pid == 0:
                time.sleep(30)          # each child leaves by itself, too
                os._exit(0)
            children += 1
        print("children", children, flush=True)
        print("error", error, flush=True)
        sys.exit(3 if error else 0)
    """, timeout=30)
    assert time.monotonic() - started < 25, "the fork bomb was not stopped early"
    assert not r.timed_out, r
    assert r.exit_code == 3, (r.exit_code, r.stdout, r.stderr)
    assert "Resource temporarily unavailable" in r.stdout, r.stdout
    children = int(r.stdout.split("children", 1)[1].split()[0])
    # The limit is the sandbox's 128 tasks, bwrap and python included.
    assert SMALL_PIDS // 2 < children < SMALL_PIDS, children
    assert_host_and_sandbox_fine(sandbox)
    # The pid budget is free again: the next command can start many processes.
    r = sandbox.commands.run("for i in $(seq 60); do sleep 0.3 & done; wait; echo done", timeout=20)
    assert (r.exit_code, r.stdout) == (0, "done\n"), (r.stdout, r.stderr)


def test_thread_bomb_hits_the_pids_limit(sandbox: Sandbox) -> None:
    r = py(sandbox, """
        import sys, threading, time
        stop = threading.Event()
        started = 0
        error = None
        for _ in range(2000):
            t = threading.Thread(target=stop.wait, args=(30,), daemon=True)
            try:
                t.start()
            except RuntimeError as e:
                error = e
                break
            started += 1
        print("threads", started, flush=True)
        print("error", error, flush=True)
        stop.set()
        sys.exit(3 if error else 0)
    """, timeout=30)
    assert r.exit_code == 3, (r.exit_code, r.stdout, r.stderr)
    assert "can't start new thread" in r.stdout, r.stdout
    assert int(r.stdout.split("threads", 1)[1].split()[0]) < SMALL_PIDS
    assert_host_and_sandbox_fine(sandbox)


# -- memory ---------------------------------------------------------------------------------------


def test_memory_bomb_is_oom_killed_and_reported(sandbox: Sandbox) -> None:
    started = time.monotonic()
    r = py(sandbox, """
        chunks = []
        for i in range(32):                             # 32 x 64 MiB = 2 GiB at most
            chunks.append(b"\\x01" * (64 << 20))        # written, so really resident
            print("allocated", (i + 1) * 64, flush=True)
        print("survived", flush=True)
    """, timeout=30)
    assert time.monotonic() - started < 25
    assert not r.timed_out
    assert "survived" not in r.stdout, r.stdout
    assert r.usage.oom_killed is True, r
    assert r.exit_code == 128 + 9, (r.exit_code, r.stderr)
    allocated = [int(line.split()[1]) for line in r.stdout.splitlines()
                 if line.startswith("allocated")]
    assert allocated and max(allocated) * MiB <= SMALL_MEMORY, allocated
    assert r.usage.peak_memory_bytes <= SMALL_MEMORY + MiB, r.usage
    assert r.usage.peak_memory_bytes > SMALL_MEMORY // 2, r.usage
    assert_host_and_sandbox_fine(sandbox)
    # The memory is free again.
    r = py(sandbox, """
        data = b"\\x02" * (300 << 20)
        print("ok", len(data) >> 20)
    """)
    assert (r.exit_code, r.stdout, r.usage.oom_killed) == (0, "ok 300\n", False), r


# -- disk -----------------------------------------------------------------------------------------


def test_filling_tmp_fails_with_enospc_and_the_sandbox_can_free_it(sandbox: Sandbox) -> None:
    r = sandbox.commands.run(
        "head -c 200000000 /dev/zero > /tmp/fill; echo rc=$?; stat -c %s /tmp/fill", timeout=30
    )
    assert "rc=1" in r.stdout, (r.stdout, r.stderr)
    assert "No space left on device" in r.stderr, r.stderr
    size = int(r.stdout.split()[-1])
    assert SMALL_TMP // 2 < size <= SMALL_TMP, size
    assert not r.usage.oom_killed
    assert_host_and_sandbox_fine(sandbox)
    # /tmp is the sandbox's for its life: still full for the next command, until it frees it.
    r = sandbox.commands.run("ls -A /tmp | wc -l; rm /tmp/fill; "
                             "head -c 10000000 /dev/zero > /tmp/x && echo ok")
    assert r.stdout.split() == ["1", "ok"], (r.stdout, r.stderr)


def test_filling_dev_shm_is_contained(sandbox: Sandbox) -> None:
    """`/dev/shm` has no size of its own (it is a directory on bwrap's `/dev` tmpfs), so only the
    memory limit bounds it: the write must fail or be OOM-killed, and nothing may outlive it."""
    started = time.monotonic()
    r = sandbox.commands.run("head -c 1000000000 /dev/zero > /dev/shm/fill; echo rc=$?",
                             timeout=30)
    assert time.monotonic() - started < 25
    assert not r.timed_out
    assert ("rc=0" not in r.stdout) or r.usage.oom_killed, (r.stdout, r.stderr)
    assert r.usage.peak_memory_bytes <= SMALL_MEMORY + MiB
    assert_host_and_sandbox_fine(sandbox)


def test_filling_the_workspace_fails_with_enospc_and_rm_frees_it(
    sandbox: Sandbox, home: str
) -> None:
    started = time.monotonic()
    r = sandbox.commands.run(
        "head -c 2000000000 /dev/zero > /workspace/fill; echo rc=$?; stat -c %s /workspace/fill",
        timeout=60,
    )
    assert time.monotonic() - started < 55
    assert not r.timed_out, r
    assert "rc=1" in r.stdout, (r.stdout, r.stderr)
    assert "No space left on device" in r.stderr, r.stderr
    size = int(r.stdout.split()[-1])
    assert SMALL_DISK // 2 < size <= SMALL_DISK, size
    # The host's disk holds at most the workspace's size for it.
    image = Path(home) / "sandboxes" / sandbox.id / "upper.img"
    assert image.stat().st_blocks * 512 <= SMALL_DISK + 4 * MiB
    assert_host_and_sandbox_fine(sandbox)
    r = sandbox.commands.run("echo x > /workspace/small; echo rc=$?")
    assert "No space left on device" in r.stderr and "rc=1" in r.stdout, (r.stdout, r.stderr)
    # The sandbox still works, and rm gives the space back.
    r = sandbox.commands.run("rm /workspace/fill && head -c 100000000 /dev/zero > /workspace/big "
                             "&& stat -c %s /workspace/big && df -B1 --output=avail /workspace",
                             timeout=30)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    lines = r.stdout.split()
    assert lines[0] == "100000000"
    assert int(lines[-1]) > SMALL_DISK // 2
    sandbox.files.write("from-sdk.txt", "fine")
    assert sandbox.commands.run("cat from-sdk.txt").stdout == "fine"


# -- CPU and time ---------------------------------------------------------------------------------


def test_infinite_loop_times_out(sandbox: Sandbox) -> None:
    started = time.monotonic()
    r = sandbox.commands.run("while true; do :; done", timeout=2)
    elapsed = time.monotonic() - started
    assert r.timed_out is True
    assert r.exit_code == 124
    assert elapsed < 10 and r.duration_s < 10, elapsed
    assert r.usage.cpu_s <= r.usage.wall_s * 1.0 + 0.3, r.usage
    assert_host_and_sandbox_fine(sandbox)


def test_two_busy_processes_share_one_core(sandbox: Sandbox) -> None:
    """The small tier has 1 CPU: two spinning processes (on a 2-core host) get one core between
    them, not two."""
    started = time.monotonic()
    r = sandbox.commands.run("(while :; do :; done) & while :; do :; done", timeout=3)
    assert time.monotonic() - started < 10
    assert r.timed_out and r.exit_code == 124
    assert r.usage.cpu_s <= r.usage.wall_s * 1.0 * 1.15 + 0.2, r.usage
    assert r.usage.cpu_s > 0.3, r.usage  # it really ran
    assert_host_and_sandbox_fine(sandbox)


@pytest.mark.parametrize(
    "script",
    [
        "sh -c 'sleep 100 & sleep 100 & wait'",
        "setsid sh -c 'sleep 100 & sleep 100 & wait' </dev/null >/dev/null 2>&1 & wait",
        "sh -c 'trap \"\" TERM INT HUP; sleep 100 & wait'",
        "python3 -c 'import os, time\nif os.fork() == 0:\n    os.setsid()\n"
        "    if os.fork() == 0:\n        time.sleep(100)\n    os._exit(0)\ntime.sleep(100)'",
    ],
    ids=["children", "setsid", "ignores-term", "double-fork"],
)
def test_timeout_kills_the_whole_tree(sandbox: Sandbox, script: str) -> None:
    uid = host_uid(sandbox.id)
    started = time.monotonic()
    r = sandbox.commands.run(script, timeout=1)
    assert time.monotonic() - started < 10
    assert r.timed_out is True and r.exit_code == 124, r
    assert live_host_procs_of_uid(uid) == []
    assert_host_and_sandbox_fine(sandbox)
    r = sandbox.commands.run("ps -eo comm=")
    assert "sleep" not in r.stdout.split() and "python3" not in r.stdout.split(), r.stdout


# -- output ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_flood_is_capped_and_reported(sandbox: Sandbox, stream: str) -> None:
    total = 50_000_000
    seen: list[int] = []
    redirect = " >&2" if stream == "stderr" else ""
    started = time.monotonic()
    kwargs = {f"on_{stream}": lambda text: seen.append(len(text))}
    r = sandbox.commands.run(f"head -c {total} /dev/zero | tr '\\0' a{redirect}", timeout=30,
                             **kwargs)  # type: ignore[arg-type]
    assert time.monotonic() - started < 25
    assert not r.timed_out and r.exit_code == 0, r
    text = getattr(r, stream)
    dropped = getattr(r, f"{stream}_truncated")
    assert dropped == total - SMALL_OUTPUT, dropped
    kept, marker = text[:SMALL_OUTPUT], text[SMALL_OUTPUT:]
    assert kept == "a" * SMALL_OUTPUT
    assert f"[corral: {stream} truncated" in marker, marker
    assert len(marker) < 200
    # The callback saw only the kept part and the one marker line (said live, at the cut), so a
    # flood cannot flood the caller either.
    assert sum(seen) == len(text) == SMALL_OUTPUT + len(marker), sum(seen)
    other = "stderr" if stream == "stdout" else "stdout"
    assert getattr(r, other) == "" and getattr(r, f"{other}_truncated") == 0
    assert_host_and_sandbox_fine(sandbox)
