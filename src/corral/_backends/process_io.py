"""What both tiers do with a running command's standard streams: feed stdin, read stdout and
stderr (or the terminal) under a deadline, keep a capped, decoded copy of each, and hand
interactive callers a handle to write, close and resize."""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import os
import selectors
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..backends import ExecRequest, OutputCallback, OutputCut

__all__ = ["OutputStream", "ProcessHandle", "pump", "set_terminal_size"]

READ_CHUNK = 65536


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

    def feed(self, data: bytes) -> None:
        room = self.limit - self.kept
        kept = data[:max(room, 0)]
        if kept:
            self.kept += len(kept)
            self.raw += kept
            self._emit(self.decoder.decode(kept))
        if len(data) > len(kept):
            if not self.dropped and self.callback is not None:
                # Said live, when it happens (not only in the final text); not kept output.
                self._emit(self.decoder.decode(b"", final=True))
                self.callback(OutputCut(self.name, self.limit))
            self.dropped += len(data) - len(kept)

    def finish(self) -> str:
        self._emit(self.decoder.decode(b"", final=True))
        text = "".join(self.parts)
        if self.dropped:
            text += (
                f"\n[corral: {self.name} truncated: {self.dropped} more bytes dropped; "
                f"{self.limit} bytes are kept per stream]\n"
            )
        return text

    def _emit(self, text: str) -> None:
        if text:
            self.parts.append(text)
            if self.callback is not None:
                self.callback(text)


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
    proc: subprocess.Popen[bytes], request: ExecRequest, started: float
) -> tuple[tuple[OutputStream, OutputStream], bool]:
    """Feed stdin, read stdout and stderr (or the terminal) until they close or time runs out;
    True on timeout."""
    out = OutputStream("stdout", request.output_limit_bytes, request.on_stdout)
    err = OutputStream("stderr", request.output_limit_bytes, request.on_stderr)
    deadline = started + request.timeout_s
    terminal: int | None = getattr(proc, "terminal", None)
    if terminal is not None:
        try:
            return (out, err), pump_terminal(terminal, out, deadline)
        finally:
            os.close(terminal)
    assert proc.stdout is not None and proc.stderr is not None
    pending = memoryview(request.stdin or b"")
    timed_out = False
    with selectors.DefaultSelector() as sel:
        handlers: dict[int, Callable[[], None]] = {}

        def reader(fd: int, stream: OutputStream) -> Callable[[], None]:
            def handle() -> None:
                chunk = os.read(fd, READ_CHUNK)
                if chunk:
                    stream.feed(chunk)
                else:
                    sel.unregister(fd)
                    del handlers[fd]
            return handle

        for pipe, stream in ((proc.stdout, out), (proc.stderr, err)):
            sel.register(pipe.fileno(), selectors.EVENT_READ)
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
                    sel.unregister(stdin_fd)
                    del handlers[stdin_fd]
                    stdin.close()

            if pending:
                sel.register(stdin_fd, selectors.EVENT_WRITE)
                handlers[stdin_fd] = write_stdin
            else:
                stdin.close()
        outputs = (proc.stdout.fileno(), proc.stderr.fileno())
        while any(fd in handlers for fd in outputs):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(remaining):
                handler = handlers.get(key.fd)
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
