"""A Corral process's connection to one microVM's keeper: requests and their answers, and the
event stream of each running command, multiplexed over one unix socket.

One reader thread per connection routes every message by id. Events of a command go to a queue
its ``exec`` caller drains in its own thread, so a slow consumer (a callback writing to a slow
HTTP client) never holds up another command's output or a file operation.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import (
    BackendError,
    CommandError,
    FileError,
    FileNotFound,
    PathRefused,
    QuotaExceeded,
    SandboxBusy,
)
from .wire import ProtocolError, encode, read_lines

__all__ = ["AgentError", "KeeperClient", "raise_for"]

# The longest any single request (not a command) may take before the VM counts as hung.
REQUEST_TIMEOUT_S = 60.0


class AgentError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def raise_for(error: object) -> None:
    """Raise the Corral error for an agent ``error`` object."""
    if not isinstance(error, dict):
        raise BackendError(f"the microVM agent failed: {error!r}")
    kind, message = str(error.get("kind", "io")), str(error.get("message", "no message"))
    if kind == "not_found":
        raise FileNotFound(message)
    if kind == "refused":
        raise PathRefused(message)
    if kind in ("too_large", "no_space"):
        raise QuotaExceeded(message)  # as the host tiers' WorkspaceFiles says both
    if kind in ("not_dir", "is_dir", "exists"):
        raise FileError(message)
    if kind == "busy":
        raise SandboxBusy(message)
    if kind in ("cwd", "e2big"):
        raise CommandError(message)
    raise BackendError(f"the microVM agent failed: {message}")


class KeeperClient:
    """Connected to ``path``; ``closed`` once the keeper went away (then every call fails)."""

    def __init__(self, path: Path, *, timeout: float = 5.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(str(path))
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(None)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._waiters: dict[int, Callable[[dict[str, Any]], None]] = {}
        self.closed = False
        self._reader = threading.Thread(target=self._read, daemon=True, name="corral-keeper")
        self._reader.start()

    def _read(self) -> None:
        try:
            for message in read_lines(self._sock):
                mid = message.get("id")
                with self._lock:
                    waiter = self._waiters.get(mid) if isinstance(mid, int) else None
                if waiter is not None:
                    waiter(message)
        except ProtocolError:
            pass
        with self._lock:
            self.closed = True
            waiters = list(self._waiters.items())
            self._waiters.clear()
        gone = {"kind": "io", "message": "the microVM's keeper went away (the VM stopped)"}
        for mid, waiter in waiters:
            waiter({"id": mid, "error": gone})

    def _send(self, message: dict[str, Any]) -> None:
        data = encode(message)
        with self._send_lock:
            try:
                self._sock.sendall(data)
            except OSError as exc:
                raise BackendError(f"the microVM's keeper went away: {exc}") from None

    def call(self, op: str, *, timeout: float = REQUEST_TIMEOUT_S, **fields: Any) -> Any:
        """Send one request and return its ``ok`` value; agent errors become Corral errors.
        Long listings come as ``more`` batches before the ``ok``: they are joined here."""
        box: queue.Queue[dict[str, Any]] = queue.Queue()
        batches: list[Any] = []
        mid = next(self._ids)

        def deliver(message: dict[str, Any]) -> None:
            more = message.get("more")
            if isinstance(more, list) and "ok" not in message and "error" not in message:
                batches.extend(more)
            else:
                box.put(message)

        with self._lock:
            if self.closed:
                raise BackendError("the microVM's keeper went away (the VM stopped)")
            self._waiters[mid] = deliver
        try:
            self._send({"id": mid, "op": op, **fields})
            try:
                answer = box.get(timeout=timeout)
            except queue.Empty:
                raise BackendError(f"the microVM did not answer {op} within {timeout:.0f} s "
                                   "(it may be hung)") from None
        finally:
            with self._lock:
                self._waiters.pop(mid, None)
        if "error" in answer:
            raise_for(answer["error"])
        result = answer.get("ok")
        if batches and isinstance(result, list):
            return batches + result
        return result

    def start_exec(self, fields: dict[str, Any]) -> tuple[int, queue.Queue[dict[str, Any]]]:
        """Start a command; its events (``started``, ``out``, ``exit``/``error``) arrive on the
        returned queue, the last one being ``exit`` or ``error``."""
        events: queue.Queue[dict[str, Any]] = queue.Queue()
        mid = next(self._ids)

        def deliver(message: dict[str, Any]) -> None:
            events.put(message)
            if "exit" in message or "error" in message:
                with self._lock:
                    self._waiters.pop(mid, None)

        with self._lock:
            if self.closed:
                raise BackendError("the microVM's keeper went away (the VM stopped)")
            self._waiters[mid] = deliver
        try:
            self._send({"id": mid, "op": "exec", **fields})
        except BaseException:
            with self._lock:
                self._waiters.pop(mid, None)
            raise
        return mid, events

    def notify(self, op: str, **fields: Any) -> None:
        """Send a request whose answer does not matter (stdin, resize, kill of a command)."""
        mid = next(self._ids)
        with self._lock:
            if self.closed:
                return
            self._waiters[mid] = lambda _m: self._forget(mid)
        with contextlib.suppress(BackendError):
            self._send({"id": mid, "op": op, **fields})

    def _forget(self, mid: int) -> None:
        with self._lock:
            self._waiters.pop(mid, None)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
