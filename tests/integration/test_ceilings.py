"""Operator ceilings and the one quota path (issue 11): the caller is untrusted too.

A tenant with a ceiling cannot give a sandbox a host, template, isolation tier, resource tier,
secret or lifetime beyond it — through the remote SDK, raw HTTP, the embedded SDK (with the
server default from Settings), MCP, a policy change after create, fork and create-from-
snapshot. Terminals and background processes count against commands-per-minute exactly like
commands. MCP refuses arguments it does not know instead of ignoring them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp_types import CallToolResult, TextContent

from corral import CeilingExceeded, QuotaExceeded, Sandbox
from corral._control.manager import Manager
from corral._control.plane import TenantDirectory
from corral._settings import Settings

from ..conftest import managed
from .servers import Server

pytestmark = pytest.mark.needs_root

# Each refusal is a 403 `ceiling_exceeded` whose message names the ceiling it hit.
BEYOND: list[tuple[str, dict[str, Any], str]] = [
    ("host", {"network": {"allow": ["evil.example.net"]}}, "hosts ceiling"),
    ("host-apex", {"network": {"allow": ["pypi.org.evil.test"]}}, "hosts ceiling"),
    ("host-port", {"network": {"allow": ["api.example.com:8443"]}}, "hosts ceiling"),
    ("host-wider-wildcard", {"network": {"allow": ["*.example.com"]}}, "hosts ceiling"),
    ("template", {"template": "python"}, "template ceiling"),
    ("resources", {"resources": "large"}, "resources ceiling"),
    ("isolation", {"isolation": "gvisor"}, "isolation ceiling"),
    ("secret", {"secrets": ["OTHER_TOKEN"]}, "secrets ceiling"),
    ("lifetime", {"timeout": 1200}, "max lifetime ceiling"),
]
# Within it: exact names, subdomains and sub-wildcards of a wildcard, the port a pattern names.
WITHIN: dict[str, Any] = {
    "template": "base", "resources": "small", "isolation": "namespace", "timeout": 300,
    "secrets": ["OK_TOKEN"],
    "network": {"allow": ["api.example.com", "files.pythonhosted.org", "*.files.pythonhosted.org",
                          "pypi.org:443", "git.example.com:8443"]},
}
CEILING: dict[str, Any] = {
    "hosts": ["api.example.com", "*.pythonhosted.org", "pypi.org", "git.example.com:8443"],
    "templates": ["base"], "isolation": ["namespace"], "resources": ["small"],
    "secrets": ["OK_TOKEN"], "max_lifetime_s": 600,
}


def _ceiling(**fields: Any) -> Any:
    # Imported here so that the file collects (and each test fails) on code without ceilings.
    from corral._control.tenants import Ceiling

    return Ceiling.build(**fields)


def _new_home(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"corral-test-{prefix}-"))


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[Server, dict[str, str], Manager]]:
    """A service with a capped tenant, an uncapped one and a slow (2 per minute) one."""
    home = _new_home("ceilings")
    settings = Settings(home=home, uid_start=2_135_000_000 + random.randrange(100) * 1000,
                        uid_count=1000)
    with managed(settings) as mgr:
        mgr.secrets.add("OK_TOKEN", "ok-secret-value", ["api.example.com"])
        mgr.secrets.add("OTHER_TOKEN", "other-secret-value", ["api.example.com"])
        directory = TenantDirectory(mgr.store)
        directory.add_tenant("capped", max_sandboxes=20, tiers=["small", "large"],
                             commands_per_minute=1000, ceiling=_ceiling(**CEILING))
        directory.add_tenant("open", max_sandboxes=20, tiers=["small", "large"],
                             commands_per_minute=1000)
        directory.add_tenant("slow", max_sandboxes=5, tiers=["small"], commands_per_minute=2)
        keys = {name: directory.create_key(name)[1] for name in ("capped", "open", "slow")}
        with Server(mgr) as srv:
            yield srv, keys, mgr
    shutil.rmtree(home, ignore_errors=True)


def _remote(service: tuple[Server, dict[str, str], Manager], tenant: str) -> dict[str, str]:
    return {"url": service[0].url, "api_key": service[1][tenant]}


def _live(mgr: Manager, tenant: str) -> set[str]:
    return {i.id for i in mgr.list(tenant=tenant)}


# -- the rule: which allow rules a ceiling pattern covers ----------------------------------------


@pytest.mark.parametrize(("pattern", "requested", "covered"), [
    ("*.example.com", "a.example.com", True),
    ("*.example.com", "*.a.example.com", True),
    ("*.example.com", "*.example.com", True),
    ("*.example.com", "example.com", False),  # a wildcard never covers the apex
    ("*.example.com", "badexample.com", False),
    ("example.com", "example.com", True),
    ("example.com", "a.example.com", False),  # an exact name covers only itself
    ("example.com", "*.example.com", False),
    ("example.com", "example.com:443", True),  # no port = 80 and 443
    ("example.com", "example.com:8443", False),
    ("example.com:8443", "example.com:8443", True),
    ("example.com:8443", "example.com", False),  # the port in the ceiling restricts
    ("*.example.com:8443", "a.example.com:8443", True),
    ("*.example.com:8443", "a.example.com:443", False),
    ("Example.COM.", "example.com", True),  # both normalised the same way
])
def test_a_ceiling_pattern_covers_allow_rules(pattern: str, requested: str,
                                              covered: bool) -> None:
    from corral._control.tenants import covers
    from corral._egress.policy import Rule

    assert covers(Rule.parse(pattern), Rule.parse(requested)) is covered


# -- create: remote SDK and raw HTTP -------------------------------------------------------------


@pytest.mark.parametrize(("case", "asked", "names"), BEYOND, ids=[b[0] for b in BEYOND])
def test_remote_sdk_refuses_beyond_the_ceiling(
    service: tuple[Server, dict[str, str], Manager], case: str, asked: dict[str, Any],
    names: str,
) -> None:
    before = _live(service[2], "capped")
    with pytest.raises(CeilingExceeded, match=names) as caught:
        Sandbox.create(**asked, **_remote(service, "capped")).kill()
    assert "capped" in caught.value.message and caught.value.status == 403
    assert _live(service[2], "capped") == before  # nothing was made


@pytest.mark.parametrize(("case", "asked", "names"), BEYOND, ids=[b[0] for b in BEYOND])
def test_http_api_refuses_beyond_the_ceiling_with_403(
    service: tuple[Server, dict[str, str], Manager], case: str, asked: dict[str, Any],
    names: str,
) -> None:
    srv, keys, _ = service
    with httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {keys['capped']}"},
                      timeout=30) as client:
        response = client.post("/v1/sandboxes", json=asked)
    assert response.status_code == 403, response.text
    body = response.json()
    assert body["error"] == "ceiling_exceeded" and names in body["message"], body


def test_within_the_ceiling_works_and_no_ceiling_is_todays_behaviour(
    service: tuple[Server, dict[str, str], Manager],
) -> None:
    with Sandbox.create(**WITHIN, **_remote(service, "capped")) as sb:
        info = sb.get_info()
        assert info.network["mode"] == "allowlist" and "api.example.com" in info.network["allow"]
        assert sb.commands.run("echo ok").stdout == "ok\n"
    # The default (no timeout) is fitted to the max lifetime instead of being refused.
    with Sandbox.create(**_remote(service, "capped")) as sb:
        info = sb.get_info()
        assert info.expires_at - info.created_at <= 600 + 1
    # A tenant without a ceiling asks for what it likes, as before.
    wide = {"network": {"allow": ["evil.example.net"]}, "resources": "large", "timeout": 1200}
    with Sandbox.create(**wide, **_remote(service, "open")) as sb:
        assert sb.get_info().network["allow"] == ["evil.example.net"]


# -- after create: set_network, set_timeout, fork, create-from-snapshot, restore ------------------


def test_policy_change_after_create_stays_within_the_ceiling(
    service: tuple[Server, dict[str, str], Manager],
) -> None:
    srv, keys, _ = service
    with Sandbox.create(**_remote(service, "capped")) as sb:
        with pytest.raises(CeilingExceeded, match="hosts ceiling"):
            sb.network.update(allow=["evil.example.net"])
        with pytest.raises(CeilingExceeded, match="hosts ceiling"):
            sb.network.update(allow=["api.example.com", "*.example.com"])
        assert sb.get_info().network["mode"] == "none"  # unchanged
        assert sb.network.update(allow=["x.pythonhosted.org"])["allow"] == ["x.pythonhosted.org"]
        with httpx.Client(base_url=srv.url,
                          headers={"authorization": f"Bearer {keys['capped']}"}) as client:
            raw = client.put(f"/v1/sandboxes/{sb.id}/network", json={"allow": ["evil.test"]})
            assert raw.status_code == 403 and raw.json()["error"] == "ceiling_exceeded"
            # Extending the lifetime again and again cannot pass the max either.
            longer = client.post(f"/v1/sandboxes/{sb.id}/timeout", json={"timeout": 3000})
            assert longer.status_code == 403, longer.text
            assert "max lifetime ceiling" in longer.json()["message"]
            assert client.post(f"/v1/sandboxes/{sb.id}/timeout",
                               json={"timeout": 100}).status_code == 200


def test_fork_and_snapshot_cannot_carry_a_policy_past_a_ceiling(
    service: tuple[Server, dict[str, str], Manager],
) -> None:
    srv, keys, mgr = service
    directory = TenantDirectory(mgr.store)
    directory.add_tenant("shifting", max_sandboxes=10, tiers=["small"],
                         commands_per_minute=1000)
    key = directory.create_key("shifting")[1]
    kw = {"url": srv.url, "api_key": key}
    # Made while the tenant had no ceiling; then the operator sets one.
    sb = Sandbox.create(network={"allow": ["evil.example.net"]}, **kw)
    try:
        sb.files.write("state.txt", "one")
        snap = sb.snapshot()
        directory.set_tenant("shifting", ceiling={"hosts": ("api.example.com",)})
        before = _live(mgr, "shifting")
        with pytest.raises(CeilingExceeded, match="hosts ceiling"):
            sb.fork(1)
        with pytest.raises(CeilingExceeded, match="hosts ceiling"):
            sb.restore(snap)
        assert _live(mgr, "shifting") == before
        with pytest.raises(CeilingExceeded, match="hosts ceiling"):
            Sandbox.create(snapshot=snap, network={"allow": ["evil.example.net"]}, **kw)
        # From a snapshot within the ceiling: fine, and its files come along.
        with Sandbox.create(snapshot=snap, network={"allow": ["api.example.com"]}, **kw) as ok:
            assert ok.files.read("state.txt") == "one"
            forks = ok.fork(1)
            assert len(forks) == 1
            forks[0].kill()
        directory.set_tenant("shifting", ceiling={"templates": ("python",)})
        with pytest.raises(CeilingExceeded, match="template ceiling"):
            Sandbox.create(snapshot=snap, **kw)
    finally:
        sb.kill()
        mgr.delete_snapshot(snap.id)


# -- embedded, with the server default ceiling from Settings -------------------------------------


@pytest.fixture(scope="module")
def capped_home() -> Iterator[tuple[str, Manager]]:
    home = _new_home("default-ceiling")
    settings = Settings(home=home, uid_start=2_136_000_000 + random.randrange(100) * 1000,
                        uid_count=1000, ceiling_hosts="api.example.com,*.pythonhosted.org,"
                        "pypi.org,git.example.com:8443", ceiling_templates="base",
                        ceiling_isolation="namespace", ceiling_resources="small",
                        ceiling_secrets="OK_TOKEN", ceiling_max_lifetime_s=600)
    with managed(settings) as mgr:
        mgr.secrets.add("OK_TOKEN", "ok-secret-value", ["api.example.com"])
        mgr.secrets.add("OTHER_TOKEN", "other-secret-value", ["api.example.com"])
        yield str(home), mgr
    shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize(("case", "asked", "names"), BEYOND, ids=[b[0] for b in BEYOND])
def test_embedded_sdk_gets_the_server_default_ceiling(
    capped_home: tuple[str, Manager], case: str, asked: dict[str, Any], names: str,
) -> None:
    home, mgr = capped_home
    with pytest.raises(CeilingExceeded, match=names):
        Sandbox.create(**asked, home=home).kill()
    assert mgr.list() == []


def test_embedded_within_the_default_ceiling_and_after_create(
    capped_home: tuple[str, Manager],
) -> None:
    home, _ = capped_home
    with Sandbox.create(**WITHIN, home=home) as sb:
        with pytest.raises(CeilingExceeded, match="hosts ceiling"):
            sb.network.update(allow=["evil.example.net"])
        assert sb.commands.run("echo ok").stdout == "ok\n"


def test_keyless_service_tenant_gets_the_server_default_ceiling(
    capped_home: tuple[str, Manager],
) -> None:
    with Server(capped_home[1]) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        refused = client.post("/v1/sandboxes", json={"network": {"allow": ["evil.test"]}})
        assert refused.status_code == 403 and refused.json()["error"] == "ceiling_exceeded"


# -- the CLI: set, show ----------------------------------------------------------------------------


def test_cli_sets_and_shows_a_tenants_ceiling(capped_home: tuple[str, Manager]) -> None:
    import subprocess

    home, mgr = capped_home
    env = {**os.environ, "CORRAL_HOME": home,
           "CORRAL_UID_START": str(mgr.settings.uid_start),
           "CORRAL_UID_COUNT": str(mgr.settings.uid_count)}
    env.pop("CORRAL_URL", None)

    def corral(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "corral", *args], env=env,
                              capture_output=True, text=True, timeout=60)

    added = corral("tenants", "add", "clitenant", "--allow-host", "*.example.com",
                   "--template", "base", "--max-lifetime", "900", "--json")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["ceiling"] == {
        "hosts": ["*.example.com"], "templates": ["base"], "max_lifetime_s": 900}
    changed = corral("tenants", "set", "clitenant", "--no-network", "--secret", "OK_TOKEN",
                     "--isolation", "namespace", "--json")
    assert changed.returncode == 0, changed.stderr
    listed = {t["name"]: t for t in json.loads(corral("tenants", "ls", "--json").stdout)}
    assert listed["clitenant"]["ceiling"] == {
        "hosts": [], "templates": ["base"], "isolation": ["namespace"],
        "secrets": ["OK_TOKEN"], "max_lifetime_s": 900}
    assert "hosts=(none)" in corral("tenants", "ls").stdout
    bad = corral("tenants", "set", "clitenant", "--allow-host", "*.com")
    assert bad.returncode != 0 and "top-level domain" in bad.stderr
    slept = corral("tenants", "set", "clitenant", "--max-asleep", "3600", "--max-hibernated",
                   "20", "--json")
    assert slept.returncode == 0, slept.stderr
    assert json.loads(slept.stdout)["ceiling"]["max_asleep_s"] == 3600
    assert json.loads(slept.stdout)["ceiling"]["max_hibernated"] == 20
    negative = corral("tenants", "set", "clitenant", "--max-hibernated", "-1")
    assert negative.returncode != 0 and "number of sandboxes" in negative.stderr
    mgr.store.remove_tenant("clitenant")


# -- one quota path: commands, background processes, terminals -----------------------------------


def _terminal(url: str, key: str, sandbox_id: str) -> str:
    """Open a terminal, run one command in it; 'ran' or the close code/error it got."""
    import websockets

    async def session() -> str:
        ws_url = url.replace("http", "ws") + f"/v1/sandboxes/{sandbox_id}/pty"
        try:
            async with websockets.connect(
                    ws_url, additional_headers={"authorization": f"Bearer {key}"}) as ws:
                screen = ""
                async with asyncio.timeout(15):
                    sent = False
                    while "t-42" not in screen:
                        frame = await ws.recv()
                        text = frame.decode() if isinstance(frame, bytes) else frame
                        if text.startswith('{"type": "error"'):
                            return str(json.loads(text)["error"])
                        screen += text
                        if not sent:  # after the first frame: the shell is there
                            await ws.send(json.dumps({"type": "input",
                                                      "data": "echo t-$((6*7))\n"}))
                            sent = True
                    await ws.send(json.dumps({"type": "input", "data": "exit\n"}))
                    # Until the shell has exited, so the sandbox is not destroyed under it.
                    while '"type": "exit"' not in screen:
                        frame = await ws.recv()
                        screen += frame.decode() if isinstance(frame, bytes) else frame
                    return "ran"
        except websockets.exceptions.ConnectionClosed as exc:
            return f"closed {exc.rcvd.code if exc.rcvd else 0}"
        except websockets.exceptions.InvalidStatus as exc:
            # A refusal before the handshake completes: an HTTP status with the JSON error.
            assert exc.response.status_code == 429, exc.response.status_code
            return str(json.loads(exc.response.body or b"{}").get("error"))

    return asyncio.run(session())


@pytest.fixture(scope="module")
def quota_service() -> Iterator[tuple[Server, Manager]]:
    """A service with no ceilings at all: the quota path alone."""
    home = _new_home("quotas")
    settings = Settings(home=home, uid_start=2_137_000_000 + random.randrange(100) * 1000,
                        uid_count=1000)
    with managed(settings) as mgr, Server(mgr) as srv:
        yield srv, mgr
    shutil.rmtree(home, ignore_errors=True)


def test_terminals_and_processes_count_like_commands(
    quota_service: tuple[Server, Manager],
) -> None:
    srv, mgr = quota_service
    directory = TenantDirectory(mgr.store)
    for name in ("slowpty", "slowproc"):
        directory.add_tenant(name, max_sandboxes=2, tiers=["small"], commands_per_minute=2)
    # Terminals: two starts per minute, whatever kind; the third (a terminal) is refused.
    key = directory.create_key("slowpty")[1]
    with Sandbox.create(url=srv.url, api_key=key) as sb:
        assert sb.commands.run("true").exit_code == 0
        assert _terminal(srv.url, key, sb.id) == "ran"
        assert _terminal(srv.url, key, sb.id) == "quota_exceeded"
        with pytest.raises(QuotaExceeded, match="commands per minute"):
            sb.commands.run("true")
    # Background processes likewise, and a command after them is refused.
    key = directory.create_key("slowproc")[1]
    with Sandbox.create(url=srv.url, api_key=key) as sb:
        first = sb.processes.start("sleep 30")
        assert sb.commands.run("true").exit_code == 0
        with pytest.raises(QuotaExceeded, match="commands per minute"):
            sb.processes.start("sleep 30")
        with pytest.raises(QuotaExceeded, match="commands per minute"):
            _ = sb.commands.run("true")
        first.kill()
        # A terminal is refused before a shell starts, with the reason.
        assert _terminal(srv.url, key, sb.id) == "quota_exceeded"


# -- MCP: its own (tighter) ceiling, its template, no unknown arguments ---------------------------


def _mcp_data(result: CallToolResult) -> dict[str, Any]:
    assert result.structured_content is not None, result
    return dict(result.structured_content)


def _text(result: CallToolResult) -> str:
    return " ".join(c.text for c in result.content if isinstance(c, TextContent))


def _mcp(settings: Settings, home: str, *extra: str) -> StdioServerParameters:
    env = {**os.environ, "CORRAL_HOME": home, "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    env.pop("CORRAL_URL", None)
    return StdioServerParameters(command=sys.executable, args=["-m", "corral", "mcp", *extra],
                                 env=env)


def test_mcp_refuses_beyond_its_ceiling_and_unknown_arguments(
    settings: Settings, home: str,
) -> None:
    async def main() -> None:
        with tempfile.TemporaryFile("w+") as errlog, anyio.fail_after(90):
            async with stdio_client(_mcp(settings, home), errlog=errlog) as (read, write), \
                    ClientSession(read, write) as session:
                await session.initialize()
                # The model sets its own allowlist: refused by MCP's default (no network).
                opened = await session.call_tool("create_sandbox",
                                                 {"allow": ["attacker.example.net"]})
                assert opened.is_error and _mcp_data(opened)["code"] == "ceiling_exceeded"
                assert "hosts ceiling" in _mcp_data(opened)["message"]
                # template is a real argument now: used, and bounded by the ceiling.
                python = await session.call_tool("create_sandbox", {"template": "python"})
                assert python.is_error and _mcp_data(python)["code"] == "ceiling_exceeded"
                assert "template ceiling" in _mcp_data(python)["message"]
                made = await session.call_tool("create_sandbox", {"template": "base"})
                assert not made.is_error and _mcp_data(made)["template"] == "base"
                sandbox_id = _mcp_data(made)["sandbox_id"]
                # An argument the tool does not take is refused, naming it.
                for tool, args, field in [
                    ("create_sandbox", {"templat": "python"}, "templat"),
                    ("run_command", {"command": "true", "env": {"LD_PRELOAD": "x"}}, "env"),
                    ("read_file", {"path": "a", "sandbox_id": sandbox_id, "mode": "rb"},
                     "mode"),
                    ("fork", {"count": 1, "sandbox_id": sandbox_id, "network": "all"},
                     "network"),
                ]:
                    result = await session.call_tool(tool, args)
                    assert result.is_error, (tool, result)
                    assert f"unknown argument '{field}'" in _text(result), _text(result)
                listed = {t.name: t for t in (await session.list_tools()).tools}
                schema = listed["create_sandbox"].input_schema
                assert schema.get("additionalProperties") is False
                assert "template" in schema["properties"]

    anyio.run(main)


def test_mcp_operator_widens_its_ceiling_explicitly(settings: Settings, home: str) -> None:
    params = _mcp(settings, home, "--allow-host", "*.example.com", "--template", "python")

    async def main() -> None:
        with tempfile.TemporaryFile("w+") as errlog, anyio.fail_after(90):
            async with stdio_client(params, errlog=errlog) as (read, write), \
                    ClientSession(read, write) as session:
                await session.initialize()
                made = await session.call_tool("create_sandbox", {"allow": ["api.example.com"]})
                assert not made.is_error, _text(made)
                assert _mcp_data(made)["network"]["allow"] == ["api.example.com"]
                wider = await session.call_tool("create_sandbox", {"allow": ["evil.test"]})
                assert _mcp_data(wider)["code"] == "ceiling_exceeded"
                # Allowed by the ceiling, so what answers is the template itself: not built
                # here, or built — either way the name reached the control plane.
                python = await session.call_tool("create_sandbox", {"template": "python"})
                if python.is_error:
                    assert _mcp_data(python)["code"] != "ceiling_exceeded"
                    assert "python" in _mcp_data(python)["message"]
                else:
                    assert _mcp_data(python)["template"] == "python"

    anyio.run(main)


# -- the store: a database from before ceilings ---------------------------------------------------


def test_a_store_from_before_ceilings_is_migrated(tmp_path: Path) -> None:
    import sqlite3

    from corral._control.store import Store

    db = tmp_path / "corral.db"
    with sqlite3.connect(db) as old:  # the tenants table as it was, with one tenant in it
        old.execute("CREATE TABLE tenants (name TEXT PRIMARY KEY, max_sandboxes INTEGER NOT "
                    "NULL, tiers TEXT NOT NULL, commands_per_minute INTEGER NOT NULL, "
                    "created_at REAL NOT NULL)")
        old.execute("INSERT INTO tenants VALUES ('before', 3, '[\"small\"]', 5, 0)")
    old.close()
    store = Store(db)
    try:
        directory = TenantDirectory(store)
        (tenant,) = directory.tenants()
        assert (tenant.name, tenant.commands_per_minute) == ("before", 5)
        assert tenant.ceiling.is_empty  # no ceiling: today's rules
        changed = directory.set_tenant("before", ceiling={"hosts": ("*.pypi.org",)})
        assert changed.ceiling.hosts == ("*.pypi.org",) and changed.max_sandboxes == 3
        assert directory.get("before").ceiling.hosts == ("*.pypi.org",)
    finally:
        store.close()
