"""Preview URLs and the service's own origin: a page a sandbox serves must never run with the
authority of the dashboard or the API (its session, its cookies, its Origin).

The second tenant's app (``hostileapp.py``) serves a page on a public port whose script attacks
whoever opens it. With a browser on the host, the drill opens it as a signed-in dashboard user
would and checks what the page got and what changed; without one, the HTTP-only cases check the
two defences a browser relies on: the path form's pages are sandboxed in an opaque origin (or a
browser is sent to the port's own origin), and the dashboard's session is refused from any
other site of Fetch Metadata.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx

from ..case import Case
from ..context import DrillContext
from ..model import Evidence, Outcome
from ..preview import plant_of

Run = Callable[[DrillContext], Outcome]
NEEDS = frozenset({"preview", "python3"})
_ATTACK_TIMEOUT_MS = 120_000


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def _sandboxed(csp: str) -> bool:
    """Whether a Content-Security-Policy puts the page in an opaque origin."""
    for policy in csp.split(","):
        for directive in policy.split(";"):
            words = directive.split()
            if words and words[0].lower() == "sandbox" and "allow-same-origin" not in words:
                return True
    return False


def _path_form_is_sandboxed(ctx: DrillContext) -> Outcome:
    """A browser opening the path URL either lands on another origin (the port's host URL) or
    gets a page sandboxed in an opaque origin; a page's subresource (no navigation) is
    sandboxed too."""
    plant = plant_of(ctx.preview)
    url = plant.port()["url"]
    evidence: list[Evidence] = []
    with httpx.Client(timeout=60) as web:
        navigated = web.get(url, headers={"Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest":
                                          "document", "Accept": "text/html"})
        fetched = web.get(url)
    location = navigated.headers.get("location", "")
    shown = (f"navigation -> {navigated.status_code}"
             + (f" to {location}" if location else "")
             + f", CSP {navigated.headers.get('content-security-policy', 'none')!r}; "
             f"fetch -> {fetched.status_code}, CSP "
             f"{fetched.headers.get('content-security-policy', 'none')!r}")
    evidence.append(Evidence("response", f"GET {url}: {shown}"))
    moved = navigated.is_redirect and location and _origin(location) != _origin(url)
    nav_ok = moved or _sandboxed(navigated.headers.get("content-security-policy", ""))
    fetch_ok = _sandboxed(fetched.headers.get("content-security-policy", ""))
    if nav_ok and fetch_ok:
        return Outcome("held", shown, tuple(evidence))
    return Outcome("breached", "a page the sandbox serves would run on the service's own "
                   f"origin, with its session: {shown}", tuple(evidence))


def _session_from_another_site(ctx: DrillContext) -> Outcome:
    """The dashboard's own header and cookie, sent as a page of the same site but not the
    service's origin would send them (a preview on another port or a sibling host)."""
    plant = plant_of(ctx.preview)
    name, value = plant.session(plant.own_key)
    tried = []
    with httpx.Client(base_url=plant.access.url, timeout=60) as web:
        for site in ("same-site", "cross-site"):
            answer = web.get("/v1/sandboxes", headers={
                "Cookie": f"{name}={value}", "X-Corral-UI": "1", "Sec-Fetch-Site": site,
                "Sec-Fetch-Mode": "cors"})
            tried.append((site, answer.status_code))
    shown = ", ".join(f"Sec-Fetch-Site {site} -> {status}" for site, status in tried)
    evidence = (Evidence("response", f"GET /v1/sandboxes with the session: {shown}"),)
    if all(status == 401 for _, status in tried):
        return Outcome("held", shown, evidence)
    return Outcome("breached", f"the dashboard's session acted for another site's page: "
                   f"{shown}", evidence)


def _in_a_browser(ctx: DrillContext) -> Outcome:
    """The whole attack as it happens: the first tenant signs in to the dashboard in a real
    browser and opens the second tenant's public page (its path URL, as shared)."""
    from ..browser import browser_page

    plant = plant_of(ctx.preview)
    port = plant.port()
    victim = ctx.service_sandbox
    if victim is None:
        raise RuntimeError("the first tenant has no sandbox on the service")
    doomed = plant.doomed()
    service = plant.access.url.rstrip("/")
    plant.configure({"service": service, "victim": victim, "doomed": doomed,
                     "attacker_key": plant.other_key,
                     "cookie_domain": urlsplit(service).hostname or ""})
    commands_before = plant.commands_in(victim)
    with browser_page() as page:
        page.goto(f"{service}/ui/")
        signed = page.evaluate("""async (key) => {
            const r = await fetch("/ui/session", {method: "POST", headers: {"X-Corral-UI": "1",
                "Content-Type": "application/json"}, body: JSON.stringify({key})});
            return r.status;
        }""", plant.own_key)
        if signed != 200:
            raise RuntimeError(f"the browser could not sign in to the dashboard ({signed})")
        sessions = [c["value"] for c in page.context.cookies(service)
                    if c["name"].endswith("corral_session")]
        page.goto(port["url"])
        page.wait_for_function("document.title === 'done'", timeout=_ATTACK_TIMEOUT_MS)
        results: dict[str, Any] = page.evaluate("window.results")
        landed = page.url
        page.goto(f"{service}/ui/")
        me = page.evaluate("""async () => {
            const r = await fetch("/ui/api/me", {headers: {"X-Corral-UI": "1"}});
            return [r.status, await r.text()];
        }""")
        after = [c["value"] for c in page.context.cookies(service)
                 if c["name"].endswith("corral_session")]
    evidence = [Evidence("observation", f"the page ran at {landed} with origin "
                                        f"{results.get('origin')}")]
    problems = []
    for name, outcome in results.get("attempts", {}).items():
        status = outcome.get("status", 0)
        evidence.append(Evidence("response", f"the page's {name}: "
                                 + (f"{status} {outcome.get('body', '')[:60]!r}"
                                    if "status" in outcome else outcome.get("error", "")[:80])))
        if status not in (0, 401, 403) or victim in outcome.get("body", ""):
            problems.append(f"{name} answered {status}")
    if "corral_session" in str(results.get("cookie") or ""):
        problems.append("the page read the session cookie")
    if not plant.alive(doomed):
        problems.append(f"the page destroyed the first tenant's sandbox {doomed}")
    if plant.commands_in(victim) != commands_before:
        problems.append(f"the page ran a command in the first tenant's sandbox {victim}")
    if me[0] != 200 or after != sessions:
        problems.append(f"the viewer's session changed (now {me[0]} "
                        f"{json.dumps(me[1])[:80]}, {len(after)} session cookie(s))")
    if problems:
        return Outcome("breached", "; ".join(problems), tuple(evidence))
    return Outcome("held", f"the page ran with origin {results.get('origin')} and got "
                   "nothing of Corral's; the viewer's session is unchanged", tuple(evidence))


CASES: list[Case] = [
    Case("preview.path-form-sandboxed", "previews",
         "open the second tenant's public page at its path URL (the service's own origin), "
         "as a browser navigates and as a page fetches it",
         "a browser is sent to another origin (the port's host URL) or gets the page "
         "sandboxed in an opaque origin (CSP sandbox without allow-same-origin)",
         _path_form_is_sandboxed, NEEDS),
    Case("preview.session-from-another-site", "previews",
         "send the dashboard's session cookie and X-Corral-UI as a page of the same site "
         "but another origin (Sec-Fetch-Site: same-site, cross-site)",
         "401: the session acts only for the dashboard's own pages",
         _session_from_another_site, NEEDS),
    Case("preview.browser-signed-in", "previews",
         "in a real browser signed in to the dashboard as the first tenant, open the second "
         "tenant's public page, whose script lists sandboxes, runs a command in and destroys "
         "the first tenant's, signs in as the attacker and out, and reads and tosses cookies",
         "every attempt fails, nothing changed, the viewer's one session is as it was",
         _in_a_browser, NEEDS | {"browser", "service-sandbox"}),
]
