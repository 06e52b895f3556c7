"""A real browser for the drill's preview cases, when the host has one: Playwright (the
``playwright`` package; its own browser builds are never downloaded) driving the system's
Chromium headless. Without either, the preview cases that need a browser are skipped and say
which is missing; the HTTP-only cases still run.

Chromium runs with its background networking off, so the only requests it makes are the
page's: to the service under test and to the sandbox's own app.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import Page

__all__ = ["browser_page", "missing"]

_EXECUTABLES = ("chromium", "chromium-browser", "google-chrome")
_ARGS = ["--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", "--disable-quic", "--no-proxy-server", "--disable-gpu"]
_LAUNCH_TIMEOUT_MS = 120_000  # a loaded host
_ACTION_TIMEOUT_MS = 60_000


def _executable() -> str | None:
    return next((found for name in _EXECUTABLES if (found := shutil.which(name))), None)


def missing() -> str | None:
    """What the host lacks for a browser case, or None."""
    if importlib.util.find_spec("playwright") is None:
        return "Playwright (pip install playwright; it drives the host's Chromium)"
    if _executable() is None:
        return "Chromium (the Debian package chromium)"
    return None


@contextlib.contextmanager
def browser_page() -> Iterator[Page]:
    """A page in a fresh headless Chromium with an empty profile, closed however the block
    ends."""
    from playwright.sync_api import sync_playwright

    executable = _executable()
    assert executable is not None, missing()
    # Chromium's own sandbox refuses to start as root; the pages are the drill's targets.
    args = [*_ARGS, *(["--no-sandbox"] if os.geteuid() == 0 else [])]
    with tempfile.TemporaryDirectory(prefix="corral-drill-browser-") as profile, \
            sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=executable, headless=True, args=args,
            chromium_sandbox=False, timeout=_LAUNCH_TIMEOUT_MS)
        try:
            context.set_default_timeout(_ACTION_TIMEOUT_MS)
            context.set_default_navigation_timeout(_ACTION_TIMEOUT_MS)
            yield context.new_page()
        finally:
            context.close()
