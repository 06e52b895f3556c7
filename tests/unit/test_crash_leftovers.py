"""What a Corral process killed mid-way leaves, and what the next recovery makes of it at once
(issue 36): a command it ran gets its end in the trail, whatever the tier ran it in; a create
it had begun is cleaned up, not left ``creating`` for a minute. Over the memory backend, with
the dead process played by an owner that never existed (``PID.START`` that is no process)."""

from __future__ import annotations

import os
from pathlib import Path

from corral._audit.inflight import InFlight, abandoned, unfinished
from corral._control.manager import Manager
from corral._core.owner import this_owner

_DEAD = "1.1"  # pid 1 did not start at tick 1: no such process


def _marks(manager: Manager) -> list[str]:
    """What the journals on disk show in flight, as ``owner/sandbox.command``."""
    root = manager.auditor.directory / ".inflight"
    return sorted(f"{owner}/{mark}" for owner in os.listdir(root)
                  for mark in unfinished((root / owner).read_bytes())) if root.exists() else []


def test_a_command_marks_itself_while_it_runs(manager: Manager) -> None:
    sandbox = manager.create().id
    seen: list[list[str]] = []
    manager.run(sandbox, ["echo", "hi"], on_stdout=lambda _: seen.append(_marks(manager)))
    command = manager.auditor.trail(sandbox, types=["command.started"]).events[-1].command
    assert seen and seen[0] == [f"{this_owner()}/{sandbox}.{command}"]
    assert _marks(manager) == []


def test_a_dead_processs_command_gets_its_end_at_the_next_recovery(manager: Manager) -> None:
    sandbox = manager.create().id
    recorder = manager.auditor.command(sandbox)
    assert recorder is not None
    recorder.started(argv=["sleep", "600"], cwd="/workspace", env={}, timeout_s=60,
                     context=None)
    # The process that started it is gone: its marks are a dead owner's.
    InFlight(manager.auditor.directory, _DEAD).add(sandbox, recorder.command_id)
    manager.auditor.inflight.remove(sandbox, recorder.command_id)  # only the dead one's
    assert any("interrupted" in item for item in manager.recover())
    ends = manager.auditor.trail(sandbox, types=["command.finished"],
                                 command=recorder.command_id).events
    assert len(ends) == 1 and ends[0].data["interrupted"] is True
    assert "pid 1" in ends[0].data["error"]
    assert _marks(manager) == []
    manager.recover()  # once: the end is not written again
    assert len(manager.auditor.trail(sandbox, types=["command.finished"]).events) == 1


def test_abandoned_skips_live_owners_and_removes_strays_unopened(tmp_path: Path) -> None:
    live = InFlight(tmp_path, this_owner())
    live.add("sbx_aaaaaaaaaaaa", "cmd_0123456789ab")
    dead = InFlight(tmp_path, _DEAD)
    for sandbox in ("sbx_bbbbbbbbbbbb", "sbx_cccccccccccc", "sbx_dddddddddddd"):
        dead.add(sandbox, "cmd_0123456789ab")
    dead.remove("sbx_cccccccccccc", "cmd_0123456789ab")  # finished: nothing to close
    with open(tmp_path / ".inflight" / _DEAD, "a") as journal:
        journal.write("+not a mark\n-sbx_\n")  # torn or foreign lines are ignored
    os.mkfifo(tmp_path / ".inflight" / "2.2")  # a dead owner's name, a FIFO: never opened
    (tmp_path / ".inflight" / "3.3").mkdir()  # a directory (an older layout)
    os.mkfifo(tmp_path / ".inflight" / "3.3" / "sbx_eeeeeeeeeeee.cmd_0123456789ab")
    os.mkfifo(tmp_path / ".inflight" / "junk")
    found = list(abandoned(tmp_path, lambda pid, start: f"{pid}.{start}" == this_owner()))
    assert [(a.sandbox_id, a.owner_pid) for a in found] == [
        ("sbx_bbbbbbbbbbbb", 1), ("sbx_dddddddddddd", 1)]
    assert os.listdir(tmp_path / ".inflight") == [this_owner()]


def test_the_journal_stays_small_on_a_process_that_always_runs_something(
        tmp_path: Path) -> None:
    journal = InFlight(tmp_path, this_owner())
    journal.add("sbx_aaaaaaaaaaaa", "cmd_000000000000")  # runs throughout
    for i in range(20_000):
        journal.add("sbx_bbbbbbbbbbbb", f"cmd_{i:012x}")
        journal.remove("sbx_bbbbbbbbbbbb", f"cmd_{i:012x}")
    path = tmp_path / ".inflight" / this_owner()
    assert path.stat().st_size < 300 * 1024
    assert unfinished(path.read_bytes()) == ["sbx_aaaaaaaaaaaa.cmd_000000000000"]
    journal.remove("sbx_aaaaaaaaaaaa", "cmd_000000000000")
    assert path.stat().st_size == 0  # nothing in flight: emptied


def test_a_create_whose_process_died_is_cleaned_at_once(manager: Manager) -> None:
    manager.list()  # recovery has run: what follows is what a later pass finds

    def creating(creator: str | None) -> str:
        sandbox_id = f"sbx_{os.urandom(6).hex()}"
        manager.store.insert(sandbox_id=sandbox_id, template="base", resources="small",
                             ttl_s=600, labels={}, allocate_uid=lambda taken: 100_000 + len(
                                 taken), creator=creator)
        return sandbox_id

    dead, mine, unknown = creating(_DEAD), creating(this_owner()), creating(None)
    removed = manager.recover()
    assert f"sandbox {dead}" in removed
    assert manager.store.get(dead) is None
    # Its creator is alive (a create under way), or unknown and not yet a minute old.
    assert manager.store.get(mine) is not None and manager.store.get(unknown) is not None
