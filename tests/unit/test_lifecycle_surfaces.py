"""A sandbox's lifecycle on every surface that creates one (issue 40): the SDK embedded and over
HTTP (the app in-process), the REST body, the CLI's flags and MCP's create tool, each asking for
it and reading it back; a sandbox paused at its timeout is resumed by a command when it says
``auto_resume`` and refused otherwise. Over the memory backend: no root."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from mcp import Client
from starlette.testclient import TestClient

from corral import Sandbox
from corral._cli.main import cli
from corral._control import manager as manager_module
from corral._control.plane import Manager
from corral._mcp.server import build_server
from corral._sdk._embedded import EmbeddedTransport
from corral._sdk._sync.transport import Transport
from corral._serve.app import create_app
from corral._settings import Settings
from corral.errors import InvalidRequestError, SandboxBusy, UsageError
from corral.models import Lifecycle
from corral.testing import asgi_transport

_TRANSPORTS: dict[str, Callable[[Manager], Transport]] = {
    "embedded": EmbeddedTransport,
    "http": lambda manager: asgi_transport(create_app(manager)),
}


@pytest.fixture(params=sorted(_TRANSPORTS))
def transport(request: pytest.FixtureRequest, manager: Manager) -> Transport:
    return _TRANSPORTS[request.param](manager)


def _time_out(manager: Manager, sandbox_id: str) -> None:
    manager.store.set_expiry(sandbox_id, time.time() - 1)


@pytest.mark.parametrize("asked", [
    Lifecycle(on_timeout="pause", auto_resume=True),
    {"on_timeout": "pause", "auto_resume": True},  # E2B's form
])
def test_the_sdk_asks_for_a_lifecycle_and_reads_it_back(
        transport: Transport, asked: Lifecycle | dict[str, Any]) -> None:
    with Sandbox.create(timeout=60, lifecycle=asked, transport=transport) as sb:
        assert sb.get_info().lifecycle == Lifecycle(on_timeout="pause", auto_resume=True)


def test_without_one_a_sandbox_is_killed_at_its_timeout(transport: Transport) -> None:
    with Sandbox.create(transport=transport) as sb:
        assert sb.get_info().lifecycle == Lifecycle()


def test_auto_resume_has_a_command_resume_a_sandbox_paused_at_its_timeout(
        manager: Manager, transport: Transport) -> None:
    with Sandbox.create(timeout=60, lifecycle={"on_timeout": "pause", "auto_resume": True},
                        transport=transport) as sb:
        _time_out(manager, sb.id)
        assert sb.get_info().state == "paused"
        assert sb.commands.run("echo awake").stdout == "awake\n"
        info = sb.get_info()
        assert info.state == "running"
        assert time.time() + 50 < info.expires_at <= time.time() + 60  # its lifetime again


def test_without_auto_resume_a_command_is_refused_until_resumed(
        manager: Manager, transport: Transport) -> None:
    with Sandbox.create(timeout=60, lifecycle=Lifecycle(on_timeout="pause"),
                        transport=transport) as sb:
        _time_out(manager, sb.id)
        with pytest.raises(SandboxBusy, match=r"paused; resume\(\) it to run commands"):
            sb.commands.run("true")
        assert sb.get_info().state == "paused"
        sb.resume()
        assert sb.commands.run("true").exit_code == 0


@pytest.mark.parametrize("asked, words", [
    ({"on_timeout": "sleep"}, "lifecycle.on_timeout: Input should be 'kill' or 'pause'"),
    ({"on_timout": "pause"}, "did you mean 'on_timeout'?"),
])
def test_a_bad_lifecycle_is_refused_in_the_same_words_on_either_transport(
        transport: Transport, asked: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words):
        Sandbox.create(lifecycle=asked, transport=transport)


def test_a_lifecycle_of_another_type_is_refused_before_it_is_sent(
        transport: Transport) -> None:
    with pytest.raises(UsageError, match="lifecycle must be a Lifecycle or a dict"):
        Sandbox.create(lifecycle="pause", transport=transport)  # type: ignore[arg-type]


def test_the_rest_body_carries_it(manager: Manager) -> None:
    with TestClient(create_app(manager), base_url="http://127.0.0.1") as rest:
        made = rest.post("/v1/sandboxes", json={"lifecycle": {"on_timeout": "pause"}})
        assert made.status_code == 201, made.text
        assert made.json()["lifecycle"] == Lifecycle(on_timeout="pause").to_dict()
        refused = rest.post("/v1/sandboxes", json={"lifecycle": {"auto_resume": "yes"}})
        assert refused.status_code == 422, refused.text
        assert "lifecycle.auto_resume" in refused.json()["message"]


@pytest.fixture
def embedded_home(manager: Manager, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The data directory whose embedded manager (the CLI's, MCP's) is ``manager``."""
    home = Settings(home=manager.settings.home).home
    monkeypatch.setattr(manager_module, "_managers", {home: manager})
    yield home


def test_the_cli_creates_with_on_timeout_and_auto_resume(
        manager: Manager, embedded_home: Path) -> None:
    runner = CliRunner()
    made = runner.invoke(cli, ["--home", str(embedded_home), "create", "--ttl", "60",
                               "--on-timeout", "pause", "--auto-resume", "--json"])
    assert made.exit_code == 0, made.output
    sandbox = json.loads(made.stdout)
    assert sandbox["lifecycle"] == Lifecycle(on_timeout="pause", auto_resume=True).to_dict()
    plain = runner.invoke(cli, ["--home", str(embedded_home), "create", "--json"])
    assert json.loads(plain.stdout)["lifecycle"] == Lifecycle().to_dict()
    _time_out(manager, sandbox["id"])
    listed = runner.invoke(cli, ["--home", str(embedded_home), "ls"])
    assert listed.exit_code == 0, listed.output
    (row,) = [line for line in listed.stdout.splitlines() if line.startswith(sandbox["id"])]
    assert row.split()[1] == "paused"
    shown = runner.invoke(cli, ["--home", str(embedded_home), "info", sandbox["id"], "--json"])
    assert json.loads(shown.stdout)["state"] == "paused"
    refused = runner.invoke(cli, ["--home", str(embedded_home), "create",
                                  "--on-timeout", "sleep"])
    assert refused.exit_code == 2 and "'sleep' is not one of 'kill', 'pause'" in refused.output


def test_mcp_creates_with_on_timeout_and_auto_resume(embedded_home: Path) -> None:
    server, state = build_server(embedded_home, "stdio")

    async def create(client: Client, **args: Any) -> dict[str, Any]:
        result = await client.call_tool("create_sandbox", args)
        assert not result.is_error, result
        return dict(result.structured_content or {})

    async def both() -> tuple[dict[str, Any], dict[str, Any]]:
        try:
            async with Client(server) as client:  # the official client, in-process
                return (await create(client, timeout_s=60, on_timeout="pause",
                                     auto_resume=True),
                        await create(client))
        finally:
            await state.shutdown()

    asked, plain = asyncio.run(both())
    assert asked["lifecycle"] == Lifecycle(on_timeout="pause", auto_resume=True).to_dict()
    assert plain["lifecycle"] == Lifecycle().to_dict()
