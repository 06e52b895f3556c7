"""Builds the bubblewrap invocation for one sandboxed command. Pure: no I/O.

Two parts. The *options* (mounts, namespaces, descriptors, the command's environment) travel
as a NUL-separated list on a file descriptor (``--args FD``), not on bwrap's argv: bwrap's
sandbox init is PID 1 inside, and ``/proc/1/cmdline`` would otherwise show every host path the
sandbox is built from (data directory, template, workspace). The *command line* is then only
``bwrap --args FD -- ARGV...``. bwrap keeps the command's own argv on its command line (what
follows ``--`` inside an args file is ignored), which is the command's own data.

The environment is ``--clearenv`` then one ``--setenv`` per variable: bwrap applies them to
itself while parsing, after it was started unprivileged with Corral's fixed environment, so the
caller's variables reach only the command it execs inside the sandbox.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .._linux.template import SANDBOX_GID, SANDBOX_UID, BaseTemplate

__all__ = ["BwrapFds", "build_options", "command_line", "encode_args"]


@dataclass(frozen=True, slots=True)
class BwrapFds:
    info: int
    block: int
    seccomp: int | None  # None: the resident zygote, which installs the filter per command


#: Where the resident zygote's directory (``resident.ensure_zygote``) is bound, read-only.
HELPER_MOUNT = "/.corral"
# Inside the sandbox's user namespace only: unshare and mount, per command (see zygote.c).
_RESIDENT_CAPS = ("CAP_SYS_ADMIN", "CAP_SETPCAP")


def build_options(
    *,
    template: BaseTemplate,
    workspace: Path,
    tmp_bytes: int,
    cwd: str,
    env: Mapping[str, str],
    fds: BwrapFds,
    new_session: bool = True,
    mounts: Sequence[tuple[str, str, bool]] = (),
    resident: Path | None = None,
    tmp: Path | None = None,
) -> list[str]:
    """The options for ``--args``: everything but the command itself.

    The network namespace and host uid are set by the caller, not by bwrap. ``env`` is the
    command's whole environment (the caller builds it from scratch). ``mounts`` are the
    sandbox's volumes and data mounts as (host source, target, read-only), in mount order.

    ``resident`` (the zygote's directory) makes them the options of a sandbox's resident
    helper instead: the same sandbox, with the zygote bound at ``HELPER_MOUNT`` as PID 1,
    holding ``_RESIDENT_CAPS`` in the user namespace, and without the filter and the /proc
    masks, which it applies to each command it starts (a masked /proc would forbid the fresh
    /proc each command mounts).

    ``tmp`` is the sandbox's own /tmp (a tmpfs that lives as long as the sandbox); without
    it (an image build's step) the command gets a fresh one of ``tmp_bytes``.
    """
    args = [
        # Fresh user (needed unprivileged), PID, IPC, UTS and cgroup namespaces per command.
        # No --unshare-net: the command joins its sandbox's persistent namespace instead.
        "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
        "--disable-userns",
        # A build step is root in its user namespace: it owns the root it writes.
        "--uid", "0" if template.writable else str(SANDBOX_UID),
        "--gid", "0" if template.writable else str(SANDBOX_GID),
        "--hostname", "sandbox",
        "--die-with-parent",
    ]
    if resident is None:
        args += ["--cap-drop", "ALL"]
    else:
        args += ["--cap-drop", "ALL", "--as-pid-1"]
        for cap in _RESIDENT_CAPS:
            args += ["--cap-add", cap]
    if new_session:
        # Detaches from any terminal (the classic TIOCSTI defence; seccomp also blocks it).
        # PTY commands keep their session so the PTY can be their controlling terminal.
        args.append("--new-session")
    for kind, source, dest in template.system:
        if kind == "symlink":
            args += ["--symlink", source, dest]
        elif kind == "bind-rw":
            args += ["--bind", source, dest]
        else:
            args += ["--ro-bind", source, dest]
    if not template.writable:  # a build's /etc is among its writable directories
        args += ["--ro-bind", str(template.etc), "/etc"]
    args += [
        # bwrap's /dev is a writable tmpfs; keep /dev/shm writable (POSIX semaphores need it) as
        # a size-limited tmpfs of its own and make the rest read-only.
        "--dev", "/dev",
        "--size", str(tmp_bytes), "--perms", "1777", "--tmpfs", "/dev/shm",
        "--remount-ro", "/dev",
        "--proc", "/proc",
    ]
    if resident is None:
        for hidden in template.masked_proc:
            args += ["--ro-bind", "/dev/null", hidden]
    else:
        args += ["--ro-bind", str(resident), HELPER_MOUNT]
    if tmp is None:
        args += ["--size", str(tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp"]
    else:
        args += ["--bind", str(tmp), "/tmp"]
    if not template.writable:  # a build step's files are its root's, not a workspace's
        args += [
            "--bind", str(workspace), "/workspace",
            # E2B's home: the same workspace, where E2B's SDKs and templates expect the files.
            "--bind", str(workspace), "/home/user",
        ]
        # After the workspace, so a target under /workspace lands on it (its mount point was
        # made there, or in the volume it is under, by ``_linux.volumes``); under /mnt bwrap
        # makes it in its tmpfs root, read-only from --remount-ro / on. Each source is the
        # sandbox's own bind; a symlink inside it resolves in the sandbox's root.
        for source, target, read_only in mounts:
            bind = "--ro-bind" if read_only else "--bind"
            args += [bind, source, target]
            if target.startswith("/workspace/"):
                # /home/user is the same workspace: the mount shows there too.
                args += [bind, source, "/home/user/" + target.removeprefix("/workspace/")]
    args += [
        "--remount-ro", "/",
        "--chdir", cwd,
        "--info-fd", str(fds.info),
        "--block-fd", str(fds.block),
    ]
    if fds.seccomp is not None:
        args += ["--seccomp", str(fds.seccomp)]
    args += [
        "--clearenv",
    ]
    for name, value in env.items():
        args += ["--setenv", name, value]
    return args


def encode_args(options: Sequence[str]) -> bytes:
    """``options`` as bwrap's ``--args`` reads them: each one NUL-terminated."""
    for option in options:
        if "\0" in option:
            # Validation refuses NUL in argv and env before a command gets here; a NUL would
            # split one option into two, so never let one through.
            raise ValueError("a bwrap option contains a NUL byte")
    return b"".join(os.fsencode(option) + b"\0" for option in options)


def command_line(bwrap: str, args_fd: int, argv: Sequence[str]) -> list[str]:
    """bwrap's argv: the options come from ``args_fd``, the command follows ``--``."""
    return [bwrap, "--args", str(args_fd), "--", *argv]
