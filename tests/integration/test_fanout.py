"""``FanOut``/``AsyncFanOut``: sandboxes from one snapshot, a command in each, results as they
finish, with back-pressure; embedded and over HTTP (``where``), real sandboxes.

(Through a cluster gateway, with a tenant quota pushing back and the snapshot copied to the
other node: ``test_cluster_serve.py``.)

Bounded: a handful of sandboxes per case, every command with a timeout.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator

import anyio
import pytest

from corral import AsyncFanOut, FanOut, Sandbox, SnapshotInfo

pytestmark = pytest.mark.needs_root


@pytest.fixture
def seed(where: dict[str, str]) -> Iterator[SnapshotInfo]:
    with Sandbox.create(**where) as source:
        source.files.write("seed.txt", "from the snapshot")
        snap = source.snapshot(f"fanout-{secrets.token_hex(4)}")
    yield snap
    Sandbox.delete_snapshot(snap, **where)


def alive(where: dict[str, str], tag: str) -> int:
    return sum(1 for info in Sandbox.list(**where) if info.labels.get("fanout") == tag)


def test_every_rollout_runs_once_and_a_slow_consumer_holds_the_starts_back(
        where: dict[str, str], seed: SnapshotInfo) -> None:
    tag = secrets.token_hex(4)
    most = 0
    watching = threading.Event()

    def watch() -> None:
        nonlocal most
        while not watching.is_set():
            most = max(most, alive(where, tag))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    seen = []
    try:
        with FanOut(seed.id, 6, lambda i: f"cat seed.txt; echo ' #{i}'", concurrency=2,
                    timeout=30, create={"labels": {"fanout": tag}}, **where) as rollouts:
            for rollout in rollouts:
                seen.append(rollout)
                time.sleep(0.3)  # a slow learner: nothing new starts past two unread
    finally:
        watching.set()
        watcher.join()
    assert sorted(r.index for r in seen) == list(range(6))
    for rollout in seen:
        assert rollout.ok, rollout
        assert rollout.result is not None
        assert rollout.result.stdout == f"from the snapshot #{rollout.index}\n"
    assert len({r.sandbox_id for r in seen}) == 6
    assert 1 <= most <= 2, most
    assert alive(where, tag) == 0  # each destroyed once its command was done


def test_leaving_early_destroys_what_runs(where: dict[str, str], seed: SnapshotInfo) -> None:
    tag = secrets.token_hex(4)

    async def main() -> list[int]:
        got = []
        with anyio.fail_after(60):
            await leave_early(got)
        return got

    async def leave_early(got: list[int]) -> None:
        async with AsyncFanOut(seed.name or seed.id, 20,
                               lambda i: "true" if i == 0 else "sleep 30", concurrency=3,
                               timeout=60, create={"labels": {"fanout": tag}},
                               **where) as rollouts:
            async for rollout in rollouts:
                got.append(rollout.index)
                break

    assert anyio.run(main) == [0]
    assert alive(where, tag) == 0


def test_a_failing_rollout_is_a_result_not_an_exception(where: dict[str, str],
                                                        seed: SnapshotInfo) -> None:
    with FanOut(seed.id, 3, lambda i: [] if i == 1 else f"exit {i}",
                concurrency=3, timeout=30, **where) as rollouts:
        by_index = {r.index: r for r in rollouts}
    assert by_index[0].ok
    # An empty command: refused before it runs, reported on its rollout alone.
    assert type(by_index[1].error).__name__ == "CommandError" and by_index[1].result is None
    assert by_index[2].result is not None and by_index[2].result.exit_code == 2
    assert not by_index[2].ok
    with FanOut("no-such-snapshot", 2, "true", **where) as rollouts:
        failed = list(rollouts)
    assert [type(r.error).__name__ for r in failed] == ["SnapshotNotFound"] * 2
