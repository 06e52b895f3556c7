"""A sandbox stuck in its destroy is isolated (issue 36): the reaper, other sandboxes and other
calls (set_timeout, the HTTP and E2B deletes) answer without waiting on it, and its destroy is
tried again in the background, boundedly. Over the memory backend, with a destroy that blocks
on an event the test holds (and releases at the end: every wait here is bounded by
construction, and none assumes how fast the host is)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from corral._control import destroyer, recovery, sandboxes
from corral._control.destroyer import Destroyer
from corral._control.manager import Manager
from corral._control.records import SandboxRecord
from corral._control.tenants import TenantDirectory
from corral._e2b.app import E2BConfig, create_e2b_app
from corral._ids import from_e2b
from corral._serve.app import create_app
from corral.backends import SandboxSpec
from corral.errors import BackendError, SandboxNotFound
from corral.testing import memory_manager
from corral.testing.backend import MemoryBackend

# Far above anything here takes (each wait ends on an event); reached only on a failure.
_BOUND_S = 60.0


class StuckBackend(MemoryBackend):
    """Destroys of the sandboxes in ``stuck`` block until ``release`` is set; those in
    ``failing`` raise until their count runs out."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck: set[str] = set()
        self.failing: dict[str, int] = {}
        self.release = threading.Event()
        self.entered = threading.Event()

    def destroy(self, spec: SandboxSpec) -> None:
        if spec.id in self.stuck:
            self.entered.set()
            self.release.wait(_BOUND_S * 5)
        left = self.failing.get(spec.id, 0)
        if left:
            self.failing[spec.id] = left - 1
            raise BackendError(f"cannot remove sandbox {spec.id} (test)")
        super().destroy(spec)


@pytest.fixture
def backend() -> StuckBackend:
    return StuckBackend()


@pytest.fixture
def manager(tmp_path: Path, backend: StuckBackend) -> Iterator[Manager]:
    manager = memory_manager(tmp_path / "home", backend=backend)
    yield manager
    backend.release.set()
    backend.failing.clear()
    for info in manager.store.list():
        manager._destroy(info, reason="cleanup")
    manager.close()


def _in_thread(call: Callable[[], object]) -> threading.Thread:
    """Run ``call`` on a thread and wait for it at most ``_BOUND_S``: the returned thread is
    alive afterwards only if ``call`` hung."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(_BOUND_S)
    return thread


def _until(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + _BOUND_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _expire_now(manager: Manager, sandbox_id: str) -> None:
    manager.store.set_expiry(sandbox_id, time.time() - 1)


def test_a_stuck_destroy_never_holds_up_the_reaper_or_other_sandboxes(
        manager: Manager, backend: StuckBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    stuck, other = manager.create(), manager.create()
    backend.stuck.add(stuck.id)
    manager.pause(stuck.id)  # a paused sandbox expires like any other
    for info in (stuck, other):
        _expire_now(manager, info.id)
    monkeypatch.setattr(recovery, "_REAP_WAIT_S", 0.2)
    assert not _in_thread(manager.recover).is_alive()
    assert backend.entered.is_set()
    assert _until(lambda: manager.store.get(other.id) is None), "the other one was not reaped"
    assert manager.store.get(stuck.id).state == "destroying"  # type: ignore[union-attr]
    # Later passes never wait on it again, however long a pass would wait for a destroy.
    monkeypatch.setattr(recovery, "_REAP_WAIT_S", _BOUND_S * 10)
    late = manager.create()
    _expire_now(manager, late.id)
    assert not _in_thread(manager.recover).is_alive()
    assert manager.store.get(late.id) is None
    # Everything else works meanwhile.
    fresh = manager.create()
    assert manager.run(fresh.id, ["echo", "hi"]).stdout == "hi\n"
    assert manager.set_timeout(fresh.id, 600).state == "running"
    with pytest.raises(SandboxNotFound, match="being destroyed"):
        manager.set_timeout(stuck.id, 600)
    backend.release.set()
    assert _until(lambda: manager.store.get(stuck.id) is None)
    events = [e.type for e in manager.auditor.trail(stuck.id).events]
    assert events.count("sandbox.expired") == 1 and events[-1] == "sandbox.destroyed"


def test_deletes_answer_promptly_and_the_destroy_finishes_in_the_background(
        manager: Manager, backend: StuckBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandboxes, "DESTROY_WAIT_S", 0.2)
    tenants = TenantDirectory(manager.store)
    tenants.add_tenant("acme")
    e2b_key = tenants.create_key("acme", e2b=True)[1]
    key = {"Authorization": f"Bearer {tenants.create_key('acme')[1]}"}
    native = TestClient(create_app(manager), base_url="http://127.0.0.1", headers=key)
    e2b = TestClient(create_e2b_app(manager, E2BConfig.build()), base_url="http://127.0.0.1")
    with native, e2b:
        first = native.post("/v1/sandboxes", json={}).json()["id"]
        backend.stuck.add(first)
        answer = native.delete(f"/v1/sandboxes/{first}")
        assert answer.status_code == 202, answer.text  # accepted: under way
        assert native.get(f"/v1/sandboxes/{first}").status_code == 404
        assert native.post(f"/v1/sandboxes/{first}/timeout",
                           json={"timeout": 60}).status_code == 404
        created = e2b.post("/v2/sandboxes", headers={"X-API-KEY": e2b_key},
                           json={"templateID": "base"}).json()
        second = from_e2b(created["sandboxID"])
        assert second is not None
        backend.stuck.add(second)
        answer = e2b.delete(f"/sandboxes/{created['sandboxID']}",
                            headers={"X-API-KEY": e2b_key})
        assert answer.status_code == 204, answer.text  # E2B's kill: it is gone for the caller
        answer = e2b.post(f"/sandboxes/{created['sandboxID']}/timeout",
                          headers={"X-API-KEY": e2b_key}, json={"timeout": 60})
        assert answer.status_code == 404, answer.text
        fine = native.post("/v1/sandboxes", json={}).json()["id"]
        assert native.delete(f"/v1/sandboxes/{fine}").status_code == 204
    backend.release.set()
    assert _until(lambda: manager.store.get(first) is None)
    assert _until(lambda: manager.store.get(second) is None)


def test_a_failed_destroy_is_tried_again_then_left_to_the_reaper_with_a_pause(
        manager: Manager, backend: StuckBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(destroyer, "RETRY_PAUSES_S", (0.0, 0.0))
    flaky, broken = manager.create(), manager.create()
    backend.failing[flaky.id] = 2  # the third try works
    manager.destroy(flaky.id)
    assert manager.store.get(flaky.id) is None
    backend.failing[broken.id] = 10**6
    with pytest.raises(BackendError, match="cannot remove"):
        manager.destroy(broken.id)
    assert backend.failing[broken.id] == 10**6 - 3
    record = manager.store.get(broken.id)
    assert record is not None and record.state == "destroying"
    # The reaper does not try again at once (nor at every pass): it waits its pause out.
    assert not manager.sandboxes.destroy_due(broken.id)
    assert not _in_thread(manager.recover).is_alive()
    assert backend.failing[broken.id] == 10**6 - 3
    # Asked for explicitly (`corral reap` in another process, a clean-up), it is tried now.
    backend.failing.clear()
    manager._destroy(record, reason="cleanup")
    assert manager.store.get(broken.id) is None


def test_the_reapers_pause_after_a_failed_destroy_grows_and_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(destroyer, "RETRY_PAUSES_S", (0.0, 0.0, 0.0))
    now = [1000.0]
    tries: list[str] = []

    def destroy(info: SandboxRecord, reason: str) -> None:
        tries.append(info.id)
        raise BackendError("stuck")

    subject = Destroyer(destroy, clock=lambda: now[0])
    info = SandboxRecord(id="sbx_a", template="base", resources="small", state="destroying",
                         created_at=0.0, expires_at=0.0, uid=1)
    pauses = []
    for _ in range(len(destroyer.REAP_BACKOFF_S) + 1):
        with pytest.raises(BackendError):
            subject.start(info, "expired").wait(_BOUND_S)
        assert not subject.due(info.id)
        start = now[0]
        while not subject.due(info.id):
            now[0] += 1.0
        pauses.append(now[0] - start)
    assert pauses == [*destroyer.REAP_BACKOFF_S, destroyer.REAP_BACKOFF_S[-1]]
    assert len(tries) == len(pauses) * (len(destroyer.RETRY_PAUSES_S) + 1)
