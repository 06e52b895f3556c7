"""The agent's channel to the host (one JSON object per line each way, ``protocol``) and its
``Lane``: ordered work on a thread of its own, bounded in bytes. Guest side, standard library
only."""

from __future__ import annotations

import contextlib
import os
import queue
import select
import threading
import time
from collections.abc import Callable, Iterator

from .protocol import MAX_LINE, Message, encode
from .system import log

__all__ = ["Channel", "Lane"]


class Channel:
    """One JSON object per line each way. A virtio-serial port reads EOF while no host is
    connected; a file descriptor handed over by a test ends the agent at EOF."""

    def __init__(self, spec: str) -> None:
        if spec.startswith("fd:"):
            self.fd = int(spec[3:])
            self.reconnects = False
        else:
            self.fd = self._open_port(spec)
            self.reconnects = True
        self._lock = threading.Lock()

    @staticmethod
    def _open_port(path: str) -> int:
        # /dev/virtio-ports/NAME is a udev symlink and the guest runs no udev: find the port's
        # device by its name in sysfs.
        name = os.path.basename(path)
        deadline = time.monotonic() + 30
        while True:
            for candidate in (path, *Channel._ports_named(name)):
                with contextlib.suppress(FileNotFoundError):
                    return os.open(candidate, os.O_RDWR | os.O_CLOEXEC)
            if time.monotonic() > deadline:
                raise SystemExit(f"corral-agent: no channel {path} (no virtio-serial port "
                                 f"named {name!r})")
            time.sleep(0.05)

    @staticmethod
    def _ports_named(name: str) -> list[str]:
        root = "/sys/class/virtio-ports"
        found = []
        with contextlib.suppress(OSError):
            for port in sorted(os.listdir(root)):
                with contextlib.suppress(OSError), open(os.path.join(root, port, "name")) as f:
                    if f.read().strip() == name:
                        found.append(f"/dev/{port}")
        return found

    def send(self, message: Message) -> None:
        data = encode(message)
        with self._lock:
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(self.fd, view):]
            except OSError as exc:  # the host went away; it resynchronises on reconnect
                log(f"channel write failed: {exc.strerror}")

    def _wait_host(self) -> None:
        # The port polls POLLHUP while the host end is closed: sleep between looks, never spin.
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while True:
            events = poller.poll(1000)
            if not events or not events[0][1] & select.POLLHUP:
                return
            time.sleep(0.1)

    def lines(self) -> Iterator[bytes | None]:
        """Yield each line; ``None`` for a line over ``MAX_LINE`` (dropped) and ``b""`` when the
        host reconnected."""
        buffer = bytearray()
        dropping = False
        while True:
            try:
                chunk = os.read(self.fd, 1 << 18)
            except InterruptedError:
                continue
            if not chunk:
                if not self.reconnects:
                    return
                buffer.clear()
                dropping = False
                self._wait_host()
                yield b""
                continue
            start = 0
            while (end := chunk.find(b"\n", start)) >= 0:
                if dropping:
                    dropping = False
                else:
                    buffer += chunk[start:end]
                    line = bytes(buffer)
                    buffer.clear()
                    if line.strip():
                        yield line
                start = end + 1
            if not dropping:
                buffer += chunk[start:]
                if len(buffer) > MAX_LINE:
                    buffer.clear()
                    dropping = True
                    yield None


class Lane:
    """An ordered queue of work with one thread and a byte bound, so one slow consumer (a
    command not reading its stdin, a frozen disk) never stalls the channel reader."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._pending = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], int] | None] = \
            queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, work: Callable[[], None], size: int) -> bool:
        with self._lock:
            if self._pending and self._pending + size > self._limit:
                return False
            self._pending += size
        self._queue.put((work, size))
        return True

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work, size = item
            try:
                work()
            except Exception as exc:  # a bug in one item must not stop the lane
                log(f"lane work failed: {exc!r}")
            finally:
                with self._lock:
                    self._pending -= size
