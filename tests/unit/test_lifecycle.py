"""A sandbox's lifecycle (issue 40, first part): killed at its timeout by default; with
``on_timeout="pause"`` paused instead and kept for ``paused_keep_s``; with ``auto_resume`` a call
that needs it resumes it first (one resume for concurrent callers), else it is refused with what
to do. Over the memory backend, with the lifetime's end set in the store (no waiting)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from corral._control.plane import Manager
from corral.errors import SandboxBusy, SandboxExpired
from corral.models import Lifecycle
from corral.testing import memory_manager


def _events(manager: Manager, sandbox_id: str, kind: str) -> list[dict[str, object]]:
    trail = manager.auditor.trail(sandbox_id, types=[kind])
    return [event.data for event in trail.events]


def _time_out(manager: Manager, sandbox_id: str) -> None:
    manager.store.set_expiry(sandbox_id, time.time() - 1)


def test_by_default_a_sandbox_is_killed_at_its_timeout(manager: Manager) -> None:
    sandbox = manager.create(timeout=60)
    assert sandbox.lifecycle == Lifecycle()
    _time_out(manager, sandbox.id)
    with pytest.raises(SandboxExpired):
        manager.get(sandbox.id)


def test_on_timeout_pause_keeps_it_paused_and_a_resume_starts_its_life_again(
        manager: Manager) -> None:
    sandbox = manager.create(timeout=60, lifecycle=Lifecycle(on_timeout="pause"))
    manager.files(sandbox.id).write("notes.txt", b"kept")
    _time_out(manager, sandbox.id)
    paused = manager.get(sandbox.id)
    assert paused.state == "paused"
    keep = manager.settings.paused_keep_s
    assert time.time() + keep - 5 < paused.expires_at <= time.time() + keep
    assert _events(manager, sandbox.id, "sandbox.paused")[-1]["reason"] == "timeout"
    # Not resumed by a call (no auto_resume): refused with what to do.
    with pytest.raises(SandboxBusy, match=r"paused; resume\(\) it to run commands"):
        manager.run(sandbox.id, ["true"])
    resumed = manager.resume(sandbox.id)
    assert resumed.state == "running"
    assert time.time() + 55 < resumed.expires_at <= time.time() + 60  # its own 60 s again
    assert manager.files(sandbox.id).read("notes.txt") == b"kept"


def test_a_sandbox_kept_paused_past_its_keep_is_destroyed(manager: Manager) -> None:
    sandbox = manager.create(timeout=60, lifecycle=Lifecycle(on_timeout="pause"))
    _time_out(manager, sandbox.id)
    assert manager.get(sandbox.id).state == "paused"
    _time_out(manager, sandbox.id)  # the keep is over too
    with pytest.raises(SandboxExpired):
        manager.get(sandbox.id)


def test_auto_resume_wakes_it_for_a_command_a_file_and_code(manager: Manager) -> None:
    sandbox = manager.create(timeout=60, lifecycle=Lifecycle(on_timeout="pause",
                                                             auto_resume=True))
    _time_out(manager, sandbox.id)
    assert manager.get(sandbox.id).state == "paused"
    assert manager.run(sandbox.id, ["true"]).exit_code == 0
    assert manager.get(sandbox.id).state == "running"
    assert _events(manager, sandbox.id, "sandbox.resumed")[-1]["reason"] == "a call needed it"
    _time_out(manager, sandbox.id)
    assert manager.get(sandbox.id).state == "paused"
    manager.files(sandbox.id).write("woken.txt", b"by a file")
    assert manager.get(sandbox.id).state == "running"


def test_files_of_a_paused_sandbox_without_auto_resume_are_read_in_place(
        manager: Manager) -> None:
    sandbox = manager.create(timeout=60, lifecycle=Lifecycle(on_timeout="pause"))
    manager.files(sandbox.id).write("a.txt", b"x")
    manager.pause(sandbox.id)
    assert manager.files(sandbox.id).read("a.txt") == b"x"
    assert manager.get(sandbox.id).state == "paused"


def test_concurrent_callers_wait_for_one_resume(manager: Manager) -> None:
    sandbox = manager.create(timeout=60, lifecycle=Lifecycle(on_timeout="pause",
                                                             auto_resume=True))
    manager.pause(sandbox.id)
    codes: list[int] = []
    start = threading.Barrier(8)

    def call() -> None:
        start.wait(timeout=30)
        codes.append(manager.run(sandbox.id, ["true"]).exit_code)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert codes == [0] * 8
    assert len(_events(manager, sandbox.id, "sandbox.resumed")) == 1


def test_the_reaper_pauses_what_its_lifecycle_keeps(manager: Manager) -> None:
    kept = manager.create(timeout=60, lifecycle=Lifecycle(on_timeout="pause"))
    killed = manager.create(timeout=60)
    _time_out(manager, kept.id)
    _time_out(manager, killed.id)
    manager.recovery.recover()
    assert manager.record(kept.id) is not None and manager.record(kept.id).state == "paused"
    record = manager.record(killed.id)
    assert record is None or record.state == "destroying"


def test_a_lifecycle_survives_a_restart_and_a_fork(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = memory_manager(home)
    asked = Lifecycle(on_timeout="pause", auto_resume=True)
    sandbox = first.create(timeout=120, lifecycle=asked)
    (child,) = first.fork(sandbox.id, 1)
    assert child.lifecycle == asked
    first.close()
    again = memory_manager(home)
    try:
        assert again.get(sandbox.id).lifecycle == asked
        record = again.record(sandbox.id)
        assert record is not None and record.timeout_s == 120
    finally:
        for info in again.store.list():
            again._destroy(info, reason="cleanup")
        again.close()


def test_on_idle_pause_freezes_an_idle_sandbox_and_a_call_wakes_it(manager: Manager) -> None:
    sandbox = manager.create(timeout=600, idle_timeout=1, lifecycle=Lifecycle(
        on_idle="pause", auto_resume=True))
    destroyed = manager.create(timeout=600, idle_timeout=1)  # the default: destroyed when idle
    time.sleep(1.2)
    manager.recovery.recover()
    assert manager.get(sandbox.id).state == "paused"
    assert _events(manager, sandbox.id, "sandbox.paused")[-1]["reason"] == "idle"
    record = manager.record(destroyed.id)
    assert record is None or record.state == "destroying"
    # The next call wakes it, and counts as activity: the reaper leaves it running.
    assert manager.run(sandbox.id, ["true"]).exit_code == 0
    manager.recovery.recover()
    woken = manager.get(sandbox.id)
    assert woken.state == "running" and woken.expires_at > time.time() + 500  # lifetime kept
