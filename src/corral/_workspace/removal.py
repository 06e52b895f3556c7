"""Delete a directory tree a hostile sandbox built and may be changing while we delete it.

Iterative, so no depth (a sandbox can nest directories as deep as its disk allows) exhausts the
Python stack, and holding at most ``MAX_OPEN`` directory descriptors, so no depth exhausts the
process's descriptors either. Every directory is opened one component at a time from its
parent's descriptor with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV)``:
no symlink is ever followed and no other filesystem entered, so a swap meanwhile can make the
delete fail, never make it delete outside the tree.
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
        for entry in it:
            if entry.is_dir(follow_symlinks=False):
                level.pending.append(entry.name)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=level.fd)


def remove_tree(dir_fd: int, name: str) -> None:
    """``rm -r`` of the directory ``name`` in ``dir_fd``, never following a symlink.

    Raises:
        OSError: as the failing call raised it (the caller maps it), including ``ENOTEMPTY``
            when the sandbox keeps adding entries, and ``ESTALE`` when a directory was swapped
            for another while its descriptor was closed.
    """
    first = _open_child(dir_fd, name)
    stack = [_Level(name, _ident(first), first)]
    try:
        _empty_files(stack[0])
        while stack:
            level = stack[-1]
            if level.pending:
                child_name = level.pending.pop()
                fd = _open_child(_reopen(dir_fd, stack), child_name)
                stack.append(_Level(child_name, _ident(fd), fd))
                _close_oldest(stack)
                _empty_files(stack[-1])
                continue
            stack.pop()
            if level.fd is not None:
                os.close(level.fd)
                level.fd = None
            parent = _reopen(dir_fd, stack) if stack else dir_fd
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(level.name, dir_fd=parent)
    finally:
        for level in stack:
            if level.fd is not None:
                os.close(level.fd)


def _close_oldest(stack: list[_Level]) -> None:
    open_levels = [level for level in stack if level.fd is not None]
    for level in open_levels[: max(0, len(open_levels) - MAX_OPEN)]:
        assert level.fd is not None
        os.close(level.fd)
        level.fd = None


def _reopen(dir_fd: int, stack: list[_Level]) -> int:
    """The descriptor of the deepest level, reopening closed levels from the nearest open
    ancestor (or ``dir_fd``) by name; each must still be the directory it was."""
    if stack[-1].fd is not None:
        return stack[-1].fd
    start = len(stack) - 1
    while start > 0 and stack[start - 1].fd is None:
        start -= 1
    # Reopen up to MAX_OPEN levels and keep them, so popping back up costs one walk from an
    # open ancestor per MAX_OPEN levels rather than one per level.
    keep_from = max(start, len(stack) - MAX_OPEN)
    base = dir_fd if start == 0 else stack[start - 1].fd
    assert base is not None
    held: int | None = None
    try:
        for index in range(start, len(stack)):
            level = stack[index]
            fd = _open_child(base if held is None else held, level.name)
            if held is not None:
                os.close(held)
            held = fd
            if _ident(fd) != level.ident:
                raise OSError(errno.ESTALE, "a directory was replaced while being removed",
                              level.name)
            if index >= keep_from:
                level.fd = os.dup(fd)
    finally:
        if held is not None:
            os.close(held)
    result = stack[-1].fd
    assert result is not None
    return result
