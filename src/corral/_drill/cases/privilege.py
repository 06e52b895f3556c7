"""Privilege: every road to more power than an unprivileged user with nothing: setuid,
capabilities, namespaces, mounts, and the kernel interfaces behind most container escapes."""

from __future__ import annotations

from collections.abc import Callable

from ..case import Case
from ..context import DrillContext
from ..model import Outcome

Run = Callable[[DrillContext], Outcome]
PY = frozenset({"python3"})

# Calls a raw syscall; prints ALLOWED when the kernel accepted it. Argv: number, then up to five
# integer arguments. Only calls that are harmless when they succeed are made (queries, or
# creating something that is closed at once).
SYSCALL = """
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
nr, *args = (int(a) for a in sys.argv[1:])
res = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
err = ctypes.get_errno()
if res >= 0:
    print("ALLOWED", res)
    if res > 2:
        os.close(res)
elif err in (errno.EPERM, errno.EACCES, errno.ENOSYS):
    print("refused", err, os.strerror(err))
else:
    # EFAULT, EINVAL, EBADF...: the call got past every filter into the kernel proper.
    print("ALLOWED reached the kernel:", err, os.strerror(err))
"""

def _shell(script: str | list[str], what: str) -> Run:
    """``script`` (a shell string or an argv) prints ESCALATED when the attempt gained
    something."""
    def run(ctx: DrillContext) -> Outcome:
        result = ctx.run(script)
        out = (result.stdout + result.stderr).strip()
        evidence = tuple(ctx.evidence(result))
        if "ESCALATED" in result.stdout:
            return Outcome("breached", f"{what}: {out[:300]}", evidence)
        return Outcome("held", f"{what} refused: {out[:300]}", evidence)
    return run


def _syscall(number: int, *args: int, what: str) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        result = ctx.run(["python3", "-c", SYSCALL, str(number), *map(str, args)])
        out = (result.stdout + result.stderr).strip()
        evidence = tuple(ctx.evidence(result))
        if "ALLOWED" in result.stdout:
            return Outcome("breached", f"{what} was allowed: {out[:200]}", evidence)
        if "refused" not in result.stdout:
            # Killed by the filter (SIGSYS) is held too: nothing ran.
            if result.exit_code < 0 or result.exit_code >= 128:
                return Outcome("held", f"{what}: the process was killed ({result.exit_code})",
                               evidence)
            return Outcome("error", f"{what}: unexpected output {out[:200]}", evidence)
        return Outcome("held", f"{what}: {out[:200]}", evidence)
    return run


TIOCSTI = """
import fcntl, os, pty, termios
master, slave = pty.openpty()
try:
    fcntl.ioctl(slave, termios.TIOCSTI, b"x")
    print("ESCALATED TIOCSTI accepted")
except OSError as e:
    print("refused", e.errno, e.strerror)
"""

PTRACE = """
import ctypes, os, signal, time
libc = ctypes.CDLL(None, use_errno=True)
pid = os.fork()
if pid == 0:
    time.sleep(5)
    os._exit(0)
res = libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH to our own child
err = ctypes.get_errno()
os.kill(pid, signal.SIGKILL)
os.waitpid(pid, 0)
print("ESCALATED attached" if res == 0 else f"refused {err} {os.strerror(err)}")
"""


CASES = [
    Case("priv.capabilities", "privilege", "look for any capability in the effective, permitted "
         "or ambient sets", "all empty",
         _shell("grep -E '^Cap(Eff|Prm|Amb)' /proc/self/status | "
                "awk '$2 != \"0000000000000000\" {print \"ESCALATED\", $0} "
                "END {print \"checked\"}'",
                "capabilities")),
    Case("priv.no-new-privs", "privilege", "gain privileges through exec (setuid binaries, "
         "file capabilities)", "no_new_privs is set",
         # prctl first: gVisor's /proc/self/status has no NoNewPrivs line.
         _shell("v=$(python3 -c 'import ctypes; print(ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))' "
                "2>/dev/null || sed -n 's/^NoNewPrivs:[[:space:]]*//p' /proc/self/status); "
                "[ \"$v\" = 1 ] || echo ESCALATED no_new_privs is \"$v\"; echo checked",
                "no_new_privs")),
    Case("priv.setuid", "privilege", "become root with su, sudo or any setuid-root binary",
         "nothing runs as root",
         _shell("for b in su sudo pkexec newgrp; do command -v $b >/dev/null && "
                "$b -c id </dev/null 2>/dev/null | grep -q 'uid=0' && echo ESCALATED $b; done; "
                "sudo -n id -u 2>/dev/null | grep -qx 0 && echo ESCALATED sudo; "
                "find / -xdev -perm -4000 -user root -type f 2>/dev/null | head -20 | "
                "while read b; do echo setuid: $b; done; [ \"$(id -u)\" = 0 ] && echo ESCALATED "
                "uid0; echo checked", "setuid")),
    Case("priv.userns", "privilege", "create a user namespace (root inside it, then more "
         "kernel surface)", "refused",
         _shell("unshare -Ur id 2>&1 | grep -q 'uid=0' && echo ESCALATED; "
                "python3 -c 'import ctypes; l = ctypes.CDLL(None); "
                "print(\"ESCALATED\" if l.unshare(0x10000000) == 0 else \"refused\")' 2>&1; "
                "echo checked", "user namespace")),
    Case("priv.mount", "privilege", "mount a tmpfs on a fresh directory in the workspace",
         "refused",
         _shell("mkdir -p /workspace/drill-mnt && mount -t tmpfs none /workspace/drill-mnt "
                "2>/dev/null && { echo ESCALATED; umount /workspace/drill-mnt; }; "
                "rmdir /workspace/drill-mnt; echo checked", "mount")),
    Case("priv.chroot", "privilege", "chroot (the classic way out of a chroot)", "refused",
         _syscall(161, 0, what="chroot(NULL)"), PY),
    Case("priv.ptrace", "privilege", "ptrace-attach to a process (even its own child)",
         "refused", _shell(["python3", "-c", PTRACE], "ptrace"), PY),
    Case("priv.io-uring", "privilege", "io_uring_setup (a frequent kernel exploit surface)",
         "refused", _syscall(425, 1, 0, what="io_uring_setup"), PY),
    Case("priv.bpf", "privilege", "bpf(BPF_PROG_LOAD)-class calls", "refused",
         _syscall(321, 5, 0, 0, what="bpf"), PY),
    Case("priv.perf", "privilege", "perf_event_open (kernel memory side channels)", "refused",
         _syscall(298, 0, 0, -1, -1, 0, what="perf_event_open"), PY),
    Case("priv.keyctl", "privilege", "keyctl: read the session keyring shared with the host "
         "user", "refused", _syscall(250, 0, -3, 0, what="keyctl(GET_KEYRING_ID)"), PY),
    Case("priv.tiocsti", "privilege", "TIOCSTI: type commands into a terminal", "refused",
         _shell(["python3", "-c", TIOCSTI], "TIOCSTI"), PY),
    Case("priv.kernel-module", "privilege", "load a kernel module", "refused",
         _syscall(313, -1, 0, 0, what="finit_module"), PY),
    Case("priv.userfaultfd", "privilege", "userfaultfd (used to win kernel races)", "refused",
         _syscall(323, 0, what="userfaultfd"), PY),
]


