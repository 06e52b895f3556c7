"""Builds the bubblewrap command line for one sandboxed command. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .template import SANDBOX_GID, SANDBOX_UID, BaseTemplate

__all__ = ["BwrapFds", "build_argv"]


@dataclass(frozen=True, slots=True)
class BwrapFds:
    info: int
    block: int
    seccomp: int


def build_argv(
    bwrap: str,
    *,
    template: BaseTemplate,
    workspace: Path,
    tmp_bytes: int,
    cwd: str,
    argv: Sequence[str],
    fds: BwrapFds,
    new_session: bool = True,
) -> list[str]:
    """The full argv.

    The network namespace and host uid are set by the caller, not by bwrap, and so is the
    environment: bwrap hands its own (which the caller builds from scratch) to the command, which
    keeps values out of the host's process list and argv limits.
    """
    args = [
        bwrap,
        # Fresh user (needed unprivileged), PID, IPC, UTS and cgroup namespaces per command.
        # No --unshare-net: the command joins its sandbox's persistent namespace instead.
        "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
        "--disable-userns",
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID),
        "--hostname", "sandbox",
        "--die-with-parent", "--cap-drop", "ALL",
    ]
    if new_session:
        # Detaches from any terminal (the classic TIOCSTI defence; seccomp also blocks it).
        # PTY commands keep their session so the PTY can be their controlling terminal.
        args.append("--new-session")
    for kind, source, dest in template.system:
        if kind == "symlink":
            args += ["--symlink", source, dest]
        else:
            args += ["--ro-bind", source, dest]
    args += [
        "--ro-bind", str(template.etc), "/etc",
        # bwrap's /dev is a writable tmpfs; keep /dev/shm writable (POSIX semaphores need it) as
        # a size-limited tmpfs of its own and make the rest read-only.
        "--dev", "/dev",
        "--size", str(tmp_bytes), "--perms", "1777", "--tmpfs", "/dev/shm",
        "--remount-ro", "/dev",
        "--proc", "/proc",
    ]
    for hidden in template.masked_proc:
        args += ["--ro-bind", "/dev/null", hidden]
    args += [
        "--size", str(tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp",
        "--bind", str(workspace), "/workspace",
        "--remount-ro", "/",
        "--chdir", cwd,
        "--info-fd", str(fds.info),
        "--block-fd", str(fds.block),
        "--seccomp", str(fds.seccomp),
        "--",
        *argv,
    ]
    return args
