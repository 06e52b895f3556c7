"""Aggregation of repeated events, with a clock the test moves: what is written in full, what
is counted, and that the counts are exact."""

from __future__ import annotations

import json

from corral._audit.aggregate import Aggregator

SBX = "sbx_000000000001"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _decision(host: str, command: str = "cmd_a") -> dict[str, object]:
    return {"method": "GET", "host": host, "port": 80, "verdict": "denied", "rule": "no-match",
            "reason": f"{host}:80 matches no allow rule", "bytes_up": 0, "bytes_down": 0}


def _aggregator(clock: Clock, *, burst: int = 3, max_keys: int = 32) -> Aggregator:
    return Aggregator(window_s=10.0, burst=burst, max_keys=max_keys, clock=clock, wall=clock)


def test_the_first_of_an_interval_are_written_in_full_and_the_rest_counted() -> None:
    clock = Clock()
    agg = _aggregator(clock)
    verdicts = [agg.offer(SBX, "egress.decision", {"rule": "no-match"},
                          _decision(f"h{i}.test"), "cmd_a") for i in range(10)]
    assert [full for full, _ in verdicts] == [True] * 3 + [False] * 7
    assert all(ended == [] for _, ended in verdicts)
    assert agg.due() == []  # the interval has not ended
    clock.now += 10.0
    [summary] = agg.due()
    assert summary.type == "egress.summary" and summary.command == "cmd_a"
    data = summary.data
    assert data["count"] == 7 and data["written_in_full"] == 3
    assert data["key"] == {"rule": "no-match"} and data["of"] == "egress.decision"
    assert data["sample"]["host"] == "h3.test"
    # Distinct hosts: bounded (8 kept), the cut said.
    assert data["distinct"]["host"] == [f"h{i}.test" for i in range(3, 10)]
    assert data["distinct_truncated"] == []
    assert agg.due() == [] and agg.pending() == 0
    # A new interval: written in full again.
    assert agg.offer(SBX, "egress.decision", {"rule": "no-match"}, _decision("x"))[0]


def test_a_single_refusal_is_written_in_full_and_leaves_no_summary() -> None:
    clock = Clock()
    agg = _aggregator(clock)
    assert agg.offer(SBX, "egress.decision", {"rule": "no-match"}, _decision("a"))[0]
    clock.now += 60
    assert agg.due() == [] and agg.next_due() is None


def test_counts_are_exact_across_intervals_keys_and_a_drain() -> None:
    clock = Clock()
    agg = _aggregator(clock, burst=2)
    offered: dict[str, int] = {"no-match": 0, "ip-literal": 0}
    full: dict[str, int] = {"no-match": 0, "ip-literal": 0}
    counted: dict[str, int] = {"no-match": 0, "ip-literal": 0}
    for step in range(5000):
        rule = "no-match" if step % 3 else "ip-literal"
        clock.now += 0.013
        written, ended = agg.offer(SBX, "egress.decision", {"rule": rule}, _decision("h"))
        offered[rule] += 1
        full[rule] += written
        for summary in ended:
            counted[summary.data["key"]["rule"]] += summary.count
        if step % 700 == 0:
            for summary in agg.due():
                counted[summary.data["key"]["rule"]] += summary.count
    for summary in agg.drain(SBX):
        counted[summary.data["key"]["rule"]] += summary.count
    assert agg.pending() == 0
    for rule in offered:
        assert full[rule] + counted[rule] == offered[rule], rule
    # ~65 s of flood, 10 s intervals: at most 2 in full per interval and rule.
    assert full["no-match"] <= 2 * 8 and full["ip-literal"] <= 2 * 8


def test_keys_per_sandbox_are_bounded_by_an_overflow_key() -> None:
    clock = Clock()
    agg = _aggregator(clock, burst=1, max_keys=4)
    for i in range(100):
        agg.offer(SBX, "egress.decision", {"rule": f"deny r{i}.test"}, _decision("h"))
    summaries = agg.drain()
    keys = {json.dumps(s.data["key"], sort_keys=True) for s in summaries}
    # Four real keys (each wrote its one in full, counted nothing) and the overflow's.
    assert len(keys) == 1 and "overflow" in next(iter(keys))
    assert sum(s.count for s in summaries) == 100 - 4 - 1


def test_distinct_values_and_tallies_are_bounded() -> None:
    clock = Clock()
    agg = _aggregator(clock, burst=1)
    for i in range(1000):
        agg.offer(SBX, "port.connection", {"port": 8000},
                  {"port": 8000, "who": "public", "status": 200 + i % 40,
                   "path": f"/{i}/" + "p" * 500, "method": "GET", "bytes_in": 10,
                   "bytes_out": 5})
    [summary] = agg.drain(SBX)
    data = summary.data
    assert summary.type == "port.summary" and summary.command is None
    assert data["count"] == 999
    assert len(data["distinct"]["path"]) == 8 and data["distinct_truncated"] == ["path"]
    assert all(len(p) <= 100 for p in data["distinct"]["path"])
    assert len(data["tallies"]["status"]) <= 17 and sum(data["tallies"]["status"].values()) == 999
    assert data["sums"] == {"bytes_in": 9990, "bytes_out": 4995}
    assert len(json.dumps(data)) < 6000


def test_drain_takes_one_sandbox_only() -> None:
    clock = Clock()
    agg = _aggregator(clock, burst=1)
    other = "sbx_000000000002"
    for sandbox in (SBX, other):
        for _ in range(3):
            agg.offer(sandbox, "egress.decision", {"rule": "no-match"}, _decision("h"))
    assert [s.sandbox_id for s in agg.drain(SBX)] == [SBX]
    assert agg.pending() == 2
    assert [s.sandbox_id for s in agg.drain()] == [other]


def test_what_is_written_has_a_size_bound_whatever_the_sandbox_sent() -> None:
    from corral._audit.aggregate import FULL_MAX_BYTES, SUMMARY_MAX_BYTES, bounded

    def size(data: dict[str, object]) -> int:
        return len(json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode())

    ugly = "\x01\u202e" * 200  # escaped in JSON to 6 bytes a character, bidi overrides too
    decision = {"method": ugly[:40], "host": ugly, "port": 80, "verdict": "denied",
                "rule": "bad-host", "reason": ugly, "mode": "", "address": "",
                "bytes_up": 0, "bytes_down": 0, "secrets_substituted": [ugly] * 4}
    assert size(decision) > FULL_MAX_BYTES
    cut = bounded(decision, FULL_MAX_BYTES)
    assert size(cut) <= FULL_MAX_BYTES and cut["clipped"] is True
    assert cut["rule"] == "bad-host" and cut["port"] == 80
    assert bounded({"host": "a.test"}, FULL_MAX_BYTES) == {"host": "a.test"}

    clock = Clock()
    agg = _aggregator(clock, burst=1)
    for i in range(50):
        agg.offer(SBX, "egress.decision", {"rule": "bad-host", "command": "cmd_a"},
                  {**decision, "host": f"{i}{ugly}", "method": f"{i}{ugly}"}, "cmd_a")
    [summary] = agg.drain()
    assert size(summary.data) > SUMMARY_MAX_BYTES
    data = bounded(summary.data, SUMMARY_MAX_BYTES)
    assert size(data) <= SUMMARY_MAX_BYTES and data["count"] == 49
