"""Watching a workspace directory from the host with inotify (ctypes on libc, no dependency).

Both host tiers keep the workspace as a host mount that the sandbox's processes write through
(bind-mounted by bwrap, served by runsc's gofer), so one inotify instance on the host side
sees what commands inside do. The watch never trusts a path string: every directory is opened
with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | ...)`` from the workspace root and the
watch is placed on that descriptor (through ``/proc/self/fd``), so a symlink or a swapped
directory can neither redirect it out of the workspace nor make it follow a link.

Events are translated the way Go's fsnotify does (the library envd is built on), so the E2B
SDKs see what they expect: ``IN_CREATE``/``IN_MOVED_TO`` → create, ``IN_MODIFY`` → write,
``IN_DELETE`` → remove, ``IN_MOVED_FROM`` → rename, ``IN_ATTRIB`` → chmod.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import posixpath
import struct
from collections.abc import Callable
from pathlib import Path

from .._core import linux
from ..backends import WatchEvent, WatchOp
from ..errors import FileError, FileNotFound, PathRefused

__all__ = ["MAX_WATCHED_DIRS", "InotifyWatch"]

logger = logging.getLogger(__name__)

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_RESOLVE_NO_SYMLINKS = 0x04

_MASK = (IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
         | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK)
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (struct inotify_event)
#: A recursive watch covers at most this many directories; deeper trees are watched in part
#: (and logged), so one sandbox cannot take the host's whole inotify budget.
MAX_WATCHED_DIRS = 4096
#: Events kept between two reads; the kernel's own queue (fs.inotify.max_queued_events) sits
#: behind it, and past either the surplus is dropped and counted.
MAX_PENDING = 8192
_READ_BYTES = 64 * 1024
# The files API writes through a temporary name and renames it into place: its traffic is an
# implementation detail the watcher hides (the rename shows as create + write of the target).
_TEMP_PREFIX = ".corral-tmp-"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]


def _os_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


class InotifyWatch:
    """A ``DirWatch`` over one directory of a workspace mounted at ``root`` on the host.

    Args:
        root: host path of the workspace.
        rel: the watched directory, relative to ``root`` (``.`` for the workspace itself).
        recursive: also watch every directory under it, as they appear.
        shown: turns a relative path into the name reported in errors.
    """

    def __init__(self, root: Path, rel: str, *, recursive: bool,
                 shown: Callable[[str], str]) -> None:
        self._root = root
        self._recursive = recursive
        self._shown = shown
        self._paths: dict[int, str] = {}  # watch descriptor -> dir relative to the watched one
        self._top = rel
        self._pending: list[WatchEvent] = []
        self._dropped = 0
        self._ended = False
        self._capped = False
        self._temp_cookies: set[int] = set()  # renames away from a files-API temp name
        self._fd: int = int(_libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC))
        if self._fd < 0:
            raise FileError(f"cannot watch {shown(rel)}: {_os_error('inotify_init1').strerror}; "
                            "raise fs.inotify.max_user_instances on the host")
        try:
            self._add(rel, "", top=True)
        except BaseException:
            os.close(self._fd)
            raise

    # -- DirWatch ----------------------------------------------------------------------------

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def dropped(self) -> int:
        return self._dropped

    def fileno(self) -> int:
        return self._fd

    def read(self) -> list[WatchEvent]:
        if self._fd >= 0:
            self._drain()
        events, self._pending = self._pending, []
        return events

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # the kernel drops every watch of the instance with it
            self._fd = -1
        self._ended = True

    def __enter__(self) -> InotifyWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- watches -----------------------------------------------------------------------------

    def _add(self, rel: str, inside: str, *, top: bool = False) -> None:
        """Watch the directory ``rel`` (of the workspace), reported as ``inside`` (relative to
        the watched directory); with ``recursive``, its subdirectories too, iteratively."""
        todo = [(rel, inside)]
        while todo:
            rel, inside = todo.pop()
            if len(self._paths) >= MAX_WATCHED_DIRS:
                if not self._capped:
                    self._capped = True
                    logger.warning("a recursive watch of %s reached %d directories; deeper "
                                   "ones are not watched", self._shown(self._top),
                                   MAX_WATCHED_DIRS)
                return
            try:
                fd = self._open_dir(rel)
            except OSError as exc:
                if top:
                    raise self._refused(rel, exc) from None
                continue  # vanished or swapped for a link meanwhile: nothing to watch
            try:
                wd = _libc.inotify_add_watch(self._fd, f"/proc/self/fd/{fd}".encode(), _MASK)
                if wd < 0:
                    err = _os_error("inotify_add_watch")
                    if top:
                        raise FileError(f"cannot watch {self._shown(rel)}: {err.strerror}; "
                                        "raise fs.inotify.max_user_watches on the host")
                    continue
                self._paths[wd] = inside
                if self._recursive:
                    with os.scandir(fd) as it:
                        for entry in sorted(it, key=lambda e: e.name):
                            if entry.name.startswith(_TEMP_PREFIX):
                                continue
                            if not top:
                                # Made before its directory was watched (mkdir -p, a tree
                                # moved in): announced now, or it would never be seen.
                                self._emit(posixpath.join(inside, entry.name), "create")
                            if entry.is_dir(follow_symlinks=False):
                                todo.append((posixpath.join(rel, entry.name),
                                             posixpath.join(inside, entry.name)))
            finally:
                os.close(fd)
            top = False

    def _open_dir(self, rel: str) -> int:
        root_fd = os.open(self._root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return linux.openat2(root_fd, rel, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0,
                                 linux.RESOLVE_BENEATH | linux.RESOLVE_NO_MAGICLINKS
                                 | linux.RESOLVE_NO_XDEV | _RESOLVE_NO_SYMLINKS)
        finally:
            os.close(root_fd)

    def _refused(self, rel: str, exc: OSError) -> Exception:
        shown = self._shown(rel)
        if exc.errno == errno.ENOENT:
            return FileNotFound(f"{shown} does not exist")
        if exc.errno == errno.ENOTDIR:
            return FileError(f"{shown} is not a directory; only directories can be watched")
        if exc.errno in (errno.ELOOP, errno.EXDEV):
            return PathRefused(f"{shown} is (or goes through) a symlink; watches never follow "
                               "links")
        return FileError(f"cannot watch {shown}: {exc.strerror}")

    # -- events ------------------------------------------------------------------------------

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._fd, _READ_BYTES)
            except BlockingIOError:
                return
            except OSError as exc:
                logger.warning("reading a workspace watch failed: %s", exc)
                self._ended = True
                return
            if not data:
                return
            self._parse(data)

    def _parse(self, data: bytes) -> None:
        moved_dirs: dict[int, str] = {}  # cookie -> where a directory moved from
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, cookie, length = _HEADER.unpack_from(data, offset)
            offset += _HEADER.size
            raw = data[offset:offset + length].split(b"\0", 1)[0]
            offset += length
            if mask & IN_Q_OVERFLOW:
                self._dropped += 1
                continue
            base = self._paths.get(wd)
            if base is None:
                continue
            if base == "" and mask & (IN_IGNORED | IN_UNMOUNT | IN_DELETE_SELF | IN_MOVE_SELF):
                self._ended = True  # the watched directory itself went away
                continue
            if mask & IN_IGNORED:  # a subdirectory's watch is gone (it was removed)
                del self._paths[wd]
                continue
            if mask & (IN_UNMOUNT | IN_DELETE_SELF | IN_MOVE_SELF):
                continue  # seen from its parent as remove / rename
            name = posixpath.join(base, os.fsdecode(raw)) if raw else base
            self._on_event(name, mask, cookie, moved_dirs)
        for old in moved_dirs.values():  # moved out of the watched tree: nothing left to see
            self._forget_tree(old)

    def _on_event(self, name: str, mask: int, cookie: int, moved_dirs: dict[int, str]) -> None:
        leaf = posixpath.basename(name)
        if mask & IN_MOVED_TO and cookie in self._temp_cookies:
            self._temp_cookies.discard(cookie)
            self._emit(name, "create")
            self._emit(name, "write")
            return
        if leaf.startswith(_TEMP_PREFIX):
            if mask & IN_MOVED_FROM:
                self._temp_cookies.add(cookie)
            return
        op = _op(mask)
        if op is not None:
            self._emit(name, op)
        is_dir = bool(mask & IN_ISDIR)
        if mask & IN_MOVED_FROM and is_dir:
            moved_dirs[cookie] = name
        if mask & IN_MOVED_TO and is_dir and self._recursive:
            old = moved_dirs.pop(cookie, None)
            if old is not None and old in self._paths.values():
                self._rename_tree(old, name)
            else:
                self._add_child(name)
        elif mask & IN_CREATE and is_dir and self._recursive:
            self._add_child(name)

    def _emit(self, name: str, op: WatchOp) -> None:
        if len(self._pending) >= MAX_PENDING:
            self._dropped += 1
            return
        self._pending.append(WatchEvent(name=name, op=op))

    def _add_child(self, inside: str) -> None:
        self._add(posixpath.normpath(posixpath.join(self._top, inside)), inside)

    def _forget_tree(self, old: str) -> None:
        for wd, path in list(self._paths.items()):
            if path == old or path.startswith(old + "/"):
                _libc.inotify_rm_watch(self._fd, wd)
                del self._paths[wd]

    def _rename_tree(self, old: str, new: str) -> None:
        for wd, path in list(self._paths.items()):
            if path == old or path.startswith(old + "/"):
                self._paths[wd] = new + path[len(old):]


def _op(mask: int) -> WatchOp | None:
    if mask & (IN_CREATE | IN_MOVED_TO):
        return "create"
    if mask & IN_MODIFY:
        return "write"
    if mask & IN_DELETE:
        return "remove"
    if mask & IN_MOVED_FROM:
        return "rename"
    if mask & IN_ATTRIB:
        return "chmod"
    return None
