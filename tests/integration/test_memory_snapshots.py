"""Memory snapshots on a tier without them (the namespace tier): a clear refusal naming the
microvm tier, through the embedded and the remote SDK, while a real command runs, and nothing
changed by it. What they do where they exist is tested over ``MemoryVMBackend``
(tests/unit/test_memory_snapshots.py) and with the microvm tier."""

from __future__ import annotations

import threading
import time

import pytest

from corral import Sandbox, UsageError
from corral._control.manager import Manager

pytestmark = pytest.mark.needs_root


def test_the_namespace_tier_refuses_memory_snapshots_clearly(where: dict[str, str],
                                                             manager: Manager) -> None:
    sb = Sandbox.create(isolation="namespace", **where)
    runner: threading.Thread | None = None
    taken: list[str] = []
    try:
        sb.files.write("state.txt", "kept")
        snapshots_before = {s.id for s in Sandbox.list_snapshots(**where)}
        sandboxes_before = {i.id for i in Sandbox.list(**where)}
        layers_before = manager.store.layer_ids()
        # A real process runs in it: the moment a memory snapshot is for.
        runner = threading.Thread(target=sb.commands.run, args=("sleep 3",),
                                  kwargs={"timeout": 20}, daemon=True)
        runner.start()
        deadline = time.monotonic() + 10
        info = manager.sandboxes.get(sb.id)
        while not manager.sandboxes.busy(info):
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.02)
        for call in (lambda: sb.snapshot(memory=True), lambda: sb.fork(2, memory=True)):
            started = time.monotonic()
            with pytest.raises(UsageError, match="microvm tier") as refused:
                call()
            assert "namespace tier" in str(refused.value)
            assert "isolation='microvm'" in str(refused.value)
            assert time.monotonic() - started < 2.0  # refused at once, not after waiting
        runner.join(timeout=20)
        assert not runner.is_alive()
        assert {s.id for s in Sandbox.list_snapshots(**where)} == snapshots_before
        assert {i.id for i in Sandbox.list(**where)} == sandboxes_before
        assert manager.store.layer_ids() == layers_before
        assert sb.get_info().layer is None
        events = [e.type for e in manager.auditor.trail(sb.id).events]
        assert "snapshot.created" not in events and "sandbox.forked" not in events
        assert sb.files.read("state.txt") == "kept"
        # A disk snapshot still works as before once it is quiet.
        snap = sb.snapshot()
        taken.append(snap.id)
        assert snap.memory is False
    finally:
        if runner is not None:
            runner.join(timeout=20)
        sb.kill()
        for snap_id in taken:
            Sandbox.delete_snapshot(snap_id, **where)
