"""A namespace sandbox's resident helper: one bwrap whose PID 1 is the zygote (``zygote.c``),
kept while the sandbox is in use, which starts each command in fresh namespaces of its own.

A command in the bwrap path costs a bwrap: a new user namespace, the sandbox's mount tree
built mount by mount, a PID namespace.
From the resident, the sandbox's user and mount namespace already exist; what each command
gets new (PID, mount, IPC, UTS and cgroup namespace, ``/tmp``, ``/dev/shm``, devpts,
``/proc``, its cgroup, the capability drop and the seccomp filter) is made by the zygote in a
command *init* ahead of the command, which writes itself into a cgroup of its own (the host
hands the zygote that group's files, opened for writing, with the request to make it; they
move only their writer, and the init closes them at once), so a command
waits only for its request, a vfork and its exec (``bench/bench_profile.py``).

Per command the guarantees are the bwrap path's: its init is in the command's cgroup before
anything of the user's runs (the init waits for its request, and the host renames the group
made for it to the command's before sending it); its PID namespace dies with the init, which
exits when the command does; the filter is the same BPF program, installed by the init on
itself before it vforks the command. What differs, and why it is safe: the zygote keeps
CAP_SYS_ADMIN and CAP_SETPCAP in the sandbox's user namespace (they give nothing outside it)
and is not reachable from a command: not in its PID namespace, no descriptor shared, not
dumpable. A terminal (PTY) command and an image build's step take the bwrap path.

The launch helper's ``PR_SET_PDEATHSIG`` ties the resident's bwrap to the spawner thread
(which lives as long as Corral) and bwrap's ``--die-with-parent`` the zygote to bwrap, so a
resident never outlives its Corral process; its cgroup group (``r.<owner>.N``) and the group
of the init made ahead (``w.<owner>.N``) carry the owner as command groups do, so a crashed
owner's are swept.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import fcntl
import itertools
import logging
import os
import select
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ...errors import BackendError
from .._linux.cgroups import CgroupDriver, open_join_files
from .._linux.static_helper import FILTER_NAME, build_static_helper
from .._linux.supervise import SETUP_TIMEOUT_S
from .bwrap import HELPER_MOUNT

__all__ = ["RESIDENT_PREFIX", "WARM_PREFIX", "GroupRetirer", "Zygote", "ZygoteProcess",
           "ensure_zygote", "sealed_file", "zygote_argv"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("zygote.c")
_PROGRAM = "zygote"
#: Group names of a resident (``r.<owner>.N``) and of an init made ahead (``w.<owner>.N``).
RESIDENT_PREFIX = "r."
WARM_PREFIX = "w."
_UCRED = struct.Struct("iII")
_RESIDENT_NUMBERS = itertools.count()
_REPLY_MAX = 256
_KILLED = -9
_EXIT_WAIT_S = 0.5


def ensure_zygote(parent: Path) -> Path:
    """The directory bound at ``/.corral`` in a resident: the zygote and the filter."""
    return build_static_helper(parent, _SOURCE, _PROGRAM, "the namespace tier's zygote")


def zygote_argv(control_fd: int, tmp_bytes: int, masked_proc: Sequence[str]) -> list[str]:
    return [f"{HELPER_MOUNT}/{_PROGRAM}", str(control_fd), str(tmp_bytes),
            f"{HELPER_MOUNT}/{FILTER_NAME}", *masked_proc]


def _wait_readable(sock: socket.socket, timeout: float | None) -> bool:
    ready, _, _ = select.select([sock], [], [], timeout)
    return bool(ready)


def _setup_failure(reply: bytes) -> str:
    """ "e ERRNO WHAT" as words."""
    parts = reply.decode(errors="replace").split()
    code = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    what = parts[2] if len(parts) > 2 else "set-up"
    return f"{what}: {os.strerror(code)}"


@dataclass(slots=True)
class WarmInit:
    """A command's init made ahead: set up, in its own group, waiting for a request."""

    sock: socket.socket
    pid: int
    group: str
    #: the init's pidfd: readable once it has exited, and with it its whole PID namespace
    pidfd: int

    def close(self) -> None:
        self.sock.close()
        if self.pidfd >= 0:  # once: the number may be another file's after
            fd, self.pidfd = self.pidfd, -1
            os.close(fd)


class ZygoteProcess:
    """A started command as ``supervise`` follows it (the ``Popen`` surface it uses): its
    stdio pipes, and its end read from its init's answer. An init that dies without one was
    killed (a timeout, ``kill_command``, the sandbox's destroy): minus SIGKILL."""

    def __init__(self, init: WarmInit, stdin: int | None, stdout: int, stderr: int) -> None:
        self._init = init
        self._sock = init.sock
        self.pid = init.pid
        # Buffered as Popen's: an interactive caller's write (``ProcessHandle``) is whole.
        self.stdin = os.fdopen(stdin, "wb") if stdin is not None else None
        self.stdout = os.fdopen(stdout, "rb", buffering=0)
        self.stderr = os.fdopen(stderr, "rb", buffering=0)
        self.returncode: int | None = None
        #: execve failed with this errno: the program cannot be run
        self.exec_errno: int | None = None
        #: the init could not set the command up ("chdir: No such file or directory")
        self.setup_error: str | None = None
        #: the command ended and its init vouches that none of its processes is left
        self.settled = False

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        if not _wait_readable(self._sock, timeout):
            raise subprocess.TimeoutExpired("command", timeout or 0.0)
        try:
            reply = self._sock.recv(_REPLY_MAX)
        except OSError:
            reply = b""
        self._sock.close()
        if reply.startswith((b"x ", b"n ")):
            # The init killed and reaped everything in its PID namespace before it answered
            # (zygote.c): nothing of the command's is left, only the init, exiting. The
            # group's kill and removal are left to its retirement (``GroupRetirer``).
            self.settled = True
        else:
            # Set-up failed or the init was killed: once its pidfd reads, the kernel has
            # emptied its PID namespace, and the group's kill finds it empty at its first
            # look. A process stuck in the kernel (D state) bounds this wait; the group's
            # kill then deals with it.
            select.select([self._init.pidfd], [], [], _EXIT_WAIT_S)
        if reply.startswith(b"x "):
            self.returncode = int(reply[2:])
        elif reply.startswith(b"n "):
            self.exec_errno = int(reply[2:])
            self.returncode = 1
        elif reply.startswith(b"e "):
            self.setup_error = _setup_failure(reply)
            self.returncode = 125
        else:
            self.returncode = _KILLED
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)

    def close(self) -> None:
        for pipe in (self.stdin, self.stdout, self.stderr):
            if pipe is not None and not pipe.closed:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._init.close()


#: the most a request's text travels in its message (zygote.c's MAX_INLINE); a larger one
#: (a large environment) goes in a sealed memfd
_MAX_INLINE = 32 << 10


_devnull_lock = threading.Lock()
_devnull_fd: int | None = None


def _devnull() -> int:
    """One ``/dev/null`` for the process, read by every command without stdin (the init
    dup2s its own copy): kept open, never closed."""
    global _devnull_fd
    with _devnull_lock:
        if _devnull_fd is None:
            _devnull_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        return _devnull_fd


def _request_text(cwd: str, argv: Sequence[str], env: dict[str, str]) -> bytes:
    """The request as ``zygote.c`` parses it."""
    fields = [cwd, str(len(argv)), *argv, str(len(env)),
              *(f"{name}={value}" for name, value in env.items())]
    for field in fields:
        if "\0" in field:
            raise ValueError("a command's argv or environment contains a NUL byte")
    return b"".join(os.fsencode(field) + b"\0" for field in fields)


def sealed_file(data: bytes, name: str) -> int:
    """A read-only descriptor holding ``data`` from offset 0 (a sealed memfd): nothing, not
    even a later bug of ours, can change what the reader is about to parse."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK
                    | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd


class GroupRetirer:
    """Removes finished commands' groups off the command's path, on a thread of its own, once
    commands pause (``quiet_s`` after the last retirement) or ``batch`` of them are waiting.

    An rmdir in five v1 hierarchies costs ~0.2 ms and waits for the kernel's cgroup lock; in
    line it cost a command up to ~20 ms at p99. Done on a pool beside the next command it still
    cost that command ~0.3 ms on a 2-core host: its system calls and Python took turns with the
    command's own on the GIL and on the cores. An agent's commands come with pauses between
    them (the model thinks), and a tight loop pays for one batch every ``batch`` commands.
    Until it is removed, a retiring group is no command (``pending``); it is empty (the init
    killed and reaped what the command left before it answered, and the bwrap path's
    supervise killed the group); a crash in between leaves it to the sweep, which finds the
    command's end already in the trail."""

    def __init__(self, cgroups: CgroupDriver, *, quiet_s: float = 0.02, batch: int = 32) -> None:
        self._cgroups = cgroups
        self._quiet_s = quiet_s
        self._batch = batch
        self._cond = threading.Condition()
        self._waiting: dict[str, None] = {}  # in order of retirement
        self._removing: set[str] = set()
        self._last = 0.0
        self._thread: threading.Thread | None = None
        self._idle = False  # the thread waits with nothing to do: a retirement wakes it
        self._soon = False  # a group waiting is to go without a pause
        self._closed = False

    def retire(self, group: str, *, soon: bool = False) -> None:
        """Leave ``group`` to the thread; with ``soon``, removed without waiting for a pause
        (a sandbox's first command, often its last: its group should not be left for its
        destroy to remove)."""
        with self._cond:
            if not self._closed:
                self._waiting[group] = None
                self._last = time.monotonic()
                self._soon = self._soon or soon
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="corral-group-retirer")
                    self._thread.start()
                    # A process that ends without closing its backend (`corral exec`) still
                    # removes its groups: another process would read them as commands.
                    atexit.register(self.close)
                elif soon or self._idle or len(self._waiting) == self._batch:
                    self._cond.notify()
                return
        self._remove(group)  # closing: no thread to leave it to

    def pending(self) -> frozenset[str]:
        with self._cond:
            return frozenset(self._waiting) | frozenset(self._removing)

    def close(self) -> None:
        """Stop the thread and remove what is still waiting, here and now."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify()
        atexit.unregister(self.close)
        if thread is not None:
            thread.join(timeout=10)
        with self._cond:
            left, self._waiting = list(self._waiting), {}
        for group in left:
            self._remove(group)

    def _run(self) -> None:
        # Normal priority: a sandbox's first command's group is removed beside its destroy.
        while True:
            with self._cond:
                while not self._closed:
                    if not self._waiting:
                        self._idle = True
                        self._cond.wait()
                        self._idle = False
                        continue
                    quiet_for = time.monotonic() - self._last
                    if (self._soon or quiet_for >= self._quiet_s
                            or len(self._waiting) >= self._batch):
                        break
                    self._cond.wait(self._quiet_s - quiet_for)
                if self._closed:
                    return
                groups, self._waiting, self._soon = list(self._waiting), {}, False
                self._removing.update(groups)
            for group in groups:
                self._remove(group)

    def _remove(self, group: str) -> None:
        try:
            # Empty but for an init still exiting, at most (``ZygoteProcess.settled``); the
            # kill is the belt and braces the command's path left here.
            self._cgroups.kill(group)
            self._cgroups.remove(group)
        except (BackendError, OSError) as exc:
            logger.warning("a finished command's cgroup %s was not removed (the sweep "
                           "will): %s", group, exc)
        finally:
            with self._cond:
                self._removing.discard(group)


class Zygote:
    """One sandbox's resident, started with ``start`` (bwrap, placed in ``group`` before the
    zygote runs), and the next command's init, made ahead on ``warmer``."""

    def __init__(self, *, start: Callable[[int, str], subprocess.Popen[bytes]],
                 cgroups: CgroupDriver, sandbox_group: str, owner: str,
                 warmer: ThreadPoolExecutor) -> None:
        self._cgroups = cgroups
        self._sandbox_group = sandbox_group
        self._owner = owner
        self._warmer = warmer
        self._numbers = itertools.count()
        self._control_lock = threading.Lock()
        self._lock = threading.Lock()
        self._closed = False
        # Numbered: a resident being replaced (its mounts went stale) may still be closing.
        self.group = f"{sandbox_group}/{RESIDENT_PREFIX}{owner}.{next(_RESIDENT_NUMBERS)}"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._control = ours
        try:
            os.set_inheritable(theirs.fileno(), True)
            cgroups.create_command(self.group)
            try:
                self._proc = start(theirs.fileno(), self.group)
            except BaseException:
                cgroups.remove(self.group)
                raise
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._next: Future[WarmInit] | None = None
        try:
            first = self._warm()  # proves the zygote up, and its inits able to set up
        except BaseException:
            self.close()
            raise
        done: Future[WarmInit] = Future()
        done.set_result(first)
        self._next = done

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def _warm(self) -> WarmInit:
        """Have the zygote make an init in a group made for it, and wait until it is set up.
        The init writes itself into the group first thing, before it sets anything up: a
        process moving itself takes no global cgroup lock, where the host placing it waited
        for an RCU grace period holding the cgroup lock every other command's rename and
        removal need."""
        group = f"{self._sandbox_group}/{WARM_PREFIX}{self._owner}.{next(self._numbers)}"
        self._cgroups.create_command(group)
        try:
            return self._warm_into(group)
        except BaseException:
            with contextlib.suppress(BackendError, OSError):
                self._cgroups.kill(group)
            with contextlib.suppress(OSError):
                self._cgroups.remove(group)
            raise

    def _warm_into(self, group: str) -> WarmInit:
        join = open_join_files(self._cgroups, group)
        try:
            with self._control_lock:
                try:
                    self._control.sendmsg([b"w"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                    array.array("i", join))])
                    if not _wait_readable(self._control, SETUP_TIMEOUT_S):
                        raise BackendError("the sandbox's zygote did not answer in "
                                           f"{SETUP_TIMEOUT_S:.0f} s")
                    reply, ancillary, _, _ = self._control.recvmsg(
                        _REPLY_MAX, socket.CMSG_SPACE(array.array("i", [0]).itemsize))
                except OSError as exc:
                    raise BackendError(f"the sandbox's zygote is gone ({exc})") from None
        finally:
            for fd in join:
                os.close(fd)
        fds = array.array("i")
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        if reply != b"i" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            detail = _setup_failure(reply) if reply.startswith(b"e ") else "no answer"
            raise BackendError(f"the sandbox's zygote could not make a command's init: {detail}")
        sock = socket.socket(fileno=fds[0])
        pidfd = -1
        try:
            pid = self._ready_pid(sock)
            # Opened while the init waits for its request (it exits only on one, or on its
            # socket's EOF): the pid is still its own.
            pidfd = os.pidfd_open(pid)
        except BaseException:
            sock.close()
            if pidfd >= 0:
                os.close(pidfd)
            raise
        return WarmInit(sock=sock, pid=pid, group=group, pidfd=pidfd)

    @staticmethod
    def _ready_pid(sock: socket.socket) -> int:
        """The init's "r", and its pid in our PID namespace from the kernel's credentials."""
        if not _wait_readable(sock, SETUP_TIMEOUT_S):
            raise BackendError(f"a command's init did not set up in {SETUP_TIMEOUT_S:.0f} s")
        reply, ancillary, _, _ = sock.recvmsg(_REPLY_MAX, socket.CMSG_SPACE(_UCRED.size))
        if reply.startswith(b"e "):
            raise BackendError("a command's init could not set up the sandbox: "
                               + _setup_failure(reply))
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, _, _ = _UCRED.unpack(data[:_UCRED.size])
                if reply == b"r" and pid > 0:
                    return int(pid)
        raise BackendError("a command's init died while setting up")

    def take(self) -> WarmInit:
        """The init made ahead (waiting for it if it is still being made). The next one is
        started once this one has its command (``start_command``): made now, its group's
        mkdirs and its init's joins would queue the command's rename behind them on the
        kernel's cgroup lock."""
        with self._lock:
            if self._closed:
                raise BackendError("the sandbox's resident helper was stopped")
            # None: another command took it and has not sent its request yet.
            current, self._next = self._next, None
            if current is None:
                current = self._warmer.submit(self._warm)
        try:
            init = current.result(timeout=2 * SETUP_TIMEOUT_S)
        except BackendError:
            if not self.alive:
                raise
            # Made ahead while the last command ran (a fork bomb may have held every pid):
            # once more, now.
            return self._warm()
        if _wait_readable(init.sock, 0):
            # An init says nothing before its request: this one died waiting (the OOM killer
            # took it under another command's load). Its command gets a fresh one.
            self.discard(init)
            return self._warm()
        return init

    def start_command(self, init: WarmInit, *, group: str, cwd: str, argv: Sequence[str],
                      env: dict[str, str], stdin: bool) -> ZygoteProcess:
        """Give ``init`` the group ``group`` and the command; it runs from here."""
        self._cgroups.rename_command(init.group, group, (init.pid,))
        init.group = group
        text = _request_text(cwd, argv, env)
        opened: list[int] = []  # ours to close once sent (the init holds its own then)
        in_w = out_r = err_r = None
        try:
            if stdin:
                in_r, in_w = os.pipe()
                opened.append(in_r)
            else:
                in_r = _devnull()
            out_r, out_w = os.pipe()
            opened.append(out_w)
            err_r, err_w = os.pipe()
            opened.append(err_w)
            fds = [in_r, out_w, err_w]
            if len(text) <= _MAX_INLINE:
                message = b"x" + text
            else:
                message = b"m"
                fds.append(sealed_file(text, "corral-request"))
                opened.append(fds[-1])
            init.sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                           array.array("i", fds))])
        except BaseException:
            for fd in (*opened, in_w, out_r, err_r):
                if fd is not None:
                    os.close(fd)
            raise
        for fd in opened:
            os.close(fd)
        self._make_next()
        return ZygoteProcess(init, in_w, out_r, err_r)

    def _make_next(self) -> None:
        with self._lock:
            if not self._closed and self._next is None:
                self._next = self._warmer.submit(self._warm)

    def discard(self, init: WarmInit) -> None:
        """Let an init go unused (its answer socket closed, it exits) and remove its group."""
        init.close()
        with contextlib.suppress(BackendError, OSError):
            self._cgroups.kill(init.group)
        with contextlib.suppress(OSError):
            self._cgroups.remove(init.group)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pending, self._next = self._next, None
        if pending is not None and not pending.cancel():
            with contextlib.suppress(Exception):
                self.discard(pending.result(timeout=2 * SETUP_TIMEOUT_S))
        with self._control_lock:
            self._control.close()  # the zygote's EOF: it exits, and bwrap with it
        try:
            self._proc.wait(timeout=SETUP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(BackendError, OSError):
            self._cgroups.kill(self.group)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait(timeout=SETUP_TIMEOUT_S)
        with contextlib.suppress(OSError):
            self._cgroups.remove(self.group)
        for pipe in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            if pipe is not None:
                pipe.close()
