"""Resource abuse: bombs and floods, each bounded by its own construction (a capped count or
size, a timeout), each in a fresh sandbox so one cannot starve the next case."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..case import Case
from ..context import DrillContext
from ..model import Evidence, Outcome
from ..target import DrillSandbox

Run = Callable[[DrillContext], Outcome]
PY = frozenset({"python3"})

# At most 2000 children, each exits after 20 s: a broken limit costs a slow case, not a host.
FORK_BOMB = """
import os, time
made = 0
error = ""
for _ in range(2000):
    try:
        pid = os.fork()
    except OSError as e:
        error = e.strerror
        break
    if pid == 0:
        time.sleep(20)
        os._exit(0)
    made += 1
print("made", made, error)
"""

THREAD_BOMB = """
import threading, time
made = 0
error = ""
for _ in range(2000):
    try:
        threading.Thread(target=time.sleep, args=(20,), daemon=True).start()
    except RuntimeError as e:
        error = str(e)
        break
    made += 1
print("made", made, error)
"""

# At most 2 GiB, touched page by page.
MEMORY_BOMB = """
chunks = []
try:
    for i in range(32):
        chunks.append(bytearray(64 * 1024 * 1024))
        print("allocated", (i + 1) * 64, flush=True)
except MemoryError:
    print("MemoryError")
"""

FD_BOMB = """
import os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
except (ValueError, OSError):
    pass
fds = []
error = ""
for _ in range(100000):
    try:
        fds.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as e:
        error = e.strerror
        break
print("opened", len(fds), "hard", hard, error)
"""

# Creates files until the workspace runs out of inodes, but only when its filesystem has a
# limit under 700000 to run into: the count is capped at that limit plus 100.
INODE_BOMB = """
import os
st = os.statvfs("/workspace")
if not 0 < st.f_files <= 700000:
    print("made 700000 no inode limit under 700000:", st.f_files)
    raise SystemExit
os.makedirs("/workspace/inodes", exist_ok=True)
made, error = 0, ""
for i in range(st.f_files + 100):
    try:
        os.close(os.open(f"/workspace/inodes/{i}", os.O_CREAT | os.O_WRONLY, 0o600))
    except OSError as e:
        error = e.strerror
        break
    made += 1
print("made", made, error, "of", st.f_files)
"""

def _in_fresh(body: Callable[[DrillContext, DrillSandbox], Outcome]) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        sb = ctx.fresh()
        try:
            return body(ctx, sb)
        finally:
            ctx.discard(sb)
    return run


def _after_ok(ctx: DrillContext, sb: DrillSandbox, evidence: list[Evidence]) -> str | None:
    """The sandbox's next command runs normally; None when it does, else what went wrong."""
    started = time.monotonic()
    result = ctx.run("echo alive", sandbox=sb, timeout=20)
    evidence += ctx.evidence(result, sb)
    if result.stdout != "alive\n" or time.monotonic() - started > 15:
        return f"the next command failed: exit {result.exit_code} {result.stderr[:100]}"
    return None


def _counted(script: str, cap: int, what: str) -> Run:
    def body(ctx: DrillContext, sb: DrillSandbox) -> Outcome:
        result = ctx.run(["python3", "-c", script], sandbox=sb, timeout=60)
        evidence = ctx.evidence(result, sb)
        words = result.stdout.split()
        count = int(words[1]) if len(words) > 1 and words[1].isdigit() else -1
        broken = _after_ok(ctx, sb, evidence)
        if broken:
            return Outcome("breached", f"{what} left the sandbox unusable: {broken}",
                           tuple(evidence))
        if count < 0:
            if result.exit_code != 0:
                return Outcome("held", f"{what} was stopped (exit {result.exit_code})",
                               tuple(evidence))
            return Outcome("error", f"unexpected output: {result.stdout[:200]}",
                           tuple(evidence))
        if count >= cap:
            return Outcome("breached", f"{what} reached its own cap of {cap} unstopped",
                           tuple(evidence))
        return Outcome("held", f"{what} stopped at {count}: {result.stdout.strip()[:150]}",
                       tuple(evidence))
    return _in_fresh(body)


def _memory(ctx: DrillContext, sb: DrillSandbox) -> Outcome:
    result = ctx.run(["python3", "-c", MEMORY_BOMB], sandbox=sb, timeout=60)
    evidence = ctx.evidence(result, sb)
    reached = [int(w) for line in result.stdout.splitlines() if line.startswith("allocated")
               for w in line.split()[1:2]]
    top = max(reached, default=0)
    broken = _after_ok(ctx, sb, evidence)
    if broken:
        return Outcome("breached", f"the memory bomb left the sandbox unusable: {broken}",
                       tuple(evidence))
    if top >= 2048:
        return Outcome("breached", "allocated all 2 GiB it asked for", tuple(evidence))
    how = "OOM-killed" if result.usage.oom_killed else (
        "MemoryError" if "MemoryError" in result.stdout else f"exit {result.exit_code}")
    return Outcome("held", f"stopped at {top} MiB ({how})", tuple(evidence))


def _disk(ctx: DrillContext, sb: DrillSandbox) -> Outcome:
    result = ctx.run("head -c 3000000000 /dev/zero > /workspace/fill; echo rc=$?; "
                     "stat -c %s /workspace/fill", sandbox=sb, timeout=60)
    evidence = ctx.evidence(result, sb)
    size = int(result.stdout.split()[-1]) if result.stdout.split()[-1:] and \
        result.stdout.split()[-1].isdigit() else -1
    broken = _after_ok(ctx, sb, evidence)
    if broken:
        return Outcome("breached", f"filling the disk broke the sandbox: {broken}",
                       tuple(evidence))
    if size >= 3_000_000_000:
        return Outcome("breached", "wrote all 3 GB without hitting a limit", tuple(evidence))
    if "No space left" not in result.stderr:
        return Outcome("error", f"stopped without ENOSPC: {result.stderr[:200]}",
                       tuple(evidence))
    return Outcome("held", f"ENOSPC at {size} bytes", tuple(evidence))


def _spin(ctx: DrillContext, sb: DrillSandbox) -> Outcome:
    started = time.monotonic()
    result = ctx.run("end=$(( $(date +%s) + 30 )); while [ $(date +%s) -lt $end ]; do :; done",
                     sandbox=sb, timeout=2)
    took = time.monotonic() - started
    evidence = ctx.evidence(result, sb)
    if not result.timed_out or took > 10:
        return Outcome("breached", f"a 2 s timeout let it spin {took:.1f} s", tuple(evidence))
    return Outcome("held", f"killed at the timeout after {took:.1f} s", tuple(evidence))


def _flood(ctx: DrillContext, sb: DrillSandbox) -> Outcome:
    result = ctx.run("head -c 50000000 /dev/zero | tr '\\0' 'a'", sandbox=sb,
                     timeout=60)
    evidence = ctx.evidence(result, sb)
    kept = len(result.stdout)
    if kept >= 50_000_000 or not result.stdout_truncated:
        return Outcome("breached", f"kept {kept} bytes of a 50 MB flood", tuple(evidence))
    return Outcome("held", f"kept {kept} bytes, dropped {result.stdout_truncated}",
                   tuple(evidence))


def _linger(ctx: DrillContext, sb: DrillSandbox) -> Outcome:
    # The loop beats for 30 s at most; it must die when the command returns after 0.5 s.
    result = ctx.run("(for i in $(seq 300); do date +%s%N > /workspace/beat; sleep 0.1; done) "
                     "</dev/null >/dev/null 2>&1 & "
                     "nohup sleep 60 </dev/null >/dev/null 2>&1 & setsid sleep 60 & "
                     "sleep 0.5; echo started", sandbox=sb, timeout=20)
    evidence = ctx.evidence(result, sb)
    time.sleep(0.3)
    first = sb.read("/workspace/beat")
    time.sleep(0.6)
    second = sb.read("/workspace/beat")
    if first != second:
        return Outcome("breached", "a background process kept running after its command "
                       "returned", tuple(evidence))
    return Outcome("held", "the heartbeat stopped when the command returned: everything it "
                   "started was killed", tuple(evidence))


# Stops the command's init once, then from a loop that outlives the command's main process
# (at most 20000 tries: it ends by itself where nothing kills it).
STOP_INIT = ("kill -STOP 1; (for i in $(seq 20000); do kill -STOP 1; done 2>/dev/null) & "
             "sleep 0.3; echo after")


def _stop_init(ctx: DrillContext, sb: DrillSandbox) -> Outcome:
    # pid 1 reaps the command and reports its end: stopped, it reports nothing, and the
    # command would hang until its timeout (gVisor, unlike Linux, lets a namespace's init be
    # signalled from inside it).
    started = time.monotonic()
    result = ctx.run(STOP_INIT, sandbox=sb, timeout=10)
    took = time.monotonic() - started
    evidence = ctx.evidence(result, sb)
    if result.timed_out or result.stdout != "after\n" or result.exit_code != 0:
        return Outcome("breached", f"the command hung after stopping its init: exit "
                       f"{result.exit_code}{', timed out' if result.timed_out else ''} after "
                       f"{took:.1f} s", tuple(evidence))
    broken = _after_ok(ctx, sb, evidence)
    if broken:
        return Outcome("breached", f"stopping the init broke the sandbox: {broken}",
                       tuple(evidence))
    said = result.stderr.strip().splitlines()[:1]
    return Outcome("held", f"the command ended at once ({took:.1f} s, exit 0); the stop: "
                   f"{said[0] if said else 'ignored'}", tuple(evidence))


CASES = [
    Case("res.fork-bomb", "resources", "fork up to 2000 processes", "the pids limit stops it "
         "and the sandbox works afterwards", _counted(FORK_BOMB, 2000, "the fork bomb"), PY),
    Case("res.thread-bomb", "resources", "start up to 2000 threads", "the pids limit stops it",
         _counted(THREAD_BOMB, 2000, "the thread bomb"), PY),
    Case("res.memory-bomb", "resources", "allocate up to 2 GiB", "the memory limit stops it "
         "(OOM kill or MemoryError)", _in_fresh(_memory), PY),
    Case("res.fd-bomb", "resources", "raise the open-file limit and open up to 100000 files",
         "a file limit stops it", _counted(FD_BOMB, 100000, "the fd bomb"), PY),
    Case("res.disk-fill", "resources", "write 3 GB into the workspace", "ENOSPC at the tier's "
         "disk limit", _in_fresh(_disk)),
    Case("res.inode-bomb", "resources", "create empty files until the inodes run out",
         "the workspace has an inode limit under 700000 and creating stops at it",
         _counted(INODE_BOMB, 700000, "the inode bomb"), PY),
    Case("res.cpu-spin", "resources", "spin the CPU for 30 s under a 2 s timeout",
         "killed at the timeout", _in_fresh(_spin)),
    Case("res.output-flood", "resources", "print 50 MB", "output is capped and the cut is "
         "reported", _in_fresh(_flood)),
    Case("res.lingering", "resources", "leave background processes (&, nohup, setsid) running "
         "after the command returns", "all killed when the command ends", _in_fresh(_linger)),
    Case("res.stop-init", "resources", "SIGSTOP the command's own init (kill -STOP 1), once "
         "and from a loop that outlives the command", "the stop is refused or ignored: the "
         "command ends at once with its own exit code, not at its timeout",
         _in_fresh(_stop_init)),
]
