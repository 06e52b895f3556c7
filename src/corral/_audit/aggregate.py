"""Aggregation of repeated events: a flood becomes a few full events and one summary per
interval, so what a sandbox makes the host write about it grows with time, not with its rate.

An event is repeated under a key: the sandbox, its type and a small key its writer chooses
from what the sandbox cannot pick freely (the command and refusal rule of an egress decision,
the port of a public connection), never from what it can (host names, paths): that would make
the number of keys, and with it the trail, unbounded again. Per key, windows of ``window_s``
seconds open at the
first event: its first ``burst`` events are written in full (one refused attempt reads as it
always did, command id and all); the rest are counted, and when the window ends one summary
event carries the count, the first and last time, a sample, a bounded list of the distinct
values of a few fields (hosts, paths), sums and tallies. Per sandbox at most ``max_keys`` keys
are open at once; more share one overflow key (memory stays bounded whatever happens).

This module only decides and accounts; it writes nothing. Its caller writes what ``offer``
says to write in full, and the summaries ``offer``, ``due`` and ``drain`` hand back. Counts
are exact: the events written in full plus every summary's ``count`` are the events offered.
Pending counts live in memory until their summary is written, so a crash loses at most the
counts of the windows still open (one interval's worth per key).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FULL_MAX_BYTES", "SHAPES", "SUMMARY_MAX_BYTES", "Aggregator", "Shape", "Summary",
           "bounded"]

# The most a repeated event written in full, and a summary, may hold as JSON (their data,
# after redaction): the flood bound in docs/audit.md is computed from these. A longer one has
# its strings cut (``bounded``); the caller's own fields rarely come near.
FULL_MAX_BYTES = 3 * 1024
SUMMARY_MAX_BYTES = 8 * 1024
# What is left of a summary whose strings, cut short, still do not fit.
_SUMMARY_CORE = ("of", "key", "count", "written_in_full", "window_s", "first_ts", "last_ts")

# What a summary lists of the distinct values of a field: at most this many, each this long.
_DISTINCT_KEPT = 8
_DISTINCT_CHARS = 100
_TALLY_KEPT = 16
_COMMANDS_KEPT = 8
_OVERFLOW_KEY = {"overflow": "more distinct keys than the aggregator keeps per sandbox"}


@dataclass(frozen=True, slots=True)
class Shape:
    """How a type of repeated event is summarised.

    Attributes:
        summary_type: the summary event's type.
        distinct: data fields whose distinct values the summary lists (bounded).
        sums: numeric data fields added up.
        tallies: data fields counted per value (bounded; the rest under ``"other"``).
    """

    summary_type: str
    distinct: tuple[str, ...] = ()
    sums: tuple[str, ...] = ()
    tallies: tuple[str, ...] = ()


SHAPES: Mapping[str, Shape] = {
    "egress.decision": Shape("egress.summary", distinct=("host", "method"),
                             sums=("bytes_up", "bytes_down")),
    "port.connection": Shape("port.summary", distinct=("path", "method"),
                             sums=("bytes_in", "bytes_out"), tallies=("status",)),
}


@dataclass(frozen=True, slots=True)
class Summary:
    """One summary event to write: what a window counted and did not write in full."""

    sandbox_id: str
    type: str
    data: dict[str, Any]
    command: str | None = None

    @property
    def count(self) -> int:
        return int(self.data["count"])

    @property
    def of(self) -> str:
        return str(self.data["of"])


@dataclass(slots=True)
class _Window:
    sandbox_id: str
    type: str
    key: dict[str, Any]
    opened: float  # monotonic
    first_ts: float  # wall clock, of the first event counted (not written)
    last_ts: float = 0.0
    written: int = 0
    count: int = 0
    sample: dict[str, Any] | None = None
    commands: list[str] = field(default_factory=list)
    commands_cut: bool = False
    distinct: dict[str, list[str]] = field(default_factory=dict)
    distinct_cut: set[str] = field(default_factory=set)
    sums: dict[str, float] = field(default_factory=dict)
    tallies: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, shape: Shape, data: Mapping[str, Any], command: str | None,
            now: float) -> None:
        if self.count == 0:
            self.first_ts = now
            self.sample = dict(data)
        self.count += 1
        self.last_ts = now
        if command is not None and command not in self.commands:
            if len(self.commands) < _COMMANDS_KEPT:
                self.commands.append(command)
            else:
                self.commands_cut = True
        for name in shape.distinct:
            value = data.get(name)
            if value is None or value == "":
                continue
            text = str(value)[:_DISTINCT_CHARS]
            seen = self.distinct.setdefault(name, [])
            if text not in seen:
                if len(seen) < _DISTINCT_KEPT:
                    seen.append(text)
                else:
                    self.distinct_cut.add(name)
        for name in shape.sums:
            value = data.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.sums[name] = self.sums.get(name, 0) + value
        for name in shape.tallies:
            tally = self.tallies.setdefault(name, {})
            label = str(data.get(name))[:_DISTINCT_CHARS]
            if label not in tally and len(tally) >= _TALLY_KEPT:
                label = "other"
            tally[label] = tally.get(label, 0) + 1

    def summary(self, shape: Shape, window_s: float) -> Summary:
        data: dict[str, Any] = {
            "of": self.type, "key": self.key, "count": self.count,
            "written_in_full": self.written, "window_s": window_s,
            "first_ts": self.first_ts, "last_ts": self.last_ts, "sample": self.sample,
            "commands": self.commands, "commands_truncated": self.commands_cut,
            "distinct": self.distinct, "distinct_truncated": sorted(self.distinct_cut),
        }
        if shape.sums:
            data["sums"] = self.sums
        if shape.tallies:
            data["tallies"] = self.tallies
        # One command only: the summary is that command's, so `replay --command` finds it.
        command = self.commands[0] if len(self.commands) == 1 and not self.commands_cut \
            else None
        return Summary(self.sandbox_id, shape.summary_type, data, command)


class Aggregator:
    """Decides which repeated events are written in full and counts the rest. Thread-safe;
    every method is O(1) in the number of events (``due``/``drain``: in open windows)."""

    def __init__(self, *, window_s: float, burst: int, max_keys: int = 256,
                 shapes: Mapping[str, Shape] = SHAPES,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.window_s = window_s
        self.burst = burst
        self.max_keys = max_keys
        self._shapes = shapes
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, str, str], _Window] = {}
        self._keys: dict[str, int] = {}  # sandbox -> windows open

    def offer(self, sandbox_id: str, type_: str, key: Mapping[str, str | int],
              data: Mapping[str, Any], command: str | None = None,
              ) -> tuple[bool, list[Summary]]:
        """Account one event: (write it in full?, summaries of this key's window that ended,
        to write before it)."""
        shape = self._shapes[type_]
        now = self._clock()
        ended: list[Summary] = []
        with self._lock:
            name = _key_name(key)
            window = self._windows.get((sandbox_id, type_, name))
            if window is not None and now - window.opened >= self.window_s:
                self._close(window)
                if window.count:
                    ended.append(window.summary(shape, self.window_s))
                window = None
            if window is None:
                if self._keys.get(sandbox_id, 0) >= self.max_keys:
                    key, name = _OVERFLOW_KEY, _key_name(_OVERFLOW_KEY)
                    window = self._windows.get((sandbox_id, type_, name))
                if window is None:
                    window = _Window(sandbox_id, type_, dict(key), now, 0.0)
                    self._windows[(sandbox_id, type_, name)] = window
                    self._keys[sandbox_id] = self._keys.get(sandbox_id, 0) + 1
            if window.written < self.burst:
                window.written += 1
                return True, ended
            window.add(shape, data, command, self._wall())
            return False, ended

    def due(self) -> list[Summary]:
        """The summaries of every window that has ended (those windows are closed)."""
        now = self._clock()
        with self._lock:
            ended = [w for w in self._windows.values() if now - w.opened >= self.window_s]
            return self._take(ended)

    def drain(self, sandbox_id: str | None = None) -> list[Summary]:
        """Close the sandbox's open windows (every sandbox's with None) now: their summaries."""
        with self._lock:
            chosen = [w for w in self._windows.values()
                      if sandbox_id is None or w.sandbox_id == sandbox_id]
            return self._take(chosen)

    def next_due(self) -> float | None:
        """Seconds until the first open window ends (None: none is open)."""
        with self._lock:
            if not self._windows:
                return None
            first = min(w.opened for w in self._windows.values())
        return max(0.0, first + self.window_s - self._clock())

    def pending(self) -> int:
        """Events counted and not yet in a summary (every sandbox)."""
        with self._lock:
            return sum(w.count for w in self._windows.values())

    def _take(self, windows: list[_Window]) -> list[Summary]:
        summaries = []
        for window in windows:
            self._close(window)
            if window.count:
                summaries.append(window.summary(self._shapes[window.type], self.window_s))
        return summaries

    def _close(self, window: _Window) -> None:
        del self._windows[(window.sandbox_id, window.type, _key_name(window.key))]
        left = self._keys[window.sandbox_id] - 1
        if left:
            self._keys[window.sandbox_id] = left
        else:
            del self._keys[window.sandbox_id]


def _key_name(key: Mapping[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def _size(data: Any) -> int:
    return len(json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode())


def _cut(value: Any, chars: int) -> Any:
    if isinstance(value, str):
        return value if len(value) <= chars else f"{value[:chars]}...({len(value)} chars)"
    if isinstance(value, dict):
        return {k: _cut(v, chars) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_cut(v, chars) for v in value]
    return value


def bounded(data: dict[str, Any], limit: int) -> dict[str, Any]:
    """``data`` as it is if its JSON fits in ``limit`` bytes; else with every string cut
    shorter and shorter (saying so), and as a last resort only a summary's counts."""
    if _size(data) <= limit:
        return data
    for chars in (256, 64, 16):
        cut = _cut(data, chars)
        if _size(cut) <= limit:
            return {**cut, "clipped": True}
    core = {k: data[k] for k in _SUMMARY_CORE if k in data}
    core["key"] = _cut(core.get("key"), 16)
    return {**core, "clipped": True}
