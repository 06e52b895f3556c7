"""Declared background processes (a dev server, a kernel): started, listed, reconnected to,
fed input, killed. Each runs as a command bounded by its sandbox's lifetime, in the sandbox's
cgroup (so it counts against the limits) and dies with the sandbox. Its output is kept in a
bounded buffer with absolute offsets, so a client can reconnect and read on from where it was.

They belong to the process that started them (the service, in practice): an embedded program's
background processes end when it exits.

Each also has a small per-sandbox ``pid`` (never reused while the table runs) and an optional
``tag``, so a surface that addresses processes by number (E2B's envd) can; a ``timeout`` kills
it at a deadline; a ``pty`` runs it on a terminal. A kill the table issued (``kill``, the
deadline) is remembered, so a surface can tell "killed" apart from "exited 137".
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .._audit.recorder import new_command_id
from .._core.text import readable
from ..backends import OutputCallback, ProcessIO
from ..errors import CommandNotFound, CorralError, UsageError
from ..models import CommandResult, ProcessInfo

if TYPE_CHECKING:
    from .tenants import Tenant

__all__ = ["MAX_PTY_SIZE", "BackgroundProcess", "CommandRunner", "ProcessTable"]

_KEEP_BYTES = 4 * 1024 * 1024
_KEEP_EXITED = 100
MAX_PTY_SIZE = 1000
_MAX_PID = 2**32 - 1


class CommandRunner(Protocol):
    """What a background process needs of the control plane to run as one command (the
    commands service implements it; this table knows nothing else of the control plane)."""

    def admit_background(self, sandbox_id: str, caller: Tenant | None) -> str:
        """Check the sandbox is usable and count the start; return its id."""
        ...

    def run(self, sandbox_id: str, cmd: str | Sequence[str], *,
            envs: Mapping[str, str] | None, cwd: str | None,
            context: Mapping[str, Any] | None, interactive: bool,
            on_start: Callable[[ProcessIO], None] | None, lifetime: bool,
            command_id: str | None, on_stdout: OutputCallback | None,
            on_stderr: OutputCallback | None,
            pty: tuple[int, int] | None = None,
            stream_past_limit: bool = False,
            lossless_output: bool = False) -> CommandResult: ...

    def kill(self, sandbox_id: str, command_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Tap:
    """A reader of every chunk (``BackgroundProcess.tap``)."""

    on_chunk: Callable[[str, str], None]  # (stream, text)
    on_exit: Callable[[], None]


@dataclass
class BackgroundProcess:
    id: str
    sandbox_id: str
    command_id: str
    argv: list[str]
    started_at: float
    state: Literal["starting", "running", "exited"] = "starting"
    result: CommandResult | None = None
    error: str | None = None
    pid: int = 0  # small, per sandbox, never reused while the table runs
    tag: str | None = None
    envs: dict[str, str] = field(default_factory=dict)  # as the caller passed them
    cwd: str | None = None
    pty: tuple[int, int] | None = None  # (rows, cols) at start, for a terminal
    # Output chunks re-encode to the exact bytes (``ExecRequest.lossless_output``); ``output``
    # hands them so only to a reader that asks (``raw``).
    lossless: bool = False
    #: The table killed it (``kill`` or the deadline): with exit 137 it died of that SIGKILL.
    kill_requested: bool = False
    deadline_passed: bool = False  # killed because its ``timeout`` ran out
    #: Why the process failed to run, when it did (``error`` is its text).
    failure: CorralError | None = None
    _chunks: list[tuple[int, str, str]] = field(default_factory=list)  # (offset, stream, text)
    _end: int = 0  # offset after the last chunk
    _kept_from: int = 0
    _io: ProcessIO | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _watchers: list[Callable[[], None]] = field(default_factory=list)
    _taps: list[Tap] = field(default_factory=list)
    _deadline: threading.Timer | None = None

    def info(self) -> ProcessInfo:
        return ProcessInfo(
            id=self.id, sandbox_id=self.sandbox_id, argv=self.argv,
            started_at=self.started_at, state=self.state,
            exit_code=self.result.exit_code if self.result else None,
            command_id=self.command_id, error=self.error, output_bytes=self._end)

    def to_dict(self) -> dict[str, Any]:
        return self.info().to_dict()

    @property
    def signaled(self) -> bool:
        """It ended by a SIGKILL: one the table sent, the OOM killer's, or the end of the
        sandbox's lifetime (a command's own ``exit 137`` is not)."""
        result = self.result
        if result is None:
            return False
        return (result.timed_out or result.usage.oom_killed
                or (self.kill_requested and result.exit_code == 137))

    @property
    def position(self) -> int:
        """The offset after the output so far (where a follower "from now on" starts)."""
        with self._cond:
            return self._end

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (from the process's thread; it must be quick and not raise) on
        new output and on exit; returns the function that stops it. Lets an event loop follow
        the output without parking a thread per follower."""
        with self._cond:
            self._watchers.append(callback)

        def unwatch() -> None:
            with self._cond, contextlib.suppress(ValueError):
                self._watchers.remove(callback)

        return unwatch

    def tap(self, on_chunk: Callable[[str, str], None], on_exit: Callable[[], None]) -> None:
        """Give ``on_chunk(stream, text)`` every chunk of output, the kept ones first, then
        each as it comes, and ``on_exit()`` once at the end; both are called under this
        process's lock (from the thread that feeds it: quick, never raising). For a reader that
        must see every byte, a kernel's protocol: one that follows ``output`` from a thread
        of its own loses what the window drops while it is not scheduled. Output the window
        dropped before the tap comes as one ``notice`` chunk."""
        with self._cond:
            if self._kept_from:
                on_chunk("notice", f"[corral: {self._kept_from} bytes of earlier output are "
                         "no longer kept]\n")
            for _start, stream, text in self._chunks:
                on_chunk(stream, text)
            if self.state == "exited":
                on_exit()
            else:
                self._taps.append(Tap(on_chunk, on_exit))

    def _notify(self) -> None:
        # Under self._cond: every waiter, blocking or not, learns at once.
        self._cond.notify_all()
        for callback in list(self._watchers):
            with contextlib.suppress(Exception):  # a follower's bug never stops the output
                callback()

    def _feed(self, stream: str, text: str) -> None:
        with self._cond:
            for tap in self._taps:
                with contextlib.suppress(Exception):  # a reader's bug never stops the output
                    tap.on_chunk(stream, text)
            self._chunks.append((self._end, stream, text))
            self._end += len(text)
            while self._chunks and self._end - self._chunks[0][0] > _KEEP_BYTES:
                first = self._chunks.pop(0)
                self._kept_from = first[0] + len(first[2])
            self._notify()

    def _started(self, io: ProcessIO) -> None:
        with self._cond:
            self._io = io
            self.state = "running"
            self._notify()

    def _finished(self, result: CommandResult | None, error: str | None,
                  failure: CorralError | None = None) -> None:
        with self._cond:
            self.result, self.error, self.failure, self.state = result, error, failure, "exited"
            self._io = None
            taps, self._taps = self._taps, []
            for tap in taps:
                with contextlib.suppress(Exception):
                    tap.on_exit()
            timer, self._deadline = self._deadline, None
            self._notify()
        if timer is not None:
            timer.cancel()

    def output(self, offset: int = 0, *, follow: bool = False, wait_s: float | None = None,
               raw: bool = False) -> Iterator[tuple[int, str, str]]:
        """(offset, stream, text) from ``offset`` on; with ``follow``, until the process exits
        (or ``wait_s`` passes). Output older than the kept window is announced, not replayed.
        Of a lossless process, ``raw`` gets the text that re-encodes to the exact bytes; any
        other reader, bytes that are not UTF-8 as U+FFFD (offsets count the raw text)."""
        shown = readable if self.lossless and not raw else None
        deadline = None if wait_s is None else time.monotonic() + wait_s
        position = offset
        while True:
            with self._cond:
                if position < self._kept_from:
                    yield (position, "notice",
                           f"[corral: {self._kept_from - position} bytes of earlier output "
                           "are no longer kept]\n")
                    position = self._kept_from
                ready = [c for c in self._chunks if c[0] + len(c[2]) > position]
                done = self.state == "exited"
                if not ready and follow and not done:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return
                    self._cond.wait(timeout=min(remaining or 1.0, 1.0))
                    continue
            for start, stream, text in ready:
                cut = max(0, position - start)
                yield (start + cut, stream, text[cut:] if shown is None else shown(text[cut:]))
                position = start + len(text)
            if not follow or (done and not ready):
                return

    def send(self, data: bytes) -> None:
        with self._cond:
            io = self._io
        if io is None:
            raise CommandNotFound(f"process {self.id} is not running")
        io.write(data)

    def close_input(self) -> None:
        with self._cond:
            io = self._io
        if io is not None:
            io.close_stdin()

    def resize(self, rows: int, cols: int) -> None:
        """Change a terminal process's size (it gets SIGWINCH)."""
        if self.pty is None:
            raise UsageError(f"process {self.id} has no terminal to resize; start it with pty=")
        if not (0 < rows <= MAX_PTY_SIZE and 0 < cols <= MAX_PTY_SIZE):
            raise UsageError(f"rows and cols must be 1..{MAX_PTY_SIZE}, got {rows}x{cols}")
        with self._cond:
            io = self._io
        if io is None:
            raise CommandNotFound(f"process {self.id} is not running")
        io.resize(rows, cols)

    def wait(self, timeout: float | None = None) -> CommandResult | None:
        with self._cond:
            self._cond.wait_for(lambda: self.state == "exited", timeout=timeout)
            return self.result


class ProcessTable:
    """The background processes started through one control plane; each is one command of
    ``runner`` (which knows nothing of this table: the dependency goes one way)."""

    def __init__(self, runner: CommandRunner) -> None:
        self._runner = runner
        self._processes: dict[str, BackgroundProcess] = {}
        self._pids: dict[str, int] = {}  # the last pid given out, per sandbox
        self._lock = threading.Lock()

    def start(self, sandbox_id: str, cmd: str | Sequence[str], *,
              envs: Mapping[str, str] | None = None, cwd: str | None = None,
              context: Mapping[str, Any] | None = None,
              caller: Tenant | None = None, pty: tuple[int, int] | None = None,
              timeout: float | None = None, tag: str | None = None,
              stream_past_limit: bool = False,
              lossless_output: bool = False) -> BackgroundProcess:
        """Start ``cmd`` in the background; with ``caller``, it counts against its commands
        per minute like any command (counted here, before the thread starts).

        ``pty`` (rows, cols) runs it on a terminal (output is ``stdout``); ``timeout`` (s)
        kills it that long after the start (else only the sandbox's lifetime bounds it);
        ``tag`` names it for ``find``. ``stream_past_limit``: the tier's output limit caps
        the result only, not what this table receives (kept in its rolling window): for a
        kernel, whose protocol must not be cut after the tier's few MiB over a long life.
        ``lossless_output``: its chunks re-encode to the exact bytes (``output(raw=True)``).
        """
        if pty is not None and not all(0 < n <= MAX_PTY_SIZE for n in pty):
            raise UsageError(f"pty rows and cols must be 1..{MAX_PTY_SIZE}, got {pty}")
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise UsageError(f"timeout must be a positive number of seconds, got {timeout!r}")
        checked_id = self._runner.admit_background(sandbox_id, caller)
        argv = [cmd] if isinstance(cmd, str) else list(cmd)
        process = BackgroundProcess(id="proc_" + secrets.token_hex(6), sandbox_id=checked_id,
                                    command_id=new_command_id(), argv=argv,
                                    started_at=time.time(), tag=tag, envs=dict(envs or {}),
                                    cwd=cwd, pty=pty, lossless=lossless_output)
        # Only a terminal passes pty=, and only a kernel stream_past_limit=, so runners that
        # predate them (a test's) keep working.
        extra: dict[str, Any] = {"pty": pty} if pty is not None else {}
        if stream_past_limit:
            extra["stream_past_limit"] = True
        if lossless_output:
            extra["lossless_output"] = True

        def run() -> None:
            try:
                result = self._runner.run(
                    sandbox_id, cmd, envs=envs, cwd=cwd, context=context, interactive=True,
                    on_start=process._started, lifetime=True, command_id=process.command_id,
                    on_stdout=lambda text: process._feed("stdout", text),
                    on_stderr=lambda text: process._feed("stderr", text), **extra)
                process._finished(result, None)
            except CorralError as exc:
                process._finished(None, f"{exc.code}: {exc.message}", exc)
            except Exception as exc:  # recorded for the caller; the thread must not vanish
                process._finished(None, f"{type(exc).__name__}: {exc}")

        with self._lock:
            self._prune()
            process.pid = self._next_pid(checked_id)
            self._processes[process.id] = process
        threading.Thread(target=run, name=f"corral-{process.id}", daemon=True).start()
        with process._cond:
            process._cond.wait_for(lambda: process.state != "starting", timeout=30)
            if timeout is not None and process.state == "running":
                process._deadline = threading.Timer(timeout, self._expire, args=(process,))
                process._deadline.daemon = True
                process._deadline.start()
        if process.state == "exited" and process.error:
            raise UsageError(f"the process could not start: {process.error}") \
                from process.failure
        return process

    def _next_pid(self, sandbox_id: str) -> int:
        # Under self._lock. Counting on past 2**32 - 1 would leave uint32: wrap, skipping
        # pids still remembered (the table keeps at most a few hundred).
        taken = {p.pid for p in self._processes.values() if p.sandbox_id == sandbox_id}
        pid = self._pids.get(sandbox_id, 0)
        while True:
            pid = pid % _MAX_PID + 1
            if pid not in taken:
                self._pids[sandbox_id] = pid
                return pid

    def _expire(self, process: BackgroundProcess) -> None:
        process.deadline_passed = True
        with contextlib.suppress(CorralError):  # already gone, or the sandbox with it
            self.kill(process.sandbox_id, process.id)

    def _prune(self) -> None:
        exited = [p for p in self._processes.values() if p.state == "exited"]
        for process in exited[:-_KEEP_EXITED] if len(exited) > _KEEP_EXITED else []:
            del self._processes[process.id]

    def get(self, sandbox_id: str, process_id: str) -> BackgroundProcess:
        with self._lock:
            process = self._processes.get(process_id)
        if process is None or process.sandbox_id != sandbox_id:
            raise CommandNotFound(f"no background process {process_id!r} in {sandbox_id}")
        return process

    def find(self, sandbox_id: str, *, pid: int | None = None,
             tag: str | None = None) -> BackgroundProcess:
        """The process of ``sandbox_id`` with that ``pid`` (or else ``tag``; the latest one
        started if several share it)."""
        with self._lock:
            mine = [p for p in self._processes.values() if p.sandbox_id == sandbox_id]
        if pid is not None:
            found = [p for p in mine if p.pid == pid]
            what = f"pid {pid}"
        else:
            found = [p for p in mine if tag is not None and p.tag == tag]
            what = f"tag {tag!r}"
        if not found:
            raise CommandNotFound(f"no process with {what} in {sandbox_id}; list() shows the "
                                  "running ones")
        return max(found, key=lambda p: p.started_at)

    def list(self, sandbox_id: str) -> list[BackgroundProcess]:
        with self._lock:
            return [p for p in self._processes.values() if p.sandbox_id == sandbox_id]

    def any_live(self, sandbox_id: str) -> bool:
        """True while a background process of the sandbox has not exited."""
        return any(p.state != "exited" for p in self.list(sandbox_id))

    def drop(self, sandbox_id: str) -> None:
        """Forget a destroyed sandbox's processes (its destroy killed them)."""
        with self._lock:
            gone = [p for p in self._processes.values() if p.sandbox_id == sandbox_id]
            for process in gone:
                del self._processes[process.id]
            self._pids.pop(sandbox_id, None)
        for process in gone:
            if process._deadline is not None:
                process._deadline.cancel()

    def kill(self, sandbox_id: str, process_id: str) -> None:
        process = self.get(sandbox_id, process_id)
        if process.state == "exited":
            return
        process.kill_requested = True
        self._runner.kill(sandbox_id, process.command_id)
