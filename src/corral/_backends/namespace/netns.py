"""Per-sandbox network namespaces holding only ``lo``, pinned under /run/netns.

Namespaces are per thread in Linux, so each operation runs on a short-lived thread that enters the
namespace and then dies; the rest of the process never leaves the host namespace.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..._core import linux

__all__ = ["create_netns", "is_pinned", "remove_netns", "run_in_netns"]

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1

T = TypeVar("T")


def _on_fresh_thread(fn: Callable[[], T]) -> T:
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the caller's thread below
            box["error"] = exc

    thread = threading.Thread(target=target, name="corral-netns")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def _ensure_run_dir(run_dir: Path) -> None:
    # Like `ip netns`: make the directory a shared mount point so a later `ip netns add`
    # (which binds the directory recursively) keeps our pinned namespaces visible.
    run_dir.mkdir(parents=True, exist_ok=True)
    with open("/proc/self/mountinfo") as f:
        if any(line.split()[4] == str(run_dir) for line in f):
            return
    linux.mount(str(run_dir), str(run_dir), None, linux.MS_BIND | linux.MS_REC)


def create_netns(path: Path) -> None:
    """Create a network namespace with ``lo`` up and pin it at ``path``."""
    _ensure_run_dir(path.parent)

    def work() -> None:
        linux.unshare(linux.CLONE_NEWNET)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            ifreq = struct.pack("16sH14x", b"lo", 0)
            flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, ifreq))[1]
            fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDONLY, 0o444)
        os.close(fd)
        try:
            linux.mount("/proc/thread-self/ns/net", str(path), None,
                        linux.MS_BIND)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    _on_fresh_thread(work)


def remove_netns(path: Path) -> None:
    """Unpin and delete; the namespace dies with its last process. Idempotent."""
    try:
        linux.umount(str(path), linux.MNT_DETACH)
    except OSError:
        pass
    path.unlink(missing_ok=True)


def run_in_netns(path: Path, fn: Callable[[], T]) -> T:
    """Run ``fn`` on a thread inside the namespace pinned at ``path``; children it forks stay there."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        def work() -> T:
            linux.setns(fd, linux.CLONE_NEWNET)
            return fn()

        return _on_fresh_thread(work)
    finally:
        os.close(fd)


def is_pinned(path: Path) -> bool:
    """True when ``path`` is a live namespace mount (not an empty leftover file)."""
    try:
        return os.stat(path).st_dev != os.stat(path.parent).st_dev
    except OSError:
        return False
