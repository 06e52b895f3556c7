"""`corral mcp`'s port and volume tools, end to end: the official MCP client drives a `corral mcp`
subprocess over stdio; the URLs and tokens it hands the model are used through a real proxy
(the API server of the same data directory), and volumes are mounted only as the operator's
`--volume` flags allow."""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp_types import CallToolResult

from corral import Sandbox, Volume
from corral._control.manager import Manager
from corral._settings import Settings

from .servers import Server

pytestmark = pytest.mark.needs_root

TOOLS = {"expose_port", "list_ports", "unexpose_port", "list_volumes"}


@pytest.fixture
def env(settings: Settings, home: str, server: Server) -> dict[str, str]:
    return {**os.environ, "CORRAL_HOME": str(settings.home),
            "CORRAL_UID_START": str(settings.uid_start),
            "CORRAL_UID_COUNT": str(settings.uid_count), "CORRAL_PORTS_URL": server.url}


@pytest.fixture
def volumes(home: str) -> Iterator[dict[str, str]]:
    """Three fresh volumes: one the model may write, one it may only read, one it may not
    mount at all; deleted after the test."""
    tag = secrets.token_hex(3)
    names = {"rw": f"mcp-rw-{tag}", "ro": f"mcp-ro-{tag}", "no": f"mcp-no-{tag}"}
    for name in names.values():
        Volume.create(name, size="32M", home=home)
    yield names
    for name in names.values():
        Volume.delete(name, home=home)


def _data(result: CallToolResult) -> dict[str, Any]:
    assert result.structured_content is not None, result
    return dict(result.structured_content)


async def _call(session: ClientSession, tool: str, **args: Any) -> dict[str, Any]:
    result = await session.call_tool(tool, args)
    assert not result.is_error, result.content
    return _data(result)


async def _refused(session: ClientSession, tool: str, **args: Any) -> dict[str, Any]:
    result = await session.call_tool(tool, args)
    assert result.is_error, result.content
    return _data(result)


def _get(url: str, token: str | None = None) -> httpx.Response:
    headers = {"X-Corral-Port-Token": token} if token else {}
    return httpx.get(url, headers=headers)


def _wait_served(url: str, token: str) -> httpx.Response:
    deadline = time.monotonic() + 20
    while True:
        answer = _get(url, token)
        if answer.status_code != 502:  # 502: the server in the sandbox is not listening yet
            return answer
        assert time.monotonic() < deadline, "the server in the sandbox never listened"
        time.sleep(0.1)


def _run(env: dict[str, str], body: Any, *flags: str) -> Any:
    params = StdioServerParameters(command=sys.executable, args=["-m", "corral", "mcp", *flags],
                                   env=env)

    async def main() -> Any:
        with tempfile.TemporaryFile("w+") as errlog:
            with anyio.fail_after(120):
                async with stdio_client(params, errlog=errlog) as (read, write):
                    async with ClientSession(read, write) as session:
                        await session.initialize()
                        return await body(session)

    return anyio.run(main)


def test_expose_port_hands_the_model_a_working_url_and_token(
        env: dict[str, str], home: str, server: Server) -> None:
    async def body(session: ClientSession) -> str:
        listed = await session.list_tools()
        assert TOOLS <= {t.name for t in listed.tools}
        schema = next(t for t in listed.tools if t.name == "expose_port").input_schema
        assert schema["properties"]["public"]["default"] is False

        first = await _call(session, "write_file", path="index.html", content="from mcp\n")
        sandbox_id = first["sandbox_id"]
        sb = await anyio.to_thread.run_sync(lambda: Sandbox.connect(sandbox_id, home=home))
        await anyio.to_thread.run_sync(lambda: sb.processes.start(
            ["python3", "-m", "http.server", "8000", "--bind", "0.0.0.0"]))

        port = await _call(session, "expose_port", port=8000)  # the session sandbox
        url = f"{server.url}/ports/{sandbox_id}/8000/"
        assert port["sandbox_id"] == sandbox_id and port["port"] == 8000
        assert port["url"] == url and port["public"] is False
        assert port["token"].startswith("cpt_")
        assert port["token_header"] == "X-Corral-Port-Token"
        assert port["signed_url"].startswith(url + "?corral_expires=")
        assert port["signed_expires_at"] > time.time()

        answer = await anyio.to_thread.run_sync(
            lambda: _wait_served(url + "index.html", port["token"]))
        assert answer.status_code == 200 and answer.text == "from mcp\n"
        denied = await anyio.to_thread.run_sync(lambda: _get(url + "index.html"))
        assert denied.status_code == 401

        def open_signed_link() -> httpx.Response:
            with httpx.Client(follow_redirects=True) as browser:  # keeps the cookie it sets
                browser.get(port["signed_url"])
                return browser.get(url + "index.html")

        opened = await anyio.to_thread.run_sync(open_signed_link)
        assert opened.status_code == 200 and opened.text == "from mcp\n"

        ports = await _call(session, "list_ports", sandbox_id=sandbox_id)
        assert [p["port"] for p in ports["ports"]] == [8000]
        assert ports["ports"][0]["token"] == port["token"]

        public = await _call(session, "expose_port", port=8000, public=True,
                             sandbox_id=sandbox_id)
        assert public["public"] is True and public["token"] == port["token"]
        anyone = await anyio.to_thread.run_sync(lambda: _get(url + "index.html"))
        assert anyone.status_code == 200

        gone = await _call(session, "unexpose_port", port=8000)
        assert gone == {"sandbox_id": sandbox_id, "port": 8000, "unexposed": True}
        assert (await _call(session, "list_ports"))["ports"] == []
        revoked = await anyio.to_thread.run_sync(
            lambda: _get(url + "index.html", port["token"]))
        assert revoked.status_code == 404

        bad = await _refused(session, "expose_port", port=0)
        assert bad["code"] == "usage_error" and "1-65535" in bad["message"]
        missing = await _refused(session, "expose_port", port=8000,
                                 sandbox_id="sbx_000000000000")
        assert missing["code"] == "sandbox_not_found"
        unknown = await session.call_tool("expose_port", {"port": 80, "visibility": "all"})
        assert unknown.is_error and "visibility" in str(unknown.content)

        # A sandbox made with create_sandbox, by id.
        other = (await _call(session, "create_sandbox"))["sandbox_id"]
        theirs = await _call(session, "expose_port", port=3000, sandbox_id=other)
        assert theirs["url"] == f"{server.url}/ports/{other}/3000/"
        assert theirs["token"] != port["token"]
        return sandbox_id

    sandbox_id = _run(env, body)
    # The session ended: its sandboxes, and so their ports, are gone.
    assert sandbox_id not in {i.id for i in Sandbox.list(home=home)}


def test_volumes_are_mounted_only_as_the_operator_allows(
        env: dict[str, str], home: str, volumes: dict[str, str]) -> None:
    rw, ro, no = volumes["rw"], volumes["ro"], volumes["no"]

    async def body(session: ClientSession) -> None:
        listed = await _call(session, "list_volumes")
        shown = {v["name"]: v for v in listed["volumes"]}
        assert set(shown) == {rw, ro}  # the one not allowed is not even listed
        assert shown[rw]["writable"] is True and shown[ro]["writable"] is False
        assert shown[rw]["size_bytes"] == 32 * 2**20 and shown[rw]["mounted_by"] == []
        assert shown[rw]["volume_id"].startswith("vol_")

        made = await _call(session, "create_sandbox", volumes={
            rw: "/mnt/rw", ro: {"path": "/mnt/ro", "read_only": True}})
        writer = made["sandbox_id"]
        assert {(m["target"], m["read_only"]) for m in made["mounts"]} == {
            ("/mnt/rw", False), ("/mnt/ro", True)}
        wrote = await _call(session, "run_command", sandbox_id=writer,
                            command="echo kept > /mnt/rw/note && cat /mnt/rw/note; "
                                    "touch /mnt/ro/x")
        assert wrote["stdout"] == "kept\n" and "Read-only file system" in wrote["stderr"]
        held = {v["name"]: v for v in (await _call(session, "list_volumes"))["volumes"]}
        assert held[rw]["writer"] == writer and held[ro]["mounted_by"] == [writer]

        # One writer: a second sandbox may not write it too.
        busy = await _refused(session, "create_sandbox", volumes={rw: "/mnt/rw"})
        assert busy["code"] == "volume_in_use" and writer in busy["message"]

        # The operator's bounds: read-only only, and not at all.
        ro_only = await _refused(session, "create_sandbox", volumes={ro: "/mnt/ro"})
        assert ro_only["code"] == "ceiling_exceeded" and "read-only" in ro_only["message"]
        not_allowed = await _refused(session, "create_sandbox", volumes={no: "/mnt/no"})
        assert not_allowed["code"] == "ceiling_exceeded"
        assert "--volume" in not_allowed["message"]
        odd = await session.call_tool("create_sandbox", {
            "volumes": {rw: {"path": "/mnt/rw", "mode": "rw"}}})
        assert odd.is_error and "mode" in str(odd.content)
        escape = await _refused(session, "create_sandbox", volumes={ro: {
            "path": "/etc", "read_only": True}})
        assert escape["code"] == "usage_error"

        await _call(session, "destroy_sandbox", sandbox_id=writer)
        reader = await _call(session, "create_sandbox", volumes={
            rw: {"path": "/workspace/data", "read_only": True}})
        seen = await _call(session, "run_command", sandbox_id=reader["sandbox_id"],
                           command="cat data/note")
        assert seen["stdout"] == "kept\n"  # outlived the sandbox that wrote it

    _run(env, body, "--volume", rw, "--volume", f"{ro}:ro")
    # The session's sandboxes are gone, so nothing mounts the volumes any more.
    assert all(Volume.get(name, home=home).mounted_by == [] for name in volumes.values())


def test_without_volume_flags_the_model_gets_no_volumes(manager: Manager,
                                                        volumes: dict[str, str]) -> None:
    from corral._mcp.server import build_server
    from corral._sdk._aembedded import AsyncEmbeddedTransport

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        mcp, state = build_server(None, "stdio")
        state._opened = AsyncEmbeddedTransport(manager, caller=state.caller)
        try:
            listed = await mcp.call_tool("list_volumes", {})
            refused = await mcp.call_tool("create_sandbox",
                                          {"volumes": {volumes["rw"]: "/mnt/rw"}})
        finally:
            await state.shutdown()
        return (dict(listed.structured_content or {}),  # type: ignore[union-attr]
                dict(refused.structured_content or {}))  # type: ignore[union-attr]

    listed, refused = asyncio.run(main())
    assert listed == {"volumes": []}
    assert refused["code"] == "ceiling_exceeded" and "allowed: none" in refused["message"]


@pytest.mark.parametrize(("flag", "needle"), [("cache:rx", "is not NAME or NAME:ro"),
                                              (":ro", "is not NAME or NAME:ro")])
def test_bad_volume_flags_are_refused(flag: str, needle: str) -> None:
    from click.testing import CliRunner

    from corral._cli.main import cli

    done = CliRunner().invoke(cli, ["mcp", "--volume", flag])
    assert done.exit_code == 2 and needle in done.output
