"""A full data disk, told apart from other failures and said the same way everywhere: as
``DiskFullError`` (HTTP 507), naming the disk and what frees space.

A full disk shows up as ENOSPC or EDQUOT from a system call, as SQLite's "database or disk is
full", or as "No space left on device" in a tool's error output; each layer that meets one
turns it into the one error (``disk_full_as_error``), so every surface reports it alike.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from ..errors import CorralError, DiskFullError

__all__ = ["DiskReserve", "disk_full_as_error", "free_bytes", "insufficient", "is_disk_full"]

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_FULL_TEXTS = ("no space left on device", "database or disk is full", "disk quota exceeded")
#: What frees space, as the error says it.
REMEDY = ("free space on it: destroy sandboxes (`corral rm`), delete snapshots (`corral "
          "snapshots rm`) or volumes (`corral volumes rm`), prune old audit trails (`corral "
          "audit prune`); deleting works on a full disk")


def is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, DiskFullError):
        return True
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        return True
    if isinstance(exc, sqlite3.OperationalError | CorralError):
        return any(text in str(exc).lower() for text in _FULL_TEXTS)
    return False


def insufficient(where: Path | str, detail: str = "") -> DiskFullError:
    return DiskFullError(f"the disk holding {where} is full"
                               + (f" ({detail})" if detail else "") + f"; {REMEDY}")


def free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


@contextlib.contextmanager
def disk_full_as_error(where: Path | str) -> Iterator[None]:
    """Re-raise a full disk met in the block as ``DiskFullError``."""
    try:
        yield
    except DiskFullError:
        raise
    except (OSError, sqlite3.OperationalError, CorralError) as exc:
        if not is_disk_full(exc):
            raise
        raise insufficient(where, str(exc)[:200]) from exc


class DiskReserve:
    """A few MiB of the data directory's disk held back as a preallocated file, given up when
    the disk is nearly full and something that frees space begins (a destroy, a snapshot's or
    a volume's delete): its store rows and audit lines then still have room. Taken back once
    there is space again (``ensure``, on every reaper pass)."""

    SIZE = 16 * 1024 * 1024

    def __init__(self, home: Path) -> None:
        self._home = home
        self._path = home / ".disk-reserve"

    def ensure(self) -> None:
        """Hold the reserve again, when the disk has room for it and more."""
        if self._path.exists() or free_bytes(self._home) < 4 * self.SIZE:
            return
        temp = self._path.with_name(f"{self._path.name}.new")
        with contextlib.suppress(OSError):
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.SIZE)
            finally:
                os.close(fd)
            os.rename(temp, self._path)
        temp.unlink(missing_ok=True)

    def release_if_short(self) -> None:
        """Give the reserve up when the disk is nearly full (before a write that frees)."""
        if free_bytes(self._home) < 2 * self.SIZE:
            self._path.unlink(missing_ok=True)
