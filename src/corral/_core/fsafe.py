"""Removing and reading what Corral finds in its own state directories without ever opening a
special file there.

Opening a FIFO for reading blocks until a writer comes (and one for writing until a reader
does), a device may do anything on open, and ``shutil.rmtree(path)`` opens ``path`` itself
before it looks at what it is: a FIFO a crashed process left where a directory was expected
(the gVisor tier's ``<container>.release``) hung every later sweep, and with it every CLI call
and the service's reaper. So a sweep looks first (``lstat``) and unlinks what is not a
directory; a read opens with ``O_NONBLOCK | O_NOFOLLOW`` and reads only a regular file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path

__all__ = ["is_special", "read_regular", "remove_special", "remove_tree"]

#: the most ``read_regular`` reads unless told: the small files it is for (pid files, errors)
_READ_LIMIT = 1 << 20


def is_special(mode: int) -> bool:
    """A FIFO, a socket or a device: what a sweep must never open."""
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode) \
        or stat.S_ISBLK(mode)


def remove_tree(path: Path | str) -> None:
    """Remove ``path`` whatever it is, opening nothing but directories: a directory with all
    below it (``rmtree`` unlinks the entries it finds inside without opening them), anything
    else (a file, a symlink, a FIFO, a socket, a device) with one ``unlink``. Missing is fine;
    other errors are ignored, as ``rmtree(ignore_errors=True)`` does (the next sweep retries)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)
        return
    with contextlib.suppress(OSError):
        os.unlink(path)


def remove_special(path: Path | str) -> bool:
    """Unlink ``path`` if it is a special file (``is_special``); whether it was one."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    if not is_special(mode):
        return False
    with contextlib.suppress(OSError):
        os.unlink(path)
    return True


def read_regular(path: Path | str, limit: int = _READ_LIMIT) -> bytes | None:
    """Up to ``limit`` bytes of ``path`` if it is a regular file (not through a symlink), else
    None (missing, a directory, a FIFO, a socket, a device, unreadable). Never blocks on open:
    a special file is refused by its ``lstat`` before any open, and ``O_NONBLOCK`` covers one
    swapped in between (the type is checked again on what was opened)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY
                     | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks: list[bytes] = []
        left = limit
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)
