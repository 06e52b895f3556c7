"""Per-sandbox network namespaces holding only ``lo``, pinned under /run/netns.

Namespaces are per thread in Linux: creation runs on a short-lived thread that unshares and dies,
and processes are started by the ``Spawner`` thread; no other thread ever leaves the host's
namespace.
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import logging
import os
import queue
import re
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..._core import linux
from .storage import is_mount, unescape_mountinfo

__all__ = ["SpareNamespaces", "Spawner", "create_netns", "is_pinned", "remove_netns", "start_netns"]

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1

T = TypeVar("T")

logger = logging.getLogger(__name__)


def _start_on_fresh_thread(fn: Callable[[], T]) -> Callable[[], T]:
    """Run ``fn`` on a new thread (it may unshare or setns, and dies with what it changed);
    the returned function waits for it and returns its value or raises its error."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the caller's thread below
            box["error"] = exc

    thread = threading.Thread(target=target, name="corral-netns")
    thread.start()

    def result() -> T:
        thread.join()
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["value"]  # type: ignore[return-value]

    return result


def _on_fresh_thread(fn: Callable[[], T]) -> T:
    return _start_on_fresh_thread(fn)()


def _ensure_run_dir(run_dir: Path) -> None:
    # Like `ip netns`: make the directory a shared mount point so a later `ip netns add`
    # (which binds the directory recursively) keeps our pinned namespaces visible.
    run_dir.mkdir(parents=True, exist_ok=True)
    # The kernel's word (statx), not a read of the mount table: with a sandbox's mounts in
    # it, that read cost each create in a burst of 100 ~0.3 ms of kernel time.
    if is_mount(run_dir):
        return
    linux.mount(str(run_dir), str(run_dir), None, linux.MS_BIND | linux.MS_REC)


def create_netns(path: Path) -> None:
    """Create a network namespace with ``lo`` up and pin it at ``path``."""
    listener = start_netns(path)()
    if listener is not None:
        listener.close()


def start_netns(path: Path) -> Callable[[], socket.socket | None]:
    """``create_netns`` on a thread of its own: the returned function waits for it (and
    raises what failed), so the caller can do other work meanwhile (~1.5 ms here). It gives
    a listener bound in the namespace meanwhile (see ``_listener``)."""
    _ensure_run_dir(path.parent)

    def work() -> socket.socket | None:
        linux.unshare(linux.CLONE_NEWNET)
        _lo_up()
        _pin("/proc/thread-self/ns/net", path)
        return _listener()

    return _start_on_fresh_thread(work)


def _listener() -> socket.socket | None:
    """A TCP listener on 127.0.0.1 of this thread's namespace, made while the thread is in it
    anyway: the sandbox's first egress listener (``HostBackedBackend.egress_endpoint``), which
    otherwise costs a hop to the spawner thread and two ``setns`` on its first command."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        logger.debug("no listener made with a network namespace: %s", exc)
        return None
    return sock


def _new_netns_fd() -> tuple[int, socket.socket | None]:
    """A descriptor of a new network namespace with ``lo`` up, and a listener in it (from a
    fresh thread)."""
    def work() -> tuple[int, socket.socket | None]:
        linux.unshare(linux.CLONE_NEWNET)
        _lo_up()
        return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC), _listener()

    return _on_fresh_thread(work)


def _lo_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def _pin(source: str, path: Path) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDONLY, 0o444)
    os.close(fd)
    try:
        linux.mount(source, str(path), None, linux.MS_BIND)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


class SpareNamespaces:
    """Network namespaces made ahead, for a process that creates sandboxes again and again:
    the kernel's making of one (``copy_net_ns``) is ~1.4 ms here, on a create's path once
    its workspace is claimed ready (``ready``). Held as descriptors only, so nothing of them
    outlives the process; a create pins one with a bind mount. As ``ready``, the first
    create of a process makes none, the second starts the refill."""

    SLOTS = 2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: list[tuple[int, socket.socket | None]] = []
        self._creates = 0
        self._filling = False
        self._closed = False

    def start(self, path: Path) -> Callable[[], socket.socket | None]:
        """``start_netns(path)``, from a spare when there is one."""
        with self._lock:
            self._creates += 1
            spare = self._fds.pop() if self._fds else None
            refill = self._creates >= 2 and not self._filling and not self._closed
            self._filling = self._filling or refill
        if refill:
            threading.Thread(target=self._refill, name="corral-spare-netns",
                             daemon=True).start()
        if spare is None:
            return start_netns(path)
        fd, listener = spare
        try:
            _ensure_run_dir(path.parent)
            _pin(f"/proc/self/fd/{fd}", path)
        except BaseException:
            if listener is not None:
                listener.close()
            raise
        finally:
            os.close(fd)
        return lambda: listener

    def _refill(self) -> None:
        linux.yield_cpu_to_others()
        try:
            while True:
                with self._lock:
                    if self._closed or len(self._fds) >= self.SLOTS:
                        return
                try:
                    spare = _new_netns_fd()
                except OSError as exc:
                    logger.debug("could not make a spare network namespace: %s", exc)
                    return
                with self._lock:
                    keep = not self._closed
                    if keep:
                        self._fds.append(spare)
                if not keep:
                    _close_spare(spare)
        finally:
            with self._lock:
                self._filling = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spares, self._fds = self._fds, []
        for spare in spares:
            _close_spare(spare)


def _close_spare(spare: tuple[int, socket.socket | None]) -> None:
    fd, listener = spare
    os.close(fd)
    if listener is not None:
        listener.close()


def remove_netns(path: Path) -> None:
    """Unpin and delete; the namespace dies with its last process. Idempotent."""
    try:
        linux.umount(str(path), linux.MNT_DETACH)
    except OSError:
        pass
    path.unlink(missing_ok=True)


# A Corral data directory's per-sandbox mounts, whichever instance made them: a sandbox's
# disk, overlay and binds (a spare's too: ``ready``), a volume's mount, a snapshot layer's.
_CORRAL_MOUNT = re.compile(r"/sandboxes/(?:sbx_|\.ready\.|\.making\.)[^/]+/"
                           r"|/volumes/vol_[^/]+/mnt$|/layers/lyr_[^/]+/")


def _lean_namespace(hidden: tuple[Path, ...]) -> int:
    """A descriptor of a new mount namespace: the host's, private, without the mounts below
    any of ``hidden`` (every sandbox's workspace and volume binds, the pinned network
    namespaces), nor any other Corral instance's sandbox, volume or layer mounts, nor any
    pinned namespace. Made on a fresh thread, which dies; the descriptor keeps it alive.

    What it holds it keeps alive for the life of the process: a copy of another instance's
    workspace disk here would keep its superblock after that instance unmounted it, and a
    second mount of the image beside it would lose what the first had not written back."""
    def work() -> int:
        linux.unshare(linux.CLONE_FS | linux.CLONE_NEWNS)
        # Private first: an unmount here must never reach the host's peers (/run/netns is
        # shared).
        linux.mount("none", "/", None, linux.MS_REC | linux.MS_PRIVATE)
        prefixes = tuple(f"{path}/" for path in hidden)
        with open("/proc/thread-self/mountinfo") as f:
            rows = [line.split() for line in f]
        dropped = []
        for row in rows:
            point = unescape_mountinfo(row[4])
            fstype = row[row.index("-") + 1]
            if point.startswith(prefixes) or fstype == "nsfs" or _CORRAL_MOUNT.search(point):
                dropped.append(point)
        for point in sorted(dropped, key=lambda p: p.count("/"), reverse=True):
            try:
                linux.umount(point, linux.MNT_DETACH)
            except OSError:
                pass  # below one detached already
        return os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)

    return _on_fresh_thread(work)


class Spawner:
    """Long-lived threads that start processes inside sandbox network namespaces: one per
    CPU (at least two), so a burst of sandboxes starts in parallel.

    Why not a fresh thread per spawn: bwrap's ``--die-with-parent`` is ``PR_SET_PDEATHSIG``, which
    fires when the *thread* that forked it exits. A short-lived spawning thread would SIGKILL the
    sandbox moments after starting it (a race that load makes likely). These threads live as long
    as the process, so sandboxes die exactly when Corral does. Each enters a namespace only for
    the fork and always returns to the host's namespace before taking the next job.

    With ``lean_hides``, a job given a ``tree`` forks in a mount namespace of its own: a copy
    of a lean one (the host's without the mounts below ``lean_hides``) with the mounts at and
    below ``tree`` attached at the same path. A new mount namespace copies every mount of the
    one it starts from, under a lock of the kernel's, and each live sandbox adds three to the
    host's: a bwrap started from the host's costs 7 ms with none and 234 ms beside 500. From
    the lean one it costs the same beside any number.
    """

    def __init__(self, workers: int | None = None,
                 lean_hides: tuple[Path, ...] = ()) -> None:
        self._host_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._host_mnt_fd = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        self._lean_hides = lean_hides
        self._lean_fd: int | None = None
        self._lean_lock = threading.Lock()
        self._lean_off = not lean_hides
        self._jobs: queue.SimpleQueue[
            tuple[Path, Path | None, Callable[[], object], concurrent.futures.Future[object]]
        ] = queue.SimpleQueue()
        count = workers if workers is not None else max(2, os.cpu_count() or 1)
        self._threads = [threading.Thread(target=self._loop, name=f"corral-spawner-{n}",
                                          daemon=True) for n in range(count)]
        for thread in self._threads:
            thread.start()

    def _lean(self) -> int | None:
        with self._lean_lock:
            if self._lean_off:
                return None
            if self._lean_fd is None:
                try:
                    self._lean_fd = _lean_namespace(self._lean_hides)
                except OSError as exc:
                    logger.warning("cannot make the lean mount namespace commands start from "
                                   "(%s); they start from the host's", exc)
                    self._lean_off = True
            return self._lean_fd

    def _enter_tree(self, tree: Path) -> bool:
        """Move this thread into a fresh copy of the lean namespace holding ``tree``'s mounts;
        False (still in the host's) where that cannot be done."""
        lean = self._lean()
        if lean is None:
            return False
        try:
            tree_fd = linux.clone_tree(str(tree))
        except OSError as exc:
            self._refused(exc)
            return False
        try:
            linux.setns(lean, linux.CLONE_NEWNS)
            try:
                linux.unshare(linux.CLONE_NEWNS)
                linux.move_tree(tree_fd, str(tree))
            except BaseException:
                self._leave_tree()
                raise
        except OSError as exc:
            self._refused(exc)
            return False
        finally:
            os.close(tree_fd)
        return True

    def _refused(self, exc: OSError) -> None:
        """This job starts from the host's namespace; every later one too if the kernel or
        our privileges will never allow it (not for a sandbox destroyed meanwhile, say)."""
        if exc.errno in (errno.ENOSYS, errno.EPERM):
            logger.warning("cannot start commands from a lean mount namespace (%s); they "
                           "start from the host's", exc)
            self._lean_off = True
        else:
            logger.debug("this command starts from the host's mount namespace: %s", exc)

    def _leave_tree(self) -> None:
        try:
            linux.setns(self._host_mnt_fd, linux.CLONE_NEWNS)
        except OSError:
            os._exit(70)  # never take the next job outside the host's mount namespace

    def _loop(self) -> None:
        own_fs = False
        if self._lean_hides:
            try:
                # A thread may enter another mount namespace only with its own root and cwd.
                linux.unshare(linux.CLONE_FS)
                own_fs = True
            except OSError as exc:
                logger.warning("a spawner thread cannot leave the host's mount namespace "
                               "(%s); its commands start from the host's", exc)
        while True:
            path, tree, fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # before leaving the host's view
                try:
                    moved = own_fs and tree is not None and self._enter_tree(tree)
                    try:
                        linux.setns(fd, linux.CLONE_NEWNET)
                    except BaseException:
                        if moved:
                            self._leave_tree()
                        raise
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
                    if moved:
                        self._leave_tree()
            except BaseException as exc:
                if not future.done():
                    future.set_exception(exc)

    def run(self, path: Path, fn: Callable[[], T], *, tree: Path | None = None) -> T:
        """Run ``fn`` inside the namespace pinned at ``path``; children it forks stay there.
        ``tree``: they need only the mounts at and below it of Corral's own (see the class)."""
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._jobs.put((path, tree, fn, future))
        return future.result()  # type: ignore[return-value]


def is_pinned(path: Path) -> bool:
    """True when ``path`` is a live namespace mount (not an empty leftover file)."""
    try:
        return os.stat(path).st_dev != os.stat(path.parent).st_dev
    except OSError:
        return False
