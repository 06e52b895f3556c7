"""Every destroy path cleans up the same over a real tier (issue 39, R4): a code context with a
running kernel (a real background process) and the E2B surface's row go with the sandbox,
whether it was asked for (the control plane, E2B's kill) or reached its lifetime (the reaper,
a look-up). The memory backend's versions of each path are tests/unit/test_destroy_paths.py;
these are the ones a real kernel and the E2B app make worth running for real."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from corral._control.manager import Manager
from corral._control.tenants import TenantDirectory
from corral._e2b.app import E2BConfig, create_e2b_app
from corral._e2b.state import E2BState, follow_destroys
from corral._ids import from_e2b
from corral.errors import SandboxExpired

from ..conftest import managed, private_settings

pytestmark = pytest.mark.needs_root

_BOUND_S = 60.0


@pytest.fixture(scope="module")
def manager() -> Iterator[Manager]:
    """A data directory of this module's own: the E2B case makes a tenant and an API key, and a
    key in the session's shared store ends keyless loopback for every module after it (the
    last CI run: 29 401s in the modules that followed)."""
    with private_settings("corral-test-destroy-") as settings, managed(settings) as mgr:
        yield mgr


def _until(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + _BOUND_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _held(manager: Manager, sandbox_id: str, e2b: E2BState | None = None) -> set[str]:
    held = set()
    if any(c.sandbox_id == sandbox_id for c in manager.interpreter._contexts.values()):
        held.add("context")
    if manager.processes.list(sandbox_id):
        held.add("process")
    if e2b is not None and e2b.get(sandbox_id) is not None:
        held.add("e2b")
    if manager.store.get(sandbox_id) is not None:
        held.add("row")
    return held


def _destroy(manager: Manager, sandbox_id: str, path: str) -> None:
    if path == "requested":
        assert manager.destroy(sandbox_id) is True
        return
    manager.store.set_expiry(sandbox_id, time.time() - 1)
    if path == "reaper":
        manager.recover()
    else:
        with pytest.raises(SandboxExpired):
            manager.get(sandbox_id)


@pytest.mark.parametrize("path", ["requested", "reaper", "look-up"])
def test_a_running_kernel_goes_with_its_sandbox(manager: Manager, path: str) -> None:
    sandbox_id = manager.create().id
    execution = manager.interpreter.execute(sandbox_id, "x = 41\nx + 1")
    assert execution.text == "42", execution
    assert manager.processes.any_live(sandbox_id)  # the kernel
    assert _held(manager, sandbox_id) == {"context", "process", "row"}
    _destroy(manager, sandbox_id, path)
    assert _until(lambda: not _held(manager, sandbox_id)), _held(manager, sandbox_id)


@pytest.mark.parametrize("path", ["kill", "reaper"])
def test_the_e2b_surfaces_state_goes_with_its_sandbox(manager: Manager, path: str) -> None:
    tenants = TenantDirectory(manager.store)
    tenants.add_tenant("acme")
    key = {"X-API-KEY": tenants.create_key("acme", e2b=True)[1]}
    app = create_e2b_app(manager, E2BConfig.build())
    follow_destroys(app.e2b, manager)  # idempotent: the app may subscribe it itself
    with TestClient(app, base_url="http://127.0.0.1") as client:
        made = client.post("/v2/sandboxes", headers=key,
                           json={"templateID": "base", "envVars": {"A": "1"}})
        assert made.status_code == 201, made.text
        sandbox: dict[str, Any] = made.json()
        sandbox_id = from_e2b(sandbox["sandboxID"])
        assert sandbox_id is not None
        manager.interpreter.execute(sandbox_id, "1 + 1")
        assert _held(manager, sandbox_id, app.e2b) == {"context", "process", "e2b", "row"}
        if path == "kill":
            answer = client.delete(f"/sandboxes/{sandbox['sandboxID']}", headers=key)
            assert answer.status_code == 204, answer.text
        else:
            _destroy(manager, sandbox_id, "reaper")
        assert _until(lambda: not _held(manager, sandbox_id, app.e2b)), \
            _held(manager, sandbox_id, app.e2b)
