"""Exposed ports: a real web app in a sandbox, reached through ``corral serve``'s proxy by real
clients (httpx, the websockets client, headless Chromium), with its access rules, status pages
and audit trail. Everything is on loopback: the proxy connects inside the sandbox's own
network namespace, and the sandboxes have no network at all."""

from __future__ import annotations

import hashlib
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from corral._control.manager import Manager
from corral._control.ports import MAX_PORTS
from corral._control.tenants import Tenant, TenantDirectory
from corral._ids import to_e2b
from corral._serve.app import create_app
from corral._settings import Settings
from corral.errors import QuotaExceeded
from corral.models import PortInfo, SandboxInfo

from ..browser import chromium_page, save_screenshot
from ..conftest import managed
from .servers import Server

pytestmark = pytest.mark.needs_root

APP = (Path(__file__).parent / "portapp.py").read_bytes()
PORT = 8000
DOMAIN = "ports.corral.test"


@dataclass
class Service:
    server: Server
    manager: Manager
    keys: dict[str, str]
    tenants: dict[str, Tenant]


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    home = Path(tempfile.mkdtemp(prefix="corral-test-ports-"))
    home.chmod(0o711)
    settings = Settings(home=home, uid_start=2_120_000_000 + secrets.randbelow(100) * 1000,
                        uid_count=1000)
    with managed(settings) as mgr:
        directory = TenantDirectory(mgr.store)
        for name in ("alpha", "beta"):
            directory.add_tenant(name, max_sandboxes=5, tiers=["small"],
                                 commands_per_minute=1000)
        keys = {name: directory.create_key(name)[1] for name in ("alpha", "beta")}
        tenants = {name: directory.get(name) for name in ("alpha", "beta")}
        app = create_app(mgr, ports_domain=DOMAIN)
        with Server(mgr, app) as srv:
            yield Service(srv, mgr, keys, tenants)
    shutil.rmtree(home, ignore_errors=True)


def start_app(service: Service, *, isolation: str = "namespace", tenant: str = "alpha",
              host: str = "0.0.0.0") -> SandboxInfo:
    mgr = service.manager
    info = mgr.create(caller=service.tenants[tenant], isolation=isolation, timeout=600)
    mgr.files(info.id).write("portapp.py", APP)
    mgr.processes.start(info.id, ["python3", "portapp.py", str(PORT), host])
    return info


def expose(service: Service, sandbox_id: str, *, public: bool = False,
           tenant: str = "alpha") -> PortInfo:
    with httpx.Client(base_url=service.server.url) as client:
        answer = client.post(f"/v1/sandboxes/{sandbox_id}/ports/{PORT}",
                             json={"public": public},
                             headers={"Authorization": f"Bearer {service.keys[tenant]}"})
    assert answer.status_code == 201, answer.text
    return PortInfo.model_validate(answer.json())


def wait_listening(port: PortInfo) -> None:
    """The app starts in the background: wait until the proxy stops answering 502."""
    assert port.url and port.token
    deadline = time.monotonic() + 20
    while True:
        answer = httpx.get(port.url + "headers", headers={"X-Corral-Port-Token": port.token})
        if answer.status_code == 200:
            return
        assert answer.status_code == 502, answer.text
        assert time.monotonic() < deadline, "the app in the sandbox never listened"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def running(service: Service) -> Iterator[tuple[SandboxInfo, PortInfo]]:
    info = start_app(service)
    port = expose(service, info.id)
    wait_listening(port)
    yield info, port
    service.manager.destroy(info.id)


# -- the proxy speaks HTTP and WebSockets ------------------------------------------------------


@pytest.mark.parametrize("tier", ["namespace", "gvisor"])
def test_a_page_and_a_websocket_through_the_url_on_each_host_tier(
        service: Service, tier: str, request: pytest.FixtureRequest) -> None:
    if tier == "gvisor":
        problems: list[str] = request.getfixturevalue("gvisor_problems")
        if problems:
            pytest.skip("; ".join(problems))
    info = start_app(service, isolation=tier)
    try:
        port = expose(service, info.id)
        wait_listening(port)
        assert port.url is not None and port.token is not None
        page = httpx.get(port.url, headers={"X-Corral-Port-Token": port.token})
        assert page.status_code == 200 and b"hello from the sandbox" in page.content
        url = port.url.replace("http://", "ws://") + "ws"
        with ws_connect(url, additional_headers={"X-Corral-Port-Token": port.token}) as ws:
            ws.send("hi")
            assert ws.recv(timeout=10) == "echo: hi"
    finally:
        service.manager.destroy(info.id)


def test_headers_reach_the_app_as_a_framework_needs_them(
        service: Service, running: tuple[SandboxInfo, PortInfo]) -> None:
    info, port = running
    assert port.url is not None and port.token is not None
    seen = httpx.get(port.url + "headers?x=1", headers={
        "X-Corral-Port-Token": port.token, "Cookie": "app=kept"}).json()
    headers = {k.lower(): v for k, v in seen["headers"].items()}
    assert seen["path"] == "/headers?x=1"
    assert headers["host"] == f"127.0.0.1:{service.server.port}"  # the client's own Host
    assert headers["x-forwarded-host"] == headers["host"]
    assert headers["x-forwarded-proto"] == "http"
    assert headers["x-forwarded-prefix"] == f"/ports/{info.id}/{PORT}"
    assert headers["x-forwarded-for"] == "127.0.0.1"
    assert headers["cookie"] == "app=kept"
    assert "x-corral-port-token" not in headers  # Corral's credentials stay outside


def test_a_large_download_streams_and_a_large_upload_arrives_whole(
        running: tuple[SandboxInfo, PortInfo]) -> None:
    _, port = running
    assert port.url is not None and port.token is not None
    auth = {"X-Corral-Port-Token": port.token}
    size = 64 << 20
    digest, got, first_at = hashlib.sha256(), 0, None
    started = time.monotonic()
    with httpx.stream("GET", port.url + f"big?n={size}", headers=auth, timeout=60) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-length"] == str(size)
        for chunk in answer.iter_raw():
            first_at = first_at or time.monotonic()
            digest.update(chunk)
            got += len(chunk)
    assert got == size
    expected = hashlib.sha256((bytes(range(256)) * 1024) * (size // (256 * 1024))).hexdigest()
    assert digest.hexdigest() == expected
    assert first_at is not None and first_at - started < 5  # streamed, not buffered first

    body = secrets.token_bytes(1 << 20) * 24

    def chunks() -> Iterator[bytes]:  # no length: it goes up chunked
        for start in range(0, len(body), 1 << 20):
            yield body[start:start + (1 << 20)]

    for content in (body, chunks()):
        answer = httpx.post(port.url + "upload", headers=auth, content=content, timeout=60)
        assert answer.json() == {"sha256": hashlib.sha256(body).hexdigest(),
                                 "bytes": len(body)}


def test_an_endless_answer_stops_when_its_client_leaves(
        running: tuple[SandboxInfo, PortInfo]) -> None:
    _, port = running
    assert port.url is not None and port.token is not None
    auth = {"X-Corral-Port-Token": port.token}
    with httpx.stream("GET", port.url + "stream", headers=auth, timeout=10) as answer:
        assert answer.headers["content-type"] == "text/event-stream"
        lines = answer.iter_lines()
        assert next(lines) == "data: tick 0"  # streamed as written, not at the end
    deadline = time.monotonic() + 10
    while True:  # the proxy dropped its upstream connection: the app's write failed
        streams = httpx.get(port.url + "streams", headers=auth).json()
        if streams["open"] == 0 and streams["ended"] >= 1:
            break
        assert time.monotonic() < deadline, streams
        time.sleep(0.1)


def test_a_websocket_echoes_text_and_binary_both_ways(
        running: tuple[SandboxInfo, PortInfo]) -> None:
    _, port = running
    assert port.url is not None and port.token is not None
    url = port.url.replace("http://", "ws://") + "ws"
    with ws_connect(url, additional_headers={"X-Corral-Port-Token": port.token},
                    max_size=4 << 20) as ws:
        for n in range(3):
            ws.send(f"message {n}")
            assert ws.recv(timeout=10) == f"echo: message {n}"
        blob = secrets.token_bytes(1 << 20)
        ws.send(blob)
        assert ws.recv(timeout=30) == blob


def test_the_host_form_url_reaches_the_same_app(
        service: Service, running: tuple[SandboxInfo, PortInfo]) -> None:
    info, port = running
    assert port.host_url == (f"http://{PORT}-{to_e2b(info.id)}.{DOMAIN}:"
                             f"{service.server.port}/")
    assert port.token is not None
    host = f"{PORT}-{to_e2b(info.id)}.{DOMAIN}:{service.server.port}"
    seen = httpx.get(f"{service.server.url}/headers", headers={
        "Host": host, "X-Corral-Port-Token": port.token}).json()
    headers = {k.lower(): v for k, v in seen["headers"].items()}
    assert headers["host"] == host and "x-forwarded-prefix" not in headers
    assert seen["path"] == "/headers"
    # The host name resolves nowhere here: the socket is connected to the service itself.
    sock = socket.create_connection(("127.0.0.1", service.server.port))
    with ws_connect(f"ws://{host}/ws", sock=sock,
                    additional_headers={"X-Corral-Port-Token": port.token}) as ws:
        ws.send("by host")
        assert ws.recv(timeout=10) == "echo: by host"
    # A host under the domain that names no sandbox is not the service either.
    other = httpx.get(f"{service.server.url}/", headers={
        "Host": f"{PORT}-sbx-000000000000.{DOMAIN}", "X-Corral-Port-Token": port.token})
    assert other.status_code == 404


# -- who may pass ------------------------------------------------------------------------------


def test_a_port_is_private_to_its_owner_and_its_credentials(
        service: Service, running: tuple[SandboxInfo, PortInfo]) -> None:
    info, port = running
    assert port.url is not None and port.token is not None
    url = port.url + "headers"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"X-Corral-Port-Token": "cpt_" + "0" * 40}).status_code == 401
    owner = httpx.get(url, headers={"Authorization": f"Bearer {service.keys['alpha']}"})
    assert owner.status_code == 200
    # The owner's key is Corral's credential: the app never sees it.
    assert "authorization" not in {k.lower() for k in owner.json()["headers"]}
    bearer = httpx.get(url, headers={"Authorization": f"Bearer {port.token}"})
    assert bearer.status_code == 200
    # Another tenant: the sandbox does not exist for it, through the proxy or the API.
    foreign = httpx.get(url, headers={"Authorization": f"Bearer {service.keys['beta']}"})
    assert foreign.status_code == 404 and foreign.json()["error"] == "sandbox_not_found"
    api = httpx.post(f"{service.server.url}/v1/sandboxes/{info.id}/ports/{PORT}",
                     headers={"Authorization": f"Bearer {service.keys['beta']}"})
    assert api.status_code == 404
    with pytest.raises(InvalidStatus):
        ws_connect(port.url.replace("http://", "ws://") + "ws").close()


def test_public_ports_unexposing_and_signed_links(service: Service) -> None:
    info = start_app(service)
    try:
        port = expose(service, info.id)
        wait_listening(port)
        assert port.url and port.token and port.signed_url
        assert httpx.get(port.url).status_code == 401
        public = expose(service, info.id, public=True)
        assert public.token == port.token  # exposing again keeps the credentials
        assert httpx.get(port.url).status_code == 200
        expose(service, info.id, public=False)
        assert httpx.get(port.url).status_code == 401
        # A signed link sets a cookie and sends the browser to the plain URL.
        with httpx.Client() as browser:
            first = browser.get(port.signed_url)
            assert first.status_code == 303 and "corral_sig" not in first.headers["location"]
            assert "HttpOnly" in first.headers["set-cookie"]
            after = browser.get(port.url + "headers")
            assert after.status_code == 200
            # The cookie is Corral's: the app does not see it.
            assert "cookie" not in {k.lower() for k in after.json()["headers"]}
        tampered = port.signed_url[:-1] + ("0" if port.signed_url[-1] != "0" else "1")
        assert httpx.get(tampered).status_code == 401
        expired = httpx.get(port.url + f"?corral_expires={int(time.time()) - 5}&corral_sig=x")
        assert expired.status_code == 401
        with httpx.Client(base_url=service.server.url) as client:
            gone = client.delete(f"/v1/sandboxes/{info.id}/ports/{PORT}", headers={
                "Authorization": f"Bearer {service.keys['alpha']}"})
            assert gone.status_code == 204
        refused = httpx.get(port.url, headers={"X-Corral-Port-Token": port.token})
        assert refused.status_code == 404 and refused.json()["error"] == "port_not_exposed"
        again = expose(service, info.id)
        assert again.token != port.token  # a new exposure: the old credentials stay dead
        assert httpx.get(port.url, headers={"X-Corral-Port-Token": port.token}
                         ).status_code == 401
    finally:
        service.manager.destroy(info.id)


def test_a_sandbox_exposes_a_bounded_number_of_ports(service: Service) -> None:
    mgr = service.manager
    info = mgr.create(caller=service.tenants["alpha"], timeout=120)
    try:
        for port in range(9000, 9000 + MAX_PORTS):
            mgr.ports.expose(info.id, port)
        mgr.ports.expose(info.id, 9000, public=True)  # exposing again is no new port
        with pytest.raises(QuotaExceeded, match="unexpose one first"):
            mgr.ports.expose(info.id, 9999)
        assert len(mgr.ports.list(info.id)) == MAX_PORTS
    finally:
        mgr.destroy(info.id)


# -- clear answers when there is nothing to reach ----------------------------------------------


def test_closed_paused_and_destroyed_get_clear_status_pages(service: Service) -> None:
    mgr = service.manager
    info = mgr.create(caller=service.tenants["alpha"], timeout=600)
    port = expose(service, info.id)
    assert port.url and port.token
    auth = {"X-Corral-Port-Token": port.token}
    closed = httpx.get(port.url, headers=auth)
    assert closed.status_code == 502 and closed.json()["error"] == "port_closed"
    assert f"port {PORT}" in closed.json()["message"]
    page = httpx.get(port.url, headers={**auth, "Accept": "text/html"})
    assert page.status_code == 502 and page.text.startswith("<!doctype html>")
    mgr.pause(info.id)
    paused = httpx.get(port.url, headers=auth)
    assert paused.status_code == 503 and "resume" in paused.json()["message"]
    mgr.resume(info.id)
    mgr.destroy(info.id)
    gone = httpx.get(port.url, headers=auth)
    assert gone.status_code == 404 and gone.json()["error"] == "sandbox_not_found"
    assert "destroyed" in gone.json()["message"]
    unexposed = httpx.get(f"{service.server.url}/ports/{info.id}/9/")
    assert unexposed.status_code == 404


def test_every_proxied_connection_is_in_the_audit_trail(
        service: Service, running: tuple[SandboxInfo, PortInfo]) -> None:
    info, port = running
    assert port.url and port.token
    httpx.get(port.url + "big?n=12345", headers={"X-Corral-Port-Token": port.token})
    with ws_connect(port.url.replace("http://", "ws://") + "ws",
                    additional_headers={"Authorization": f"Bearer {service.keys['alpha']}"}
                    ) as ws:
        ws.send("audited")
        ws.recv(timeout=10)
    deadline = time.monotonic() + 10
    while True:
        events = [e for e in service.manager.auditor.trail(info.id).events
                  if e.type == "port.connection"]
        http_events = [e.data for e in events if e.data.get("path") == "/big?n=12345"]
        ws_events = [e.data for e in events if e.data["kind"] == "websocket"
                     and e.data.get("tenant") == "alpha"]
        if http_events and ws_events:
            break
        assert time.monotonic() < deadline, events
        time.sleep(0.1)
    assert http_events[0]["who"] == "token" and http_events[0]["bytes_out"] == 12345
    assert http_events[0]["status"] == 200 and http_events[0]["port"] == PORT
    assert ws_events[0]["who"] == "key" and ws_events[0]["bytes_in"] == len("audited")
    assert ws_events[0]["bytes_out"] == len("echo: audited")


def test_another_sandbox_cannot_reach_the_port(
        service: Service, running: tuple[SandboxInfo, PortInfo]) -> None:
    info, port = running
    mgr = service.manager
    other = mgr.create(caller=service.tenants["beta"], timeout=120)
    try:
        probe = (
            "import socket\n"
            f"for port in ({PORT}, {service.server.port}):\n"
            "    s = socket.socket(); s.settimeout(2)\n"
            "    try:\n"
            "        s.connect(('127.0.0.1', port)); print('reached', port)\n"
            "    except OSError as e:\n"
            "        print('refused', port, e.__class__.__name__)\n"
        )
        result = mgr.run(other.id, ["python3", "-c", probe])
        # Its own loopback has neither A's app nor the service: it has no network at all.
        assert "reached" not in result.stdout, result.stdout
        assert result.stdout.count("refused") == 2, result.stdout + result.stderr
    finally:
        mgr.destroy(other.id)


# -- a real browser ----------------------------------------------------------------------------


def test_a_browser_opens_a_signed_link_and_its_page_talks_over_a_websocket(
        service: Service, running: tuple[SandboxInfo, PortInfo]) -> None:
    _, port = running
    assert port.signed_url is not None and port.host_url is not None
    with chromium_page(loopback_domains=[DOMAIN]) as page:
        page.goto(port.signed_url)
        # A browser is sent to the port's own origin (the path form is the service's), and
        # the link was traded for a cookie there: the address bar holds the plain host URL.
        assert page.url == port.host_url
        page.wait_for_function(
            "document.getElementById('state').textContent.startsWith('echo:')",
            timeout=120_000)
        assert page.text_content("#state") == "echo: ping from the page"
        save_screenshot(page, "port-signed-link")
        cookies = page.context.cookies()
    mine = [c for c in cookies if c["name"].startswith("corral_port_")]
    assert len(mine) == 1 and mine[0]["httpOnly"], cookies
    assert mine[0]["domain"] == port.host_url.split("//")[1].split(":")[0]  # host-only
