"""Commands in flight, known after a crash: each process marks the commands it has started
and not yet finished with an empty file, ``<audit>/.inflight/<owner>/<sandbox>.<command>``
(``owner``: the process's ``PID.START``), made before the command's ``command.started`` event
and removed after its ``command.finished`` one.

A process killed (SIGKILL, the OOM killer) leaves its marks; the next recovery finds the ones
of dead owners (``abandoned``) and closes each command's story in its trail, however the
command ran: in its own cgroup, inside a gVisor resident or a microVM, or in a sandbox
destroyed since. A mark costs a create and an unlink of an empty file (no sync: a mark only
needs to survive the process, not the machine; a power loss takes the unsynced trail too).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .._core.fsafe import remove_tree

__all__ = ["Abandoned", "InFlight", "abandoned"]

logger = logging.getLogger(__name__)

_DIR = ".inflight"
_OWNER = re.compile(r"(\d+)\.(\d+)")
_MARK = re.compile(r"(sbx_[0-9a-z]{12})\.(cmd_[0-9a-f]{12})")


@dataclass(frozen=True, slots=True)
class Abandoned:
    """A command a dead process started and never finished."""

    sandbox_id: str
    command_id: str
    owner_pid: int


class InFlight:
    """This process's marks (thread-safe: one file per command, made and removed once)."""

    def __init__(self, audit_dir: Path, owner: str) -> None:
        self._dir = audit_dir / _DIR / owner
        self._made = False

    def _path(self, sandbox_id: str, command_id: str) -> Path | None:
        name = f"{sandbox_id}.{command_id}"
        return self._dir / name if _MARK.fullmatch(name) else None

    def add(self, sandbox_id: str, command_id: str) -> None:
        path = self._path(sandbox_id, command_id)
        if path is None:  # an id this process chose itself (tests): no mark, no harm
            return
        # Best effort: a mark that cannot be made (a full disk) only loses the end event a
        # crash would need; the command's own start event then says what is wrong.
        for attempt in range(2):
            try:
                if not self._made or attempt:  # again: a sweep after a pid reuse took it
                    self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                    self._made = True
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
                                 | os.O_NONBLOCK | os.O_CLOEXEC, 0o600))
                return
            except FileNotFoundError:
                continue
            except OSError as exc:
                logger.debug("command %s not marked in flight: %s", command_id, exc.strerror)
                return

    def remove(self, sandbox_id: str, command_id: str) -> None:
        path = self._path(sandbox_id, command_id)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def abandoned(audit_dir: Path, alive: Callable[[str, str], bool]) -> Iterator[Abandoned]:
    """The marks of processes ``alive(pid, start)`` says are gone, each removed once the
    caller has taken it (the loop's next step), and their directories after them. Anything
    else found there (a stray file, a FIFO) is removed without being opened."""
    root = audit_dir / _DIR
    try:
        owners = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return
    for owner in owners:
        found = _OWNER.fullmatch(owner.name)
        if found is not None and owner.is_dir(follow_symlinks=False) \
                and alive(found.group(1), found.group(2)):
            continue
        if found is not None and owner.is_dir(follow_symlinks=False):
            yield from _marks(Path(owner.path), int(found.group(1)))
        remove_tree(owner.path)


def _marks(directory: Path, pid: int) -> Iterator[Abandoned]:
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        found = _MARK.fullmatch(entry.name)
        if found is not None and entry.is_file(follow_symlinks=False):
            yield Abandoned(found.group(1), found.group(2), pid)
        remove_tree(entry.path)
