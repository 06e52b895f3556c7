"""A hostile tenant's preview, for the tests of where previews meet the service: the app
(``corral/_drill/hostileapp.py``, the drill's too), signing a browser in to the dashboard,
running the page's attack, and reading what the app was sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import corral._drill

if TYPE_CHECKING:
    from playwright.sync_api import Page

__all__ = ["APP", "CREDENTIAL_PREFIXES", "PORT", "attack", "corral_credentials_in",
           "parse_log", "session_cookies", "sign_in", "whoami"]

APP = (Path(corral._drill.__file__).parent / "hostileapp.py").read_bytes()
PORT = 8000
# How Corral's credentials begin (tests/unit/test_preview.py holds the makers to it).
CREDENTIAL_PREFIXES = ("ck_", "e2b_", "cpt_", "cp1.", "us1.")
# A page's attack is a dozen fetches on loopback; a loaded CI host may take long over them.
ATTACK_TIMEOUT_MS = 120_000


def sign_in(page: Page, service: str, key: str) -> str:
    """Sign in to the dashboard as a person would (its page, then its own sign-in request);
    returns the tenant the session is for."""
    page.goto(f"{service}/ui/")
    answer = page.evaluate("""async (key) => {
        const r = await fetch("/ui/session", {method: "POST", headers: {"X-Corral-UI": "1",
            "Content-Type": "application/json"}, body: JSON.stringify({key})});
        return [r.status, await r.text()];
    }""", key)
    assert answer[0] == 200, answer
    return str(json.loads(answer[1])["tenant"])


def whoami(page: Page, service: str) -> tuple[int, str]:
    page.goto(f"{service}/ui/")
    status, text = page.evaluate("""async () => {
        const r = await fetch("/ui/api/me", {headers: {"X-Corral-UI": "1"}});
        return [r.status, await r.text()];
    }""")
    return int(status), str(text)


def session_cookies(page: Page, service: str) -> list[dict[str, Any]]:
    return [c for c in page.context.cookies(service) if "corral_session" in c["name"]]


def attack(page: Page, url: str) -> dict[str, Any]:
    page.goto(url)
    page.wait_for_function("document.title === 'done'", timeout=ATTACK_TIMEOUT_MS)
    results = page.evaluate("window.results")
    assert isinstance(results, dict)
    return results


def parse_log(raw: bytes) -> list[dict[str, Any]]:
    """The app's ``requests.log``: one request a line."""
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


def corral_credentials_in(entries: list[dict[str, Any]], genuine: list[str]) -> list[str]:
    """Every header value in the app's log that holds one of Corral's credentials."""
    found = []
    for entry in entries:
        for name, value in entry["headers"]:
            text = f"{name}: {value}"
            if any(g in value for g in genuine) or "corral_" in value.lower() or any(
                    prefix in value for prefix in CREDENTIAL_PREFIXES):
                found.append(text)
    return found
