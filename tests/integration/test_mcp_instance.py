"""`corral mcp` cannot surprise (issue 38): it says which data directory it uses, refuses one
another Corral instance uses unless told to share, and ends with its client, killed or not,
its session sandbox destroyed on the way out.

Driven as MCP clients drive it: the official `mcp` client passes the server none of the test's
environment beyond its defaults (PATH, HOME, ...), plus what the test names."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from corral import Sandbox
from corral._settings import Settings

from ..conftest import private_settings
from .servers import free_port

pytestmark = pytest.mark.needs_root

_BOUND_S = 60.0  # any wait of these tests, on a loaded 2-core host


def _uids(settings: Settings) -> dict[str, str]:
    """The variables a test's server needs besides its data directory: its uid range (the
    default one would collide with other test sessions'). No CORRAL_HOME among them."""
    return {"CORRAL_UID_START": str(settings.uid_start),
            "CORRAL_UID_COUNT": str(settings.uid_count)}


def _live(home: str | Path) -> set[str]:
    return {info.id for info in Sandbox.list(home=str(home))}


def _exited_within(pid: int, bound_s: float) -> bool:
    """Whether process ``pid`` (not necessarily a child) has ended within ``bound_s``: waits on
    its pidfd, which becomes readable when it exits."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], bound_s)
        return bool(readable)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _corral_serve(settings: Settings) -> Iterator[subprocess.Popen[bytes]]:
    """``corral serve`` on ``settings``' data directory (given by CORRAL_HOME), until SIGTERM."""
    port = free_port()
    log = tempfile.TemporaryFile()
    env = {**os.environ, **_uids(settings), "CORRAL_HOME": str(settings.home)}
    env.pop("CORRAL_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "corral", "serve", "--port", str(port)],
                            env=env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + _BOUND_S
        while True:
            log.seek(0)
            assert proc.poll() is None, log.read().decode(errors="replace")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, "corral serve did not start"
            time.sleep(0.1)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=_BOUND_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def _initialize(params: StdioServerParameters) -> tuple[str, str]:
    """The instructions a client gets at initialize, and what the server wrote on stderr."""

    async def main() -> str:
        with anyio.fail_after(_BOUND_S):
            async with stdio_client(params, errlog=errlog) as (read, write), \
                    ClientSession(read, write) as session:
                result = await session.initialize()
                return result.instructions or ""

    with tempfile.TemporaryFile("w+") as errlog:
        instructions = anyio.run(main)
        errlog.seek(0)
        return instructions, errlog.read()


def test_mcp_names_its_data_directory(settings: Settings, home: str) -> None:
    """An environment without CORRAL_HOME, --home given: the client is told which directory
    (and where that came from) at initialize, and stderr says so too."""
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "corral", "--home", home, "mcp"],
        env=_uids(settings))
    assert "CORRAL_HOME" not in (params.env or {})
    instructions, stderr = _initialize(params)
    said = f"data directory {home} (from --home), tier {settings.backend}"
    assert said in instructions, instructions
    assert "network none" in instructions
    assert f"corral mcp: {said}" in stderr, stderr


def test_mcp_refuses_a_data_directory_in_use_unless_shared() -> None:
    """A home a `corral serve` runs on: `corral mcp` exits at once, non-zero, naming the
    service's pid and both ways out; with --share-home it starts. A second `corral serve`
    there is refused the same way."""
    with private_settings("corral-test-instance-") as settings, _corral_serve(settings) as served:
        home = str(settings.home)
        env = {**os.environ, **_uids(settings)}
        env.pop("CORRAL_HOME", None)
        env.pop("CORRAL_URL", None)
        started = time.monotonic()
        refused = subprocess.run([sys.executable, "-m", "corral", "--home", home, "mcp"],
                                 env=env, stdin=subprocess.PIPE, capture_output=True,
                                 text=True, timeout=_BOUND_S)
        took = time.monotonic() - started
        assert refused.returncode == 2, refused
        assert f"data directory {home} is in use by another Corral instance" in refused.stderr
        assert f"pid {served.pid} (corral serve" in refused.stderr, refused.stderr
        assert "--home" in refused.stderr and "--share-home" in refused.stderr
        assert took < _BOUND_S / 2, f"the refusal took {took:.1f} s"  # never a hang

        # Told to share, it starts, and says with whom.
        params = StdioServerParameters(
            command=sys.executable, args=["-m", "corral", "--home", home, "mcp", "--share-home"],
            env=_uids(settings))
        instructions, stderr = _initialize(params)
        assert f"data directory {home} (from --home)" in instructions
        assert f"sharing the data directory with pid {served.pid}" in stderr, stderr

        second = subprocess.run([sys.executable, "-m", "corral", "--home", home, "serve",
                                 "--port", str(free_port())], env=env, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=_BOUND_S)
        assert second.returncode != 0, second
        assert f"pid {served.pid} (corral serve" in second.stderr, second.stderr
        assert served.poll() is None  # the first service is untouched

        # A short command works beside the service: it takes no lock.
        listed = subprocess.run([sys.executable, "-m", "corral", "--home", home, "ls"],
                                env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                text=True, timeout=_BOUND_S)
        assert listed.returncode == 0, listed


# A client as MCP hosts are: it spawns `corral mcp` over stdio, makes one call (the session
# sandbox is made), and forks a helper that inherits the pipes (as a client's other children
# may), so the server's stdin does not end when the client dies. It prints what the test needs,
# then waits to be killed.
_CLIENT = textwrap.dedent("""
    import json, os, sys, time, anyio
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(command=sys.executable, args=["-m", "corral", "mcp"],
                                   env=json.loads(sys.argv[1]))

    def children():
        found = set()
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                found |= {int(p) for p in f.read().split()}
        return found

    async def main():
        async with stdio_client(params, errlog=sys.stderr) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                result = await session.call_tool("run_command", {"command": "true"})
                assert not result.is_error, result
                server = children()
                helper = os.fork()
                if helper == 0:  # holds every pipe end the client held, for a while
                    time.sleep(120)
                    os._exit(0)
                print(json.dumps({"sandbox_id": result.structured_content["sandbox_id"],
                                  "server": sorted(server), "helper": helper}), flush=True)
                await anyio.sleep(600)

    anyio.run(main)
""")


def _line(proc: subprocess.Popen[bytes], bound_s: float) -> dict[str, Any]:
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], bound_s)
    assert readable, "the client did not report within the bound"
    line = proc.stdout.readline()
    assert line, "the client ended before reporting"
    return dict(json.loads(line))


def test_mcp_ends_when_its_client_is_killed(settings: Settings, home: str) -> None:
    env = {**_uids(settings), "CORRAL_HOME": home}
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, json.dumps(env)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL)
    reported: dict[str, Any] = {}
    try:
        reported = _line(client, 120)
        [server] = reported["server"]
        sandbox_id = reported["sandbox_id"]
        assert sandbox_id in _live(home)
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=10)
        # The helper still holds the server's stdin open: no end of file; the server must see
        # its parent go, destroy its session sandbox, and exit.
        assert _exited_within(server, 30), "corral mcp outlived its killed client"
        assert sandbox_id not in _live(home)
    finally:
        client.kill()
        client.wait(timeout=10)
        assert client.stdout is not None
        client.stdout.close()
        for pid in [reported.get("helper"), *reported.get("server", [])]:
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if reported.get("sandbox_id") in _live(home):
            Sandbox.connect(reported["sandbox_id"], home=home).kill()


def test_mcp_ends_at_the_end_of_stdin(settings: Settings, home: str) -> None:
    """No signal at all: stdin's end of file ends the server, which cleans up first."""
    env = {**os.environ, **_uids(settings), "CORRAL_HOME": home}
    env.pop("CORRAL_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "corral", "mcp"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        for message in (
            {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "test", "version": "0"}}},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
             "params": {"name": "run_command", "arguments": {"command": "true"}}},
        ):
            proc.stdin.write((json.dumps(message) + "\n").encode())
            proc.stdin.flush()
        replies = [json.loads(proc.stdout.readline()) for _ in range(2)]
        sandbox_id = replies[1]["result"]["structuredContent"]["sandbox_id"]
        assert sandbox_id in _live(home)
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
        assert sandbox_id not in _live(home)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
