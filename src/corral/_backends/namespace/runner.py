"""Runs one sandboxed command: spawn, place in its cgroup before it runs, stream, limit, reap.

The host side of a launch (setsid, the launch helper, bwrap until it has built the sandbox)
runs with Corral's fixed environment (``_core.privileged``); the command's own environment and
every host path travel to bwrap as data on an ``--args`` descriptor (see ``bwrap``).

Ordering that makes the limits hold: the launch helper (``launch.c``) joins the command's
cgroup before it drops to the sandbox's uid and execs bwrap, so bwrap and everything it starts
are born in the group, and bwrap makes the cgroup namespace there (the command sees the root of
its own group and none of the host's names). bwrap is started with ``--block-fd``: after
building the namespaces its sandbox init waits until we have read its pid from ``--info-fd``
and set its limits. A process moving *itself* into a v1 cgroup takes no global lock; moving
another one from the host took an RCU grace period (~10 ms here) under the cgroup lock, which
cost a sandbox's first command that much and serialized a burst of them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import resource
import selectors
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._audit.tracing import tracer
from ..._core import linux
from ..._core.privileged import privileged_env
from ...backends import ExecOutcome, ExecRequest
from ...errors import BackendError, CommandError
from .._linux import netns, seccomp
from .._linux.cgroups import CgroupDriver, open_join_files
from .._linux.notfound import ExecFailureHead, exec_failure
from .._linux.process_io import command_stdio
from .._linux.static_helper import build_static_helper
from .._linux.supervise import SETUP_TIMEOUT_S as _SETUP_TIMEOUT_S
from .._linux.supervise import supervise
from .._linux.template import BaseTemplate
from ..execlimits import check_exec_size
from .bwrap import BwrapFds, build_options, command_line, encode_args
from .resident import Zygote, ZygoteProcess, sealed_file, zygote_argv

__all__ = ["CommandLauncher", "Launch"]



def _reap(pid: int) -> None:
    """Collect ``pid`` if it was re-parented to us; it is already dead or dying."""
    if pid <= 0:
        return
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # not ours: bwrap's outer process reaped it
        if done:
            return
        time.sleep(0.001)


_NOFILE = (4096, 4096)
# What bwrap's own execvp of the command says inside the sandbox when the kernel refuses it.
_BWRAP_E2BIG = re.compile(r"^bwrap: execvp [^\n]*: Argument list too long\n?$")
_BWRAP_EXEC = re.compile(r"^bwrap: execvp .*: ([^:]+)$")


_CHDIR_FAILED = "bwrap: Can't chdir to "


class _BwrapHead:
    """bwrap's own reports at the head of stderr, written before the command exists: a failed
    exec (``exec_failure``: Corral's line instead) and a failed chdir into the working
    directory (held back, never shown as the command's output: the run raises instead)."""

    def __init__(self, program: str, cwd: str) -> None:
        # bwrap execs the program itself; when that fails, its report is the stderr.
        self.exec_failure = ExecFailureHead(program, b"bwrap: execvp ", _bwrap_exec_reason)
        self._chdir = f"{_CHDIR_FAILED}{cwd}: ".encode()
        self.chdir_failure: str | None = None

    def __call__(self, held: bytes) -> bytes | None:
        if held[:len(self._chdir)] != self._chdir[:len(held)]:
            return self.exec_failure(held)
        line, newline, rest = held.partition(b"\n")
        if not newline:
            return None  # undecided until the line is whole (or the stream ends)
        self.chdir_failure = line[len(self._chdir):].decode(errors="replace")
        return rest


def _bwrap_exec_reason(line: str) -> str | None:
    match = _BWRAP_EXEC.match(line)
    return match.group(1) if match else None


@dataclass(frozen=True, slots=True)
class Launch:
    """One command to start, with everything about its sandbox that the launch needs."""

    uid: int
    netns_path: Path
    template: BaseTemplate
    workspace: Path
    tmp_bytes: int
    group: str
    request: ExecRequest
    env: Mapping[str, str]
    # The sandbox's volumes and data mounts: (host source, target, read-only), in order.
    mounts: tuple[tuple[str, str, bool], ...] = ()
    # The sandbox's /tmp (``WorkspaceStore.ensure_tmp``); None: a fresh one per command.
    tmp: Path | None = None
    # The directory holding every mount of Corral's the command needs (the sandbox's), if
    # one does: it starts from a lean mount namespace (``netns.Spawner``).
    tree: Path | None = None


_LAUNCH_SOURCE = Path(__file__).with_name("launch.c")


def ensure_launch_helper(parent: Path) -> Path:
    """The launch helper (``launch.c``), built once under ``parent``."""
    return build_static_helper(parent, _LAUNCH_SOURCE, "launch",
                               "the namespace tier's launch helper") / "launch"


class CommandLauncher:
    """Starts commands for one backend: the bwrap binary, the cgroup driver, the spawner thread."""

    def __init__(self, bwrap: str, cgroups: CgroupDriver,
                 launch_helper: Path | Callable[[], Path],
                 lean_hides: tuple[Path, ...] = ()) -> None:
        self.bwrap = bwrap
        self.cgroups = cgroups
        # launch.c (see ensure_launch_helper), or what builds it on the first command: a
        # process that only sweeps and lists (`corral ls`) neither hashes nor compiles the
        # seccomp filter it is checked against.
        self._launch_helper = launch_helper
        self._helper_lock = threading.Lock()
        self.spawner = netns.Spawner(lean_hides=lean_hides)
        self.setsid = shutil.which("setsid") or "setsid"
        # When a kill takes bwrap's outer process before the sandbox's init, the init is
        # re-parented; as a subreaper we get it (and reap it) instead of a host init that may
        # never reap (containers often run one that doesn't).
        linux.set_child_subreaper()

    @property
    def launch_helper(self) -> str:
        with self._helper_lock:
            if callable(self._launch_helper):
                self._launch_helper = self._launch_helper()
            return str(self._launch_helper)

    def run(self, launch: Launch, *,
            retire: Callable[[str], None] | None = None) -> ExecOutcome:
        """Run ``launch`` in a bwrap of its own. ``retire`` takes the command's group once
        the command is done and its group empty (``GroupRetirer``); without it, or when the
        command failed, the group is removed here."""
        self.cgroups.create_command(launch.group)
        try:
            outcome = self._run_in_group(launch)
        except BaseException:
            # supervise kills the group once the command is done; this is for what failed.
            with contextlib.suppress(BackendError):
                self.cgroups.kill(launch.group)
            self.cgroups.remove(launch.group)
            raise
        if retire is None:
            self.cgroups.remove(launch.group)
        else:
            retire(launch.group)  # supervise's kill found it empty
        return outcome

    def _run_in_group(self, launch: Launch) -> ExecOutcome:
        request, group = launch.request, launch.group
        started = time.monotonic()
        with tracer.start_as_current_span("corral.process.start"):
            proc, init_pid = self._start(launch)
        head = _BwrapHead(request.argv[0], request.cwd)
        seen = supervise(
            proc, request, cgroups=self.cgroups, group=group, started=started,
            terminal=getattr(proc, "terminal", None),
            abort=lambda: self._abort(proc, group, init_pid), reap=lambda: _reap(init_pid),
            stderr_head=head)
        if seen.returncode == 1 and head.exec_failure.exit_code is not None:
            return seen.outcome(head.exec_failure.exit_code)
        if head.chdir_failure is not None:
            if seen.returncode == 1 and not seen.stdout.parts and not seen.stderr.parts:
                raise CommandError(f"cannot enter the working directory {request.cwd}: "
                                   f"{head.chdir_failure}")
            # The command's own words after all (it ran, and said the same): they stay its.
            seen.stderr.parts.insert(0, f"{_CHDIR_FAILED}{request.cwd}: {head.chdir_failure}\n")
        if seen.returncode == 1 and _BWRAP_E2BIG.match("".join(seen.stderr.parts)):
            # check_exec_size guards this; a limit it did not foresee still is the caller's.
            raise CommandError("the kernel refused the command's argv and environment as too "
                               "large (ARG_MAX or MAX_ARG_STRLEN, 128 KiB per entry); pass "
                               "data through files or stdin")
        return seen.outcome()

    def _start(self, launch: Launch) -> tuple[subprocess.Popen[bytes], int]:
        """Start bwrap, place it in the command's cgroup, then let the command run."""
        request = launch.request
        check_exec_size(request.argv, launch.env)
        seccomp_fd = seccomp.filter_fd()
        try:
            argv, stdio, terminal = command_stdio(request, [], self.setsid)
        except BaseException:
            os.close(seccomp_fd)
            raise
        return self._start_bwrap(
            launch, request.argv, group=launch.group, seccomp_fd=seccomp_fd,
            prefix=argv, stdio=stdio, terminal=terminal, env=launch.env, cwd=request.cwd,
            new_session=request.pty is None)

    def start_resident(self, launch: Launch, helper: Path, control_fd: int,
                       group: str) -> subprocess.Popen[bytes]:
        """Start ``launch``'s sandbox's resident: bwrap with the zygote (``resident``) as its
        PID 1, holding ``control_fd``, placed in ``group`` before the zygote runs."""
        argv = zygote_argv(control_fd, launch.tmp_bytes, launch.template.masked_proc)
        stdio: dict[str, Any] = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL,
                                 "stderr": subprocess.PIPE, "start_new_session": True}
        proc, _ = self._start_bwrap(
            launch, argv, group=group, seccomp_fd=None, prefix=[], stdio=stdio,
            terminal=None, env={"PATH": "/usr/bin:/bin"}, cwd="/", new_session=True,
            resident=helper, extra_fds=(control_fd,), pdeathsig=True)
        return proc

    def _start_bwrap(
        self, launch: Launch, command: Sequence[str], *, group: str, seccomp_fd: int | None,
        prefix: list[str], stdio: dict[str, Any], terminal: int | None, env: Mapping[str, str],
        cwd: str, new_session: bool, resident: Path | None = None,
        extra_fds: tuple[int, ...] = (), pdeathsig: bool = False,
    ) -> tuple[subprocess.Popen[bytes], int]:
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        options = build_options(
            template=launch.template, workspace=launch.workspace,
            tmp_bytes=launch.tmp_bytes, cwd=cwd, env=env,
            fds=BwrapFds(info=info_w, block=block_r, seccomp=seccomp_fd),
            new_session=new_session, mounts=launch.mounts, resident=resident, tmp=launch.tmp,
        )
        bwrap_fds = (info_w, block_r) + ((seccomp_fd,) if seccomp_fd is not None else ())
        # A memfd rather than a pipe: the options (the environment included, up to a few
        # hundred KiB) are written whole before bwrap starts, with no reader to wait for.
        try:
            args_fd = sealed_file(encode_args(options), "corral-bwrap-args")
        except BaseException:
            for fd in (info_r, block_w, *bwrap_fds):
                os.close(fd)
            raise
        try:
            join_fds = tuple(open_join_files(self.cgroups, group))
        except OSError as exc:
            for fd in (info_r, block_w, *bwrap_fds, args_fd):
                os.close(fd)
            raise BackendError(f"cannot open the command's cgroup {group}: {exc}") from exc
        child_fds = (*bwrap_fds, args_fd, *join_fds)
        argv = command_line(self.bwrap, args_fd, command)
        # The launch helper joins the command's group (bwrap and its child are born in it),
        # resets the signals (ignored ones survive exec: a service started under nohup would
        # hand them on), drops to the sandbox's uid and execs bwrap, same pid. Doing it here
        # rather than with Popen(user=...) lets CPython use vfork: forking a large process
        # (the service) costs milliseconds. A resident dies with the spawner thread.
        argv = [self.launch_helper, str(launch.uid), ",".join(map(str, join_fds)) or "-",
                "1" if pdeathsig else "0", "--", *argv]
        argv = [*prefix, *argv]  # setsid execs: same pid

        def spawn() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                argv,
                env=privileged_env(),
                cwd="/",
                pass_fds=(*child_fds, *extra_fds),
                **stdio,
            )

        try:
            proc = self.spawner.run(launch.netns_path, spawn, tree=launch.tree)
        except OSError as exc:
            for fd in (*child_fds, info_r, block_w):
                os.close(fd)
            if terminal is not None:
                os.close(terminal)
                os.close(stdio["stdin"])
            if exc.errno == 7:  # E2BIG: only the argv is on the host's exec now
                raise CommandError(
                    "the kernel refused the command's argv as too large (ARG_MAX, a quarter "
                    "of the stack limit, or 128 KiB for one argument); pass data through "
                    "files or stdin"
                ) from exc
            raise BackendError(f"cannot start bwrap: {exc}") from exc
        for fd in child_fds:
            os.close(fd)
        if terminal is not None:
            os.close(stdio["stdin"])  # the child holds the PTY's other end now
            proc.terminal = terminal  # type: ignore[attr-defined]
        init_pid = 0
        try:
            init_pid = self._read_init_pid(info_r, proc)
            for pid in (proc.pid, init_pid):
                # Whatever the service was started with (often a million open files), the
                # sandbox gets 4096 and no core dumps. Needs CAP_SYS_RESOURCE; a host whose
                # root lacks it keeps the limits Corral inherited (`corral drill` shows them).
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    resource.prlimit(pid, resource.RLIMIT_NOFILE, _NOFILE)
                    resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
            try:
                # Release the init: it and bwrap were born in the group (launch.c), so a
                # resident's bwrap, which lives as long as the resident, is counted there too.
                os.write(block_w, b"1")
            except BrokenPipeError:  # bwrap died before its init was released
                raise BackendError(
                    "the sandbox could not be set up: " + self._setup_error(proc)
                ) from None
        except BaseException:
            self._abort(proc, group, init_pid)
            raise
        finally:
            os.close(info_r)
            os.close(block_w)
        return proc, init_pid

    def run_resident(self, zygote: Zygote, launch: Launch, *,
                     retire: Callable[[str], None]) -> ExecOutcome:
        """``run``, from the sandbox's resident: the init made ahead takes the command.
        ``retire`` takes the command's group once it is empty (``GroupRetirer``)."""
        request, group = launch.request, launch.group
        check_exec_size(request.argv, launch.env)
        started = time.monotonic()
        with tracer.start_as_current_span("corral.process.start"):
            init = zygote.take()
            try:
                proc = zygote.start_command(
                    init, group=group, cwd=request.cwd, argv=request.argv, env=dict(launch.env),
                    stdin=request.stdin is not None or request.interactive)
            except BaseException:
                zygote.discard(init)
                raise
        try:
            seen = supervise(
                proc, request, cgroups=self.cgroups, group=group,  # type: ignore[arg-type]
                started=started, terminal=None, abort=lambda: self._abort_resident(proc, group),
                emptied=lambda: proc.settled)
        except BaseException:
            with contextlib.suppress(BackendError):
                self.cgroups.kill(group)
            proc.close()
            self.cgroups.remove(group)
            raise
        proc.close()
        retire(group)  # killed there, in case the init is still exiting
        if proc.setup_error is not None:
            if proc.setup_error.startswith("chdir:"):
                raise CommandError(f"cannot enter the working directory {request.cwd}: "
                                   + proc.setup_error.removeprefix("chdir: "))
            raise BackendError(f"the command could not be set up: {proc.setup_error}")
        if proc.exec_errno is not None:
            failed = exec_failure(request.argv[0], os.strerror(proc.exec_errno))
            if failed is not None:
                code, line = failed
                seen.stderr.feed(line.encode())
                return seen.outcome(code)
            if proc.exec_errno == errno.E2BIG:
                raise CommandError("the kernel refused the command's argv and environment as "
                                   "too large (ARG_MAX or MAX_ARG_STRLEN, 128 KiB per entry); "
                                   "pass data through files or stdin")
            seen.stderr.feed(f"corral: cannot run {request.argv[0]}: "
                             f"{os.strerror(proc.exec_errno)}\n".encode())
            return seen.outcome(126)
        return seen.outcome()

    def _abort_resident(self, proc: ZygoteProcess, group: str) -> None:
        with contextlib.suppress(BackendError):
            self.cgroups.kill(group)
        proc.close()

    def _abort(self, proc: subprocess.Popen[bytes], group: str, init_pid: int) -> None:
        terminal = getattr(proc, "terminal", None)
        if terminal is not None:
            with contextlib.suppress(OSError):
                os.close(terminal)
        with contextlib.suppress(BackendError):
            self.cgroups.kill(group)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_SETUP_TIMEOUT_S)
        _reap(init_pid)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()

    def _read_init_pid(self, info_r: int, proc: subprocess.Popen[bytes]) -> int:
        data = b""
        deadline = time.monotonic() + _SETUP_TIMEOUT_S
        with selectors.DefaultSelector() as sel:
            sel.register(info_r, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not sel.select(deadline - time.monotonic()):
                    continue
                chunk = os.read(info_r, 4096)
                if not chunk:
                    break
                data += chunk
        try:
            return int(json.loads(data)["child-pid"])
        except (ValueError, KeyError, TypeError):
            pass
        message = self._setup_error(proc)
        if "chdir" in message.lower():
            raise CommandError(f"cannot enter the working directory: {message}")
        raise BackendError(f"the sandbox could not be set up: {message}")

    @staticmethod
    def _setup_error(proc: subprocess.Popen[bytes]) -> str:
        """bwrap's own complaint, once it has died during set-up."""
        try:
            _, err = proc.communicate(timeout=_SETUP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                _, err = proc.communicate(timeout=_SETUP_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # its stderr held open by what it started
                err = b""
        message = err.decode(errors="replace").strip().removeprefix("bwrap: ")
        return message or f"bwrap exited with status {proc.returncode}"
