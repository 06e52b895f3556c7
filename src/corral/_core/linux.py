"""Thin ctypes wrappers for the Linux calls Python 3.11 lacks (setns, unshare, mount, openat2,
open_tree, move_mount)."""

from __future__ import annotations

import ctypes
import os
import platform
import threading

__all__ = [
    "CLONE_FS",
    "CLONE_NEWNET",
    "CLONE_NEWNS",
    "MNT_DETACH",
    "MS_BIND",
    "RESOLVE_BENEATH",
    "RESOLVE_NO_MAGICLINKS",
    "RESOLVE_NO_XDEV",
    "clone_tree",
    "mount",
    "move_tree",
    "set_child_subreaper",
    "openat2",
    "setns",
    "umount",
    "unshare",
]

CLONE_FS = 0x200
CLONE_NEWNS = 0x20000
CLONE_NEWNET = 0x40000000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08

_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(platform.machine(), 437)
# The same on every architecture since Linux 5.2 (the new mount API).
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_OPEN_TREE_CLONE = 1
_AT_RECURSIVE = 0x8000
_AT_FDCWD = -100
_MOVE_MOUNT_F_EMPTY_PATH = 0x4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.syscall.restype = ctypes.c_long


def _check(result: int, what: str) -> None:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


_PR_SET_CHILD_SUBREAPER = 36


def set_child_subreaper() -> None:
    """Orphaned descendants become our children (so we can reap them) instead of init's."""
    _check(_libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")


def yield_cpu_to_others() -> None:
    """Lower the calling thread's CPU priority (nice 10; Linux's niceness is per thread).

    For work made ahead (spare workspaces and network namespaces): on a busy host it must not
    take a core from the creates and commands it is there to speed up.
    """
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def mount(
    source: str, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    _check(
        _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                    data.encode() if data else None),
        f"mount {target}",
    )


def umount(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(target.encode(), flags), f"umount {target}")


_RENAME_NOREPLACE = 1
_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                            ctypes.c_uint]


def rename_noreplace(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """rename(2) that never replaces ``target`` (a plain rename replaces an empty directory
    in silence): FileExistsError if it exists."""
    if _libc.renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target),
                       _RENAME_NOREPLACE) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fspath(target))


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2): open ``path`` relative to ``dir_fd`` under ``resolve`` restrictions.

    Raises OSError with the kernel's errno (EXDEV when the path would leave ``dir_fd``).
    """
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = _libc.syscall(_SYS_OPENAT2, ctypes.c_int(dir_fd), ctypes.c_char_p(os.fsencode(path)),
                       ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


def clone_tree(path: str) -> int:
    """open_tree(2) with OPEN_TREE_CLONE | AT_RECURSIVE: a descriptor holding a detached copy
    of the mounts at and below ``path``, which ``move_tree`` attaches in another namespace."""
    fd = _libc.syscall(_SYS_OPEN_TREE, ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(os.fsencode(path)),
                       ctypes.c_uint(_OPEN_TREE_CLONE | _AT_RECURSIVE | os.O_CLOEXEC))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"open_tree {path}: {os.strerror(err)}")
    return int(fd)


def move_tree(tree_fd: int, target: str) -> None:
    """move_mount(2): attach the detached tree ``tree_fd`` at ``target`` in this namespace."""
    _check(_libc.syscall(_SYS_MOVE_MOUNT, ctypes.c_int(tree_fd), ctypes.c_char_p(b""),
                         ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(os.fsencode(target)),
                         ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH)), f"move_mount {target}")
