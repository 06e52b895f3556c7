"""What both tiers do with a running command's standard streams: feed stdin, read stdout and
stderr (or the terminal) under a deadline, keep a capped, decoded copy of each, and hand
interactive callers a handle to write, close and resize."""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import math
import os
import select
import selectors
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...backends import ExecRequest, OutputCallback, OutputCut

__all__ = ["OutputStream", "ProcessHandle", "StreamHead", "command_stdio", "pump",
           "set_terminal_size"]

READ_CHUNK = 65536
# How much of a stream's head a ``StreamHead`` may hold back before it must decide.
HEAD_LIMIT = 4096


class StreamHead(Protocol):
    """Decides what the first bytes of a stream really are, before anyone sees them.

    A runtime that fails to start the program (bwrap's ``execvp``, runsc's loader) says so in
    its own words on the command's stderr; the tier rewrites that one line into Corral's,
    live and in the result alike. Called with everything held so far: None to keep holding
    (at most ``HEAD_LIMIT`` bytes), else the bytes to pass on in place of what was held."""

    def __call__(self, held: bytes) -> bytes | None: ...


@dataclass
class OutputStream:
    """One output stream: decode incrementally, keep up to ``limit`` bytes, count the rest."""

    name: str
    limit: int
    callback: OutputCallback | None
    kept: int = 0
    dropped: int = 0
    parts: list[str] = field(default_factory=list)
    raw: bytearray = field(default_factory=bytearray)
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    head: StreamHead | None = None
    held: bytes = b""
    # Past the limit the callback still gets the output (not kept): see ExecRequest.
    stream_past_limit: bool = False
    live_decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    # The callback's text re-encodes to the exact bytes (see ``ExecRequest.lossless_output``).
    lossless: bool = False

    def __post_init__(self) -> None:
        if self.lossless:
            self.live_decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")

    @classmethod
    def for_request(cls, name: str, request: ExecRequest, *,
                    head: StreamHead | None = None) -> OutputStream:
        """The stream ``name`` ("stdout" or "stderr") of ``request``, as every tier reads it."""
        callback = request.on_stdout if name == "stdout" else request.on_stderr
        return cls(name, request.output_limit_bytes, callback, head=head,
                   stream_past_limit=request.stream_past_limit,
                   lossless=request.lossless_output)

    def feed(self, data: bytes) -> None:
        if self.head is not None:
            self.held += data
            decided = self.head(self.held)
            if decided is None and len(self.held) < HEAD_LIMIT:
                return
            data = self.held if decided is None else decided
            self.head, self.held = None, b""
        self._keep(data)

    def _keep(self, data: bytes) -> None:
        if self.stream_past_limit and self.callback is not None:
            # The live reader gets every byte, decoded on its own, and no cut notice (a
            # protocol reader must see the stream exactly); only the result is capped.
            text = self.live_decoder.decode(data)
            if text:
                self.callback(text)
        room = max(self.limit - self.kept, 0)
        if len(data) <= room:
            self.kept += len(data)
            self.raw += data
            self._emit(self.decoder.decode(data), data)
            return
        first_cut = self.dropped == 0
        self.dropped += len(data) - room
        self.kept += room
        self.raw += data[:room]
        self._emit(self.decoder.decode(data[:room], final=True), data[:room], final=True)
        if first_cut:
            # The moment output is first cut, the live reader is told, in the same words the
            # result carries: a stream that just goes quiet reads as a hung command. It is an
            # ``OutputCut`` so a caller that knows (the HTTP stream) can tell it from output.
            tail = self.parts[-1] if self.parts else ""
            self._emit(OutputCut(self.name, self.limit,
                                 newline=bool(tail) and not tail.endswith("\n")))

    def finish(self) -> str:
        if self.head is not None:
            decided = self.head(self.held)
            self.head, held, self.held = None, self.held, b""
            self._keep(held if decided is None else decided)
        self._emit(self.decoder.decode(b"", final=True), b"", final=True)
        if self.stream_past_limit and self.callback is not None:
            tail = self.live_decoder.decode(b"", final=True)
            if tail:
                self.callback(tail)
        return "".join(self.parts)

    def _emit(self, text: str, data: bytes | None = None, *, final: bool = False) -> None:
        """Keep ``text`` (the reading of ``data``) and hand it to the callback; a lossless
        stream hands it ``data``'s own lossless reading instead."""
        if text:
            self.parts.append(text)
        if self.callback is None or self.stream_past_limit:
            return
        if self.lossless and data is not None:
            text = self.live_decoder.decode(data, final=final)
        if text:
            self.callback(text)


def command_stdio(request: ExecRequest, argv: list[str],
                  setsid: str) -> tuple[list[str], dict[str, Any], int | None]:
    """The argv, ``Popen`` stdio keywords and PTY master for ``request``.

    A terminal command runs in a new session whose controlling terminal is the PTY (``setsid
    --ctty``), so Ctrl-C and window-size changes reach it; the others get pipes (stdin only
    when there is input) and a session of their own. The caller closes the slave end
    (``stdio["stdin"]``) once the child holds it."""
    if request.pty is not None:
        terminal, slave = os.openpty()
        set_terminal_size(terminal, *request.pty)
        return ([setsid, "--ctty", *argv],
                {"stdin": slave, "stdout": slave, "stderr": slave, "start_new_session": False},
                terminal)
    wants_stdin = request.stdin is not None or request.interactive
    return (argv, {"stdin": subprocess.PIPE if wants_stdin else subprocess.DEVNULL,
                   "stdout": subprocess.PIPE, "stderr": subprocess.PIPE,
                   "start_new_session": True}, None)


def set_terminal_size(terminal: int, rows: int, cols: int) -> None:
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class ProcessHandle:
    """Stdin (or the terminal) of a running interactive command; safe from any thread."""

    def __init__(self, proc: subprocess.Popen[bytes], terminal: int | None) -> None:
        self._proc = proc
        self._terminal = terminal
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self._lock:
            try:
                if self._terminal is not None:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(self._terminal, view):]
                elif self._proc.stdin is not None and not self._proc.stdin.closed:
                    self._proc.stdin.write(data)
                    self._proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass  # the command has ended or closed its input

    def close_stdin(self) -> None:
        with self._lock:
            if self._terminal is not None:
                with contextlib.suppress(OSError):
                    os.write(self._terminal, b"\x04")  # Ctrl-D: end of input on a terminal
            elif self._proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self._proc.stdin.close()

    def resize(self, rows: int, cols: int) -> None:
        if self._terminal is not None:
            with contextlib.suppress(OSError):
                set_terminal_size(self._terminal, rows, cols)


def pump(
    proc: subprocess.Popen[bytes], request: ExecRequest, started: float,
    terminal: int | None = None, stderr_head: StreamHead | None = None,
) -> tuple[tuple[OutputStream, OutputStream], bool]:
    """Feed stdin, read stdout and stderr (or ``terminal``, a PTY's master, which this closes)
    until they close or time runs out; True on timeout."""
    out = OutputStream.for_request("stdout", request)
    err = OutputStream.for_request("stderr", request, head=stderr_head)
    deadline = started + request.timeout_s
    if terminal is not None:
        try:
            return (out, err), pump_terminal(terminal, out, deadline)
        finally:
            os.close(terminal)
    assert proc.stdout is not None and proc.stderr is not None
    pending = memoryview(request.stdin or b"")
    timed_out = False
    # poll(2), not an epoll selector: two or three descriptors, and an epoll instance's set-up
    # and tear-down were six system calls of a short command's path.
    poller = select.poll()
    handlers: dict[int, Callable[[], None]] = {}

    def reader(fd: int, stream: OutputStream) -> Callable[[], None]:
        def handle() -> None:
            chunk = os.read(fd, READ_CHUNK)
            if chunk:
                stream.feed(chunk)
            else:
                poller.unregister(fd)
                del handlers[fd]
        return handle

    for pipe, stream in ((proc.stdout, out), (proc.stderr, err)):
        poller.register(pipe.fileno(), select.POLLIN)
        handlers[pipe.fileno()] = reader(pipe.fileno(), stream)
    stdin = proc.stdin
    if stdin is not None and not request.interactive:
        stdin_fd = stdin.fileno()
        os.set_blocking(stdin_fd, False)

        def write_stdin() -> None:
            nonlocal pending
            try:
                pending = pending[os.write(stdin_fd, pending[:READ_CHUNK]):]
            except BrokenPipeError:
                pending = memoryview(b"")
            if not pending:
                poller.unregister(stdin_fd)
                del handlers[stdin_fd]
                stdin.close()

        if pending:
            poller.register(stdin_fd, select.POLLOUT)
            handlers[stdin_fd] = write_stdin
        else:
            stdin.close()
    outputs = (proc.stdout.fileno(), proc.stderr.fileno())
    while any(fd in handlers for fd in outputs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        # Rounded up: a zero timeout would spin through the last millisecond.
        for fd, _ in poller.poll(max(1, math.ceil(remaining * 1000))):
            handler = handlers.get(fd)
            if handler is not None:
                handler()
    for stream_pipe in (proc.stdin, proc.stdout, proc.stderr):
        if stream_pipe is not None and not stream_pipe.closed:
            with contextlib.suppress(OSError):
                stream_pipe.close()
    return (out, err), timed_out


def pump_terminal(terminal: int, out: OutputStream, deadline: float) -> bool:
    """Read the PTY until every process holding it is gone; True on timeout."""
    with selectors.DefaultSelector() as sel:
        sel.register(terminal, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            if not sel.select(remaining):
                continue
            try:
                chunk = os.read(terminal, READ_CHUNK)
            except OSError:  # EIO: the last holder of the terminal closed it
                return False
            if not chunk:
                return False
            out.feed(chunk)
