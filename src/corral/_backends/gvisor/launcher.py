"""Runs one command as its own gVisor sandbox: bundle, spawn in its cgroup, stream, limit, reap.

Ordering that makes the limits hold: runsc is started through ``sh``, which waits on a FIFO until
we have moved it into the command's cgroup and only then execs runsc. Everything runsc starts
(gofer, Sentry, systrap stubs) descends from it, so it is in the cgroup from its first
instruction; a timeout, ``kill_command`` or ``destroy`` kills the whole group at once.

``setpriv --pdeathsig KILL`` (inherited across the execs) kills runsc when the thread that
spawned it exits; the spawner thread lives as long as Corral, and runsc's attached sandbox dies
with runsc, so no sandbox outlives the process that ran it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._audit.tracing import tracer
from ..._core import linux
from ..._core.fsafe import remove_tree
from ..._core.privileged import privileged_env
from ...backends import ExecOutcome, ExecRequest
from ...errors import BackendError, CommandError
from .._linux import netns
from .._linux.cgroups import CgroupDriver
from .._linux.notfound import ExecFailureHead, exec_failure
from .._linux.process_io import command_stdio
from .._linux.supervise import SETUP_TIMEOUT_S as _SETUP_TIMEOUT_S
from .._linux.supervise import supervise
from .bundle import runtime_uid, write_config
from .runsc import Runsc

__all__ = ["GvisorLauncher", "Launch", "reap_orphans"]

_KILLED_EXIT_CODE = 128 + 9
# runsc's own failures exit 128 (a command's own 128 is told apart by runsc's log).
_RUNSC_FAILED = 128
# Waits on a FIFO until the parent has placed it in the cgroup; the FIFO closed without a line
# (set-up failed) makes `read` fail and the shell exit without starting anything.
_SHIM = 'read -r _ < "$1" && shift && exec "$@"'


@dataclass(frozen=True, slots=True)
class Launch:
    """One command to start, with the pieces of its sandbox the launch needs."""

    uid: int
    netns_path: Path
    group: str
    container_id: str
    bundle: Path
    config: Mapping[str, Any]
    request: ExecRequest


class GvisorLauncher:
    """Starts commands for one backend: the runsc binary, the cgroup driver, the spawner."""

    def __init__(self, runsc: Runsc, cgroups: CgroupDriver) -> None:
        self.runsc = runsc
        self.cgroups = cgroups
        self.spawner = netns.Spawner()
        self.setsid = shutil.which("setsid") or "setsid"
        self.setpriv = shutil.which("setpriv") or "setpriv"
        self.sh = shutil.which("sh") or "/bin/sh"
        # runsc returns (or is killed) before its gofer and Sentry are gone; they are re-parented
        # to us, as bwrap's init is in the namespace tier, and reaped by `reap_orphans`
        # instead of being left as zombies to a host init that may never reap them.
        linux.set_child_subreaper()

    def run(self, launch: Launch) -> ExecOutcome:
        self.cgroups.create_command(launch.group)
        try:
            write_config(launch.bundle, launch.config)
            return self._run_in_group(launch)
        finally:
            with contextlib.suppress(BackendError):
                self.cgroups.kill(launch.group)
            reap_orphans(runtime_uid(launch.uid))
            self.cgroups.remove(launch.group)
            self.runsc.remove_state(launch.container_id)
            remove_tree(launch.bundle)

    def _run_in_group(self, launch: Launch) -> ExecOutcome:
        started = time.monotonic()
        with tracer.start_as_current_span("corral.process.start"):
            proc, release = self._start(launch)
        try:
            return self._follow(launch, proc, started)
        finally:
            os.close(release)

    def _follow(self, launch: Launch, proc: subprocess.Popen[bytes],
                started: float) -> ExecOutcome:
        request = launch.request
        # runsc reports a program it cannot start on the command's stderr, in its own words.
        head = ExecFailureHead(request.argv[0], b"running container: ", _runsc_exec_reason)
        seen = supervise(
            proc, request, cgroups=self.cgroups, group=launch.group, started=started,
            terminal=getattr(proc, "terminal", None), abort=lambda: self._abort(proc, launch),
            stderr_head=head)
        returncode, usage, stderr = seen.returncode, seen.usage, seen.stderr
        if seen.timed_out or returncode < 0:
            exit_code = seen.exit_code()  # runsc itself killed (kill_command, destroy)
        elif returncode == _RUNSC_FAILED and (failure := self.runsc.error_of(launch.bundle)):
            if usage.oom_killed:
                # The OOM killer took the Sentry: the command died of memory, not of runsc.
                exit_code = _KILLED_EXIT_CODE
            elif head.exit_code is not None:
                # A program that cannot be run is the command's result, as in a shell; runsc's
                # report on the command's stderr (its own) is already Corral's line.
                exit_code = head.exit_code
            elif (reason := _runsc_exec_reason(failure)) is not None and (
                    not_started := exec_failure(request.argv[0], reason)) is not None:
                exit_code, message = not_started  # runsc could not say it on stderr
                stderr.feed(message.encode())
            else:
                raise _failure(failure, request.cwd)
        else:
            exit_code = returncode
        return seen.outcome(exit_code)

    def _start(self, launch: Launch) -> tuple[subprocess.Popen[bytes], int]:
        """Start runsc held by the shim, place it in the command's cgroup, then release it.

        Returns the process and our end of the release FIFO, which must stay open until the
        command ends (closing it before the shim has read would drop the byte)."""
        request = launch.request
        fifo = launch.bundle / "release"
        os.mkfifo(fifo, 0o600)
        # Read-write: opening never blocks, and the shim's read-only open does not either.
        release = os.open(fifo, os.O_RDWR | os.O_CLOEXEC)
        argv = [self.setpriv, "--pdeathsig", "KILL", "--", self.sh, "-c", _SHIM, "sh", str(fifo),
                *self.runsc.run_argv(bundle=launch.bundle, container_id=launch.container_id)]
        # A terminal's session: runsc forwards what the terminal sends it (Ctrl-C, SIGWINCH) to
        # the foreground process group inside, and the sandbox's init gets it as its own.
        argv, stdio, terminal = command_stdio(request, argv, self.setsid)

        def spawn() -> subprocess.Popen[bytes]:
            # The command's environment is in the bundle's config.json (data runsc hands to
            # gVisor's kernel); runsc, setpriv and the shim get Corral's fixed one.
            return subprocess.Popen(argv, env=privileged_env(), cwd="/", **stdio)

        try:
            proc = self.spawner.run(launch.netns_path, spawn)
        except OSError as exc:
            os.close(release)
            if terminal is not None:
                os.close(terminal)
                os.close(stdio["stdin"])
            raise BackendError(f"cannot start runsc: {exc}") from exc
        if terminal is not None:
            os.close(stdio["stdin"])  # the child holds the PTY's other end now
            proc.terminal = terminal  # type: ignore[attr-defined]
        try:
            try:
                self.cgroups.attach(launch.group, (proc.pid,))
            except ProcessLookupError:
                raise BackendError("the gVisor sandbox could not be set up: runsc's launcher "
                                   f"exited with status {proc.wait()}") from None
            os.write(release, b"go\n")
        except BaseException:
            os.close(release)
            self._abort(proc, launch)
            raise
        return proc, release

    def _abort(self, proc: subprocess.Popen[bytes], launch: Launch) -> None:
        terminal = getattr(proc, "terminal", None)
        if terminal is not None:
            with contextlib.suppress(OSError):
                os.close(terminal)
        with contextlib.suppress(BackendError):
            self.cgroups.kill(launch.group)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_SETUP_TIMEOUT_S)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()

def reap_orphans(uid: int, deadline_s: float = 2.0) -> None:
    """Reap the gVisor processes that runsc left to us: it returns once the command is
    over, before its gofer and Sentry (and the Sentry's stubs) have gone, and they are
    re-parented to us, the subreaper. Only processes of the sandbox's runtime uid whose
    parent we are: other children belong to ``subprocess``, and a concurrent command's
    gVisor processes still have their own runsc as parent."""
    me = os.getpid()
    end = time.monotonic() + deadline_s
    while True:
        ours = [(pid, state) for pid, ppid, state in _procs_of_uid(uid) if ppid == me]
        if not ours or time.monotonic() > end:
            return
        for pid, state in ours:
            if state == "Z":
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
        time.sleep(0.001)


def _procs_of_uid(uid: int) -> list[tuple[int, int, str]]:
    """(pid, ppid, state) of host processes whose real uid is ``uid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}")
            if st.st_uid != uid:
                continue
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        found.append((int(entry), int(fields[1]), fields[0]))
    return found


def _runsc_exec_reason(message: str) -> str | None:
    """The errno text when runsc says the program itself could not be started: not found on
    ``PATH`` (a bare name) or not loadable (a path: missing, not executable)."""
    for marker in ("error finding executable ", "failed to load "):
        if marker in message:
            return message.rsplit(": ", 1)[-1].strip()
    return None


def _failure(message: str, cwd: str) -> Exception:
    """runsc's own error, as the error a caller can act on."""
    lowered = message.lower()
    if "chdir" in lowered or "working directory" in lowered or f'"{cwd}"' in message:
        return CommandError(f"cannot enter the working directory {cwd}: {message}")
    return BackendError(f"the gVisor sandbox failed: {message}")
