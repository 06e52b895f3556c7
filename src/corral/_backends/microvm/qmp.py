"""A minimal QMP client that watches a QEMU for the states that look like a hang.

QEMU that hits ``KVM internal error`` (or any error with ``werror=stop``) pauses the VM and stays
alive: the process is there, the guest answers nothing. The only sign is a ``STOP`` event (or
``GUEST_PANICKED`` for a guest that reports its panic). A reader thread records the first such
event, so every wait on the guest can check it and fail at once instead of at its deadline.
"""

from __future__ import annotations

import collections
import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import BackendError

__all__ = ["Qmp"]

# Events after which the guest will not answer again on its own.
_FATAL = {"STOP", "GUEST_PANICKED", "SHUTDOWN", "RESET"}


class Qmp:
    """Connected, capabilities negotiated, events read by a daemon thread until ``close``."""

    def __init__(self, path: Path, *, deadline: float,
                 alive: Callable[[], bool] = lambda: True) -> None:
        self._sock = _connect(path, deadline, alive)
        self._file = self._sock.makefile("rwb", buffering=0)
        self._lock = threading.Lock()
        # Replies by the id we sent: a late reply to a command that timed out, or one for
        # another thread's command, is never taken for the wrong one.
        self._replies: dict[int, dict[str, Any]] = {}
        self._next_id = 1
        self._cond = threading.Condition(self._lock)
        self.fatal: str | None = None
        # STOP events our own `stop` commands cause: not a sign of a hang.
        self._expected_stops = 0
        # The latest event names, in order (bounded: a long-lived guest sends RTC_CHANGE etc.).
        self.events: collections.deque[str] = collections.deque(maxlen=256)
        self._sock.settimeout(max(0.1, deadline - time.monotonic()))
        greeting = self._file.readline()
        if b"QMP" not in greeting:
            raise BackendError(f"QEMU's QMP socket {path} did not greet: {greeting[:200]!r}")
        self._sock.settimeout(None)
        self._thread = threading.Thread(target=self._read, name="corral-qmp", daemon=True)
        self._thread.start()
        self.command("qmp_capabilities", deadline=deadline)

    def _read(self) -> None:
        try:
            for raw in self._file:
                try:
                    message = json.loads(raw)
                except ValueError:
                    continue
                with self._cond:
                    event = message.get("event")
                    if event is not None:
                        self.events.append(str(event))
                    if event == "STOP" and self._expected_stops > 0:
                        self._expected_stops -= 1
                    elif event in _FATAL and self.fatal is None:
                        data = message.get("data") or {}
                        self.fatal = f"{event} {json.dumps(data)}" if data else str(event)
                    elif event is None and isinstance(message.get("id"), int):
                        self._replies[message["id"]] = message
                    self._cond.notify_all()
        except (OSError, ValueError):
            pass
        with self._cond:
            if self.fatal is None:
                self.fatal = "QMP connection closed (QEMU exited)"
            self._cond.notify_all()

    def command(self, name: str, *, deadline: float, **arguments: Any) -> dict[str, Any]:
        """Run one QMP command; its ``return`` value, or BackendError on error or deadline."""
        with self._cond:
            rid, self._next_id = self._next_id, self._next_id + 1
            request: dict[str, Any] = {"execute": name, "id": rid}
            if arguments:
                request["arguments"] = arguments
            if name == "stop":
                self._expected_stops += 1
            self._file.write(json.dumps(request).encode() + b"\n")
            while rid not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or (self.fatal and "closed" in self.fatal):
                    raise BackendError(f"QEMU did not answer QMP {name} "
                                       f"({self.fatal or 'deadline passed'})")
                self._cond.wait(min(left, 0.2))
            reply = self._replies.pop(rid)
        if "error" in reply:
            if name == "stop":
                with self._cond:
                    self._expected_stops = max(0, self._expected_stops - 1)
            raise BackendError(f"QMP {name} failed: {reply['error'].get('desc', reply)}")
        result: dict[str, Any] = reply.get("return") or {}
        return result

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._file.close()
        self._sock.close()
        self._thread.join(timeout=2)


def _connect(path: Path, deadline: float, alive: Callable[[], bool]) -> socket.socket:
    # QEMU creates the socket a few ms after it starts; poll for it under the caller's deadline.
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            return sock
        except OSError as exc:
            sock.close()
            if not alive():
                raise BackendError(f"QEMU exited before its QMP socket {path} accepted") from exc
            if time.monotonic() >= deadline:
                raise BackendError(f"QEMU's QMP socket {path} never accepted: {exc}") from exc
            time.sleep(0.005)
