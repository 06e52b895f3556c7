"""The SDK core without root, sandboxes or a server: the wire logic, the generated sync façade,
and both façades over an in-memory HTTP transport (``httpx.MockTransport``)."""

from __future__ import annotations

import asyncio
import inspect
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import corral
from corral import (
    AsyncSandbox,
    OutputCut,
    Sandbox,
    SandboxNotFound,
    TransportError,
    UsageError,
)
from corral._sdk import _wire
from corral._sdk._async.http import AsyncHTTPTransport
from corral._sdk._sync.http import HTTPTransport

ROOT = Path(__file__).resolve().parents[2]

INFO = {"id": "sbx_a", "template": "base", "resources": "small", "state": "running",
        "created_at": 1.0, "expires_at": 2.0, "labels": {}, "network": {"mode": "none"},
        "secrets": [], "isolation": "namespace"}
USAGE = {"wall_s": 0.1, "cpu_s": 0.0, "peak_memory_bytes": 1, "oom_killed": False}
RESULT = {"exit_code": 0, "timed_out": False, "duration_s": 0.1, "usage": USAGE,
          "stdout_truncated": 0, "stderr_truncated": 0, "command_id": "cmd_1"}


def test_the_sync_sdk_is_generated_from_the_async_one() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts/unasync"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _public(cls: type) -> dict[str, inspect.Signature]:
    """Public methods by their sync name (``aclose`` is ``close``; async ``close`` an alias)."""
    return {name[1:] if name == "aclose" else name: inspect.signature(member)
            for name, member in vars(cls).items()
            if not name.startswith("_") and callable(member)}


@pytest.mark.parametrize("name", ["Sandbox", "Commands", "Files", "Network", "Audit",
                                  "Process", "Processes"])
def test_both_facades_have_the_same_methods(name: str) -> None:
    from corral._sdk import async_sandbox, sandbox

    sync, async_ = getattr(sandbox, name), getattr(async_sandbox, f"Async{name}")
    assert _public(sync).keys() == _public(async_).keys()
    for method, signature in _public(async_).items():
        assert list(_public(sync)[method].parameters) == list(signature.parameters), method
    assert hasattr(Sandbox, "close") and hasattr(AsyncSandbox, "aclose")


def test_the_stream_is_assembled_from_its_events() -> None:
    stream = _wire.CommandStream()
    pieces = [stream.feed(json.dumps(e)) for e in (
        {"type": "stdout", "data": "a"}, {"type": "keepalive"},
        {"type": "truncated", "stream": "stdout", "limit": 1,
         "data": "\n[corral: stdout truncated after 1 bytes; the rest is dropped]\n"},
        {"type": "stderr", "data": "e"},
        {"type": "result", **RESULT, "stdout_truncated": 5, "stdout_tail": "",
         "stderr_tail": "", "stdout_b64": "AAE="})]
    assert pieces[0] == ("stdout", "a") and pieces[1] is None and pieces[3] == ("stderr", "e")
    cut = pieces[2]
    assert cut is not None and isinstance(cut[1], OutputCut) and cut[1].limit == 1
    assert "[corral: stdout truncated" in cut[1]
    result = stream.finished()
    # The notice is kept output, where it happened; the result line sends nothing again.
    assert (result.stdout, result.stderr, result.stdout_truncated) == (
        "a" + str(cut[1]), "e", 5)
    assert str(cut[1]).startswith("\n")
    assert result.stdout_bytes == b"\x00\x01" and result.stderr_bytes is None


def test_an_older_server_s_result_line_still_carries_the_text() -> None:
    stream = _wire.CommandStream()
    stream.feed(json.dumps({"type": "stdout", "data": "x"}))
    stream.feed(json.dumps({"type": "result", **RESULT, "stdout": "x", "stderr": ""}))
    assert stream.finished().stdout == "x"


def test_a_stream_without_result_or_with_an_error_raises() -> None:
    with pytest.raises(TransportError):
        _wire.CommandStream().finished()
    with pytest.raises(SandboxNotFound, match="gone"):
        _wire.CommandStream().feed(json.dumps(
            {"type": "error", "error": "sandbox_not_found", "message": "gone"}))


def _api(request: httpx.Request) -> httpx.Response:
    """Just enough of the HTTP API for the façades."""
    path, method = request.url.path, request.method
    if (method, path) == ("POST", "/v1/sandboxes"):
        return httpx.Response(201, json=INFO)
    if path == "/v1/sandboxes/sbx_a" and method == "DELETE":
        return httpx.Response(204)
    if path == "/v1/sandboxes/sbx_a/commands":
        body = json.loads(request.content)
        if body["stream"]:
            lines = [{"type": "stdout", "data": "hi\n"}, {"type": "result", **RESULT,
                                                          "stdout_tail": "", "stderr_tail": ""}]
            return httpx.Response(200, content="".join(json.dumps(x) + "\n" for x in lines))
        return httpx.Response(200, json={**RESULT, "stdout": "hi\n", "stderr": ""})
    return httpx.Response(404, json={"error": "sandbox_not_found",
                                     "message": f"no {path}"})


def test_sandbox_over_an_in_memory_http_transport() -> None:
    client = httpx.Client(transport=httpx.MockTransport(_api), base_url="http://corral")
    seen: list[str] = []
    with Sandbox.create(transport=HTTPTransport(client=client)) as sb:
        assert sb.commands.run("echo hi").stdout == "hi\n"
        assert sb.commands.run("echo hi", on_stdout=seen.append).stdout == "hi\n"
        with pytest.raises(SandboxNotFound, match="no /v1/sandboxes/sbx_a/files/stat"):
            sb.files.stat("x")
        with pytest.raises(UsageError, match="output must be"):
            sb.commands.run("true", output="raw")  # type: ignore[arg-type]
    assert seen == ["hi\n"] and client.is_closed
    with pytest.raises(UsageError, match="was closed"):
        sb.get_info()


def test_async_sandbox_over_an_in_memory_http_transport() -> None:
    async def scenario() -> None:
        client = httpx.AsyncClient(transport=httpx.MockTransport(_api),
                                   base_url="http://corral")
        seen: list[str] = []

        async def on_out(text: str) -> None:
            seen.append(text)

        async with await AsyncSandbox.create(transport=AsyncHTTPTransport(client=client)) as sb:
            assert (await sb.commands.run("echo hi", on_stdout=on_out)).stdout == "hi\n"
            with pytest.raises(SandboxNotFound):
                await sb.processes.list()
        assert seen == ["hi\n"] and client.is_closed

    asyncio.run(scenario())


def test_new_public_names_are_exported() -> None:
    for name in ("Process", "AsyncProcess", "aread_audit", "OutputCut"):
        assert name in corral.__all__


def test_sdk_over_asgi_with_the_in_memory_backend(tmp_path: Path) -> None:
    """The whole stack without root: SDK -> ASGI -> app -> control plane -> in-memory backend."""
    from corral._server.app import create_app
    from corral.testing import asgi_transport, memory_manager

    manager = memory_manager(tmp_path, uid_start=100_000, uid_count=100)
    try:
        with Sandbox.create(transport=asgi_transport(create_app(manager))) as sb:
            result = sb.commands.run("echo hi")
            assert (result.exit_code, result.stdout) == (0, "hi\n")
            sb.files.write("notes.txt", "kept")
            assert sb.files.read("notes.txt") == "kept"
            assert [e.name for e in sb.files.list()] == ["notes.txt"]
            events = [e.type for e in sb.audit.events()]
            assert "command.finished" in events and "file.write" in events
        assert manager.list() == []
    finally:
        manager.close()


def test_the_control_plane_enforces_ceilings_without_root(tmp_path: Path) -> None:
    """Tenancy is the control plane's: the same ceiling holds embedded, with no HTTP layer."""
    from corral import CeilingExceeded
    from corral.testing import memory_manager

    manager = memory_manager(tmp_path, uid_start=100_000, uid_count=100, ceiling_hosts="",
                             ceiling_max_lifetime_s=600)
    try:
        with pytest.raises(CeilingExceeded, match="hosts ceiling"):
            manager.create(network={"allow": ["pypi.org"]})
        with pytest.raises(CeilingExceeded, match="lifetime"):
            manager.create(timeout=3600)
        info = manager.create(timeout=60)
        assert manager.run(info.id, "echo ok").stdout == "ok\n"
        manager.destroy(info.id)
    finally:
        manager.close()


def test_the_embedded_sync_sdk_loads_no_client_or_async_stack() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom corral import Sandbox\n"
         "print(sorted({m.split('.')[0] for m in sys.modules} & {'httpx', 'anyio'}))"],
        capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("kwargs, message", [
    ({"count": 0}, "count"), ({"concurrency": 0}, "concurrency"),
    ({"quota_wait": -1}, "quota_wait"), ({"create": {"snapshot": "x"}}, "unknown create"),
])
def test_a_fan_out_refuses_bad_arguments_before_anything_starts(kwargs: dict[str, object],
                                                          message: str) -> None:
    args: dict[str, object] = {"snapshot": "s", "count": 2, "command": "true", **kwargs}
    with pytest.raises(UsageError, match=message):
        corral.FanOut(**args)  # type: ignore[arg-type]


def test_the_shared_pools_keep_alive_every_connection_they_may_open() -> None:
    # httpcore closes a "surplus" idle connection outside its lock, racing a request it has
    # just been handed (EBADF under more threads than connections: bench_burst's 500 over
    # HTTP failed 8-9 creates a run; encode/httpcore#1110). No surplus, no such close.
    from corral._sdk._io import ahttp_pool, http_pool

    for pool in (http_pool("http://127.0.0.1:9", None, 5.0),
                 ahttp_pool("http://127.0.0.1:9", None, 5.0)):
        limits = pool.client._transport._pool
        assert limits._max_keepalive_connections >= limits._max_connections >= 100


def test_the_async_embedded_transport_serves_every_call_of_the_protocol() -> None:
    """Most of its calls are one generic worker-thread wrapper over the sync embedded
    transport: each protocol call must exist there with the same parameters."""
    from corral._sdk._aembedded import AsyncEmbeddedTransport
    from corral._sdk._async.transport import AsyncTransport
    from corral._sdk._embedded import EmbeddedTransport

    def parameters(func: object) -> list[tuple[str, object]]:
        return [(p.name, p.kind) for p in inspect.signature(func).parameters.values()]  # type: ignore[arg-type]

    calls = [name for name, member in vars(AsyncTransport).items()
             if inspect.isfunction(member) and not name.startswith("_")]
    assert len(calls) > 40
    for name in calls:
        own = vars(AsyncEmbeddedTransport).get(name)
        served = own if own is not None else getattr(EmbeddedTransport, name, None)
        assert served is not None, f"AsyncEmbeddedTransport does not serve {name}"
        assert parameters(served) == parameters(getattr(AsyncTransport, name)), name
