"""Linux calls Python 3.11 lacks (``openat2``, ``syncfs``, ``mount``), and the small file and
cgroup helpers the agent's modules share. Guest side, standard library only."""

from __future__ import annotations

import contextlib
import ctypes
import os

__all__ = ["BLKFLSBUF", "FIFREEZE", "FITHAW", "MS_BIND", "MS_NODEV", "MS_NOSUID",
           "RNDADDENTROPY", "RNDRESEEDCRNG", "cgroup_pids", "log", "mount", "openat2",
           "read_int", "remount_tmp", "syncfs", "syncfs_fd", "umount",
           "write_text"]

_RESOLVE_NO_XDEV, _RESOLVE_NO_MAGICLINKS, _RESOLVE_BENEATH = 0x01, 0x02, 0x08
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_XDEV
_SYS_OPENAT2 = 437
MS_NOSUID, MS_NODEV, _MS_REMOUNT, MS_BIND = 0x2, 0x4, 0x20, 0x1000
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
BLKFLSBUF = 0x1261
FIFREEZE, FITHAW = 0xC0045877, 0xC0045878

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syncfs.argtypes = [ctypes.c_int]


def log(text: str) -> None:
    """A line on the agent's stderr (the guest's serial console, which the host keeps)."""
    with contextlib.suppress(OSError):
        os.write(2, f"corral-agent: {text}\n".encode(errors="replace"))


def _raise_errno(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err), what)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str, flags: int, mode: int = 0, resolve: int = _RESOLVE) -> int:
    """``openat2`` beneath ``dir_fd`` (no magic links, no other mounts), close-on-exec."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd),
                       ctypes.c_char_p(os.fsencode(path)), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        _raise_errno(path)
    return int(fd)


def syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        syncfs_fd(fd, path)
    finally:
        os.close(fd)


def syncfs_fd(fd: int, what: str = "") -> None:
    if _libc.syncfs(fd) != 0:
        _raise_errno(what)


def mount(source: str, target: str, fstype: str | None, flags: int) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                   flags, None) != 0:
        _raise_errno(f"mount {source} on {target}")


def remount_tmp(size: int) -> None:
    """Resize the guest's ``/tmp`` (a tmpfs init mounts) to ``size`` bytes."""
    data = f"size={size},mode=1777".encode()
    if _libc.mount(b"tmpfs", b"/tmp", None, _MS_REMOUNT | MS_NOSUID | MS_NODEV, data) != 0:
        _raise_errno("remount /tmp")


def umount(target: str) -> None:
    if _libc.umount2(target.encode(), 0) != 0:
        _raise_errno(f"umount {target}")


def read_int(path: str, key: str | None = None) -> int:
    """The number in ``path`` (a cgroup file), or on its line ``key``; 0 when absent."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return 0
    if key is None:
        return int(text.strip()) if text.strip().isdigit() else 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def cgroup_pids(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []
