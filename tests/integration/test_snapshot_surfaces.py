"""Snapshots, forks, restore and the isolation tier through every surface: the sync SDK over both
transports (embedded and a real server on loopback), the HTTP API itself, tenants, the async SDK,
the CLI and the MCP server.

What a snapshot holds (layers, tree hashes, squashing, quotas) is tested with the control plane;
here it is that each surface reaches it and maps its errors back the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp_types import CallToolResult

from corral import (
    AsyncSandbox,
    QuotaExceeded,
    Sandbox,
    SandboxBusy,
    UsageError,
)
from corral._control.plane import TenantDirectory
from corral._settings import Settings
from corral.errors import SnapshotInUse, SnapshotNotFound
from corral.models import SnapshotInfo

from ..conftest import managed
from .servers import Server

pytestmark = pytest.mark.needs_root


def _name(prefix: str) -> str:
    """A snapshot name no other test (or transport) of the session uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def _cleanup(where: dict[str, str]) -> Iterator[tuple[list[Sandbox], list[str]]]:
    """Kill the sandboxes and delete the snapshots a test adds to these lists, whatever happens
    (sandboxes first: a snapshot cannot go while one is built on it)."""
    sandboxes: list[Sandbox] = []
    snapshots: list[str] = []
    try:
        yield sandboxes, snapshots
    finally:
        for sb in sandboxes:
            sb.kill()
        for ref in snapshots:
            with contextlib.suppress(SnapshotNotFound):
                Sandbox.delete_snapshot(ref, **where)


# -- the sync SDK, both transports -------------------------------------------------------------


def test_snapshot_fork_restore_list_and_delete(where: dict[str, str]) -> None:
    name = _name("round")
    with _cleanup(where) as (sandboxes, snapshots):
        sb = Sandbox.create(isolation="namespace", **where)
        sandboxes.append(sb)
        assert sb.get_info().isolation == "namespace" and sb.get_info().layer is None
        sb.files.write("state.txt", "one")
        snap = sb.snapshot(name)
        snapshots.append(snap.id)
        assert isinstance(snap, SnapshotInfo)
        assert (snap.name, snap.sandbox, snap.template) == (name, sb.id, "base")
        assert snap.id.startswith("snap_") and snap.depth >= 1
        assert Sandbox.get_snapshot(name, **where) == Sandbox.get_snapshot(snap.id, **where)
        assert snap.id in {s.id for s in Sandbox.list_snapshots(**where)}

        # The sandbox goes on from the snapshot; forks start from its state as it is now.
        sb.files.write("state.txt", "two")
        forks = sb.fork(2)
        sandboxes.extend(forks)
        assert len({f.id for f in forks} | {sb.id}) == 3
        for fork in forks:
            info = fork.get_info()
            assert (info.isolation, info.template, info.resources) == ("namespace", "base",
                                                                       "small")
            assert fork.files.read("state.txt") == "two"
        forks[0].files.write("state.txt", "mine")
        assert forks[1].files.read("state.txt") == "two" and sb.files.read("state.txt") == "two"
        assert {f.id for f in forks} <= {i.id for i in Sandbox.list(**where)}

        # Restore is exact: what was written since the snapshot goes, also new files.
        sb.files.write("later.txt", "x")
        sb.restore(snap)
        assert sb.files.read("state.txt") == "one" and not sb.files.exists("later.txt")
        assert sb.get_info().layer is not None
        sb.restore(name)  # by name too

        started = Sandbox.create(snapshot=name, **where)
        sandboxes.append(started)
        assert started.files.read("state.txt") == "one"
        assert started.get_info().template == snap.template

        with pytest.raises(SnapshotInUse, match="in use"):
            Sandbox.delete_snapshot(snap, **where)
        for other in sandboxes:
            other.kill()
        Sandbox.delete_snapshot(name, **where)
        with pytest.raises(SnapshotNotFound):
            Sandbox.get_snapshot(snap.id, **where)
        assert snap.id not in {s.id for s in Sandbox.list_snapshots(**where)}


def test_snapshot_errors_are_the_same_classes(where: dict[str, str]) -> None:
    name = _name("clash")
    with _cleanup(where) as (sandboxes, snapshots):
        sb = Sandbox.create(**where)
        sandboxes.append(sb)
        snapshots.append(sb.snapshot(name).id)

        for missing in (lambda: Sandbox.get_snapshot("no-such-snapshot", **where),
                        lambda: Sandbox.delete_snapshot("snap_000000000000", **where),
                        lambda: Sandbox.create(snapshot="no-such-snapshot", **where),
                        lambda: sb.restore("no-such-snapshot"),
                        lambda: Sandbox.get_snapshot("../sandboxes", **where)):
            with pytest.raises(SnapshotNotFound):
                missing()
        with pytest.raises(UsageError, match="already exists"):
            sb.snapshot(name)
        for bad_name in ("bad name!", "snap_000000000000", "-leading-dash", "x" * 64):
            with pytest.raises(UsageError, match="invalid snapshot name"):
                sb.snapshot(bad_name)
        for bad_count in (0, 65, -1, True):
            with pytest.raises(UsageError, match="count must be an integer"):
                sb.fork(bad_count)
        with pytest.raises(UsageError, match="isolation tier"):
            Sandbox.create(isolation="hypervisor", **where)
        with pytest.raises(UsageError, match="id or name"):
            Sandbox.get_snapshot("", **where)
        with pytest.raises(UsageError, match="id or name"):
            sb.restore("")
        # Refused requests left nothing behind.
        assert [s.name for s in Sandbox.list_snapshots(**where)].count(name) == 1


def test_snapshot_fork_and_restore_refuse_while_a_command_runs(where: dict[str, str]) -> None:
    with _cleanup(where) as (sandboxes, snapshots):
        sb = Sandbox.create(**where)
        sandboxes.append(sb)
        snapshots.append(sb.snapshot().id)
        results: list[Any] = []
        runner = threading.Thread(target=lambda: results.append(
            sb.commands.run("touch started; sleep 60", timeout=60)))
        runner.start()
        try:
            deadline = time.monotonic() + 20
            while not sb.files.exists("started"):
                assert time.monotonic() < deadline, "the command never started"
                time.sleep(0.05)
            for attempt in (sb.snapshot, lambda: sb.fork(1),
                            lambda: sb.restore(snapshots[0])):
                with pytest.raises(SandboxBusy, match="running"):
                    attempt()
        finally:
            started = sb.audit.events(types=["command.started"])
            assert started[-1].command is not None
            sb.commands.kill(started[-1].command)
            runner.join(timeout=30)
        assert results and results[0].exit_code == 137
        # Nothing was half made, and once idle it works again.
        assert len(Sandbox.list_snapshots(**where)) >= 1
        snapshots.append(sb.snapshot().id)
        assert sb.files.exists("started")


# -- the HTTP API itself -----------------------------------------------------------------------


def test_http_endpoints_statuses_and_defaults(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        made = client.post("/v1/sandboxes", json={"isolation": "namespace"})
        assert made.status_code == 201, made.text
        sandbox = made.json()
        assert sandbox["isolation"] == "namespace" and sandbox["layer"] is None
        base = f"/v1/sandboxes/{sandbox['id']}"
        forked: list[dict[str, Any]] = []
        snap: dict[str, Any] = {}
        try:
            taken = client.post(f"{base}/snapshots")  # no body: one unnamed snapshot
            assert taken.status_code == 201, taken.text
            snap = taken.json()
            assert snap["name"] is None and snap["sandbox"] == sandbox["id"]
            assert set(snap) == {"id", "name", "sandbox", "template", "created_at",
                                 "size_bytes", "depth", "memory"}
            assert snap["memory"] is False
            assert client.get(f"/v1/snapshots/{snap['id']}").json() == snap
            assert snap in client.get("/v1/snapshots").json()

            one = client.post(f"{base}/fork")  # no body: one fork
            assert one.status_code == 201, one.text
            forked += one.json()
            assert len(forked) == 1 and forked[0]["isolation"] == "namespace"
            assert forked[0]["layer"] is not None

            back = client.post(f"{base}/restore", json={"snapshot": snap["id"]})
            assert back.status_code == 200 and back.json()["id"] == sandbox["id"]

            for path, body, status, code in [
                (f"{base}/fork", {"count": 0}, 400, "usage_error"),
                (f"{base}/fork", {"count": True}, 400, "usage_error"),
                (f"{base}/fork", {"count": 1, "extra": 1}, 422, "invalid_request"),
                (f"{base}/snapshots", {"name": "bad name"}, 400, "usage_error"),
                (f"{base}/restore", {"snapshot": "no-such"}, 404, "snapshot_not_found"),
                (f"{base}/restore", {"snapshot": ""}, 400, "usage_error"),
                ("/v1/sandboxes", {"isolation": "bogus"}, 400, "usage_error"),
                ("/v1/sandboxes", {"snapshot": "no-such"}, 404, "snapshot_not_found"),
                ("/v1/sandboxes/sbx_000000000000/snapshots", {}, 404, "sandbox_not_found"),
            ]:
                response = client.post(path, json=body)
                assert (response.status_code, response.json()["error"]) == (status, code), (
                    path, body, response.text)

            in_use = client.delete(f"/v1/snapshots/{snap['id']}")
            assert in_use.status_code == 409 and in_use.json()["error"] == "snapshot_in_use"
        finally:
            for info in [sandbox, *forked]:
                client.delete(f"/v1/sandboxes/{info['id']}")
            if snap:
                assert client.delete(f"/v1/snapshots/{snap['id']}").status_code == 204
        gone = client.get(f"/v1/snapshots/{snap['id']}")
        assert gone.status_code == 404 and gone.json()["error"] == "snapshot_not_found"
        assert client.delete(f"/v1/snapshots/{snap['id']}").status_code == 404


# -- tenants -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tenants() -> Iterator[tuple[str, dict[str, str]]]:
    """A service with keys: alpha may have 2 sandboxes, beta 3."""
    home = Path(tempfile.mkdtemp(prefix="corral-test-snap-tenants-"))
    settings = Settings(home=home, uid_start=2_145_000_000 + random.randrange(100) * 1000,
                        uid_count=1000)
    with managed(settings) as mgr:
        directory = TenantDirectory(mgr.store)
        directory.add_tenant("alpha", max_sandboxes=2)
        directory.add_tenant("beta", max_sandboxes=3)
        keys = {name: directory.create_key(name)[1] for name in ("alpha", "beta")}
        with Server(mgr) as srv:
            yield srv.url, keys
    shutil.rmtree(home, ignore_errors=True)


def test_tenants_see_and_use_only_their_own_snapshots(
        tenants: tuple[str, dict[str, str]]) -> None:
    url, keys = tenants
    alpha: dict[str, str] = {"url": url, "api_key": keys["alpha"]}
    beta: dict[str, str] = {"url": url, "api_key": keys["beta"]}
    with _cleanup(alpha) as (a_boxes, a_snaps), _cleanup(beta) as (b_boxes, b_snaps):
        mine = Sandbox.create(**alpha)
        a_boxes.append(mine)
        mine.files.write("secret.txt", "alpha only")
        snap = mine.snapshot("same-name")
        a_snaps.append(snap.id)

        theirs = Sandbox.create(**beta)
        b_boxes.append(theirs)
        assert snap.id not in {s.id for s in Sandbox.list_snapshots(**beta)}
        for attempt in (lambda: Sandbox.get_snapshot(snap.id, **beta),
                        lambda: Sandbox.get_snapshot("same-name", **beta),
                        lambda: Sandbox.delete_snapshot(snap.id, **beta),
                        lambda: Sandbox.create(snapshot=snap.id, **beta),
                        lambda: theirs.restore(snap.id)):
            with pytest.raises(SnapshotNotFound):
                attempt()
        with httpx.Client(base_url=url, timeout=30,
                          headers={"authorization": f"Bearer {keys['beta']}"}) as client:
            base = f"/v1/sandboxes/{mine.id}"
            for path, body in [(f"{base}/snapshots", {}), (f"{base}/fork", {"count": 1}),
                               (f"{base}/restore", {"snapshot": snap.id})]:
                response = client.post(path, json=body)
                assert response.status_code == 404, (path, response.text)
                assert response.json()["error"] == "sandbox_not_found"

        # Names are per tenant: beta's own "same-name" is another snapshot.
        own = theirs.snapshot("same-name")
        b_snaps.append(own.id)
        assert own.id != snap.id
        assert Sandbox.get_snapshot("same-name", **alpha).id == snap.id
        assert Sandbox.get_snapshot("same-name", **beta).id == own.id
        assert mine.files.read("secret.txt") == "alpha only"

        # Forks count against the tenant's quota, all or nothing.
        with pytest.raises(QuotaExceeded):
            mine.fork(2)
        assert [i.id for i in Sandbox.list(**alpha)] == [mine.id]
        child = mine.fork(1)
        a_boxes.extend(child)
        assert child[0].files.read("secret.txt") == "alpha only"
        with pytest.raises(QuotaExceeded):
            Sandbox.create(snapshot=snap.id, **alpha)


# -- the async SDK -----------------------------------------------------------------------------


def test_async_round_trip(where: dict[str, str]) -> None:
    name = _name("async")

    async def scenario() -> None:
        forks: list[AsyncSandbox] = []
        try:
            async with await AsyncSandbox.create(isolation="namespace", **where) as sb:
                await sb.files.write("state.txt", "one")
                snap = await sb.snapshot(name)
                assert (snap.name, snap.sandbox) == (name, sb.id)
                await sb.files.write("state.txt", "two")
                forks = await sb.fork(2)
                assert len(forks) == 2
                await sb.restore(snap)
                assert await sb.files.read("state.txt") == "one"
                assert (await sb.get_info()).layer is not None
            # Each fork has its own connection: closing the original leaves them usable.
            for fork in forks:
                assert await fork.files.read("state.txt") == "two"
                assert (await fork.get_info()).isolation == "namespace"
            async with await AsyncSandbox.create(snapshot=snap, **where) as started:
                assert await started.files.read("state.txt") == "one"
                assert snap.id in {s.id for s in await AsyncSandbox.list_snapshots(**where)}
                assert (await AsyncSandbox.get_snapshot(name, **where)).id == snap.id
                with pytest.raises(SnapshotInUse):
                    await AsyncSandbox.delete_snapshot(snap, **where)
        finally:
            for fork in forks:
                async with fork:
                    pass
        await AsyncSandbox.delete_snapshot(name, **where)
        with pytest.raises(SnapshotNotFound):
            await AsyncSandbox.get_snapshot(snap.id, **where)

    asyncio.run(scenario())


# -- the CLI -----------------------------------------------------------------------------------


@pytest.fixture
def corral(where: dict[str, str], settings: Settings
           ) -> Callable[..., subprocess.CompletedProcess[str]]:
    """The CLI as a separate process: embedded with --home, or against the server through
    CORRAL_URL (then the data directory is the server's business)."""
    env = {**os.environ, "CORRAL_HOME": str(settings.home),
           "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count), "COLUMNS": "200"}
    env.pop("CORRAL_URL", None)
    prefix: list[str] = []
    if "url" in where:
        env["CORRAL_URL"] = where["url"]
    else:
        prefix = ["--home", where["home"]]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "corral", *prefix, *args], env=env,
                              capture_output=True, text=True, timeout=120)

    return run


def _json(done: subprocess.CompletedProcess[str]) -> Any:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_cli_commands(corral: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    name = _name("cli")
    sandbox_ids: list[str] = []
    snapshot_refs: list[str] = []
    try:
        info = _json(corral("create", "--isolation", "namespace", "--json"))
        sandbox_id = info["id"]
        sandbox_ids.append(sandbox_id)
        assert info["isolation"] == "namespace"
        assert corral("exec", sandbox_id, "--", "echo one > a.txt").returncode == 0

        snap = _json(corral("snapshot", sandbox_id, "--name", name, "--json"))
        snapshot_refs.append(snap["id"])
        assert (snap["name"], snap["sandbox"]) == (name, sandbox_id)
        plain = corral("snapshot", sandbox_id)
        assert plain.returncode == 0 and plain.stdout.strip().startswith("snap_")
        snapshot_refs.append(plain.stdout.strip())

        assert corral("exec", sandbox_id, "--", "echo two > a.txt").returncode == 0
        forks = _json(corral("fork", sandbox_id, "-n", "2", "--json"))
        sandbox_ids += [f["id"] for f in forks]
        assert len(forks) == 2 and all(f["isolation"] == "namespace" for f in forks)
        one = corral("fork", sandbox_id)
        assert one.returncode == 0 and one.stdout.strip().startswith("sbx_")
        sandbox_ids.append(one.stdout.strip())
        cat = _json(corral("exec", forks[0]["id"], "--json", "--", "cat a.txt"))
        assert cat["stdout"] == "two\n"

        restored = _json(corral("restore", sandbox_id, name, "--json"))
        assert restored["id"] == sandbox_id and restored["layer"] is not None
        assert _json(corral("exec", sandbox_id, "--json", "--", "cat a.txt"))["stdout"] == "one\n"
        quiet = corral("restore", sandbox_id, snap["id"])
        assert quiet.returncode == 0 and quiet.stdout == "" and "restored" in quiet.stderr

        started = _json(corral("create", "--snapshot", name, "--json"))
        sandbox_ids.append(started["id"])
        assert _json(corral("exec", started["id"], "--json", "--", "cat a.txt"))["stdout"] \
            == "one\n"
        ran = corral("run", "--snapshot", name, "--isolation", "namespace", "--json", "--",
                     "cat a.txt")
        assert _json(ran)["stdout"] == "one\n"

        listed = _json(corral("snapshots", "ls", "--json"))
        assert set(snapshot_refs) <= {s["id"] for s in listed}
        table = corral("snapshots", "ls")
        assert table.returncode == 0 and name in table.stdout and "DEPTH" in table.stdout
        assert _json(corral("snapshots", "info", name, "--json"))["id"] == snap["id"]
        shown = corral("snapshots", "info", name)
        assert shown.returncode == 0 and snap["id"] in shown.stdout
        ls = corral("ls")
        assert "ISOLATION" in ls.stdout and "namespace" in ls.stdout
        assert _json(corral("info", sandbox_id, "--json"))["isolation"] == "namespace"

        in_use = corral("snapshots", "rm", name, "--json")
        assert in_use.returncode == 1
        assert json.loads(in_use.stderr)["code"] == "snapshot_in_use"
        busy_name = corral("snapshot", sandbox_id, "--name", name, "--json")
        assert busy_name.returncode == 2 and "already exists" in busy_name.stderr
    finally:
        if sandbox_ids:
            assert corral("rm", *sandbox_ids).returncode == 0
        if snapshot_refs:
            removed = corral("snapshots", "rm", *snapshot_refs, "--json")
            assert _json(removed) == {"removed": snapshot_refs}
    missing = corral("snapshots", "info", name, "--json")
    assert missing.returncode != 0 and json.loads(missing.stderr)["code"] == "snapshot_not_found"
    bad = corral("create", "--isolation", "hypervisor")
    assert bad.returncode == 2 and "hypervisor" in bad.stderr
    for command in (["snapshot"], ["fork"], ["restore"], ["snapshots"], ["snapshots", "ls"],
                    ["snapshots", "rm"], ["snapshots", "info"]):
        helped = corral(*command, "--help")
        assert helped.returncode == 0 and "Usage:" in helped.stdout, command


# -- the MCP server ----------------------------------------------------------------------------


def _mcp_data(result: CallToolResult) -> dict[str, Any]:
    assert result.structured_content is not None, result
    return dict(result.structured_content)


async def _tool(session: ClientSession, tool: str, **args: Any) -> dict[str, Any]:
    result = await session.call_tool(tool, args)
    assert not result.is_error, result.content
    return _mcp_data(result)


async def _tool_error(session: ClientSession, tool: str, **args: Any) -> str:
    result = await session.call_tool(tool, args)
    assert result.is_error, result.content
    return str(_mcp_data(result)["code"])


def test_mcp_snapshot_fork_restore(settings: Settings, home: str) -> None:
    env = {**os.environ, "CORRAL_HOME": str(settings.home),
           "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    env.pop("CORRAL_URL", None)
    params = StdioServerParameters(command=sys.executable, args=["-m", "corral", "mcp"],
                                   env=env)
    name = _name("mcp")
    before = {i.id for i in Sandbox.list(home=home)}

    async def main() -> tuple[set[str], str]:
        made: set[str] = set()
        with tempfile.TemporaryFile("w+") as errlog, anyio.fail_after(90):
            async with stdio_client(params, errlog=errlog) as (read, write), \
                    ClientSession(read, write) as session:
                await session.initialize()
                tools = {t.name for t in (await session.list_tools()).tools}
                assert {"snapshot", "fork", "restore"} <= tools

                await _tool(session, "write_file", path="state.txt", content="one")
                snap = await _tool(session, "snapshot", name=name)
                session_sandbox = snap["sandbox_id"]
                made.add(session_sandbox)
                assert snap["name"] == name and snap["snapshot_id"].startswith("snap_")
                assert Sandbox.get_snapshot(name, home=home).id == snap["snapshot_id"]

                await _tool(session, "write_file", path="state.txt", content="two")
                forked = await _tool(session, "fork", count=2)
                assert forked["sandbox_id"] == session_sandbox and len(forked["forks"]) == 2
                made |= set(forked["forks"])
                for fork in forked["forks"]:
                    read_back = await _tool(session, "read_file", path="state.txt",
                                            sandbox_id=fork)
                    assert read_back["content"] == "two"

                restored = await _tool(session, "restore", snapshot=name)
                assert restored["sandbox_id"] == session_sandbox and restored["restored"]
                assert (await _tool(session, "read_file", path="state.txt"))["content"] == "one"

                started = await _tool(session, "create_sandbox", snapshot=snap["snapshot_id"],
                                      isolation="namespace")
                made.add(started["sandbox_id"])
                assert started["isolation"] == "namespace"
                again = await _tool(session, "read_file", path="state.txt",
                                    sandbox_id=started["sandbox_id"])
                assert again["content"] == "one"

                assert await _tool_error(session, "restore",
                                         snapshot="no-such-snapshot") == "snapshot_not_found"
                assert await _tool_error(session, "fork", count=0) == "usage_error"
                assert await _tool_error(session, "snapshot", name=name) == "usage_error"
                assert await _tool_error(session, "create_sandbox",
                                         isolation="hypervisor") == "usage_error"
                assert await _tool_error(session, "snapshot",
                                         sandbox_id="sbx_000000000000") == "sandbox_not_found"
                return made, str(snap["snapshot_id"])

    made, snapshot_id = anyio.run(main)
    # The session ended: its sandboxes (forks included) and then its snapshot are gone.
    deadline = time.monotonic() + 20
    while True:
        live = {i.id for i in Sandbox.list(home=home)}
        try:
            Sandbox.get_snapshot(snapshot_id, home=home)
        except SnapshotNotFound:
            if not made & live:
                break
        if time.monotonic() > deadline:
            for sandbox_id in made & live:
                Sandbox.connect(sandbox_id, home=home).kill()
            with contextlib.suppress(SnapshotNotFound):
                Sandbox.delete_snapshot(snapshot_id, home=home)
            pytest.fail("the MCP session's sandboxes or snapshot outlived it")
        time.sleep(0.1)
    assert {i.id for i in Sandbox.list(home=home)} == before

