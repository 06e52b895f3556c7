"""Cookie tossing: a sandbox's app cannot set, replace or clear a cookie Corral uses, and a
session cookie planted beside the dashboard's own is not trusted.

The second tenant's public app (``hostileapp.py``) answers every request with
``Set-Cookie: corral_session=…``, ``__Host-corral_session=…``, ``corral_port_…=…`` and
``Clear-Site-Data: "cookies"``: the cases read what reaches the client. (In a browser, the
page's script also tries ``document.cookie``: ``preview.browser-signed-in``.)
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from ..case import Case
from ..context import DrillContext
from ..model import Evidence, Outcome
from ..preview import plant_of

Run = Callable[[DrillContext], Outcome]
NEEDS = frozenset({"preview", "python3"})


def _answer_cookies(form: str) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        plant = plant_of(ctx.preview)
        if form == "path":
            base, headers = plant.port()["url"], {}
        else:
            found = plant.host_request()
            if found is None:
                return Outcome("skipped", "this service gives its ports no host URL")
            base, headers = found[0], {"Host": found[1]}
        with httpx.Client(base_url=base, timeout=60) as web:
            answer = web.get("", headers=headers)
        cookies = answer.headers.get_list("set-cookie")
        corral = [c.split(";")[0].split("=")[0] for c in cookies if "corral_" in
                  c.split("=")[0].lower()]
        cleared = answer.headers.get("clear-site-data")
        shown = (f"GET {form} URL -> {answer.status_code}, Set-Cookie names "
                 f"{[c.split('=')[0] for c in cookies]}, Clear-Site-Data {cleared!r}")
        evidence = (Evidence("response", shown),)
        if answer.status_code != 200:
            return Outcome("error", shown, evidence)
        if corral or cleared:
            return Outcome("breached", f"the app's answer reached the client with "
                           f"{corral or ''} {('Clear-Site-Data ' + cleared) if cleared else ''}"
                           .strip(), evidence)
        return Outcome("held", shown, evidence)
    return run


def _tossed_session(ctx: DrillContext) -> Outcome:
    """The dashboard's session beside another tenant's, as a browser sends both when a page of
    another host of the site set one for their common parent."""
    plant = plant_of(ctx.preview)
    name, own = plant.session(plant.own_key)
    _, tossed = plant.session(plant.other_key)
    with httpx.Client(base_url=plant.access.url, timeout=60) as web:
        answer = web.get("/ui/api/me", headers={
            "Cookie": f"{name}={tossed}; {name}={own}", "X-Corral-UI": "1"})
    shown = f"GET /ui/api/me with two session cookies -> {answer.status_code} " \
            f"{answer.text[:100]}"
    evidence = (Evidence("response", shown),)
    if answer.status_code == 401:
        return Outcome("held", shown, evidence)
    return Outcome("breached", f"a planted session cookie was trusted: {shown}", evidence)


CASES: list[Case] = [
    Case("cookie.set-by-app-path", "cookies", "answer from the app, at its path URL (the "
         "service's origin), with Set-Cookie for Corral's cookie names and Clear-Site-Data",
         "neither reaches the client", _answer_cookies("path"), NEEDS),
    Case("cookie.set-by-app-host", "cookies", "the same at the port's host URL",
         "neither reaches the client", _answer_cookies("host"), NEEDS),
    Case("cookie.tossed-session", "cookies", "send the dashboard's session cookie beside "
         "another tenant's (planted by a page of a sibling host)",
         "401: neither is trusted", _tossed_session, NEEDS),
]
