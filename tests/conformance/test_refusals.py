"""One refusal, one message, on every surface (issue 39): the same invalid input through the
SDK (embedded), the HTTP API, the E2B dialect, MCP and the CLI is refused with the words of
the request model that holds the rule, so a rule changed in one model changes the refusal
everywhere. Over the memory backend (the layer under test is above the tier): no root.

Where a surface has no way to say a thing (E2B's envd starts commands over Connect, whose
own framing its own tests cover; MCP and the CLI cannot set a running sandbox's lifetime),
a case lists the surfaces that can.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from starlette.testclient import TestClient

from corral import Sandbox
from corral._control import manager as manager_module
from corral._control.manager import Manager
from corral._control.requests import CreateSandbox, Request, RunCommand, SetTimeout
from corral._control.tenants import TenantDirectory
from corral._e2b.app import E2BApp, E2BConfig, create_e2b_app
from corral._ids import to_e2b
from corral._mcp.server import build_server
from corral._sdk._embedded import EmbeddedTransport
from corral._serve.app import create_app
from corral._settings import Settings
from corral.errors import CorralError
from corral.testing import memory_manager

from ..integration.servers import Server

_CLI_TIMEOUT_S = 300  # a Python start-up on a loaded 2-core host, far above the work


@pytest.fixture
def manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Manager]:
    manager = memory_manager(tmp_path / "home")
    # ``corral mcp --home`` of this data directory, embedded: its manager is this one.
    monkeypatch.setattr(manager_module, "_managers",
                        {Settings(home=manager.settings.home).home: manager})
    yield manager
    for info in manager.store.list():
        manager._destroy(info, reason="cleanup")
    manager.close()


class Surfaces:
    """The same request, each surface's way; each returns the refusal's message."""

    def __init__(self, manager: Manager, rest: TestClient, e2b: TestClient,
                 e2b_key: dict[str, str], url: str, operator_key: str,
                 sandbox_id: str) -> None:
        self.manager, self.rest, self.e2b, self.e2b_key, self.url = (
            manager, rest, e2b, e2b_key, url)
        self.operator_key = operator_key
        self.sandbox_id = sandbox_id  # the E2B key's tenant's (the operator sees it too)

    def sdk(self, call: Callable[[Sandbox], object]) -> str:
        sb = Sandbox.connect(self.sandbox_id, transport=EmbeddedTransport(self.manager))
        with pytest.raises(CorralError) as refused:
            call(sb)
        return refused.value.message

    def http(self, method: str, path: str, body: dict[str, Any]) -> str:
        answer = self.rest.request(method, path.format(id=self.sandbox_id), json=body)
        assert 400 <= answer.status_code < 500, answer.text
        return str(answer.json()["message"])

    def e2b_api(self, method: str, path: str, body: dict[str, Any]) -> str:
        answer = self.e2b.request(method, path.format(id=to_e2b(self.sandbox_id)), json=body,
                                  headers=self.e2b_key)
        assert 400 <= answer.status_code < 500, answer.text
        return str(answer.json()["message"])

    def mcp(self, tool: str, **args: Any) -> str:
        server, state = build_server(self.manager.settings.home, "stdio")

        async def call() -> str:
            try:
                async with Client(server) as client:  # the official client, in-process
                    result = await client.call_tool(tool, args)
                assert result.is_error, result
                return str((result.structured_content or {})["message"])
            finally:
                await state.shutdown()

        return asyncio.run(call())

    def cli(self, *args: str) -> str:
        env = {**os.environ, "CORRAL_URL": self.url, "CORRAL_API_KEY": self.operator_key}
        done = subprocess.run([sys.executable, "-m", "corral", *args], env=env,
                              capture_output=True, text=True, timeout=_CLI_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
        assert done.returncode != 0, done.stdout
        return done.stderr


@pytest.fixture
def surfaces(manager: Manager) -> Iterator[Surfaces]:
    tenants = TenantDirectory(manager.store)
    tenants.add_tenant("acme")
    e2b_key = {"X-API-KEY": tenants.create_key("acme", e2b=True)[1]}
    operator_key = tenants.create_operator_key()[1]
    e2b_app: E2BApp = create_e2b_app(manager, E2BConfig.build())
    with TestClient(create_app(manager), base_url="http://127.0.0.1",
                    headers={"Authorization": f"Bearer {operator_key}"}) as rest, \
            TestClient(e2b_app, base_url="http://127.0.0.1") as e2b, Server(manager) as served:
        sandbox_id = manager.create(caller=tenants.get("acme")).id
        yield Surfaces(manager, rest, e2b, e2b_key, served.url, operator_key, sandbox_id)


def _words(model: type[Request], data: dict[str, Any]) -> str:
    """What the request model says to ``data``: the one wording every surface must give."""
    with pytest.raises(CorralError) as refused:
        model.parse(data)
    return refused.value.message


def test_a_lifetime_of_zero_at_create(surfaces: Surfaces) -> None:
    words = _words(CreateSandbox, {"timeout": 0})
    said = {
        "sdk": surfaces.sdk(lambda sb: Sandbox.create(
            timeout=0, transport=EmbeddedTransport(surfaces.manager))),
        "http": surfaces.http("POST", "/v1/sandboxes", {"timeout": 0}),
        "e2b": surfaces.e2b_api("POST", "/v2/sandboxes", {"templateID": "base", "timeout": 0}),
        "mcp": surfaces.mcp("create_sandbox", timeout_s=0),
        "cli": surfaces.cli("create", "--ttl", "0"),
    }
    assert {surface: words in message for surface, message in said.items()} == dict.fromkeys(
        said, True), (words, said)


def test_an_unknown_on_timeout_at_create(surfaces: Surfaces) -> None:
    body = {"lifecycle": {"on_timeout": "sleep"}}
    words = _words(CreateSandbox, body)
    # MCP and the CLI offer the choices themselves (a tool's enum, --on-timeout's choice list),
    # so a value outside them never reaches the request model.
    said = {
        "sdk": surfaces.sdk(lambda sb: Sandbox.create(
            lifecycle=body["lifecycle"], transport=EmbeddedTransport(surfaces.manager))),
        "http": surfaces.http("POST", "/v1/sandboxes", body),
    }
    assert {surface: words in message for surface, message in said.items()} == dict.fromkeys(
        said, True), (words, said)


def test_a_lifetime_of_zero_for_a_running_sandbox(surfaces: Surfaces) -> None:
    words = _words(SetTimeout, {"timeout": 0})
    said = {
        "sdk": surfaces.sdk(lambda sb: sb.set_timeout(0)),
        "http": surfaces.http("POST", "/v1/sandboxes/{id}/timeout", {"timeout": 0}),
        "e2b": surfaces.e2b_api("POST", "/sandboxes/{id}/timeout", {"timeout": 0}),
    }
    assert {surface: words in message for surface, message in said.items()} == dict.fromkeys(
        said, True), (words, said)


def test_a_working_directory_outside_the_workspace(surfaces: Surfaces) -> None:
    words = _words(RunCommand, {"cmd": "true", "cwd": "../.."})
    said = {
        "sdk": surfaces.sdk(lambda sb: sb.commands.run("true", cwd="../..")),
        "http": surfaces.http("POST", "/v1/sandboxes/{id}/commands",
                              {"cmd": "true", "cwd": "../.."}),
        # MCP runs in its own session's sandbox (another's is not its to use).
        "mcp": surfaces.mcp("run_command", command="true", cwd="../.."),
        "cli": surfaces.cli("exec", surfaces.sandbox_id, "--cwd", "../..", "--", "true"),
    }
    assert {surface: words in message for surface, message in said.items()} == dict.fromkeys(
        said, True), (words, said)
