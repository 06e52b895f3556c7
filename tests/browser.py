"""A real headless browser for the tests: Debian's ``chromium`` driven by Playwright's sync API.

Playwright's own browser builds are never downloaded: ``executable_path`` points it at the
system's Chromium (``scripts/bootstrap --test`` installs the Debian package). The browser may
reach loopback only: every other request is aborted by a route handler before Chromium sends
anything, and host names other than ``localhost`` do not resolve, so a test can never send
traffic off the machine. Where Chromium or Playwright is missing, the test is skipped and says
which.

    with chromium_page() as page:
        page.goto(f"http://127.0.0.1:{port}/")
        save_screenshot(page, "front-page")

The ``browser_page`` fixture (tests/integration/conftest.py) is the same page for a test.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Page, Route, WebSocketRoute

__all__ = ["artefacts_dir", "chromium_page", "is_loopback_url", "save_screenshot"]

# Bounds on every wait, so a wedged browser fails the test instead of hanging the run.
LAUNCH_TIMEOUT_MS = 90_000  # CI runs three sessions on 2 cores: a launch took over 30 s once
# Every wait is for an event (an element, a load): a generous bound costs a passing test
# nothing, and CI's three sessions on 2 cores once took over 10 s for a dashboard's command.
ACTION_TIMEOUT_MS = 90_000

CHROMIUM_ARGS = [
    # Chromium's own sandbox cannot run as root (it refuses to start without this), and the
    # tests run as root. The pages it loads are our own, served on loopback by the test itself.
    "--no-sandbox",
    # No proxy from the environment or the system settings: loopback pages are fetched directly.
    "--no-proxy-server",
]


def _resolver_rules(loopback_domains: Sequence[str]) -> str:
    """Belt to the route handler's braces: nothing resolves but localhost (and its
    subdomains, which browsers keep on loopback themselves), loopback literals and the test's
    own domains, mapped to 127.0.0.1 (the rules apply to IP literals too), so not even a DNS
    query leaves the machine, the browser's own background requests included, which no page
    route sees."""
    mapped = [rule for domain in loopback_domains
              for rule in (f"MAP {domain} 127.0.0.1", f"MAP *.{domain} 127.0.0.1")]
    return "--host-resolver-rules=" + ", ".join(
        [*mapped, "MAP * ~NOTFOUND", "EXCLUDE localhost", "EXCLUDE *.localhost",
         "EXCLUDE 127.*", "EXCLUDE ::1"])


def is_loopback_url(url: str, loopback_domains: Sequence[str] = ()) -> bool:
    """Whether ``url`` names a host on this machine: localhost, one of ``loopback_domains``
    (which the browser maps to 127.0.0.1), a name under either, or a loopback address."""
    host = urlsplit(url).hostname
    if host is None:
        return False
    if host in ("localhost", *loopback_domains) or host.endswith(
            (".localhost", *(f".{domain}" for domain in loopback_domains))):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def artefacts_dir() -> Path:
    """Where tests leave screenshots: ``$CORRAL_TEST_ARTEFACTS``, else tests/artefacts
    (gitignored). Created on first use."""
    env = os.environ.get("CORRAL_TEST_ARTEFACTS")
    path = Path(env) if env else Path(__file__).resolve().parent / "artefacts"
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_screenshot(page: Page, name: str, *, full_page: bool = True) -> Path:
    """A PNG of ``page`` in the artefacts directory, named after ``name``; returns its path."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_.") or "screenshot"
    path = artefacts_dir() / f"{safe}.png"
    page.screenshot(path=str(path), full_page=full_page, timeout=ACTION_TIMEOUT_MS)
    return path


@contextlib.contextmanager
def chromium_page(*, blocked: list[str] | None = None,
                  loopback_domains: Sequence[str] = ()) -> Iterator[Page]:
    """A fresh page in a headless Chromium that can reach loopback only. The browser is closed
    however the block ends. ``blocked``, if given, collects the URLs the guard refused;
    every name under ``loopback_domains`` resolves to 127.0.0.1 (a test's wildcard DNS)."""
    executable = shutil.which("chromium")
    if executable is None:
        pytest.skip("no chromium on PATH (Debian package chromium; scripts/bootstrap --test)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (the test extra; scripts/bootstrap --test)")

    refused = blocked if blocked is not None else []

    def refuse(route: Route) -> None:
        refused.append(route.request.url)
        route.abort("blockedbyclient")

    def refuse_ws(ws: WebSocketRoute) -> None:
        # Not connected to any server: the page sees its WebSocket closed, nothing is sent.
        refused.append(ws.url)
        ws.close(code=1008, reason="off-machine traffic is refused in tests")

    def off_machine(url: str) -> bool:
        return not is_loopback_url(url, loopback_domains)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=executable, headless=True, chromium_sandbox=False,
            args=[*CHROMIUM_ARGS, _resolver_rules(loopback_domains)],
            timeout=LAUNCH_TIMEOUT_MS,
        )
        try:
            # Service workers would fetch around the context's routes: blocked.
            context = browser.new_context(service_workers="block")
            context.set_default_timeout(ACTION_TIMEOUT_MS)
            context.set_default_navigation_timeout(ACTION_TIMEOUT_MS)
            # Routes before the first page exists, so no request of any page escapes them.
            context.route(off_machine, refuse)
            context.route_web_socket(off_machine, refuse_ws)
            yield context.new_page()
        finally:
            browser.close()
