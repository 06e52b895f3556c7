"""The test browser works end to end (tests/browser.py): Debian's Chromium loads a page from a
loopback HTTP server, the page's JavaScript talks to a loopback WebSocket server, and a request
for any other address is refused before it leaves the machine."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

import pytest

from ..browser import chromium_page, save_screenshot

if TYPE_CHECKING:
    from playwright.sync_api import Page
    from websockets.sync.server import ServerConnection

# A documentation address (TEST-NET-2, RFC 5737): nothing is there, and nothing may be sent.
OFF_MACHINE = "198.51.100.1"
WAIT_MS = 10_000

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def serve_pages(pages: dict[str, str]) -> Iterator[str]:
    """A stdlib HTTP server on 127.0.0.1 (a free port) serving ``pages`` (path -> HTML);
    yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path)
            if body is None:
                self.send_error(404)
                return
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@contextlib.contextmanager
def echo_server(heard: list[str]) -> Iterator[str]:
    """A WebSocket server on 127.0.0.1 (a free port) that answers each message with
    ``echo: <message>`` and notes it in ``heard``; yields its ws:// URL."""
    from websockets.sync.server import serve

    def echo(ws: ServerConnection) -> None:
        for message in ws:
            text = message if isinstance(message, str) else message.decode()
            heard.append(text)
            ws.send(f"echo: {text}")

    with serve(echo, "127.0.0.1", 0) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"ws://127.0.0.1:{server.socket.getsockname()[1]}/"
        finally:
            server.shutdown()
            thread.join(timeout=10)


ECHO_PAGE = """<!doctype html>
<title>echo</title>
<p>Echoed: <span id="out">(waiting)</span></p>
<script>
  const ws = new WebSocket(%(ws)r);
  ws.onopen = () => ws.send("hello from the page");
  ws.onmessage = (event) => { document.getElementById("out").textContent = event.data; };
  ws.onerror = () => { document.getElementById("out").textContent = "websocket error"; };
</script>
"""


def test_page_talks_to_a_loopback_websocket(browser_page: Page) -> None:
    heard: list[str] = []
    with echo_server(heard) as ws_url, serve_pages({"/": ECHO_PAGE % {"ws": ws_url}}) as url:
        browser_page.goto(url + "/", timeout=WAIT_MS)
        out = browser_page.locator("#out", has_text="echo: hello from the page")
        out.wait_for(timeout=WAIT_MS)
        save_screenshot(browser_page, "browser-smoke-echo")
    assert heard == ["hello from the page"]


GUARD_PAGE = """<!doctype html>
<title>guard</title>
<p>fetch: <span id="fetch">(waiting)</span></p>
<p>websocket: <span id="ws">(waiting)</span></p>
<script>
  const show = (id, text) => { document.getElementById(id).textContent = text; };
  fetch("http://%(ip)s/", {mode: "no-cors"}).then(
    () => show("fetch", "reached"), (err) => show("fetch", "refused: " + err.name));
  const ws = new WebSocket("ws://%(ip)s/");
  ws.onopen = () => show("ws", "open");
  ws.onclose = (event) => show("ws", "closed " + event.code);
</script>
"""


def test_off_machine_requests_are_refused_before_they_are_sent() -> None:
    blocked: list[str] = []
    failures: list[tuple[str, str | None]] = []
    with serve_pages({"/": GUARD_PAGE % {"ip": OFF_MACHINE}}) as url, \
            chromium_page(blocked=blocked) as page:
        page.on("requestfailed", lambda req: failures.append((req.url, req.failure)))
        page.goto(url + "/", timeout=WAIT_MS)
        page.locator("#fetch", has_text="refused").wait_for(timeout=WAIT_MS)
        page.locator("#ws", has_text="closed").wait_for(timeout=WAIT_MS)
        ws_state = page.locator("#ws").inner_text(timeout=WAIT_MS)
    # The route handler refused both before Chromium opened a connection: the request failed as
    # blocked by the client (a real attempt would time out or find no route instead), and the
    # WebSocket was closed by the guard without ever being connected to a server.
    assert f"http://{OFF_MACHINE}/" in blocked
    assert f"ws://{OFF_MACHINE}/" in blocked
    # (Chromium names who blocked it: "net::ERR_BLOCKED_BY_CLIENT.Inspector", the route.)
    assert [url for url, why in failures if url == f"http://{OFF_MACHINE}/"
            and (why or "").startswith("net::ERR_BLOCKED_BY_CLIENT")], failures
    assert ws_state == "closed 1008"
    # The loopback page itself was let through.
    assert not [u for u in blocked if "127.0.0.1" in u]
