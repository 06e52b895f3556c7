"""Every path that destroys a sandbox cleans up the same (issue 39, R4): the code interpreter's
contexts, the background-process table, the E2B surface's state and MCP's session map all
forget the sandbox, whether the destroy was asked for (HTTP API, E2B kill, MCP), or came from
its lifetime (the reaper, an expiry seen on a look-up, paused or not), its idle timeout or its
audit budget. Over the memory backend: no root."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from corral._control import manager as manager_module
from corral._control.manager import Manager
from corral._control.tenants import TenantDirectory
from corral._e2b.app import E2BConfig, create_e2b_app
from corral._e2b.state import E2BSandbox, E2BState, follow_destroys
from corral._mcp.server import CorralMCP, build_server
from corral._server.app import create_app
from corral._settings import Settings
from corral.errors import CommandNotFound, SandboxExpired

_BOUND_S = 30.0


@pytest.fixture
def e2b_state(manager: Manager) -> Iterator[E2BState]:
    state = E2BState(manager.settings.home / "e2b-test.db")
    follow_destroys(state, manager)
    yield state
    state.close()


def _until(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + _BOUND_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Held:
    """What the control plane and the surfaces hold for one sandbox."""

    def __init__(self, manager: Manager, sandbox_id: str, e2b: E2BState) -> None:
        self.manager, self.sandbox_id, self.e2b = manager, sandbox_id, e2b
        self.context = manager.interpreter.create_context(sandbox_id).id
        self.process = manager.processes.start(sandbox_id, "echo hi").id
        e2b.remember(E2BSandbox(id=sandbox_id, template_id="base"))
        assert self.held() == {"context", "process", "e2b"}

    def held(self) -> set[str]:
        interpreter = self.manager.interpreter
        held = set()
        if any(c.sandbox_id == self.sandbox_id for c in interpreter._contexts.values()):
            held.add("context")
        try:
            self.manager.processes.get(self.sandbox_id, self.process)
            held.add("process")
        except CommandNotFound:
            pass
        if self.e2b.get(self.sandbox_id) is not None:
            held.add("e2b")
        return held

    def gone(self) -> bool:
        return self.manager.store.get(self.sandbox_id) is None and not self.held()


def test_a_requested_destroy_over_the_http_api(manager: Manager, e2b_state: E2BState) -> None:
    with TestClient(create_app(manager), base_url="http://127.0.0.1") as client:
        sandbox_id = client.post("/v1/sandboxes", json={}).json()["id"]
        held = Held(manager, sandbox_id, e2b_state)
        assert client.delete(f"/v1/sandboxes/{sandbox_id}").status_code == 204
    assert held.gone(), held.held()


def test_the_reaper_at_the_end_of_a_lifetime(manager: Manager, e2b_state: E2BState) -> None:
    held = Held(manager, manager.create().id, e2b_state)
    manager.store.set_expiry(held.sandbox_id, time.time() - 1)
    manager.recover()
    assert held.gone(), held.held()


def test_the_reaper_at_the_end_of_a_paused_lifetime(manager: Manager,
                                                   e2b_state: E2BState) -> None:
    held = Held(manager, manager.create().id, e2b_state)
    manager.pause(held.sandbox_id)
    manager.store.set_expiry(held.sandbox_id, time.time() - 1)
    manager.recover()
    assert held.gone(), held.held()


def test_an_expiry_seen_on_a_look_up(manager: Manager, e2b_state: E2BState) -> None:
    held = Held(manager, manager.create().id, e2b_state)
    manager.store.set_expiry(held.sandbox_id, time.time() - 1)
    with pytest.raises(SandboxExpired):
        manager.get(held.sandbox_id)
    assert _until(held.gone), held.held()


def test_an_expiry_seen_on_a_listing(manager: Manager, e2b_state: E2BState) -> None:
    held = Held(manager, manager.create().id, e2b_state)
    manager.store.set_expiry(held.sandbox_id, time.time() - 1)
    assert manager.list() == []
    assert _until(held.gone), held.held()


def test_the_idle_timeout(manager: Manager, e2b_state: E2BState) -> None:
    held = Held(manager, manager.create(idle_timeout=60).id, e2b_state)
    assert _until(lambda: manager.processes.get(held.sandbox_id, held.process).state
                  == "exited")
    manager.store._db.execute("UPDATE sandboxes SET last_active = ? WHERE id = ?",
                              (time.time() - 120, held.sandbox_id))
    manager.recover()
    assert held.gone(), held.held()


def test_the_e2b_kill(manager: Manager) -> None:
    tenants = TenantDirectory(manager.store)
    tenants.add_tenant("acme")
    key = {"X-API-KEY": tenants.create_key("acme", e2b=True)[1]}
    app = create_e2b_app(manager, E2BConfig.build())
    follow_destroys(app.e2b, manager)  # idempotent: the app may subscribe it itself
    with TestClient(app, base_url="http://127.0.0.1") as client:
        made = client.post("/v2/sandboxes", headers=key, json={"templateID": "base"})
        assert made.status_code == 201, made.text
        e2b_id = made.json()["sandboxID"]
        sandbox_id = next(info.id for info in manager.list())
        held = Held(manager, sandbox_id, app.e2b)
        assert client.delete(f"/sandboxes/{e2b_id}", headers=key).status_code == 204
        assert held.gone(), held.held()


def test_the_e2b_state_goes_with_a_destroy_from_elsewhere(manager: Manager) -> None:
    app = create_e2b_app(manager, E2BConfig.build())
    follow_destroys(app.e2b, manager)
    with TestClient(app, base_url="http://127.0.0.1"):
        held = Held(manager, manager.create().id, app.e2b)
        manager.store.set_expiry(held.sandbox_id, time.time() - 1)
        manager.recover()
        assert held.gone(), held.held()


# -- MCP ------------------------------------------------------------------------------------


@pytest.fixture
def mcp_over(manager: Manager, monkeypatch: pytest.MonkeyPatch) -> Any:
    # ``corral mcp --home`` of this data directory, embedded: its manager is this one.
    monkeypatch.setattr(manager_module, "_managers",
                        {Settings(home=manager.settings.home).home: manager})
    return build_server(manager.settings.home, "stdio")


def _session_sandbox(state: CorralMCP) -> str | None:
    session = state._sessions.get("stdio")
    return None if session is None or session.sandbox is None else session.sandbox.id


async def _call(mcp: Any, tool: str, **args: Any) -> dict[str, Any]:
    result = await mcp.call_tool(tool, args)
    assert not result.is_error, result
    return dict(result.structured_content or {})


def test_mcp_destroy_sandbox(manager: Manager, e2b_state: E2BState, mcp_over: Any) -> None:
    mcp, state = mcp_over

    async def main() -> None:
        sandbox_id = (await _call(mcp, "list_files"))["sandbox_id"]
        held = Held(manager, sandbox_id, e2b_state)
        assert _session_sandbox(state) == sandbox_id
        assert (await _call(mcp, "destroy_sandbox"))["destroyed"] is True
        assert held.gone(), held.held()
        assert _session_sandbox(state) is None
        await state.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("path", ["requested", "reaper", "look-up"])
def test_mcp_forgets_a_session_sandbox_destroyed_elsewhere(
        manager: Manager, e2b_state: E2BState, mcp_over: Any, path: str) -> None:
    mcp, state = mcp_over

    async def main() -> None:
        first = (await _call(mcp, "list_files"))["sandbox_id"]
        made = (await _call(mcp, "create_sandbox"))["sandbox_id"]
        held = Held(manager, first, e2b_state)
        for sandbox_id in (first, made):
            if path == "requested":
                await asyncio.to_thread(manager.destroy, sandbox_id)
            else:
                manager.store.set_expiry(sandbox_id, time.time() - 1)
        if path == "reaper":
            await asyncio.to_thread(manager.recover)
        elif path == "look-up":
            for sandbox_id in (first, made):
                with pytest.raises(SandboxExpired):
                    await asyncio.to_thread(manager.get, sandbox_id)
        assert await asyncio.to_thread(_until, held.gone), held.held()
        session = state._sessions["stdio"]
        assert session.sandbox is None and not session.owned
        # The session's next call gets a fresh sandbox, without an error first.
        again = await _call(mcp, "list_files")
        assert again["sandbox_id"] not in (first, made)
        await state.shutdown()

    asyncio.run(main())


def test_a_failing_listener_never_breaks_the_destroy(manager: Manager,
                                                    e2b_state: E2BState) -> None:
    heard: list[str] = []

    def broken(sandbox_id: str) -> None:
        raise RuntimeError("listener bug")

    unsubscribe = manager.on_destroyed(broken)
    manager.on_destroyed(heard.append)
    held = Held(manager, manager.create().id, e2b_state)
    assert manager.destroy(held.sandbox_id) is True
    assert held.gone(), held.held()
    assert heard == [held.sandbox_id]
    unsubscribe()
    other = manager.create().id
    manager.destroy(other)
    assert heard == [held.sandbox_id, other]


def test_mcp_says_the_session_sandbox_expired_even_once_forgotten(
        manager: Manager, mcp_over: Any) -> None:
    mcp, state = mcp_over

    async def main() -> None:
        first = (await _call(mcp, "list_files"))["sandbox_id"]
        manager.store.set_expiry(first, time.time() - 1)
        # The look-up inside the call destroys it, and the listener forgets it meanwhile.
        expired = await mcp.call_tool("list_files", {})
        assert expired.is_error
        data = dict(expired.structured_content or {})
        assert data["code"] == "sandbox_expired", data
        assert "the session's next call creates a new session sandbox" in data["message"]
        assert _session_sandbox(state) is None
        assert (await _call(mcp, "list_files"))["sandbox_id"] != first
        await state.shutdown()

    asyncio.run(main())
