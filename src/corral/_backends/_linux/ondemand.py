"""A sandbox's resident helper (the gVisor tier's resident sandbox, the namespace tier's
zygote), started by the first command that needs it and stopped once nothing has run for a
while, so an idle Corral sandbox still costs no process."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar

from ...errors import BackendError

__all__ = ["OnDemand", "ResidentLike"]

logger = logging.getLogger(__name__)


class ResidentLike(Protocol):
    @property
    def alive(self) -> bool: ...

    def close(self) -> None: ...


R = TypeVar("R", bound=ResidentLike)


class OnDemand(Generic[R]):
    """A resident started by the first ``use`` and stopped once nothing has used it for
    ``idle_s`` seconds; one that died (the OOM killer took it) is replaced by the next use."""

    def __init__(self, start: Callable[[], R], idle_s: float) -> None:
        self._start = start
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._resident: R | None = None
        self._busy = 0
        self._timer: threading.Timer | None = None
        self._last_release = 0.0
        self._closed = False
        self.starts = 0

    @property
    def running(self) -> bool:
        with self._lock:
            return self._resident is not None

    @property
    def current(self) -> R | None:
        """The resident if one is up (for a kill: never starts one)."""
        with self._lock:
            return self._resident

    @property
    def busy(self) -> int:
        with self._lock:
            return self._busy

    @contextmanager
    def use(self) -> Iterator[R]:
        """The resident, started if need be, kept from the idle stop while the block runs."""
        resident = self._acquire()
        try:
            yield resident
        finally:
            self._release()

    def _acquire(self) -> R:
        with self._lock:
            if self._closed:  # its sandbox is being destroyed or remounted: never start again
                raise BackendError("the sandbox's resident helper was stopped under this "
                                   "command (the sandbox was destroyed or remounted)")
            if self._resident is not None and not self._resident.alive and self._busy == 0:
                self._resident.close()
                self._resident = None
            if self._resident is None:
                self._resident = self._start()  # under the lock: one start at a time
                self.starts += 1
            self._busy += 1
            return self._resident

    def prestart(self, slots: threading.Semaphore) -> None:
        """Start the resident in the background (a new sandbox's first command then finds it
        up, or waits only for what is left of its start), when one of ``slots`` is free: a
        burst of creates must not become a burst of starts. A failed start is only logged;
        the first command tries again and reports its own error."""
        if self.running or not slots.acquire(blocking=False):
            return

        def start() -> None:
            try:
                with self._lock:
                    if self._closed or self._resident is not None:
                        return
                    self._resident = self._start()  # not busy meanwhile: nothing runs yet
                    self.starts += 1
                    if self._busy == 0:
                        self._arm_idle_timer()
            except BackendError as exc:
                logger.info("a resident helper did not start ahead: %s", exc)
            finally:
                slots.release()

        threading.Thread(target=start, name="corral-resident-start", daemon=True).start()

    def _release(self) -> None:
        with self._lock:
            self._busy -= 1
            self._last_release = time.monotonic()
            if self._busy == 0 and self._resident is not None:
                self._arm_idle_timer()

    def _arm_idle_timer(self, after_s: float | None = None) -> None:  # under the lock
        # One timer at a time, left running across uses: it re-arms for what is left of the
        # idle time when it fires early. A timer (a thread) per command cost more than the
        # command's own fork.
        if self._timer is not None and after_s is None:
            return
        self._timer = threading.Timer(self._idle_s if after_s is None else after_s,
                                      self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        # Closed under the lock: the next start may reuse the resident's names.
        with self._lock:
            if self._closed or self._resident is None:
                self._timer = None
                return
            if self._busy:
                self._timer = None  # the last use's release arms it again
                return
            left = self._last_release + self._idle_s - time.monotonic()
            if left > 0:
                self._arm_idle_timer(left)
                return
            self._resident.close()
            self._resident = self._timer = None

    def settle(self) -> None:
        """Return once no start is under way (a start holds the lock throughout)."""
        with self._lock:
            pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            if self._resident is not None:
                self._resident.close()
            self._resident = self._timer = None
