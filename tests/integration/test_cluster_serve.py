"""``corral serve --cluster`` over a real two-node Ray cluster on loopback (``raycluster``):
the same HTTP API, placed and relayed to the sandbox's node, with the gateway's own keys.

The conformance suite (``tests/conformance``) runs every behavioural SDK case through such a
gateway too; this module shows what is the cluster's own: placement per tenant, quotas across
nodes, the PTY WebSocket and an exposed port relayed, the nodes' services closed to anyone
but a gateway and to sandboxes, a gateway crash and a second gateway, and a node dying under
a streaming command.

Bounded: every command has a timeout, every server is on loopback, and teardown destroys
every node's sandboxes and checks no Ray process is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import websockets
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from corral import FanOut, QuotaExceeded, Sandbox, SandboxNotFound, SnapshotInUse
from corral._cluster.gateway import Cluster
from corral._control.store import Store
from corral._control.tenants import Ceiling, TenantDirectory
from corral.errors import AuthError, CeilingExceeded, SandboxLost

from ..browser import chromium_page, save_screenshot
from ..e2b.tlsca import free_loopback_443, make_pki
from .hostile import (
    APP,
    PORT,
    attack,
    corral_credentials_in,
    parse_log,
    session_cookies,
    sign_in,
    whoami,
)
from .raycluster import ServedGateway, ray_cluster, served_gateway

pytestmark = pytest.mark.needs_root

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Any, Any]]:
    with ray_cluster() as pair:
        yield pair


@pytest.fixture(scope="module")
def served(cluster: tuple[Any, Any]) -> Iterator[tuple[ServedGateway, Cluster, dict[str, str]]]:
    """The gateway, the same gateway embedded here, and a key per tenant."""
    with served_gateway(cluster[0]) as (gateway, embedded):
        store = Store(gateway.base.home / "corral.db")
        directory = TenantDirectory(store)
        directory.add_tenant("alpha", max_sandboxes=30, tiers=["small"])
        directory.add_tenant("beta", max_sandboxes=30, tiers=["small"])
        directory.add_tenant("tight", max_sandboxes=3, tiers=["small"])
        directory.add_tenant("narrow", max_sandboxes=5, tiers=["small"],
                             ceiling=Ceiling.build(isolation=["namespace"]))
        keys = {name: directory.create_key(name)[1]
                for name in ("alpha", "beta", "tight", "narrow")}
        keys["alpha-e2b"] = directory.create_key("alpha", e2b=True)[1]
        store.close()
        yield gateway, embedded, keys


def sdk(served: tuple[ServedGateway, Cluster, dict[str, str]], tenant: str) -> dict[str, str]:
    return {"url": served[0].url, "api_key": served[2][tenant]}


@pytest.mark.timeout(600)  # 6 s idle; a CI run on an oversubscribed host took over 120 s
def test_sandboxes_spread_per_tenant_and_each_call_reaches_its_node(
        served: tuple[ServedGateway, Cluster, dict[str, str]]) -> None:
    _, embedded, _ = served
    made = [Sandbox.create(**sdk(served, "alpha" if i % 2 else "beta")) for i in range(20)]
    try:
        placed = {sb.id: embedded.node_of(sb.id) for sb in made}
        nodes = {node.node_id for node in embedded.nodes()}
        assert sorted(list(placed.values()).count(n) for n in nodes) == [10, 10]
        for tenant in ("alpha", "beta"):
            mine = [placed[sb.id] for sb in made
                    if embedded.state.record(sb.id)["tenant"] == tenant]
            assert sorted(mine.count(n) for n in nodes) == [5, 5]
        for node in nodes:  # a node holds exactly what the gateway placed there
            held = {i.id for i in embedded._ray.get(embedded.agent(node).list.remote(None))}
            assert held == {sid for sid, n in placed.items() if n == node}
        for sb in made[:6]:
            sb.files.write("me", sb.id)
            assert sb.commands.run("cat me", timeout=30).stdout == sb.id
        # Hibernated through the gateway, on its node: listed so there, and woken there.
        sleeper = made[0]  # beta's (i = 0)
        sleeper.hibernate()
        listed = {i.id: i.state for i in Sandbox.list(**sdk(served, "beta"))}
        assert listed[sleeper.id] == "hibernated" == sleeper.get_info().state
        sleeper.resume()
        assert sleeper.commands.run("cat me", timeout=30).stdout == sleeper.id
        # A tenant sees only its own, through the gateway as on one host.
        alpha = {i.id for i in Sandbox.list(**sdk(served, "alpha"))}
        assert alpha == {sb.id for sb in made if embedded.state.record(sb.id)["tenant"] == "alpha"}
        beta_one = next(sb for sb in made if sb.id not in alpha)
        with pytest.raises(SandboxNotFound):
            Sandbox.connect(beta_one.id, **sdk(served, "alpha"))
    finally:
        for sb in made:
            sb.kill()
    assert not any(r.get("state") == "live" for r in embedded.state.records().values())


def test_quota_across_the_cluster_and_the_ceiling_on_the_node(
        served: tuple[ServedGateway, Cluster, dict[str, str]]) -> None:
    _, embedded, _ = served
    made = [Sandbox.create(**sdk(served, "tight")) for _ in range(3)]
    try:
        # Spread over both nodes, neither holds 3: only the gateway's count refuses the 4th.
        assert len({embedded.node_of(sb.id) for sb in made}) == 2
        with pytest.raises(QuotaExceeded, match="tight"):
            Sandbox.create(**sdk(served, "tight"))
        with pytest.raises(QuotaExceeded):
            made[0].fork()
    finally:
        for sb in made:
            sb.kill()
    # The tenant's ceiling travels in the signed caller and the node applies it.
    with pytest.raises(CeilingExceeded, match="isolation"):
        Sandbox.create(isolation="gvisor", **sdk(served, "narrow"))


def test_a_terminal_and_an_exposed_port_through_the_gateway(
        served: tuple[ServedGateway, Cluster, dict[str, str]]) -> None:
    gateway, _, keys = served
    sb = Sandbox.create(**sdk(served, "alpha"))
    try:
        async def terminal() -> str:
            url = gateway.url.replace("http", "ws") + f"/v1/sandboxes/{sb.id}/pty?rows=24&cols=80"
            screen = ""
            async with websockets.connect(url, additional_headers={
                    "Authorization": f"Bearer {keys['alpha']}"}) as ws:
                async def until(marker: str) -> None:
                    nonlocal screen
                    async with asyncio.timeout(60):
                        while marker not in screen:
                            frame = await ws.recv()
                            screen += frame.decode() if isinstance(frame, bytes) else frame

                await until("$ ")
                await ws.send(json.dumps({"type": "input", "data": "echo typed-$((6*7))\n"}))
                await until("typed-42")
            return screen

        assert "typed-42" in asyncio.run(terminal())
        sb.processes.start("python3 -m http.server 8000 --bind 127.0.0.1")
        port = sb.ports.expose(8000)
        assert port.url is not None and port.url.startswith(gateway.url), port.url
        deadline = time.monotonic() + 30
        while True:
            answer = httpx.get(port.url, headers={"X-Corral-Port-Token": port.token or ""})
            if answer.status_code == 200:
                break
            assert answer.status_code == 502 and time.monotonic() < deadline, answer.text
            time.sleep(0.2)
        assert "Directory listing" in answer.text
        assert httpx.get(port.url).status_code == 401  # no token: refused, by the node
    finally:
        sb.kill()


def test_the_official_e2b_sdk_through_the_gateway(
        served: tuple[ServedGateway, Cluster, dict[str, str]]) -> None:
    gateway, embedded, keys = served
    python = ROOT / ".venv-e2b" / "latest" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{python} missing: run scripts/e2b-sdks (scripts/bootstrap --test does)")
    scratch = gateway.base.home / "e2b-scratch"
    scratch.mkdir(exist_ok=True)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(scratch), "LANG": "C.UTF-8",
           "E2B_API_KEY": keys["alpha-e2b"], "E2B_CONNECTION_RETRIES": "0",
           "E2B_API_URL": gateway.e2b_url, "E2B_SANDBOX_URL": gateway.e2b_url,
           "E2B_DOMAIN": "corral.invalid"}
    done = subprocess.run([str(python), str(ROOT / "tests/e2b/clients/py/cluster.py")],
                          env=env, capture_output=True, text=True, timeout=300)
    steps = {line["step"]: line for line in map(json.loads, done.stdout.splitlines())
             if "step" in line}
    failed = {name: step for name, step in steps.items() if "error" in step}
    assert not failed and done.returncode == 0, (failed, done.stderr[-3000:])
    assert steps["run"]["value"] == {"stdout": "one\n42\n", "exit_code": 0}
    assert steps["seen"]["value"] == "one\n42\n"
    assert steps["read"]["value"] == steps["cat"]["value"] == "through the cluster"
    assert steps["listed"]["value"] is True and steps["connect"]["value"] == "again\n"
    sandbox_id = steps["id"]["value"].replace("-", "_", 1)
    with pytest.raises(SandboxNotFound):  # killed through E2B: gone from the map too
        embedded.state.record(sandbox_id)
    # Sandboxes from its snapshot: beside it, and (the third at the latest) on the other
    # node from a copy, which E2B's list does not show and its delete removes first.
    snapshot_id = steps["snapshot_id"]["value"]
    assert steps["children_read"]["value"] == ["through the cluster"] * 3
    assert steps["snapshots_listed"]["value"] == [snapshot_id]
    snap = snapshot_id.replace("-", "_", 1)
    assert len(embedded.state.copies(snap)) == 1
    deleted = httpx.delete(f"{gateway.e2b_url}/templates/{snapshot_id}",
                           headers={"X-API-KEY": keys["alpha-e2b"]})  # as delete_snapshot does
    assert deleted.status_code == 204, deleted.text
    assert embedded.state.copies(snap) == {} and embedded.state.copy_ids() == set()


def test_the_official_e2b_sdk_in_domain_mode_through_a_gateway(
        served: tuple[ServedGateway, Cluster, dict[str, str]],
        cluster: tuple[Any, Any]) -> None:
    """As tests/e2b/test_domain.py on one host: only E2B_DOMAIN, HTTPS with a test CA, the
    names in a private /etc/hosts (``unshare -m`` + a bind mount; the host's is untouched)."""
    gateway, embedded, keys = served
    python = ROOT / ".venv-e2b" / "latest" / "bin" / "python"
    if not python.exists() or shutil.which("unshare") is None:
        pytest.fail("needs .venv-e2b/latest (scripts/e2b-sdks) and unshare (util-linux)")
    scratch = Path(tempfile.mkdtemp(prefix="corral-test-e2b-client-"))
    domain = "corral-cluster.test"
    pki = make_pki(scratch, domain)
    address = free_loopback_443()
    second = ServedGateway(cluster[0], gateway.base, host=address, e2b_port=443, extra=(
        "--e2b-domain", domain, "--e2b-tls-cert", str(pki.cert),
        "--e2b-tls-key", str(pki.key))).start()
    hosts = scratch / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{address} api.{domain}\n")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(scratch), "LANG": "C.UTF-8",
           "E2B_API_KEY": keys["alpha-e2b"], "E2B_CONNECTION_RETRIES": "0",
           "E2B_DOMAIN": domain, "SSL_CERT_FILE": str(pki.ca)}
    script = ROOT / "tests/e2b/clients/py/domain.py"

    def client(*args: str) -> dict[str, Any]:
        done = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c",
             'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts),
             "env", "-i", *(f"{k}={v}" for k, v in env.items()), str(python), str(script),
             *args], capture_output=True, text=True, timeout=300, cwd=scratch)
        steps = {line["step"]: line for line in map(json.loads, done.stdout.splitlines())
                 if "step" in line}
        failed = {name: step for name, step in steps.items()
                  if "error" in step and name != "exit3"}  # exit 3 raises, as E2B's does
        assert not failed and done.returncode == 0, (failed, done.stderr[-3000:],
                                                     second.log.read_text()[-3000:])
        return {name: step.get("value", step.get("error")) for name, step in steps.items()}

    try:
        sid = client("create")["id"]
        with hosts.open("a") as names:
            names.write(f"{address} 49983-{sid}.{domain} 49999-{sid}.{domain} "
                        f"8000-{sid}.{domain}\n")
        assert embedded.state.record(sid.replace("-", "_", 1))["tenant"] == "alpha"
        used = client("use", sid, "ports")
        assert used["run"] == "over tls\n" and used["read"] == "through the domain"
        assert used["exit3"] == "CommandExitException"
        assert sid in used["list"]
        # An app's own port by its name, opened by E2B's traffic token on the node.
        port = used["port"]
        assert port["host"] == f"8000-{sid}.{domain}"
        assert (port["status"], port["listing"], port["without_token"]) == (200, True, 404)
        assert used["kill"] is True
    finally:
        second.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    assert domain not in Path("/etc/hosts").read_text()


def test_the_dashboard_through_the_gateway(
        served: tuple[ServedGateway, Cluster, dict[str, str]]) -> None:
    gateway, embedded, keys = served
    blocked: list[str] = []
    made: list[Sandbox] = []
    try:
        with chromium_page(blocked=blocked) as page:
            page.goto(f"{gateway.url}/ui")
            page.get_by_label("API key").fill(keys["alpha"])
            page.get_by_role("button", name="Sign in").click()
            page.get_by_role("heading", name="Sandboxes").wait_for()
            page.locator(".live").wait_for()  # every node's stream listens
            made = [Sandbox.create(**sdk(served, "alpha")) for _ in range(2)]
            assert len({embedded.node_of(sb.id) for sb in made}) == 2
            for sb in made:  # both nodes' sandboxes, pushed live
                page.locator(f'tr[data-id="{sb.id}"]').wait_for()
            save_screenshot(page, "cluster-dashboard-sandboxes")
            target = made[1]
            page.locator(f'tr[data-id="{target.id}"]').get_by_role("link").click()
            page.get_by_role("heading", name=target.id).wait_for()
            target.commands.run("echo through-$((40+2))-the-gateway", timeout=30)
            page.locator("li.command pre.out").get_by_text("through-42-the-gateway").wait_for()
            page.locator(f'ul.tree li[data-node="{target.id}"]').wait_for()  # from its node
            save_screenshot(page, "cluster-dashboard-timeline")
            page.goto(f"{gateway.url}/docs")
            page.locator(".swagger-ui .info .title").get_by_text("Corral").wait_for()
    finally:
        for sb in made:
            sb.kill()
    assert blocked == [], f"the page tried to reach off the machine: {blocked}"


def test_a_hostile_preview_through_the_gateway_can_do_nothing(
        served: tuple[ServedGateway, Cluster, dict[str, str]]) -> None:
    """As on one host (test_preview_origins): beta's public page, opened by alpha signed in to
    the gateway's dashboard, on the gateway's own origin (the path form, the only one a
    gateway serves), reads and changes nothing, and no Corral credential reaches the app."""
    gateway, _, keys = served
    made: list[Sandbox] = []
    try:
        victim, doomed = (Sandbox.create(**sdk(served, "alpha")) for _ in range(2))
        attacker = Sandbox.create(**sdk(served, "beta"))
        made = [victim, doomed, attacker]
        attacker.files.write("hostileapp.py", APP)
        attacker.files.write("config.json", json.dumps({
            "service": gateway.url, "victim": victim.id, "doomed": doomed.id,
            "attacker_key": keys["beta"], "cookie_domain": "127.0.0.1"}))
        attacker.processes.start(f"python3 hostileapp.py {PORT}")
        port = attacker.ports.expose(PORT, public=True)
        assert port.url is not None and port.url.startswith(gateway.url), port.url
        deadline = time.monotonic() + 120
        while (answer := httpx.get(port.url)).status_code != 200:
            assert answer.status_code == 502 and time.monotonic() < deadline, answer.text
            time.sleep(0.2)
        # A program's request with every kind of Corral credential: none reaches the app.
        direct = httpx.get(port.url, headers={
            "Authorization": f"Bearer {keys['alpha']}", "X-API-Key": keys["alpha-e2b"],
            "Cookie": "corral_session=us1.a.b; theirs=kept"})
        assert direct.status_code == 200
        assert direct.headers.get_list("set-cookie") == []
        assert direct.headers["content-security-policy"].startswith("sandbox")
        # A request framed two ways is refused at the gateway (it rebuilds the framing too).
        gateway_port = int(gateway.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", gateway_port), timeout=60) as raw:
            raw.sendall(f"POST /ports/{attacker.id}/{PORT}/report HTTP/1.1\r\nHost: "
                        f"127.0.0.1:{gateway_port}\r\nContent-Length: 5\r\nTransfer-Encoding: "
                        "chunked\r\n\r\n0\r\n\r\n".encode())
            assert raw.recv(65536).split(b"\r\n", 1)[0].endswith(b"400 Bad Request")
        with chromium_page() as page:
            tenant = sign_in(page, gateway.url, keys["alpha"])
            genuine = [c["value"] for c in session_cookies(page, gateway.url)]
            results = attack(page, port.url)
            after = whoami(page, gateway.url)
            cookies_after = session_cookies(page, gateway.url)
        assert results["origin"] == "null", results["origin"]  # sandboxed: opaque
        for name, outcome in results["attempts"].items():
            assert outcome.get("status", 0) in (0, 401, 403), (name, outcome)
            assert victim.id not in outcome.get("body", ""), (name, outcome)
        assert doomed.get_info().state == "running"
        assert not {e.name for e in victim.files.list()} & {"pwned", "pwned-simple"}
        assert [e.type for e in victim.audit.events(types=["command.*"])] == []
        assert after[0] == 200 and json.loads(after[1])["tenant"] == tenant, after
        assert [c["value"] for c in cookies_after] == genuine
        entries = parse_log(attacker.files.read("requests.log", format="bytes"))
        assert len(entries) >= 3
        assert corral_credentials_in(entries, [*genuine, keys["alpha"]]) == []
    finally:
        for sb in made:
            sb.kill()


def test_the_nodes_services_serve_gateways_only_and_sandboxes_cannot_reach_them(
        served: tuple[ServedGateway, Cluster, dict[str, str]]) -> None:
    _, embedded, keys = served
    sb = Sandbox.create(**sdk(served, "alpha"))
    try:
        url = embedded.services(embedded.node_of(sb.id))["http"]
        # A tenant's own key, a forged caller token, none: all refused by the node itself.
        for header in (f"Bearer {keys['alpha']}", "Bearer cp1.eyJuYW1lIjoiYWxwaGEifQ.00",
                       None):
            answer = httpx.get(f"{url}/v1/sandboxes", headers={"Authorization": header}
                               if header else {})
            assert answer.status_code == 401, (header, answer.text)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        probe = ("import socket\n"
                 "s=socket.socket(); s.settimeout(3)\n"
                 f"try: s.connect(({host!r}, {port})); print('connected')\n"
                 "except OSError as e: print('refused', e.errno)\n")
        result = sb.commands.run(["python3", "-c", probe], timeout=30)
        assert result.stdout.startswith("refused"), result
    finally:
        sb.kill()
    with pytest.raises(AuthError):
        Sandbox.list(url=served[0].url, api_key="ck_" + "0" * 8 + "_" + "0" * 32)


def test_a_gateway_crash_loses_nothing_and_two_gateways_serve_at_once(
        served: tuple[ServedGateway, Cluster, dict[str, str]],
        cluster: tuple[Any, Any]) -> None:
    gateway, _, keys = served
    sb = Sandbox.create(**sdk(served, "beta"))
    sb.files.write("kept", "still here")
    second = ServedGateway(cluster[0], gateway.base).start()
    try:
        other = Sandbox.connect(sb.id, url=second.url, api_key=keys["beta"])
        assert other.commands.run("cat kept", timeout=30).stdout == "still here"
        gateway.kill()  # SIGKILL: nothing of the map was only in its memory
        assert other.commands.run("cat kept", timeout=30).stdout == "still here"
        gateway.start()  # the same data directory: the same keys
        again = Sandbox.connect(sb.id, **sdk(served, "beta"))
        assert again.files.read("kept") == "still here"
    finally:
        second.stop()
        sb.kill()


TREE_HASH = ("cd /workspace && find . -type f -print0 | sort -z | xargs -0 sha256sum | "
             "sha256sum && find . | sort | sha256sum")


def test_sandboxes_from_a_snapshot_on_every_node_its_layers_copied_once(
        served: tuple[ServedGateway, Cluster, dict[str, str]]) -> None:
    _, embedded, _ = served
    alpha = sdk(served, "alpha")
    source = Sandbox.create(**alpha)
    made: list[Sandbox] = []
    try:
        source.commands.run("mkdir -p d/e && head -c 3000000 /dev/urandom > d/big && echo hi "
                            "> d/e/small && ln -s d/e/small link && chmod 750 d/e", timeout=30)
        want = source.commands.run(TREE_HASH, timeout=30).stdout
        snap = source.snapshot("seed-everywhere")
        home = embedded.node_of(source.id)
        (other,) = {n.node_id for n in embedded.nodes()} - {home}
        made = [Sandbox.create(snapshot="seed-everywhere", **alpha) for _ in range(6)]
        placed = [embedded.node_of(sb.id) for sb in made]
        # Its own node first (the layers are there), then spread, the layers copied over.
        assert placed[0] == home and other in placed, placed
        for sb in made:
            assert sb.commands.run(TREE_HASH, timeout=30).stdout == want, embedded.node_of(
                sb.id)
        copies = embedded._ray.get(embedded.agent(other).snapshot_copies.remote())
        assert list(copies) == [snap.id]  # one copy on the other node, for every create
        assert embedded.state.copies(snap.id) == {other: copies[snap.id]}
        # The caller sees the snapshot it took, not the node's copy of it.
        listed = [s.id for s in Sandbox.list_snapshots(**alpha)]
        assert snap.id in listed and copies[snap.id] not in listed
        # Sandboxes live on the copy: deleting the snapshot is refused and loses nothing.
        with pytest.raises(SnapshotInUse):
            Sandbox.delete_snapshot("seed-everywhere", **alpha)
        assert Sandbox.get_snapshot("seed-everywhere", **alpha).id == snap.id
    finally:
        for sb in [*made, source]:
            sb.kill()
    Sandbox.delete_snapshot("seed-everywhere", **alpha)
    assert embedded._ray.get(embedded.agent(other).snapshot_copies.remote()) == {}
    assert embedded.state.copies(snap.id) == {}


def test_a_fan_out_over_the_cluster_within_the_tenants_quota(
        served: tuple[ServedGateway, Cluster, dict[str, str]]) -> None:
    _, embedded, _ = served
    tight = sdk(served, "tight")  # at most 3 sandboxes in the whole cluster
    with Sandbox.create(**tight) as source:
        source.files.write("task.txt", "solve me")
        snap = source.snapshot()
    nodes: set[str] = set()

    def command(index: int) -> str:  # long enough for three to run at once
        return f"cat task.txt; echo ' {index}'; sleep 1"

    try:
        with FanOut(snap.id, 8, command, concurrency=5, timeout=30, quota_wait=120,
                    **tight) as rollouts:
            seen = []
            for rollout in rollouts:
                seen.append(rollout)
        assert sorted(r.index for r in seen) == list(range(8))
        for rollout in seen:  # refused creates waited for a slot instead of failing
            assert rollout.ok, rollout
            assert rollout.result is not None
            assert rollout.result.stdout == f"solve me {rollout.index}\n"
        nodes = {n.node_id for n in embedded.nodes()}
        # Three at once: two beside the layers, then the third on the other node.
        assert len(embedded.state.copies(snap.id)) == 1
    finally:
        Sandbox.delete_snapshot(snap, **tight)
    assert not [r for r in embedded.state.records().values() if r.get("tenant") == "tight"]
    assert len(nodes) == 2


@pytest.mark.timeout(900)  # its clean-up waits up to 400 s on a loaded host
def test_mcp_through_the_gateway(served: tuple[ServedGateway, Cluster, dict[str, str]]) -> None:
    gateway, embedded, keys = served
    env = {**os.environ, "CORRAL_URL": gateway.url, "CORRAL_API_KEY": keys["alpha"]}
    params = StdioServerParameters(command=sys.executable, args=["-m", "corral", "mcp"],
                                   env=env)

    async def main() -> str:
        with tempfile.TemporaryFile("w+") as errlog, anyio.fail_after(120):
            async with stdio_client(params, errlog=errlog) as (read, write), \
                    ClientSession(read, write) as session:
                await session.initialize()
                made = await _tool(session, "create_sandbox")
                sandbox_id = str(made["sandbox_id"])
                assert embedded.state.record(sandbox_id)["tenant"] == "alpha"
                await _tool(session, "write_file", path="via-mcp.txt", content="relayed",
                            sandbox_id=sandbox_id)
                ran = await _tool(session, "run_command", sandbox_id=sandbox_id,
                                  command="cat via-mcp.txt; echo; hostname")
                assert ran["stdout"].startswith("relayed\n"), ran
                forked = await _tool(session, "fork", count=2, sandbox_id=sandbox_id)
                for child in forked["forks"]:
                    read_back = await _tool(session, "read_file", path="via-mcp.txt",
                                            sandbox_id=child)
                    assert read_back["content"] == "relayed"
                return sandbox_id

    sandbox_id = anyio.run(main)
    # The MCP session ended: its sandboxes went, through the gateway, and from the map.
    deadline = time.monotonic() + 400  # far above the work: seconds idle, 180+ s seen loaded
    while any(r.get("tenant") == "alpha" for r in embedded.state.records().values()):
        assert time.monotonic() < deadline, embedded.state.records()
        time.sleep(0.2)
    with pytest.raises(SandboxNotFound):
        embedded.state.record(sandbox_id)


async def _tool(session: ClientSession, tool: str, **args: Any) -> dict[str, Any]:
    result = await session.call_tool(tool, args)
    assert not result.is_error, result.content
    assert result.structured_content is not None, result
    return dict(result.structured_content)


def test_a_node_dying_under_a_streaming_command(
        served: tuple[ServedGateway, Cluster, dict[str, str]],
        cluster: tuple[Any, Any]) -> None:
    """Last in the module: the worker node goes away for good."""
    ray, worker = cluster
    _, embedded, _ = served
    made = [Sandbox.create(**sdk(served, "beta")) for _ in range(4)]
    on_worker = [sb for sb in made if embedded.node_of(sb.id) == worker.node_id]
    on_head = [sb for sb in made if embedded.node_of(sb.id) != worker.node_id]
    assert on_worker and on_head
    seen: list[str] = []
    outcome: dict[str, Any] = {}

    def long_command() -> None:
        try:
            outcome["result"] = on_worker[0].commands.run(
                "echo started; sleep 50", timeout=55, on_stdout=seen.append)
        except BaseException as exc:
            outcome["error"] = exc

    runner = threading.Thread(target=long_command)
    runner.start()
    deadline = time.monotonic() + 30
    while "started\n" not in "".join(seen):
        assert time.monotonic() < deadline, outcome
        time.sleep(0.05)
    time.sleep(1)  # the node ships its audit lines every 0.1 s
    started = time.monotonic()
    ray.remove_node(worker)
    runner.join(timeout=60)
    assert not runner.is_alive(), "the streaming command hung after its node died"
    assert isinstance(outcome.get("error"), SandboxLost), outcome
    assert time.monotonic() - started < 60
    for sb in on_worker:  # every call now answers 410 sandbox_lost, at once
        before = time.monotonic()
        with pytest.raises(SandboxLost):
            sb.commands.run("true")
        assert time.monotonic() - before < 10
    # Its audit trail reads back through the gateway, up to the command in flight.
    events = on_worker[0].audit.events()
    types = [e.type for e in events]
    assert types[0] == "sandbox.created" and types[-1] in ("command.started", "command.output")
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    for sb in on_head:  # the other node and the gateway keep working
        assert sb.commands.run("echo alive", timeout=30).stdout == "alive\n"
    for sb in made:
        sb.kill()  # a lost one is forgotten
    assert not embedded.state.records()
