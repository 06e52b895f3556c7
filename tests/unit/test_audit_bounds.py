"""The audit trail's bounds without root: the auditor's aggregation and worker on a real
directory, the budget watch with a stand-in control plane, and retention of destroyed trails.
Waits are on conditions with generous deadlines, never on a fixed sleep."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pytest

from corral._audit.auditor import Auditor
from corral._audit.budget import Budget, BudgetWatch, Overrun
from corral._audit.retention import prune
from corral._control.plane import Manager

SBX = "sbx_000000000001"
OTHER = "sbx_000000000002"


class _Sink:
    def __init__(self) -> None:
        self.totals: dict[tuple[str, str], float] = {}

    def add_counters(self, rows: Sequence[tuple[str, str, float]]) -> None:
        for name, labels, value in rows:
            self.totals[(name, labels)] = self.totals.get((name, labels), 0.0) + value


class _Nothing:
    def values(self) -> Iterable[str]:
        return []

    def placeholders(self, sandbox_id: str) -> Iterable[str]:
        return []


def _auditor(directory: Path, *, window_s: float = 0.3, burst: int = 2,
             sink: _Sink | None = None) -> Auditor:
    return Auditor(directory=directory, secrets=_Nothing(), placeholders=_Nothing(),
                   counters=sink or _Sink(), enabled=True, output_limit_bytes=1024,
                   aggregate_window_s=window_s, aggregate_burst=burst)


def _events(directory: Path, sandbox_id: str = SBX) -> list[dict[str, object]]:
    path = directory / f"{sandbox_id}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _refuse(auditor: Auditor, n: int, *, rule: str = "no-match",
            sandbox_id: str = SBX) -> None:
    for i in range(n):
        auditor.repeated(sandbox_id, "egress.decision", {"rule": rule},
                         {"host": f"h{i}.test", "verdict": "denied", "rule": rule},
                         command="cmd_1")


def test_the_interval_end_is_written_without_a_further_event(tmp_path: Path) -> None:
    sink = _Sink()
    auditor = _auditor(tmp_path, sink=sink)
    try:
        _refuse(auditor, 50)
        # Nothing else happens: the worker writes the summary once the window ends.
        _wait(lambda: any(e["type"] == "egress.summary" for e in _events(tmp_path)))
        events = _events(tmp_path)
        full = [e for e in events if e["type"] == "egress.decision"]
        [summary] = [e for e in events if e["type"] == "egress.summary"]
        assert len(full) == 2 and summary["data"]["count"] == 48
        assert summary["command"] == "cmd_1"
        assert sink.totals[("corral_audit_aggregated_events",
                            '{"type": "egress.decision"}')] == 48
    finally:
        auditor.close()


def test_pending_counts_come_before_the_end_of_a_trail_and_at_close(tmp_path: Path) -> None:
    auditor = _auditor(tmp_path, window_s=3600)
    _refuse(auditor, 10)
    _refuse(auditor, 7, sandbox_id=OTHER)
    auditor.event(SBX, "sandbox.destroyed", {"reason": "requested"})
    types = [e["type"] for e in _events(tmp_path)]
    assert types == ["egress.decision"] * 2 + ["egress.summary", "sandbox.destroyed"]
    assert _events(tmp_path, OTHER)[-1]["type"] == "egress.decision"
    auditor.close()  # the other sandbox's pending count is written at close
    assert _events(tmp_path, OTHER)[-1]["data"]["count"] == 5


def test_an_overrun_is_handled_off_the_writers_thread(tmp_path: Path) -> None:
    auditor = _auditor(tmp_path)
    handled: list[tuple[Overrun, int]] = []
    done = threading.Event()

    class Source:
        def budget(self, sandbox_id: str) -> Budget | None:
            return Budget(4096, "t1", 0)

        def tenant_sandboxes(self, tenant: str) -> Iterable[str]:
            return [SBX]

    def handler(overrun: Overrun) -> None:
        handled.append((overrun, threading.get_ident()))
        done.set()

    auditor.watch_budgets(Source(), handler)
    try:
        writer = threading.get_ident()
        for i in range(100):
            auditor.event(SBX, "file.read", {"path": f"/workspace/{i}" + "x" * 100})
            if done.is_set():
                break
        assert done.wait(30)
        overrun, thread = handled[0]
        assert thread != writer
        assert overrun.scope == "sandbox" and overrun.used_bytes > overrun.budget_bytes == 4096
        time.sleep(0.2)
        assert len(handled) == 1  # reported once
    finally:
        auditor.close()


class _Source:
    def __init__(self, budgets: dict[str, Budget]) -> None:
        self.budgets = budgets

    def budget(self, sandbox_id: str) -> Budget | None:
        return self.budgets.get(sandbox_id)

    def tenant_sandboxes(self, tenant: str) -> Iterable[str]:
        return [s for s, b in self.budgets.items() if b.tenant == tenant]


def test_the_budget_watch_sums_a_tenants_live_trails(tmp_path: Path) -> None:
    now = [0.0]
    watch = BudgetWatch(path_of=lambda s: tmp_path / f"{s}.jsonl", clock=lambda: now[0],
                        tenant_every_s=2.0, recheck_s=5.0)
    watch.attach(_Source({SBX: Budget(10_000, "t1", 1500), OTHER: Budget(10_000, "t1", 1500)}))
    (tmp_path / f"{SBX}.jsonl").write_bytes(b"x" * 1000)
    (tmp_path / f"{OTHER}.jsonl").write_bytes(b"x" * 1000)
    now[0] = 3.0
    assert not watch.wrote(OTHER, 1000)
    [overrun] = watch.check()
    assert (overrun.sandbox_id, overrun.scope, overrun.used_bytes) == (OTHER, "tenant", 2000)
    # Reported once, until the recheck interval has passed.
    now[0] = 6.0
    watch.wrote(OTHER, 1100)
    assert watch.check() == []
    now[0] = 9.0
    watch.wrote(OTHER, 1200)
    assert [o.sandbox_id for o in watch.check()] == [OTHER]


def test_the_writers_side_says_when_to_look(tmp_path: Path) -> None:
    watch = BudgetWatch(path_of=lambda s: tmp_path / f"{s}.jsonl")
    watch.attach(_Source({SBX: Budget(100, "t1", 0)}))
    assert not watch.wrote(SBX, 50)  # no budget known yet: the worker looks it up
    assert watch.check() == []
    assert watch.wrote(SBX, 150)
    assert [o.scope for o in watch.check()] == ["sandbox"]
    assert not watch.wrote(SBX, 200)  # reported already


def _trail(directory: Path, sandbox_id: str, *, size: int, age_s: float,
           ended: bool = True) -> Path:
    path = directory / f"{sandbox_id}.jsonl"
    last = {"v": 1, "seq": 2, "ts": 0, "sandbox": sandbox_id, "command": None,
            "type": "sandbox.destroyed" if ended else "command.output", "data": {}}
    line = (json.dumps(last) + "\n").encode()
    path.write_bytes(b"#" * (size - len(line) - 1) + b"\n" + line)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


@pytest.mark.parametrize("dry_run", [False, True])
def test_retention_by_age_then_size_never_a_live_trail(tmp_path: Path, dry_run: bool) -> None:
    day = 86400.0
    old = _trail(tmp_path, "sbx_00000000old1", size=1000, age_s=40 * day)
    mid = _trail(tmp_path, "sbx_00000000mid1", size=3000, age_s=10 * day)
    new = _trail(tmp_path, "sbx_00000000new1", size=3000, age_s=1 * day)
    live = _trail(tmp_path, "sbx_0000000live1", size=50_000, age_s=90 * day, ended=False)
    fresh = _trail(tmp_path, "sbx_000000fresh1", size=100, age_s=60, ended=False)
    (tmp_path / "notes.txt").write_text("not a trail")
    report = prune(tmp_path, is_live=lambda s: s == "sbx_0000000live1", max_age_s=30 * day,
                   max_total_bytes=4000, dry_run=dry_run)
    assert [(p.sandbox_id, p.reason) for p in report.removed] == [
        ("sbx_00000000old1", "age"), ("sbx_00000000mid1", "size")]
    assert (report.kept, report.live, report.unsettled) == (1, 1, 1)
    assert live.exists() and fresh.exists() and new.exists()
    assert old.exists() == dry_run and mid.exists() == dry_run


def test_a_trail_whose_sandbox_appears_meanwhile_is_kept(tmp_path: Path) -> None:
    _trail(tmp_path, "sbx_00000000old1", size=1000, age_s=90 * 86400)
    asked: list[str] = []

    def is_live(sandbox_id: str) -> bool:  # not live when listed, live when about to go
        asked.append(sandbox_id)
        return len(asked) > 1

    report = prune(tmp_path, is_live=is_live, max_age_s=1, max_total_bytes=0)
    assert report.removed == [] and (tmp_path / "sbx_00000000old1.jsonl").exists()


def test_past_a_tenant_budget_the_biggest_writers_are_reported_first(tmp_path: Path) -> None:
    now = [0.0]
    watch = BudgetWatch(path_of=lambda s: tmp_path / f"{s}.jsonl", clock=lambda: now[0])
    watch.attach(_Source({SBX: Budget(0, "t1", 3000), OTHER: Budget(0, "t1", 3000)}))
    (tmp_path / f"{SBX}.jsonl").write_bytes(b"x" * 1000)
    (tmp_path / f"{OTHER}.jsonl").write_bytes(b"x" * 1000)
    now[0] = 5.0
    watch.wrote(SBX, 1000)
    watch.wrote(OTHER, 1000)
    assert watch.check() == []  # 2000 of 3000: their sizes are noted
    (tmp_path / f"{SBX}.jsonl").write_bytes(b"x" * 1050)  # a little
    (tmp_path / f"{OTHER}.jsonl").write_bytes(b"x" * 3500)  # a flood
    now[0] = 10.0
    watch.wrote(SBX, 1050)
    watch.wrote(OTHER, 3500)
    assert [(o.sandbox_id, o.used_bytes) for o in watch.check()] == [(OTHER, 4550)]
    # Still over: whoever writes next is reported too.
    now[0] = 12.0
    watch.wrote(SBX, 1100)
    assert [o.sandbox_id for o in watch.check()] == [SBX]


def test_the_control_plane_pauses_at_the_budget_and_refuses_to_resume(tmp_path: Path) -> None:
    from corral.errors import QuotaExceeded
    from corral.testing import memory_manager

    mgr = memory_manager(tmp_path, audit_sandbox_max_bytes=8192)
    try:
        info = mgr.create()
        for i in range(200):  # what a chatty sandbox makes the control plane write
            mgr.auditor.event(info.id, "file.read", {"path": f"/workspace/{i}" + "x" * 200})
            if mgr.get(info.id).state == "paused":
                break
        # The pause's own event is written just after the state changes: wait for both.
        _wait(lambda: mgr.get(info.id).state == "paused" and any(
            e["type"] == "sandbox.paused" for e in _events(tmp_path / "audit", info.id)))
        types = [e["type"] for e in _events(tmp_path / "audit", info.id)]
        assert types.index("audit.budget_exceeded") < types.index("sandbox.paused")
        with pytest.raises(QuotaExceeded, match="over its budget of 8.0 KiB"):
            mgr.resume(info.id)
        mgr.destroy(info.id)
        assert _events(tmp_path / "audit", info.id)[-1]["type"] == "sandbox.destroyed"
    finally:
        mgr.close()


def test_a_tier_that_cannot_pause_has_the_sandbox_destroyed(manager: Manager) -> None:
    from corral.errors import BackendError

    info = manager.create()

    def refuse(spec: object, paused: bool) -> None:
        raise BackendError("this tier cannot pause")

    manager.backend.pause = refuse  # type: ignore[method-assign]
    manager.sandboxes.stop_over_budget(Overrun(info.id, "sandbox", "local", 9000, 8192))
    events = _events(manager.auditor.directory, info.id)
    assert [e["type"] for e in events][-2:] == ["audit.budget_exceeded", "sandbox.destroyed"]
    assert events[-1]["data"]["reason"] == "audit-budget"
    assert manager.store.get(info.id) is None


def test_a_tenants_audit_budgets_are_kept_changed_and_cleared(tmp_path: Path) -> None:
    import sqlite3

    from corral._control.store import Store
    from corral._control.tenants import TenantDirectory
    from corral.errors import UsageError

    # A store made before audit budgets: its tenants get the columns, at the default (None).
    with sqlite3.connect(tmp_path / "old.db") as db:
        db.execute("CREATE TABLE tenants (name TEXT PRIMARY KEY, max_sandboxes INTEGER NOT "
                   "NULL, tiers TEXT NOT NULL, commands_per_minute INTEGER NOT NULL, "
                   "created_at REAL NOT NULL, ceiling TEXT NOT NULL DEFAULT '{}')")
        db.execute("INSERT INTO tenants VALUES ('old', 3, '[\"small\"]', 60, 0, '{}')")
    store = Store(tmp_path / "old.db")
    try:
        directory = TenantDirectory(store)
        assert directory.get("old").audit_max_bytes is None
        made = directory.add_tenant("acme", audit_max_bytes=2**30, audit_sandbox_max_bytes=0)
        assert (made.audit_max_bytes, made.audit_sandbox_max_bytes) == (2**30, 0)
        kept = directory.set_tenant("acme", max_sandboxes=4)  # other changes keep them
        assert (kept.audit_max_bytes, kept.audit_sandbox_max_bytes) == (2**30, 0)
        changed = directory.set_tenant("acme", audit_sandbox_max_bytes=2**20)
        assert changed.audit_sandbox_max_bytes == 2**20 and changed.audit_max_bytes == 2**30
        cleared = directory.set_tenant("acme", clear_audit=True)
        assert (cleared.audit_max_bytes, cleared.audit_sandbox_max_bytes) == (None, None)
        with pytest.raises(UsageError, match="number of bytes"):
            directory.set_tenant("acme", audit_max_bytes=-1)
    finally:
        store.close()
