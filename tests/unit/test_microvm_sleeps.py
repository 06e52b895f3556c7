"""``Sleep``: the rendezvous between a microVM's hibernate, its wake and the commands this
process follows in it (the VM side is tests/integration/test_hibernate.py's)."""

from __future__ import annotations

import queue
import threading

import pytest

from corral._backends.microvm import sleeps
from corral._backends.microvm.sleeps import Sleep
from corral.errors import BackendError


def _attach(tag: str) -> tuple[object, int, queue.Queue[dict[str, object]]]:
    if tag == "cmd_gone":
        raise BackendError("no running command is tagged 'cmd_gone' (it ended)")
    return "client", len(tag), queue.Queue()


def test_a_command_taken_before_or_after_the_wake_gets_itself_back() -> None:
    sleep = Sleep("sbx_a", ["cmd_early", "cmd_late", "cmd_gone"])
    assert sleep.holds("cmd_early") and not sleep.holds("cmd_other") and not sleep.holds(None)
    got: dict[str, object] = {}
    early = threading.Thread(target=lambda: got.update(
        early=sleep.take("cmd_early", still=lambda: True)))
    early.start()
    sleep.woke(_attach)
    early.join(timeout=10)
    assert got["early"].exec_id == len("cmd_early")  # type: ignore[attr-defined]
    assert sleep.take("cmd_late", still=lambda: True).exec_id == len("cmd_late")
    with pytest.raises(BackendError, match="it ended"):
        sleep.take("cmd_gone", still=lambda: True)
    assert not sleep.holds("cmd_late")  # taken once


def test_a_lost_sleep_or_a_vanished_sandbox_ends_the_wait_with_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sleep = Sleep("sbx_b", ["cmd_x"])
    sleep.lose("the sandbox was destroyed")
    with pytest.raises(BackendError, match="the sandbox was destroyed"):
        sleep.take("cmd_x", still=lambda: True)
    monkeypatch.setattr(sleeps, "_LOOK_S", 0.01)
    vanished = Sleep("sbx_c", ["cmd_y"])
    with pytest.raises(BackendError, match="the sandbox is gone"):
        vanished.take("cmd_y", still=lambda: False)
