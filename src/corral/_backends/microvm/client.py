"""A Corral process's connection to one microVM's keeper: requests and their answers, and the
event stream of each running command, multiplexed over one unix socket. A port connection
(``open_port``) is a unix socket of its own, a raw byte stream after its one answer line.

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
    PortClosed,
    QuotaExceeded,
    SandboxBusy,
)
from .keeper import PORT_GRACE_S
from .wire import ProtocolError, encode, read_lines, read_one

__all__ = ["AgentError", "KeeperClient", "open_port", "raise_for"]

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

    def start_exec(self, fields: dict[str, Any], *,
                   op: str = "exec") -> tuple[int, queue.Queue[dict[str, Any]]]:
        """Start a command (or, ``op="attach"``, take one over by its tag); its events
        (``started``, ``out``, ``exit``/``error``) arrive on the returned queue, the last one
        being ``exit`` or ``error``."""
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
            self._send({"id": mid, "op": op, **fields})
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


def open_port(path: Path, sandbox_id: str, port: int, timeout_s: float) -> socket.socket:
    """A fresh connection to the keeper at ``path``, which becomes (after its answer line,
    read to its newline and not a byte further) a byte stream to the connection the guest
    agent made to ``127.0.0.1:port`` inside the guest. Blocking; the caller closes it."""
    timeout = max(timeout_s, 0.01)  # (the keeper cuts a long one to what the agent allows)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # The keeper answers within timeout + its grace; past that it is hung.
        sock.settimeout(timeout + PORT_GRACE_S + 5.0)
        sock.connect(str(path))
        sock.sendall(encode({"op": "port.connect", "port": port, "timeout": timeout}))
        answer = read_one(sock, limit=64 << 10)
        sock.settimeout(None)
    except TimeoutError:
        sock.close()
        raise BackendError(f"the keeper of sandbox {sandbox_id}'s microVM did not answer a "
                           f"port connection within {timeout + PORT_GRACE_S + 5.0:.0f} s (it "
                           "may be hung)") from None
    except (OSError, ProtocolError) as exc:
        sock.close()
        raise BackendError(f"the keeper of sandbox {sandbox_id}'s microVM went away (the VM "
                           f"stopped): {exc}") from None
    if answer is None:
        sock.close()
        raise BackendError(f"the keeper of sandbox {sandbox_id}'s microVM went away (the VM "
                           "stopped)")
    if "ok" in answer:
        return sock
    sock.close()
    error = answer.get("error")
    kind = str(error.get("kind", "io")) if isinstance(error, dict) else "io"
    message = str(error.get("message", "")) if isinstance(error, dict) else str(error)
    if kind == "port_closed":
        raise PortClosed(f"nothing in sandbox {sandbox_id} accepts connections on port {port} "
                         f"({message}); start a server listening on 0.0.0.0:{port} or "
                         f"127.0.0.1:{port} there")
    if kind == "busy":
        raise QuotaExceeded(f"sandbox {sandbox_id} cannot open another connection to port "
                            f"{port}: {message}; close some first")
    raise BackendError(f"the microVM of sandbox {sandbox_id} could not open port {port}: "
                       f"{message}")
