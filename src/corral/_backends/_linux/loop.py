"""Attach an image file to a loop device and mount it, in-process (no `mount -o loop` fork).

Uses LOOP_CTL_GET_FREE + LOOP_CONFIGURE (Linux 5.8+) with autoclear, so the device is released
when the filesystem is unmounted. Callers fall back to mount(8) when this raises ``OSError``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat

from ..._core import linux

__all__ = ["mount_image"]

_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LOOP_CLR_FD = 0x4C01
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


def mount_image(image: str, target: str, *, read_only: bool = False) -> None:
    """Mount the ext4 ``image`` on ``target`` (nodev, nosuid, noatime) through a loop device."""
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
