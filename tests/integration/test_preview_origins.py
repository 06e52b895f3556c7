"""Where previews meet the service: a hostile tenant's public page, opened in a real browser by
an operator and by another tenant signed in to the dashboard, can read or change nothing of
Corral, and no Corral credential reaches the app that serves it (issue 35).

Tenant beta runs ``hostileapp.py`` (its page attacks whoever opens it, its answers try to set
and clear Corral's cookies, it logs every request whole) on a public port. The service runs
three ways: on loopback as ``corral serve`` runs by default (host URLs under ``localhost``),
with a ports domain, and under a name of its own with neither (no host form: the path form on
the service's own origin). Each viewer opens the port's path URL and its host URL in headless
Chromium; then the test checks the service's side (alpha's sandboxes and trails untouched), the
browser's side (the viewer's session still the one it signed in with, and alone) and the app's
side (its request log).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from corral._control.manager import Manager
from corral._control.ports import PortURLs
from corral._control.tenants import Tenant, TenantDirectory
from corral._ids import to_e2b
from corral._serve.app import create_app
from corral.models import SandboxInfo

from ..browser import chromium_page
from ..conftest import managed, private_settings
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
from .servers import Server

pytestmark = pytest.mark.needs_root

DOMAIN = "ports.corral.test"
SERVICE_NAME = "corral.test"


@dataclass
class World:
    manager: Manager
    keys: dict[str, str]
    tenants: dict[str, Tenant]
    victim: SandboxInfo  # alpha's: the page tries to run a command in it
    doomed: SandboxInfo  # alpha's: the page tries to destroy it
    attacker: SandboxInfo  # beta's: serves the hostile app on a public port


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with private_settings("corral-test-origins-") as settings, managed(settings) as mgr:
        directory = TenantDirectory(mgr.store)
        for name in ("alpha", "beta"):
            directory.add_tenant(name, max_sandboxes=5, tiers=["small"],
                                 commands_per_minute=1000)
        keys = {name: directory.create_key(name)[1] for name in ("alpha", "beta")}
        keys["operator"] = directory.create_operator_key()[1]
        tenants = {name: directory.get(name) for name in ("alpha", "beta")}
        victim = mgr.create(caller=tenants["alpha"], timeout=900)
        doomed = mgr.create(caller=tenants["alpha"], timeout=900)
        attacker = mgr.create(caller=tenants["beta"], timeout=900)
        mgr.files(attacker.id).write("hostileapp.py", APP)
        mgr.files(attacker.id).write("config.json", b"{}")
        mgr.processes.start(attacker.id, ["python3", "hostileapp.py", str(PORT)])
        mgr.ports.expose(attacker.id, PORT, public=True, tenant="beta")
        yield World(mgr, keys, tenants, victim, doomed, attacker)


@dataclass
class Setup:
    name: str
    server: Server
    service: str  # the service's URL as the browser reaches it
    host_form: bool
    domain: str | None  # where host URLs live

    def path_url(self, world: World) -> str:
        return f"{self.service}/ports/{world.attacker.id}/{PORT}/"

    def host_url(self, world: World) -> str:
        return f"http://{PORT}-{to_e2b(world.attacker.id)}.{self.domain}:{self.server.port}/"


@pytest.fixture(params=["loopback", "ports-domain", "no-host-form"])
def setup(request: pytest.FixtureRequest, world: World) -> Iterator[Setup]:
    mgr = world.manager
    mgr.ports.configure(PortURLs())  # each setup's app configures its own
    if request.param == "loopback":  # `corral serve` on loopback, as it runs by default
        app = create_app(mgr)
    elif request.param == "ports-domain":
        app = create_app(mgr, ports_domain=DOMAIN)
    else:  # a service answering to a name of its own, with no ports domain
        app = create_app(mgr, host_names=[SERVICE_NAME])
    with Server(mgr, app) as srv:
        service = f"http://{SERVICE_NAME}:{srv.port}" if request.param == "no-host-form" \
            else srv.url
        domain = {"loopback": "localhost", "ports-domain": DOMAIN}.get(request.param)
        wait_serving(f"{srv.url}/ports/{world.attacker.id}/{PORT}/", service)
        yield Setup(request.param, srv, service, domain is not None, domain)
    mgr.ports.configure(PortURLs())


def wait_serving(url: str, service: str) -> None:
    """The app starts in the background: wait until the proxy stops answering 502."""
    host = service.split("://", 1)[1]
    deadline = time.monotonic() + 120
    while True:
        answer = httpx.get(url, headers={"Host": host})
        if answer.status_code == 200:
            return
        assert answer.status_code == 502, answer.text
        assert time.monotonic() < deadline, "the hostile app never listened"
        time.sleep(0.2)


def app_log(world: World) -> list[dict[str, Any]]:
    try:
        raw = world.manager.files(world.attacker.id).read("requests.log")
    except Exception:
        return []
    return parse_log(raw)


@pytest.mark.parametrize("viewer", ["operator", "alpha"])
@pytest.mark.parametrize("form", ["path", "host"])
def test_a_hostile_preview_page_can_do_nothing_with_a_signed_in_browser(
        world: World, setup: Setup, viewer: str, form: str) -> None:
    if form == "host" and not setup.host_form:
        pytest.skip("this setup has no host URLs (no ports domain)")
    mgr = world.manager
    url = setup.path_url(world) if form == "path" else setup.host_url(world)
    cookie_domain = (setup.domain if form == "host" else setup.service.split("//")[1]
                     .split(":")[0])
    mgr.files(world.attacker.id).write("config.json", json.dumps({
        "service": setup.service, "victim": world.victim.id, "doomed": world.doomed.id,
        "attacker_key": world.keys["beta"], "cookie_domain": cookie_domain}).encode())
    logged_before = len(app_log(world))
    with chromium_page(loopback_domains=[DOMAIN, SERVICE_NAME]) as page:
        tenant = sign_in(page, setup.service, world.keys[viewer])
        genuine = [c["value"] for c in session_cookies(page, setup.service)]
        assert len(genuine) == 1
        results = attack(page, url)
        landed = page.url
        after = whoami(page, setup.service)
        cookies_after = session_cookies(page, setup.service)

    # The page ran where it should: on the port's own origin, or sandboxed (opaque).
    if setup.host_form:
        assert landed.startswith(setup.host_url(world)), landed  # a path URL is sent there
        assert results["origin"] == setup.host_url(world).rstrip("/")
    else:
        assert landed == url
        assert results["origin"] == "null", results["origin"]
    # It read nothing of Corral's and changed nothing.
    for name, outcome in results["attempts"].items():
        assert outcome.get("status", 0) in (0, 401, 403), (name, outcome)
        body = outcome.get("body", "")
        assert world.victim.id not in body and "tenant" not in body, (name, outcome)
    assert "corral_session" not in (results["cookie"] or "")
    assert mgr.get(world.doomed.id).state == "running"
    victim_files = {entry.name for entry in mgr.files(world.victim.id).list("/workspace")}
    assert not victim_files & {"pwned", "pwned-simple"}, victim_files
    trail = mgr.auditor.trail(world.victim.id, types=["command.*"])
    assert trail.events == [], [e.type for e in trail.events]
    # The viewer is still signed in as before, with the one session it signed in with.
    assert after[0] == 200 and json.loads(after[1])["tenant"] == tenant, after
    assert [c["value"] for c in cookies_after] == genuine, cookies_after
    # And the app never saw a Corral credential.
    entries = app_log(world)[logged_before:]
    assert entries, "the app logged no request: the page never reached it"
    assert corral_credentials_in(entries, genuine) == []


# -- without a browser: each relay's requests and answers ---------------------------------------


def raw_request(port: int, request: bytes, *, timeout: float = 60) -> bytes:
    """Send ``request`` as is and read the answer until the server closes or it is whole."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def test_no_corral_credential_reaches_the_app_and_no_answer_sets_a_corral_cookie(
        world: World) -> None:
    mgr = world.manager
    mgr.ports.configure(PortURLs())
    app = create_app(mgr, ports_domain=DOMAIN)
    session = "us1.eyJrIjoiMSJ9.forged"
    planted = {"Authorization": f"Bearer {world.keys['alpha']}",
               "Cookie": f"corral_session={session}; __Host-corral_session={session}; "
                         "corral_port_x=1; theirs=kept",
               "X-API-Key": "e2b_" + "0" * 48, "X-Access-Token": "f" * 48,
               "E2b-Traffic-Access-Token": "e" * 48, "X-Corral-Port-Token": "cpt_0",
               "X-Corral-UI": "1", "X-Theirs": "kept"}
    with Server(mgr, app) as srv:
        wait_serving(f"{srv.url}/ports/{world.attacker.id}/{PORT}/", srv.url)
        before = len(app_log(world))
        answers = {
            "path": httpx.get(f"{srv.url}/ports/{world.attacker.id}/{PORT}/", headers=planted),
            "host": httpx.get(f"{srv.url}/", headers={
                **planted, "Host": f"{PORT}-{to_e2b(world.attacker.id)}.{DOMAIN}"}),
        }
    mgr.ports.configure(PortURLs())
    for form, answer in answers.items():
        assert answer.status_code == 200, (form, answer.text)
        cookies = answer.headers.get_list("set-cookie")
        assert not any("corral" in c.lower() for c in cookies), (form, cookies)
        assert "clear-site-data" not in answer.headers, form
    # The path form is the service's own origin: its pages are sandboxed and set no cookie.
    assert answers["path"].headers.get_list("set-cookie") == []
    csp = answers["path"].headers["content-security-policy"]
    assert csp.startswith("sandbox") and "allow-same-origin" not in csp, csp
    assert answers["host"].headers.get_list("set-cookie") == ["app_cookie=1; Path=/"]
    assert "content-security-policy" not in answers["host"].headers
    entries = app_log(world)[before:]
    assert len(entries) == 2
    assert corral_credentials_in(entries, [session, world.keys["alpha"]]) == []
    for entry in entries:
        headers = {k.lower(): v for k, v in entry["headers"]}
        assert headers["cookie"] == "theirs=kept" and headers["x-theirs"] == "kept", headers
        assert not {"x-access-token", "e2b-traffic-access-token", "x-corral-ui"} & set(headers)


@pytest.mark.parametrize("framing", [
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
])
def test_a_request_framed_two_ways_is_refused_not_held(world: World, framing: bytes) -> None:
    mgr = world.manager
    mgr.ports.configure(PortURLs())
    with Server(mgr, create_app(mgr)) as srv:
        wait_serving(f"{srv.url}/ports/{world.attacker.id}/{PORT}/", srv.url)
        answer = raw_request(srv.port, (
            f"POST /ports/{world.attacker.id}/{PORT}/report HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{srv.port}\r\n").encode() + framing)
    mgr.ports.configure(PortURLs())
    status = answer.split(b"\r\n", 1)[0]
    assert status.split(b" ")[1] in (b"400", b"501"), answer[:300]


@pytest.mark.parametrize("mode", ["url", "domain"])
def test_the_e2b_relay_passes_no_credential_and_sets_no_corral_cookie(
        world: World, mode: str) -> None:
    """E2B's port traffic: by E2b-Sandbox-* headers on the listener's own origin (URL mode,
    shared by every sandbox) or by ``<port>-<id>.<domain>`` (domain mode, the port's own)."""
    from corral._e2b.app import E2BConfig, create_e2b_app

    mgr = world.manager
    e2b_domain = "e2b.corral.test"
    app = create_e2b_app(mgr, E2BConfig.build(domain=e2b_domain if mode == "domain" else None))
    e2b_id = to_e2b(world.attacker.id)
    traffic = app.tokens.traffic(world.attacker.id)
    planted = {"Authorization": f"Bearer {world.keys['alpha']}",
               "Cookie": "corral_session=us1.a.b; theirs=kept",
               "X-API-Key": world.keys["alpha"], "X-Access-Token": app.tokens.envd(
                   world.attacker.id), "E2b-Traffic-Access-Token": traffic}
    with Server(mgr, app) as srv:
        # (URL mode routes by headers only the paths E2B's envd has: the app answers any.)
        if mode == "url":
            routing = {"E2b-Sandbox-Id": e2b_id, "E2b-Sandbox-Port": str(PORT)}
        else:
            routing = {"Host": f"{PORT}-{e2b_id}.{e2b_domain}"}
        before = len(app_log(world))
        answer = httpx.get(f"{srv.url}/health", headers={**planted, **routing}, timeout=60)
        app.e2b.close()
    assert answer.status_code == 200, answer.text
    assert not any("corral" in c.lower() for c in answer.headers.get_list("set-cookie"))
    assert "clear-site-data" not in answer.headers
    if mode == "url":  # one origin for every sandbox: sandboxed, no cookies at all
        assert answer.headers.get_list("set-cookie") == []
        assert answer.headers["content-security-policy"].startswith("sandbox")
    else:
        assert answer.headers.get_list("set-cookie") == ["app_cookie=1; Path=/"]
    entries = app_log(world)[before:]
    assert len(entries) == 1
    assert corral_credentials_in(entries, [traffic, world.keys["alpha"]]) == []
    headers = {k.lower(): v for k, v in entries[0]["headers"]}
    assert headers["cookie"] == "theirs=kept"
    assert not {"x-access-token", "e2b-traffic-access-token", "x-api-key"} & set(headers)


def test_a_preview_on_a_sibling_host_cannot_plant_a_session_the_dashboard_trusts(
        world: World) -> None:
    """The weaker arrangement the docs warn of: previews under the service's own site
    (``corral.example.com`` and ``8000-….ports.example.com``, over http). The page can set a
    cookie for ``example.com`` that the browser then sends to the service beside the real
    session: the service trusts neither (sign in again), and acts for the page in nothing."""
    mgr = world.manager
    service_name, domain = "corral.example.com", "ports.example.com"
    mgr.ports.configure(PortURLs())
    app = create_app(mgr, host_names=[service_name], ports_domain=domain)
    with Server(mgr, app) as srv:
        service = f"http://{service_name}:{srv.port}"
        wait_serving(f"{srv.url}/ports/{world.attacker.id}/{PORT}/", service)
        mgr.files(world.attacker.id).write("config.json", json.dumps({
            "service": service, "victim": world.victim.id, "doomed": world.doomed.id,
            "attacker_key": world.keys["beta"], "cookie_domain": "example.com"}).encode())
        with chromium_page(loopback_domains=["example.com"]) as page:
            sign_in(page, service, world.keys["alpha"])
            genuine = [c["value"] for c in session_cookies(page, service)]
            results = attack(page, f"http://{PORT}-{to_e2b(world.attacker.id)}.{domain}:"
                                   f"{srv.port}/")
            after = whoami(page, service)
            jar = session_cookies(page, service)
    mgr.ports.configure(PortURLs())
    for name, outcome in results["attempts"].items():
        assert outcome.get("status", 0) in (0, 401, 403), (name, outcome)
    assert mgr.get(world.doomed.id).state == "running"
    assert mgr.auditor.trail(world.victim.id, types=["command.*"]).events == []
    # The planted cookie went to the service beside the real one: both refused, loudly.
    planted = [c for c in jar if c["value"] not in genuine]
    assert [c["value"] for c in planted] == ["tossed-by-script"], jar
    assert after[0] == 401 and "more than one" in after[1], after
