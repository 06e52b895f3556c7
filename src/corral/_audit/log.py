"""The append-only, per-sandbox audit log: ``<home>/audit/<sandbox>.jsonl``.

Writers from any number of processes serialise on ``flock``; the sequence number continues from the
file's last line. A crash can only tear the line being written: the next writer cuts that torn tail
off (and records an ``audit.recovered`` event), and a reader that meets one skips it and says so.
Callers ask for ``sync=True`` when the events must be on disk before they go on (the end of a
command). Those syncs are committed as a group: a caller whose write an ``fdatasync`` begun
after it already covers waits for that one instead of starting its own, so the concurrent
commands of one sandbox share one sync (each still returns only once its events are on disk).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._core import flocks
from .._core.diskfull import disk_full_as_error
from .events import SCHEMA_VERSION, AuditEvent

__all__ = ["AuditLog", "AuditTrail", "Record", "follow", "read_trail"]

_TAIL_BLOCK = 64 * 1024
# A writer holds a trail's lock for one append: far less than this, unless it is stopped.
_LOCK_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class Record:
    """An event before it has a sequence number and a time."""

    type: str
    data: dict[str, Any]
    command: str | None = None


@dataclass(frozen=True, slots=True)
class AuditTrail:
    """Events read back from a log.

    Attributes:
        events: the events that passed the filters, in log order.
        torn_tail: the last line was incomplete (a write cut short by a crash) and was skipped.
        skipped: lines other than the last that could not be parsed (0 unless the file was edited).
    """

    events: list[AuditEvent]
    torn_tail: bool = False
    skipped: int = 0


def _last_line(fd: int, size: int) -> tuple[bytes, int]:
    """The last complete line of the file and the offset just after it (where a tear starts)."""
    block = _TAIL_BLOCK
    while True:
        start = max(0, size - block)
        data = os.pread(fd, size - start, start)
        end = data.rfind(b"\n")
        if end == -1:
            if start == 0:
                return b"", 0
            block *= 4
            continue
        begin = data.rfind(b"\n", 0, end)
        if begin == -1 and start > 0:
            block *= 4
            continue
        return data[begin + 1:end], start + end + 1


class AuditLog:
    """Appends events to one sandbox's log. Thread-safe; safe across processes."""

    def __init__(self, path: Path, sandbox_id: str,
                 on_write: Callable[[int], None] | None = None) -> None:
        """``on_write`` hears the file's size after each append (the budget watch): it runs
        on the writer's thread, so it must only take note."""
        self.path = path
        self.sandbox_id = sandbox_id
        self._on_write = on_write
        self._lock = threading.Lock()
        self._fd: int | None = None
        # Group commit: writes are numbered; _synced is the last number an fdatasync covered.
        self._sync_lock = threading.Lock()
        self._written = 0
        self._synced = 0
        # (file size, last seq) as of our own last write: skips re-reading the tail when no
        # other process wrote in between.
        self._known: tuple[int, int] | None = None

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                               0o600)
        return self._fd

    def _last_seq(self, fd: int) -> tuple[int, list[Record]]:
        """The last sequence number, cutting a torn tail off first."""
        size = os.fstat(fd).st_size
        if self._known is not None and self._known[0] == size:
            return self._known[1], []
        if size == 0:
            return 0, []
        line, end = self._tail(size)
        recovered: list[Record] = []
        if end < size:
            os.ftruncate(fd, end)
            recovered.append(Record("audit.recovered", {"dropped_bytes": size - end}))
        try:
            return int(json.loads(line)["seq"]), recovered
        except (ValueError, KeyError, TypeError):
            return 0, recovered

    def _tail(self, size: int) -> tuple[bytes, int]:
        read_fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return _last_line(read_fd, size)
        finally:
            os.close(read_fd)

    def append(self, records: Sequence[Record], *, sync: bool = False) -> int:
        """Write ``records`` with the next sequence numbers; return the last one written."""
        if not records:
            return 0
        with self._lock, disk_full_as_error(self.path.parent):
            fd = self._open()
            flocks.acquire(fd, timeout_s=_LOCK_WAIT_S, busy=(
                f"the audit trail of sandbox {self.sandbox_id} ({self.path}) has been locked "
                f"by another process for {_LOCK_WAIT_S:.0f} s: a Corral process holding it is "
                f"stopped or stuck (find it with `fuser {self.path}`, then resume or kill it); "
                "retry afterwards"))
            try:
                seq, recovered = self._last_seq(fd)
                now = time.time()
                lines = []
                for record in [*recovered, *records]:
                    seq += 1
                    lines.append(json.dumps({
                        "v": SCHEMA_VERSION, "seq": seq, "ts": now, "sandbox": self.sandbox_id,
                        "command": record.command, "type": record.type, "data": record.data,
                    }, ensure_ascii=False, separators=(",", ":")))
                payload = ("\n".join(lines) + "\n").encode()
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view):]
                size = os.fstat(fd).st_size
                self._known = (size, seq)
                self._written += 1
                ticket = self._written
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        if self._on_write is not None:
            self._on_write(size)
        if sync:
            self._sync_through(ticket)
        return seq

    def _sync_through(self, ticket: int) -> None:
        """Return once write ``ticket`` is on disk: by an ``fdatasync`` of our own, or one
        that began after that write (its caller waited here meanwhile)."""
        with self._sync_lock:
            if self._synced >= ticket:
                return
            with self._lock:
                covered, fd = self._written, self._fd
            if fd is not None:
                os.fdatasync(fd)
            self._synced = covered

    def sync(self) -> None:
        with self._lock:
            ticket = self._written
        self._sync_through(ticket)

    def close(self) -> None:
        with self._sync_lock, self._lock:
            if self._fd is not None:
                if self._synced < self._written:  # a writer between its write and its sync
                    os.fdatasync(self._fd)
                    self._synced = self._written
                os.close(self._fd)
                self._fd = None
                self._known = None


def _parse(lines: Iterable[bytes], *, final_complete: bool) -> tuple[list[AuditEvent], bool, int]:
    events: list[AuditEvent] = []
    items = list(lines)
    torn = False
    skipped = 0
    for index, raw in enumerate(items):
        if not raw.strip():
            continue
        try:
            events.append(AuditEvent.model_validate_json(raw))
        except ValueError:
            if index == len(items) - 1 and not final_complete:
                torn = True
            else:
                skipped += 1
    return events, torn, skipped


def read_trail(
    path: Path,
    *,
    types: Iterable[str] | None = None,
    since: float | None = None,
    until: float | None = None,
    command: str | None = None,
) -> AuditTrail:
    """Read a log back, filtered by event type (exact or ``prefix.*``), time and command."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return AuditTrail(events=[])
    complete = data.endswith(b"\n")
    events, torn, skipped = _parse(data.split(b"\n"), final_complete=complete)
    match = _matcher(types, since, until, command)
    return AuditTrail(events=[e for e in events if match(e)], torn_tail=torn, skipped=skipped)


def _matcher(
    types: Iterable[str] | None, since: float | None, until: float | None, command: str | None
) -> Callable[[AuditEvent], bool]:
    wanted = list(types or [])

    def match(event: AuditEvent) -> bool:
        if wanted and not any(
            event.type == t or (t.endswith(".*") and event.type.startswith(t[:-1]))
            or (t.endswith(".") and event.type.startswith(t))
            for t in wanted
        ):
            return False
        if since is not None and event.ts < since:
            return False
        if until is not None and event.ts > until:
            return False
        return command is None or event.command == command

    return match


def follow(
    path: Path,
    *,
    types: Iterable[str] | None = None,
    command: str | None = None,
    poll_s: float = 0.2,
    stop: Callable[[], bool] | None = None,
    heartbeat_s: float | None = None,
    start: int = 0,
) -> Iterator[AuditEvent | None]:
    """Yield events as they are appended, from the start (or byte offset ``start``, a line's
    beginning: ``tail_offset``), until ``sandbox.destroyed``.

    ``stop`` is an optional callable; when it returns True the generator ends. With
    ``heartbeat_s``, None is yielded after that long without events (so a consumer can notice
    its client left).
    """
    for batch in follow_batches(path, types=types, command=command, poll_s=poll_s, stop=stop,
                                heartbeat_s=heartbeat_s, start=start):
        if batch:
            yield from batch
        else:
            yield None


def follow_batches(
    path: Path,
    *,
    types: Iterable[str] | None = None,
    command: str | None = None,
    poll_s: float = 0.2,
    stop: Callable[[], bool] | None = None,
    heartbeat_s: float | None = None,
    start: int = 0,
) -> Iterator[list[AuditEvent]]:
    """``follow``, each read's events at once (a page of a long trail in one piece, not one
    write per event); an empty list is the heartbeat."""
    quiet_since = time.monotonic()
    match = _matcher(types, None, None, command)
    offset = start
    pending = b""
    while True:
        with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
            offset += len(chunk)
            pending += chunk
        *complete, pending = pending.split(b"\n")
        finished = False
        batch = []
        for raw in complete:
            if not raw.strip():
                continue
            try:
                event = AuditEvent.model_validate_json(raw)
            except ValueError:
                continue
            if match(event):
                batch.append(event)
            finished = finished or event.type == "sandbox.destroyed"
        if batch:
            yield batch
            quiet_since = time.monotonic()
        if finished or (stop is not None and stop()):
            return
        if heartbeat_s is not None and time.monotonic() - quiet_since >= heartbeat_s:
            quiet_since = time.monotonic()
            yield []
        time.sleep(poll_s)


def tail_offset(path: Path, count: int, *, block: int = 1 << 16) -> int:
    """The byte offset where the last ``count`` lines of ``path`` begin (0 for fewer), found
    reading backwards, so a long trail's end is reached without reading all of it."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return 0
    with f:
        end = f.seek(0, os.SEEK_END)
        position, newlines = end, 0
        # A complete last line ends with a newline: that one does not start a line.
        if end and (f.seek(end - 1), f.read(1))[1] == b"\n":
            newlines = -1
        while position > 0:
            step = min(block, position)
            position -= step
            f.seek(position)
            chunk = f.read(step)
            for index in range(len(chunk) - 1, -1, -1):
                if chunk[index] == 0x0A:
                    newlines += 1
                    if newlines == count:
                        return position + index + 1
        return 0
