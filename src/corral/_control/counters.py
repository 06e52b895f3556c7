"""Metric counters kept in memory and written to the store in batches.

A command used to cost two SQLite transactions for its counters alone (started, finished), on
the path between the caller and its result. Counters are sums, so they merge: they are added up
here and written in one transaction at most ``flush_after_s`` after the first one arrived (by a
timer, so an idle service still publishes them), when a reader in this process asks for them,
and when the process closes its store or exits. Another process (``corral metrics``) therefore
sees a count at most ``flush_after_s`` late; a process killed with SIGKILL loses at most that
much of its counts, never the audit trail, which is written separately.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable, Sequence

__all__ = ["CounterBuffer", "CounterRows"]

CounterRows = Sequence[tuple[str, str, float]]  # (name, labels as JSON, amount)


class CounterBuffer:
    """Sums counter increments and hands them to ``write`` in batches (a ``CounterSink``)."""

    def __init__(self, write: Callable[[CounterRows], None], *,
                 flush_after_s: float = 0.5) -> None:
        self._write = write
        self._flush_after = flush_after_s
        self._pending: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        # Serialises writes, so a flush that has taken the pending rows finishes before a
        # reader's flush returns (a reader must see every count made before it asked).
        self._write_lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._closed = False
        # A CLI call never closes its store explicitly; its counts must still be kept.
        ref = weakref.ref(self)
        self._exit_hook: Callable[[], None] = lambda: _flush_ref(ref)
        atexit.register(self._exit_hook)

    def add_counters(self, rows: CounterRows) -> None:
        self.add(rows)

    def add(self, rows: CounterRows) -> None:
        with self._lock:
            if self._closed:
                direct = True
            else:
                direct = False
                for name, labels, amount in rows:
                    self._pending[(name, labels)] = self._pending.get((name, labels), 0.0) \
                        + amount
                if self._timer is None and self._pending:
                    self._timer = threading.Timer(self._flush_after, self.flush)
                    self._timer.daemon = True
                    self._timer.start()
        if direct:
            self._write(rows)

    def flush(self) -> None:
        """Write everything pending now (one transaction), and return once it is written."""
        with self._write_lock:
            with self._lock:
                rows = [(name, labels, amount)
                        for (name, labels), amount in self._pending.items()]
                self._pending.clear()
                timer, self._timer = self._timer, None
            if timer is not None and timer is not threading.current_thread():
                timer.cancel()
            if rows:
                self._write(rows)

    def close(self) -> None:
        """Flush; later counts are written directly (nothing is left behind in memory)."""
        self.flush()
        with self._lock:
            self._closed = True
        atexit.unregister(self._exit_hook)


def _flush_ref(ref: weakref.ref[CounterBuffer]) -> None:
    buffer = ref()
    if buffer is not None and not buffer._closed:
        try:
            buffer.flush()
        except Exception:  # at exit, with the database perhaps already gone: nothing to do
            pass
