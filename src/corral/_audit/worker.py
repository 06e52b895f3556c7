"""The audit layer's one background thread: it runs a step when woken or when the step's own
deadline comes, whichever is first, so pending summaries are written when their interval ends
even if no further event arrives, and budget overruns are acted on off the writers' threads."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["Worker"]

logger = logging.getLogger(__name__)


class Worker:
    """Calls ``step()`` on a daemon thread; ``step`` returns the seconds until it wants to run
    again. Started on first ``wake``; ``close`` runs a last step and joins."""

    def __init__(self, step: Callable[[], float], *, name: str = "corral-audit") -> None:
        self._step = step
        self._name = name
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._stop.is_set():
                    self._thread = threading.Thread(target=self._run, name=self._name,
                                                    daemon=True)
                    self._thread.start()
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stop.is_set()

    def _run(self) -> None:
        wait = 0.0
        while not self._stop.is_set():
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                wait = self._step()
            except Exception:  # the thread must outlive one bad step
                logger.exception("audit worker step failed")
                wait = 1.0

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stop.set()
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
