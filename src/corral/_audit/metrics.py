"""Prometheus metrics, kept as counters in a shared sink (the control plane's store) so every
process (CLI calls, the service) adds to the same numbers and ``corral metrics`` prints the totals.

This module knows the sink and the source only as the two protocols below; it does not know
where they live or how they batch.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["DURATION_BUCKETS", "MEMORY_BUCKETS", "CounterSink", "MetricsSource", "Metrics",
           "render"]


class CounterSink(Protocol):
    """Where counts go: each row is (name, labels as sorted JSON, amount), added to a sum."""

    def add_counters(self, rows: Sequence[tuple[str, str, float]]) -> None: ...


class MetricsSource(Protocol):
    """What ``render`` reads: the counters' totals, and how many sandboxes are in each state."""

    def counters(self) -> Mapping[tuple[str, str], float]: ...

    def state_counts(self) -> Mapping[str, int]: ...


DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    300.0, 600.0)
MEMORY_BUCKETS = tuple(float(1 << n) for n in range(20, 34, 2))  # 1 MiB .. 8 GiB

_COUNTERS = {
    "corral_sandboxes_created": ("Sandboxes created.", ()),
    "corral_sandboxes_destroyed": ("Sandboxes destroyed, by reason.", ("reason",)),
    "corral_commands_started": ("Commands started.", ()),
    "corral_commands_finished": ("Commands finished, by outcome.", ("outcome",)),
    "corral_command_cpu_seconds": ("CPU seconds used by commands.", ()),
    "corral_file_operations": ("File operations through the API, by operation.", ("op",)),
    "corral_file_refusals": ("File operations refused (a path leaving /workspace), by "
                             "operation.", ("op",)),
    "corral_egress_decisions": ("Egress gateway decisions, by verdict.", ("verdict",)),
    "corral_reaper_actions": ("Clean-up actions (expired sandboxes, crash leftovers).",
                              ("action",)),
    "corral_audit_aggregated_events": ("Repeated events counted into a summary event instead "
                                       "of written one by one, by event type.", ("type",)),
    "corral_audit_budget_stops": ("Sandboxes stopped at an audit byte budget, by budget "
                                  "(sandbox or tenant) and action (pause or destroy).",
                                  ("scope", "action")),
    "corral_sandbox_sleeps": ("Sandboxes put to sleep, by the state they went to (paused, "
                              "hibernated).", ("state",)),
    "corral_sandbox_wakes": ("Sandboxes woken, by the state they woke from (paused, "
                             "hibernated).", ("state",)),
    "corral_audit_pruned_trails": ("Trails of destroyed sandboxes removed by retention, by "
                                   "reason (age or size).", ("reason",)),
}
_HISTOGRAMS = {
    "corral_command_duration_seconds": ("Wall time of commands.", DURATION_BUCKETS),
    "corral_command_peak_memory_bytes": ("Peak memory of commands.", MEMORY_BUCKETS),
}


def _key(labels: Mapping[str, str]) -> str:
    return _key_of(tuple(sorted(labels.items())))


@functools.lru_cache(maxsize=1024)
def _key_of(items: tuple[tuple[str, str], ...]) -> str:
    # Label sets are few (an outcome, a bucket's bound, an operation): each command's five
    # rows were five json.dumps calls.
    return json.dumps(dict(items), sort_keys=True)


class Metrics:
    """Adds to the sink's counters (one ``add_counters`` call per event)."""

    def __init__(self, sink: CounterSink) -> None:
        self._sink = sink

    def inc(self, name: str, *, amount: float = 1.0,
            labels: Mapping[str, str] | None = None) -> None:
        self._sink.add_counters([(name, _key(labels or {}), amount)])

    def command_finished(self, *, outcome: str, duration_s: float, cpu_s: float,
                         peak_memory_bytes: int) -> None:
        rows = [
            ("corral_commands_finished", _key({"outcome": outcome}), 1.0),
            ("corral_command_cpu_seconds", _key({}), cpu_s),
        ]
        for name, value in (("corral_command_duration_seconds", duration_s),
                            ("corral_command_peak_memory_bytes", float(peak_memory_bytes))):
            buckets = _HISTOGRAMS[name][1]
            # Store the bucket an observation falls in; cumulative counts are built on read.
            bound = next((b for b in buckets if value <= b), float("inf"))
            rows += [(f"{name}:bucket", _key({"le": repr(bound)}), 1.0),
                     (f"{name}:sum", _key({}), value)]
        self._sink.add_counters(rows)


class _Collector:
    def __init__(self, source: MetricsSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        # Imported here: every command counts through `Metrics`, only `render` needs the client
        # library (~20 ms of every CLI start-up otherwise).
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        rows = self._source.counters()
        states = GaugeMetricFamily("corral_sandboxes", "Sandboxes by state.", labels=["state"])
        for state, count in sorted(self._source.state_counts().items()):
            states.add_metric([state], count)
        yield states
        for name, (doc, label_names) in _COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=list(label_names))
            for (row_name, labels), value in rows.items():
                if row_name == name:
                    parsed = json.loads(labels)
                    family.add_metric([parsed.get(k, "") for k in label_names], value)
            yield family
        for name, (doc, buckets) in _HISTOGRAMS.items():
            per_bucket = {float(json.loads(labels)["le"]): value
                          for (row_name, labels), value in rows.items()
                          if row_name == f"{name}:bucket"}
            cumulative, running = [], 0.0
            for bound in (*buckets, float("inf")):
                running += per_bucket.get(bound, 0.0)
                cumulative.append(("+Inf" if bound == float("inf") else repr(bound), running))
            total = rows.get((f"{name}:sum", _key({})), 0.0)
            histogram = HistogramMetricFamily(name, doc)
            histogram.add_metric([], cumulative, sum_value=total)
            yield histogram


def render(source: MetricsSource) -> str:
    """Every metric in Prometheus' text exposition format."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(source))
    return generate_latest(registry).decode()
