"""Commands in flight, known after a crash: each process keeps one journal,
``<audit>/.inflight/<owner>`` (``owner``: the process's ``PID.START``), where a line
``+<sandbox>.<command>`` is appended before a command's ``command.started`` event and a line
``-<sandbox>.<command>`` after its ``command.finished`` one. When nothing is in flight the
journal is emptied (one ``ftruncate``); past ``_COMPACT_BYTES`` it is rewritten with only the
commands still in flight, so it stays small on a service that always runs something.

A process killed (SIGKILL, the OOM killer) leaves its journal; the next recovery reads the ones
of dead owners (``abandoned``) and closes each unfinished command's story in its trail, however
the command ran: in its own cgroup, inside a gVisor resident or a microVM, or in a sandbox
destroyed since. A command costs two appends to an open file (no sync: the journal only needs
to survive the process, not the machine; a power loss takes the unsynced trail too), where a
file made and removed per command cost a tenth of a millisecond of file-system metadata.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .._core.fsafe import read_regular, remove_tree

__all__ = ["Abandoned", "InFlight", "abandoned", "unfinished"]

logger = logging.getLogger(__name__)

_DIR = ".inflight"
_OWNER = re.compile(r"(\d+)\.(\d+)")
_MARK = re.compile(r"(sbx_[0-9a-z]{12})\.(cmd_[0-9a-f]{12})")
# Rewritten with only what is in flight past this size; read back at most this much again.
_COMPACT_BYTES = 256 * 1024
_READ_LIMIT = 4 * _COMPACT_BYTES


@dataclass(frozen=True, slots=True)
class Abandoned:
    """A command a dead process started and never finished."""

    sandbox_id: str
    command_id: str
    owner_pid: int


class InFlight:
    """This process's journal (thread-safe)."""

    def __init__(self, audit_dir: Path, owner: str) -> None:
        self._path = audit_dir / _DIR / owner
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._fd: int | None = None
        self._open: set[str] = set()
        self._size = 0

    def add(self, sandbox_id: str, command_id: str) -> None:
        name = f"{sandbox_id}.{command_id}"
        if not _MARK.fullmatch(name):  # an id this process chose itself (tests): no mark
            return
        with self._lock:
            # Best effort: a line that cannot be written (a full disk) only loses the end
            # event a crash would need; the command's own start event says what is wrong.
            if self._write(f"+{name}\n"):
                self._open.add(name)

    def remove(self, sandbox_id: str, command_id: str) -> None:
        name = f"{sandbox_id}.{command_id}"
        with self._lock:
            if name not in self._open:
                return
            self._open.discard(name)
            self._settled.notify_all()
            assert self._fd is not None
            if not self._open:
                try:
                    os.ftruncate(self._fd, 0)
                    self._size = 0
                    return
                except OSError:
                    pass
            self._write(f"-{name}\n")
            if self._size > _COMPACT_BYTES:
                self._compact()

    def settle(self, sandbox_id: str, timeout_s: float) -> bool:
        """Wait until none of ``sandbox_id``'s commands of this process is in flight (their
        ends are in its trail), at most ``timeout_s``; whether none is. A destroy waits so
        that ``sandbox.destroyed`` is its trail's last event: the commands it killed finish
        on their own threads."""
        prefix = f"{sandbox_id}."
        with self._settled:
            return self._settled.wait_for(
                lambda: not any(name.startswith(prefix) for name in self._open), timeout_s)

    def _write(self, line: str) -> bool:
        try:
            if self._fd is None:
                self._path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                                   | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
            data = line.encode()
            os.write(self._fd, data)
            self._size += len(data)
            return True
        except OSError as exc:
            logger.debug("in-flight journal %s not written: %s", self._path, exc.strerror)
            return False

    def _compact(self) -> None:
        """The journal anew, with only the commands in flight (a rename: never torn)."""
        data = "".join(f"+{name}\n" for name in sorted(self._open)).encode()
        fresh = self._path.with_name(f".{self._path.name}.new")
        try:
            fd = os.open(fresh, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC
                         | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.write(fd, data)
            os.rename(fresh, self._path)
        except OSError as exc:
            logger.debug("in-flight journal %s not compacted: %s", self._path, exc.strerror)
            return
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._size = fd, len(data)


def unfinished(journal: bytes) -> list[str]:
    """``sandbox.command`` of every command a journal shows started and not finished, in
    the order they started (malformed lines are ignored)."""
    started: dict[str, None] = {}
    for line in journal.decode(errors="replace").splitlines():
        name = line[1:]
        if not _MARK.fullmatch(name):
            continue
        if line.startswith("+"):
            started[name] = None
        elif line.startswith("-"):
            started.pop(name, None)
    return list(started)


def abandoned(audit_dir: Path, alive: Callable[[str, str], bool]) -> Iterator[Abandoned]:
    """The unfinished commands in the journals of processes ``alive(pid, start)`` says are
    gone; each journal is removed once the caller has taken all of its commands. Anything
    else found there (a directory, a stray file, a FIFO) is removed without being opened."""
    root = audit_dir / _DIR
    try:
        owners = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return
    for owner in owners:
        found = _OWNER.fullmatch(owner.name)
        if found is not None and alive(found.group(1), found.group(2)):
            continue
        if found is not None:
            # A regular file only (read_regular opens nothing else, never blocks).
            journal = read_regular(owner.path, limit=_READ_LIMIT) or b""
            for name in unfinished(journal):
                sandbox_id, _, command_id = name.partition(".")
                yield Abandoned(sandbox_id, command_id, int(found.group(1)))
        remove_tree(owner.path)
