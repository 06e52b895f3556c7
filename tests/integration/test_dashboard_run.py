"""The dashboard's Run button streams what it runs, and a sandbox's page lists its exposed ports
(with links to their own origins) and its background processes (with a Kill button each): in
a real headless Chromium (``tests/browser.py``) against the same service as
``test_dashboard.py`` (its ``service`` fixture, a module of its own here).

Every wait is for an event on the page or in the sandbox, with the browser's generous bound
(``ACTION_TIMEOUT_MS``); the commands wait on files the test writes, never on a clock.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx
import pytest

from corral import Sandbox
from corral._ids import to_e2b

from ..browser import ACTION_TIMEOUT_MS, chromium_page, save_screenshot
from . import test_dashboard as dashboard

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = pytest.mark.needs_root

Service = dashboard.Service
service = dashboard.service  # the same fixture: a service of this module's own

UI = {"X-Corral-UI": "1"}
# A loop a command waits in until the test writes the file (at most 120 s: never forever).
_UNTIL = "for _ in $(seq 1200); do [ -e /workspace/{name} ] && break; sleep 0.1; done"


@contextmanager
def _sandbox_page(service: Service, tenant: str, sandbox: Sandbox,
                  blocked: list[str]) -> Iterator[Page]:
    """A browser signed in as ``tenant``, on ``sandbox``'s page."""
    with chromium_page(blocked=blocked) as page:
        page.goto(f"{service.server.url}/ui")
        page.get_by_label("API key").fill(service.keys[tenant])
        page.get_by_role("button", name="Sign in").click()
        page.get_by_role("heading", name="Sandboxes").wait_for()
        page.goto(f"{service.server.url}/ui#/sandboxes/{sandbox.id}")
        page.get_by_role("heading", name=sandbox.id).wait_for()
        yield page


def _run(page: Page, cmd: str) -> None:
    page.get_by_label("Command to run").fill(cmd)
    page.get_by_role("button", name="Run", exact=True).click()


def test_run_streams_the_commands_output_beside_the_button(service: Service) -> None:
    sandbox = Sandbox.create(url=service.server.url, api_key=service.keys["alpha"])
    blocked: list[str] = []
    try:
        with _sandbox_page(service, "alpha", sandbox, blocked) as page:
            _run(page, "printf 'a\\n'; " + _UNTIL.format(name="go") +
                 "; printf 'b\\n' >&2; exit 3")
            run = page.locator("ol.runs li.run").first
            # 'a' shows while the command still waits for the file: streamed, not at the end.
            page.wait_for_function(
                "() => document.querySelector('ol.runs li.run pre.out span.stdout')"
                "?.textContent === 'a\\n'", timeout=ACTION_TIMEOUT_MS)
            assert run.locator(".exit").count() == 0
            assert "running" in run.inner_text()
            sandbox.files.write("go", "")
            exit_code = run.locator(".exit")
            exit_code.wait_for()
            assert exit_code.get_attribute("data-exit-code") == "3"
            assert exit_code.inner_text() == "exit 3"
            assert run.locator("pre.out span.stderr").text_content() == "b\n"
            assert run.locator("pre.out span.stdout").text_content() == "a\n"
            assert "failed" in (run.get_attribute("class") or "")
            # The timeline has the command from the audit trail, its end included, and says
            # where its output is rather than showing it a second time.
            entry = page.locator("ol.timeline li.command", has_text="printf 'a")
            entry.get_by_text(re.compile(r"exit 3 ·")).wait_for()
            assert entry.locator("pre.out").count() == 0
            assert "beside the Run button" in entry.inner_text()
            save_screenshot(page, "dashboard-run-streamed")

            # A reload: the timeline alone, with the output from the audit trail.
            page.reload()
            page.get_by_role("heading", name=sandbox.id).wait_for()
            entry = page.locator("ol.timeline li.command", has_text="printf 'a")
            entry.get_by_text(re.compile(r"exit 3 ·")).wait_for()
            assert entry.locator("pre.out").inner_text().split() == ["a", "b"]
            assert page.locator("ol.runs li").count() == 0
    finally:
        sandbox.kill()
    assert blocked == [], f"the page tried to reach off the machine: {blocked}"


def test_a_run_is_killed_from_its_button_and_a_refusal_says_why(service: Service) -> None:
    sandbox = Sandbox.create(url=service.server.url, api_key=service.keys["alpha"])
    blocked: list[str] = []
    try:
        with _sandbox_page(service, "alpha", sandbox, blocked) as page:
            # Killed from its own Kill button (the command's id, from the trail).
            _run(page, "echo waiting; " + _UNTIL.format(name="never"))
            run = page.locator("ol.runs li.run").first
            run.locator("pre.out").get_by_text("waiting").wait_for()
            run.get_by_role("button", name="Kill this command").click()
            run.locator(".exit").wait_for()
            assert run.locator(".exit").get_attribute("data-exit-code") == "137"
            assert "killed (signal 9)" in run.inner_text()

            # Refused: the API's own message, in the run's place.
            sandbox.kill()
            _run(page, "echo too-late")
            refusal = page.locator("ol.runs li.run").first.locator(".error")
            refusal.wait_for()
            assert refusal.inner_text().startswith("refused: ")
            assert sandbox.id in refusal.inner_text() and "does not exist" in refusal.inner_text()
    finally:
        sandbox.kill()
    assert blocked == [], f"the page tried to reach off the machine: {blocked}"


def test_output_is_text_and_a_flood_is_cut(service: Service) -> None:
    sandbox = Sandbox.create(url=service.server.url, api_key=service.keys["alpha"])
    blocked: list[str] = []
    markup = ("<img src=x onerror=\"window.pwned=1\"><script>window.pwned=2</script>"
              "<b id=bold>bold</b>")
    sandbox.files.write("markup.txt", markup + "\n")
    try:
        with _sandbox_page(service, "alpha", sandbox, blocked) as page:
            _run(page, "cat markup.txt; cat markup.txt >&2")
            run = page.locator("ol.runs li.run").first
            run.locator(".exit").wait_for()
            assert run.locator("pre.out span.stdout").text_content() == markup + "\n"
            assert run.locator("pre.out span.stderr").text_content() == markup + "\n"
            page.locator("ol.timeline li.command", has_text="markup.txt").get_by_text(
                re.compile(r"exit 0 ·")).wait_for()
            # Reloaded, the timeline shows the same bytes from the trail: as text too.
            page.reload()
            page.locator("ol.timeline li.command pre.out").get_by_text(
                "<b id=bold>", exact=False).first.wait_for()
            assert page.locator("main img, main script, #bold").count() == 0
            assert page.evaluate("window.pwned") is None

            # A flood: the panel keeps the last 256 KiB and says so; the tab stays usable.
            _run(page, "head -c 3000000 /dev/zero | tr '\\0' 'x'; echo; echo the-end")
            run = page.locator("ol.runs li.run").first
            run.locator(".exit").wait_for()
            run.get_by_text("are not shown here").wait_for()
            kept = page.evaluate("document.querySelector('ol.runs li.run pre.out')"
                                 ".textContent.length")
            assert kept <= 256 * 1024, kept
    finally:
        sandbox.kill()
    assert blocked == [], f"the page tried to reach off the machine: {blocked}"


def _wait_serving(url: str, token: str) -> None:
    """The server starts in the background: wait until the proxy stops answering 502."""
    deadline = time.monotonic() + 120
    while True:
        answer = httpx.get(url, headers={"X-Corral-Port-Token": token}, timeout=30)
        if answer.status_code == 200:
            return
        assert answer.status_code == 502, answer.text
        assert time.monotonic() < deadline, "the server in the sandbox never listened"
        time.sleep(0.2)


def test_ports_link_to_their_own_origin(service: Service) -> None:
    sandbox = Sandbox.create(url=service.server.url, api_key=service.keys["alpha"])
    blocked: list[str] = []
    try:
        sandbox.files.write("www/index.html", "<title>from the sandbox</title>served")
        with _sandbox_page(service, "alpha", sandbox, blocked) as page:
            page.locator("[aria-label='Exposed ports']").get_by_text("No exposed port").wait_for()
            sandbox.processes.start("python3 -m http.server 8000 --directory www")
            exposed = sandbox.ports.expose(8000)
            assert exposed.url and exposed.token and exposed.host_url
            _wait_serving(exposed.url, exposed.token)
            origin = f"http://8000-{to_e2b(sandbox.id)}.localhost:{service.server.port}"
            assert exposed.host_url == origin + "/"
            # Listed when the trail says it was exposed: no reload.
            link = page.locator('li[data-port="8000"] a')
            link.wait_for()
            assert "private" in page.locator('li[data-port="8000"]').inner_text()
            href = link.get_attribute("href") or ""
            assert urlsplit(href).scheme + "://" + urlsplit(href).netloc == origin, href
            assert urlsplit(href).query.startswith("corral_expires="), href  # signed
            assert link.get_attribute("target") == "_blank"
            assert link.get_attribute("rel") == "noopener noreferrer"
            assert link.inner_text() == origin + "/"
            # Opened: a tab of its own, on the port's origin, with no way back to this one.
            with page.context.expect_page() as opened:
                link.click()
            preview = opened.value
            preview.wait_for_load_state()
            preview.get_by_text("served").wait_for()
            assert preview.url == origin + "/", preview.url  # the signature left the address
            assert preview.evaluate("window.opener") is None
            assert preview.evaluate("document.referrer") == ""
            assert page.url.startswith(service.server.url)
            save_screenshot(page, "dashboard-ports")
            # Unexposed: gone from the list, again from the trail's event.
            sandbox.ports.unexpose(8000)
            page.locator('li[data-port="8000"]').wait_for(state="detached")
    finally:
        sandbox.kill()
    assert blocked == [], f"the page tried to reach off the machine: {blocked}"


def test_a_background_process_is_listed_and_killed(service: Service) -> None:
    sandbox = Sandbox.create(url=service.server.url, api_key=service.keys["beta"])
    blocked: list[str] = []
    try:
        with _sandbox_page(service, "beta", sandbox, blocked) as page:
            box = page.locator("[aria-label='Background processes']")
            box.get_by_text("No background process").wait_for()
            process = sandbox.processes.start("sleep 3600")
            row = page.locator(f'li[data-process="{process.id}"]')
            row.wait_for()  # from the trail's command.started: no reload
            assert "sleep 3600" in row.inner_text() and "running" in row.inner_text()
            kill = row.get_by_role("button", name=f"Kill {process.id}")
            kill.focus()
            page.keyboard.press("Enter")  # a button, from the keyboard
            row.get_by_text("exited 137").wait_for()
            assert row.get_by_role("button").count() == 0
            page.get_by_role("status").get_by_text(f"Killed {process.id}.").wait_for()
            assert process.info()["state"] == "exited"
            assert [p.id for p in sandbox.processes.list()
                    if p.info()["state"] != "exited"] == []
            save_screenshot(page, "dashboard-processes")
    finally:
        sandbox.kill()
    assert blocked == [], f"the page tried to reach off the machine: {blocked}"


def test_a_drill_category_the_drill_does_not_know_is_refused(service: Service) -> None:
    operator = service.directory.create_operator_key()[1]
    client = httpx.Client(base_url=service.server.url, timeout=120)
    try:
        assert client.post("/ui/session", json={"key": operator}, headers=UI).status_code == 200
        unknown = client.post("/ui/api/drill", json={"categories": ["filesystem", "nosuch"]},
                              headers=UI)
        assert unknown.status_code == 400, unknown.text
        message = unknown.json()["message"]
        assert "nosuch" in message and "filesystem" in message, message  # the drill's list
        garbled = client.post("/ui/api/drill", json={"categories": ["--list"]}, headers=UI)
        assert garbled.status_code == 422, garbled.text
        assert client.post("/ui/api/drill", json={"categories": ["x"] * 17},
                           headers=UI).status_code == 422
    finally:
        client.close()


def test_the_dashboard_does_not_import_the_drill() -> None:
    ui = Path(__file__).resolve().parents[2] / "src" / "corral" / "_ui"
    for path in ui.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "_drill" not in (node.module or ""), (path, node.module)
            elif isinstance(node, ast.Import):
                assert all("_drill" not in a.name for a in node.names), path
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, json, corral._ui.routes; print(json.dumps("
         "[m for m in sys.modules if m.startswith('corral._drill')]))"],
        capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(loaded.stdout) == []
