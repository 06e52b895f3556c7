"""`corral mcp`, end to end: the official MCP client library drives a `corral mcp` subprocess
over stdio and over Streamable HTTP, and no sandbox outlives the server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, TextContent

from corral import Sandbox
from corral._settings import Settings

pytestmark = pytest.mark.needs_root

TOOLS = {"create_sandbox", "run_command", "read_file", "write_file", "list_files",
         "destroy_sandbox", "upload_tar", "download_tar"}


@pytest.fixture
def env(settings: Settings, home: str) -> dict[str, str]:
    return {**os.environ, "CORRAL_HOME": str(settings.home),
            "CORRAL_UID_START": str(settings.uid_start),
            "CORRAL_UID_COUNT": str(settings.uid_count)}


def _live(home: str) -> set[str]:
    return {info.id for info in Sandbox.list(home=home)}


def _data(result: CallToolResult) -> dict[str, Any]:
    assert result.structured_content is not None, result
    return dict(result.structured_content)


async def _call(session: ClientSession, tool: str, **args: Any) -> dict[str, Any]:
    result = await session.call_tool(tool, args)
    assert not result.is_error, result.content
    return _data(result)


def _tar_slip() -> str:
    import base64
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    return base64.b64encode(buf.getvalue()).decode()


async def _exercise(session: ClientSession, home: str) -> str:
    """Every tool once; returns the session sandbox's id (still alive)."""
    await session.initialize()
    listed = await session.list_tools()
    assert TOOLS <= {t.name for t in listed.tools}

    first = await _call(session, "run_command", command="echo hello > a.txt; echo done")
    assert first["exit_code"] == 0 and first["stdout"] == "done\n"
    assert first["truncated"] is False
    session_sandbox = first["sandbox_id"]
    assert session_sandbox in _live(home)
    second = await _call(session, "run_command", command="cat a.txt")
    assert second["sandbox_id"] == session_sandbox  # the same session sandbox
    assert second["stdout"] == "hello\n"

    wrote = await _call(session, "write_file", path="src/app.py", content="print(6 * 7)\n")
    assert wrote["sandbox_id"] == session_sandbox and wrote["size"] == 13
    read = await _call(session, "read_file", path="/workspace/src/app.py")
    assert read["content"] == "print(6 * 7)\n" and read["truncated"] is False
    listing = await _call(session, "list_files")
    assert {"a.txt", "src"} <= {e["name"] for e in listing["entries"]}
    ran = await _call(session, "run_command", command="python3 app.py", cwd="src")
    assert ran["stdout"] == "42\n"

    # Trees in and out as base64 tar.
    packed = await _call(session, "download_tar", path="/workspace/src")
    assert packed["format"] == "tar.gz" and packed["size"] > 0
    unpacked = await _call(session, "upload_tar", archive_base64=packed["archive_base64"],
                           path="/workspace/copy")
    assert unpacked["files"] == 1
    copied = await _call(session, "run_command", command="python3 copy/app.py")
    assert copied["stdout"] == "42\n"
    slip = await session.call_tool("upload_tar", {"archive_base64": _tar_slip()})
    assert slip.is_error and _data(slip)["code"] == "path_refused"

    failed = await _call(session, "run_command", command="echo oops >&2; exit 3")
    assert failed["exit_code"] == 3 and failed["stderr"] == "oops\n"

    bad = await session.call_tool("run_command", {"command": "true",
                                                  "sandbox_id": "sbx_000000000000"})
    assert bad.is_error
    assert _data(bad)["code"] == "sandbox_not_found"
    text = bad.content[0]
    assert isinstance(text, TextContent) and text.text.startswith("sandbox_not_found: ")
    assert "Traceback" not in text.text
    refused = await session.call_tool("read_file", {"path": "../../etc/shadow"})
    assert refused.is_error and _data(refused)["code"] == "path_refused"

    flood = await _call(session, "run_command",
                        command="head -c 300000 /dev/zero | tr '\\0' x")
    assert flood["truncated"] is True and flood["stdout_dropped_bytes"] > 0
    assert flood["stdout"].startswith("x" * 1000)
    assert "[corral: stdout truncated" in flood["stdout"]
    assert len(flood["stdout"]) < 70_000

    # An explicit sandbox: used by id, destroyed by id.
    made = await _call(session, "create_sandbox", labels={"purpose": "test"}, timeout_s=120)
    other = made["sandbox_id"]
    assert other != session_sandbox and other in _live(home)
    there = await _call(session, "run_command", command="ls", sandbox_id=other)
    assert there["sandbox_id"] == other and there["stdout"] == ""
    gone = await _call(session, "destroy_sandbox", sandbox_id=other)
    assert gone["destroyed"] is True and other not in _live(home)
    again = await session.call_tool("list_files", {"sandbox_id": other})
    assert again.is_error and _data(again)["code"] == "sandbox_not_found"

    # Destroying the session sandbox: the next call gets a fresh one.
    await _call(session, "destroy_sandbox")
    assert session_sandbox not in _live(home)
    fresh = await _call(session, "run_command", command="ls")
    assert fresh["sandbox_id"] != session_sandbox and fresh["stdout"] == ""
    return str(fresh["sandbox_id"])


def _wait_gone(home: str, sandbox_id: str, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while sandbox_id in _live(home) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sandbox_id not in _live(home)


def test_stdio_end_to_end(env: dict[str, str], home: str) -> None:
    params = StdioServerParameters(command=sys.executable, args=["-m", "corral", "mcp"],
                                   env=env)
    before = _live(home)

    async def main() -> str:
        with tempfile.TemporaryFile("w+") as errlog:
            with anyio.fail_after(90):
                async with stdio_client(params, errlog=errlog) as (read, write):
                    async with ClientSession(read, write) as session:
                        return await _exercise(session, home)

    session_sandbox = anyio.run(main)
    # The client closed stdin: the server destroyed its session sandbox on the way out.
    _wait_gone(home, session_sandbox)
    assert _live(home) == before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def http_server(env: dict[str, str]) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = _free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral", "mcp", "--transport", "http", "--port", str(port)],
        env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, _output(log)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "corral mcp did not listen: " + _output(log)
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp", proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        log.close()


def _output(log: Any) -> str:
    log.seek(0)
    return str(log.read().decode(errors="replace"))


def test_http_end_to_end(http_server: tuple[str, subprocess.Popen[bytes]], home: str) -> None:
    url, proc = http_server
    before = _live(home)

    async def main() -> str:
        with anyio.fail_after(90):
            async with streamable_http_client(url) as (read, write):
                async with ClientSession(read, write) as session:
                    return await _exercise(session, home)

    session_sandbox = anyio.run(main)
    # Leaving the client sends DELETE: the session ends and its sandbox with it.
    _wait_gone(home, session_sandbox)
    assert _live(home) == before
    assert proc.poll() is None  # the server goes on serving other sessions


def test_http_sessions_are_separate_and_shutdown_cleans_up(
    http_server: tuple[str, subprocess.Popen[bytes]], home: str,
) -> None:
    url, proc = http_server
    before = _live(home)

    async def one_session(ready: anyio.Event, done: anyio.Event, out: list[str]) -> None:
        # terminate_on_close=False: the client vanishes without ending its session.
        async with streamable_http_client(url, terminate_on_close=False) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                ran = await _call(session, "run_command", command="echo $RANDOM > mine; cat mine")
                out.append(ran["sandbox_id"])
                made = await _call(session, "create_sandbox")
                out.append(made["sandbox_id"])
                ready.set()
                await done.wait()

    async def main() -> list[str]:
        ids: list[str] = []
        with anyio.fail_after(90):
            ready_a, ready_b, done = anyio.Event(), anyio.Event(), anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(one_session, ready_a, done, ids)
                tg.start_soon(one_session, ready_b, done, ids)
                await ready_a.wait()
                await ready_b.wait()
                done.set()
        return ids

    ids = anyio.run(main)
    assert len(set(ids)) == 4  # two sessions: two session sandboxes, two explicit ones
    assert set(ids) <= _live(home)  # the clients left without DELETE: still there
    proc.send_signal(signal.SIGTERM)
    # uvicorn re-raises the signal once its graceful shutdown (our lifespan included) is done.
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    assert _live(home) == before  # shutdown destroyed every sandbox its sessions made


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_stdio_server_stopped_by_a_signal(env: dict[str, str], home: str, signum: int) -> None:
    """SIGTERM (stdin still open) cleans up; SIGKILL cannot: the sandbox's TTL bounds it."""
    proc = subprocess.Popen([sys.executable, "-m", "corral", "mcp"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        def send(msg: dict[str, Any]) -> None:
            assert proc.stdin is not None
            proc.stdin.write((json.dumps(msg) + "\n").encode())
            proc.stdin.flush()

        def receive() -> dict[str, Any]:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, "server closed stdout"
            return dict(json.loads(line))

        send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "test", "version": "0"}}})
        assert receive()["id"] == 1
        send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        send({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
              "params": {"name": "run_command", "arguments": {"command": "true"}}})
        reply = receive()
        sandbox_id = reply["result"]["structuredContent"]["sandbox_id"]
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == -signum
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdin.close()
        proc.stdout.close()
    infos = {info.id: info for info in Sandbox.list(home=home)}
    if signum == signal.SIGTERM:
        assert sandbox_id not in infos
        return
    assert sandbox_id in infos  # nobody cleaned up...
    assert infos[sandbox_id].expires_at <= time.time() + 3600 + 60  # ...but its TTL bounds it
    Sandbox.connect(sandbox_id, home=home).kill()
