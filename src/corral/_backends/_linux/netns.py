"""Per-sandbox network namespaces holding only ``lo``, pinned under /run/netns.

Namespaces are per thread in Linux: creation runs on a short-lived thread that unshares and dies,
and processes are started by the ``Spawner`` thread; no other thread ever leaves the host's
namespace.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import os
import queue
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..._core import linux

__all__ = ["Spawner", "create_netns", "is_pinned", "remove_netns"]

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


class Spawner:
    """Long-lived threads that start processes inside sandbox network namespaces: one per
    CPU (at least two), so a burst of sandboxes starts in parallel.

    Why not a fresh thread per spawn: bwrap's ``--die-with-parent`` is ``PR_SET_PDEATHSIG``, which
    fires when the *thread* that forked it exits. A short-lived spawning thread would SIGKILL the
    sandbox moments after starting it (a race that load makes likely). These threads live as long
    as the process, so sandboxes die exactly when Corral does. Each enters a namespace only for
    the fork and always returns to the host's namespace before taking the next job.
    """

    def __init__(self, workers: int | None = None) -> None:
        self._host_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._jobs: queue.SimpleQueue[
            tuple[Path, Callable[[], object], concurrent.futures.Future[object]]
        ] = queue.SimpleQueue()
        count = workers if workers is not None else max(2, os.cpu_count() or 1)
        self._threads = [threading.Thread(target=self._loop, name=f"corral-spawner-{n}",
                                          daemon=True) for n in range(count)]
        for thread in self._threads:
            thread.start()

    def _loop(self) -> None:
        while True:
            path, fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    linux.setns(fd, linux.CLONE_NEWNET)
                finally:
                    os.close(fd)
                try:
                    future.set_result(fn())
                finally:
                    # Never take the next job in a sandbox's namespace; if we cannot get back,
                    # the host side is compromised and the process must not go on spawning.
                    try:
                        linux.setns(self._host_fd, linux.CLONE_NEWNET)
                    except OSError:
                        os._exit(70)
            except BaseException as exc:
                if not future.done():
                    future.set_exception(exc)

    def run(self, path: Path, fn: Callable[[], T]) -> T:
        """Run ``fn`` inside the namespace pinned at ``path``; children it forks stay there."""
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._jobs.put((path, fn, future))
        return future.result()  # type: ignore[return-value]


def is_pinned(path: Path) -> bool:
    """True when ``path`` is a live namespace mount (not an empty leftover file)."""
    try:
        return os.stat(path).st_dev != os.stat(path.parent).st_dev
    except OSError:
        return False
