"""Delete a directory tree a hostile sandbox built and may be changing while we delete it.

Iterative, so no depth (a sandbox can nest directories as deep as its disk allows) exhausts the
Python stack, and holding at most ``MAX_OPEN`` directory descriptors, so no depth exhausts the
process's descriptors either. On the way down every directory is opened one component at a time
from its parent's descriptor with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
RESOLVE_NO_XDEV)``: no symlink is ever followed and no other filesystem entered. On the way up a
parent whose descriptor was closed is reopened as ``..`` of its child and used only if it is the
same directory (device and inode) it was on the way down. So a swap meanwhile can make the delete
fail, never make it delete outside the tree.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass, field

from .._core import linux

__all__ = ["MAX_OPEN", "remove_tree"]

MAX_OPEN = 64
_RESOLVE_NO_SYMLINKS = 0x04  # <linux/openat2.h>
_RESOLVE = (linux.RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | linux.RESOLVE_NO_MAGICLINKS
            | linux.RESOLVE_NO_XDEV)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(slots=True)
class _Level:
    """One directory on the way down: its name in its parent, its identity, and the
    subdirectories still to empty. ``fd`` is None while closed to stay under ``MAX_OPEN``."""

    name: str
    ident: tuple[int, int]
    fd: int | None
    pending: list[str] = field(default_factory=list)


def _open_child(dir_fd: int, name: str) -> int:
    for _ in range(16):
        try:
            return linux.openat2(dir_fd, name, _DIR_FLAGS, 0, _RESOLVE)
        except OSError as exc:
            if exc.errno != errno.EAGAIN:  # a concurrent rename; the kernel asks to retry
                raise
    raise OSError(errno.EAGAIN, "kept changing while being removed", name)


def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _empty_files(level: _Level) -> None:
    """Unlink everything in the directory but its subdirectories, which it queues."""
    assert level.fd is not None
    with os.scandir(level.fd) as it:
        entries = list(it)  # read whole before unlinking: no readdir over a changing directory
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            level.pending.append(entry.name)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.name, dir_fd=level.fd)


def remove_tree(dir_fd: int, name: str) -> None:
    """``rm -r`` of the directory ``name`` in ``dir_fd``, never following a symlink.

    Raises:
        OSError: as the failing call raised it (the caller maps it), including ``ENOTEMPTY``
            when the sandbox keeps adding entries, and ``ESTALE`` when a directory whose
            descriptor was closed on the way down is no longer the parent on the way up.
    """
    first = _open_child(dir_fd, name)
    stack = [_Level(name, _ident(first), first)]
    try:
        _empty_files(stack[0])
        while stack:
            level = stack[-1]
            assert level.fd is not None  # the deepest level is always open
            if level.pending:
                child = level.pending.pop()
                fd = _open_child(level.fd, child)
                stack.append(_Level(child, _ident(fd), fd))
                if len(stack) > MAX_OPEN and (oldest := stack[-MAX_OPEN - 1]).fd is not None:
                    os.close(oldest.fd)
                    oldest.fd = None
                _empty_files(stack[-1])
                continue
            stack.pop()
            if stack and stack[-1].fd is None:
                stack[-1].fd = _parent_of(level.fd, stack[-1].ident)
            os.close(level.fd)
            level.fd = None
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(level.name, dir_fd=stack[-1].fd if stack else dir_fd)
    finally:
        for level in stack:
            if level.fd is not None:
                os.close(level.fd)


def _parent_of(fd: int, ident: tuple[int, int]) -> int:
    """The parent of the directory ``fd``, which must be the directory ``ident`` it was when it
    was opened on the way down: the sandbox may have moved things since, and anything else
    (another directory, somewhere outside) is refused before it is used."""
    parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
    if _ident(parent) != ident:
        os.close(parent)
        raise OSError(errno.ESTALE, "a directory moved while its tree was being removed")
    return parent
