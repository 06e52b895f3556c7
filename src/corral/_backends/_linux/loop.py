"""Attach an image file to a loop device and mount it, in-process (no `mount -o loop` fork).

Uses LOOP_CTL_GET_FREE + LOOP_CONFIGURE (Linux 5.8+) with autoclear, so the device is released
when the filesystem is unmounted. Callers fall back to mount(8) when this raises ``OSError``.

An image that must never have two filesystems on it at once (a volume, written by whichever
sandbox mounts it) is mounted with ``reuse``: a mount of it that is unmounted here but still
alive (detached, held by a sandbox's mount namespace) keeps its loop device, and mounting that
device again shares its superblock, where a second loop device would make a second ext4
instance on the same file and corrupt it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat

from ..._core import linux

__all__ = ["attached", "mount_image"]

_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LOOP_CLR_FD = 0x4C01
_LOOP_GET_STATUS64 = 0x4C05
_LO_FLAGS_READ_ONLY = 1
_LO_FLAGS_AUTOCLEAR = 4
_LOOP_MAJOR = 7
_MS_RDONLY = 0x1
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_NOATIME = 0x400


class _LoopInfo64(ctypes.Structure):
    _fields_ = [
        ("lo_device", ctypes.c_uint64), ("lo_inode", ctypes.c_uint64),
        ("lo_rdevice", ctypes.c_uint64), ("lo_offset", ctypes.c_uint64),
        ("lo_sizelimit", ctypes.c_uint64), ("lo_number", ctypes.c_uint32),
        ("lo_encrypt_type", ctypes.c_uint32), ("lo_encrypt_key_size", ctypes.c_uint32),
        ("lo_flags", ctypes.c_uint32), ("lo_file_name", ctypes.c_uint8 * 64),
        ("lo_crypt_name", ctypes.c_uint8 * 64), ("lo_encrypt_key", ctypes.c_uint8 * 32),
        ("lo_init", ctypes.c_uint64 * 2),
    ]


class _LoopConfig(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_uint32), ("block_size", ctypes.c_uint32),
                ("info", _LoopInfo64), ("reserved", ctypes.c_uint64 * 8)]


def _device_node(number: int) -> str:
    path = f"/dev/loop{number}"
    try:
        if stat.S_ISBLK(os.stat(path).st_mode):
            return path
    except FileNotFoundError:
        # No udev in many containers: make the node the kernel just created.
        os.mknod(path, stat.S_IFBLK | 0o660, os.makedev(_LOOP_MAJOR, number))
    return path


def _attach(image_fd: int, read_only: bool) -> tuple[int, str]:
    control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(32):  # another process may grab the same free device first
            number = fcntl.ioctl(control, _LOOP_CTL_GET_FREE)
            path = _device_node(number)
            dev_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            config = _LoopConfig(fd=image_fd)
            config.info.lo_flags = _LO_FLAGS_AUTOCLEAR | (_LO_FLAGS_READ_ONLY if read_only else 0)
            try:
                fcntl.ioctl(dev_fd, _LOOP_CONFIGURE, bytes(config))
            except OSError as exc:
                os.close(dev_fd)
                if exc.errno == errno.EBUSY:
                    continue
                raise
            return dev_fd, path
    finally:
        os.close(control)
    raise OSError(errno.EBUSY, "no free loop device after 32 tries")


def attached(image: str) -> tuple[int, str] | None:
    """An open descriptor and the path of a loop device already backed by ``image`` (the same
    inode, not just the name). Held open, the device cannot be cleared and handed to another
    image before it is mounted."""
    wanted = os.stat(image)
    name = os.path.realpath(image)
    try:
        devices = [d for d in os.listdir("/sys/block") if d.startswith("loop")]
    except OSError:
        return None
    for device in devices:
        try:
            with open(f"/sys/block/{device}/loop/backing_file") as f:
                if f.read().rstrip("\n") != name:
                    continue
            path = _device_node(int(device[4:]))
            dev_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, ValueError):
            continue  # not configured (no backing_file) or cleared meanwhile
        try:
            info = _LoopInfo64()
            fcntl.ioctl(dev_fd, _LOOP_GET_STATUS64, info)
            if (os.major(info.lo_device), os.minor(info.lo_device), info.lo_inode) == (
                    os.major(wanted.st_dev), os.minor(wanted.st_dev), wanted.st_ino):
                return dev_fd, path
        except OSError:
            pass
        os.close(dev_fd)
    return None


def mount_image(image: str, target: str, *, read_only: bool = False,
                reuse: bool = False) -> None:
    """Mount the ext4 ``image`` on ``target`` (nodev, nosuid, noatime) through a loop device;
    with ``reuse``, through the one already backed by ``image`` if there is one (see the module
    docstring; the caller serialises mounts of one image)."""
    found = attached(image) if reuse else None
    if found is not None:
        dev_fd, path = found
        try:
            linux.mount(path, target, "ext4",
                        _MS_NODEV | _MS_NOSUID | _MS_NOATIME | (_MS_RDONLY if read_only else 0))
        finally:
            os.close(dev_fd)
        return
    image_fd = os.open(image, (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC)
    try:
        dev_fd, path = _attach(image_fd, read_only)
    finally:
        os.close(image_fd)
    try:
        linux.mount(path, target, "ext4",
                    _MS_NODEV | _MS_NOSUID | _MS_NOATIME | (_MS_RDONLY if read_only else 0))
    except OSError:
        fcntl.ioctl(dev_fd, _LOOP_CLR_FD)
        raise
    finally:
        # Autoclear: once mounted, the mount holds the device; closing ours is what lets
        # the unmount release it.
        os.close(dev_fd)
