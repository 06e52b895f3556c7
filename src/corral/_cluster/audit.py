"""Audit shipping: every node's audit lines, copied as they are written to a sink that outlives
the node, so a lost sandbox's trail still reads back to its last committed event.

The node side (``Shipper``) tails its data directory's ``audit/<sandbox>.jsonl`` files on a
thread, every ``interval_s``, and sends each file's new *complete* lines with the offset they
start at. The sink (``AuditSink``, a detached actor the gateway pins to its own node) appends
them to ``<gateway home>/audit/<sandbox>.jsonl`` only at that exact offset, so a resend after a
lost answer, or a second shipper, never duplicates or reorders a line; the shipper advances its
offset only once the sink has answered. Lines are the node's own bytes: the sink's copy reads
back with the same reader (``read_trail``) as any audit log.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

from .._audit.log import AuditTrail, read_trail

__all__ = ["AuditSink", "Shipper"]

_MAX_BATCH = 4 << 20


class AuditSink:
    """The durable copy of every node's audit lines, in one directory."""

    def __init__(self, directory: str) -> None:
        self._dir = Path(directory)
        self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.Lock()

    def _path(self, sandbox_id: str) -> Path:
        if not sandbox_id or "/" in sandbox_id or sandbox_id.startswith("."):
            raise ValueError(f"not a sandbox id: {sandbox_id!r}")
        return self._dir / f"{sandbox_id}.jsonl"

    def append(self, sandbox_id: str, offset: int, data: bytes) -> int:
        """Append ``data`` if it starts where the copy ends; returns the copy's size (the
        offset the shipper should continue from)."""
        path = self._path(sandbox_id)
        with self._lock:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            try:
                size = os.fstat(fd).st_size
                if offset == size and data:
                    os.write(fd, data)
                    os.fsync(fd)
                    size += len(data)
                return size
            finally:
                os.close(fd)

    def size(self, sandbox_id: str) -> int:
        with contextlib.suppress(FileNotFoundError):
            return self._path(sandbox_id).stat().st_size
        return 0

    def trail(self, sandbox_id: str) -> AuditTrail:
        return read_trail(self._path(sandbox_id))


class Shipper:
    """Tails one data directory's audit logs and sends new complete lines to a sink."""

    def __init__(self, directory: Path, send: Callable[[str, int, bytes], int],
                 resume: Callable[[str], int], interval_s: float = 0.1) -> None:
        self._dir = directory
        self._send = send
        self._resume = resume
        self._interval_s = interval_s
        self._offsets: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="corral-audit-ship",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            with contextlib.suppress(Exception):  # the sink is away: try again next round
                self.ship()

    def ship(self) -> None:
        """Send what is new in every log (also called once more on close)."""
        for path in sorted(self._dir.glob("*.jsonl")):
            sandbox_id = path.name[:-len(".jsonl")]
            if sandbox_id not in self._offsets:
                self._offsets[sandbox_id] = self._resume(sandbox_id)
            offset = self._offsets[sandbox_id]
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(_MAX_BATCH)
            complete = data[:data.rfind(b"\n") + 1]  # never a line still being written
            if complete:
                self._offsets[sandbox_id] = self._send(sandbox_id, offset, complete)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self.ship()
