"""The audit log's group commit: concurrent ``append(sync=True)`` calls on one sandbox's log
share ``fdatasync``s, and each returns only once an ``fdatasync`` begun after its own write
has finished (a spy around the real call records what each sync covered)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from corral._audit.log import AuditLog, Record, read_trail


def test_concurrent_synced_appends_share_syncs_and_each_is_covered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = AuditLog(tmp_path / "sbx.jsonl", "sbx")
    real = os.fdatasync
    syncs: list[tuple[int, int]] = []  # (writes made when a sync began, when it ended)
    spy_lock = threading.Lock()

    def spy(fd: int) -> None:
        begun = log._written
        real(fd)
        with spy_lock:
            syncs.append((begun, log._written))

    monkeypatch.setattr(os, "fdatasync", spy)
    failures: list[str] = []
    start = threading.Barrier(8)

    def writer(n: int) -> None:
        start.wait()
        for i in range(25):
            with log._lock:
                before = log._written
            log.append([Record("command.finished", {"n": n, "i": i})], sync=True)
            # Our write was numbered after `before`: a sync covering it has finished.
            if log._synced < before + 1:
                failures.append(f"append returned with write {before + 1} not yet synced")

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    log.close()
    assert failures == []
    events = read_trail(tmp_path / "sbx.jsonl").events
    assert [e.seq for e in events] == list(range(1, 201))
    assert 1 <= len(syncs) <= 200 and log._synced == log._written == 200
    assert all(begun <= ended for begun, ended in syncs)


def test_close_syncs_what_a_writer_has_not_yet(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    log = AuditLog(tmp_path / "sbx.jsonl", "sbx")
    log.append([Record("command.started", {})])  # unsynced
    calls: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (calls.append(fd), real(fd)))
    log.close()
    assert len(calls) == 1
