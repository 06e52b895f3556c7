"""Credential forwarding: no Corral cookie, key or token reaches an app in a sandbox through any
relay (the port proxy's two URL forms, the E2B surface's two routings, the cluster gateway
when the drill is pointed at one, the microVM keeper when the drill's tier is microvm).

Each case sends the second tenant's public app (``hostileapp.py``, which echoes what it got)
a request carrying every kind of credential the first tenant holds for Corral, as a browser or
an SDK would send them along, and reads back what arrived.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx

from ..._ids import to_e2b
from ..case import Case
from ..context import DrillContext
from ..model import Evidence, Outcome
from ..preview import APP_PORT, PreviewPlant, plant_of

Run = Callable[[DrillContext], Outcome]
NEEDS = frozenset({"preview", "python3"})
# Where the request goes: (base URL, extra headers, path), or None when the target has no
# such relay.
Route = Callable[[DrillContext, PreviewPlant], tuple[str, dict[str, str], str] | None]


def _planted(ctx: DrillContext, plant: PreviewPlant) -> dict[str, str]:
    """Every credential of the first tenant's a client could send along."""
    name, session = plant.session(plant.own_key)
    planted = {"Authorization": f"Bearer {plant.own_key}",
               "Cookie": f"{name}={session}; corral_port_{plant.app_sandbox}_{APP_PORT}="
                         f"{plant.port().get('token') or 'cpt_x'}; theirs=kept",
               "X-Corral-UI": "1", "X-Corral-Port-Token": plant.port().get("token") or "cpt_x",
               "E2b-Traffic-Access-Token": "f" * 48, "X-Access-Token": "e" * 48}
    if ctx.service is not None and ctx.service.e2b_api_key:
        planted["X-API-Key"] = ctx.service.e2b_api_key
    return planted


def _secrets(planted: dict[str, str]) -> list[str]:
    """The values that must not arrive, each on its own."""
    values = [v for k, v in planted.items() if k != "Cookie"]
    values += [part.split("=", 1)[1] for part in planted["Cookie"].split("; ")
               if part.startswith("corral") or part.startswith("__Host-corral")]
    return [v for v in values if len(v) > 4]


def _relay(route: Route, what: str) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        plant = plant_of(ctx.preview)
        where = route(ctx, plant)
        if where is None:
            return Outcome("skipped", f"this target has no {what}")
        base, headers, path = where
        planted = _planted(ctx, plant)
        with httpx.Client(base_url=base, timeout=60) as web:
            answer = web.get(path, headers={**planted, **headers, "X-Drill-Echo": "1"})
        shown = f"GET {base}{path} ({what}) -> {answer.status_code}"
        if answer.status_code != 200:
            return Outcome("error", f"{shown}: {answer.text[:160]}",
                           (Evidence("response", shown),))
        seen = {k.lower(): v for k, v in json.loads(answer.text)}
        leaked = sorted({name for name, value in seen.items()
                         for secret in _secrets(planted) if secret in value}
                        | {name for name in seen if name.startswith("x-corral-")}
                        | ({"cookie"} if "corral" in seen.get("cookie", "").lower() else set()))
        evidence = (Evidence("response", f"{shown}; the app got headers "
                                         f"{sorted(seen)}"),)
        if leaked:
            return Outcome("breached", f"the app received Corral credentials in {leaked} "
                           f"through the {what}", evidence)
        return Outcome("held", f"the app received none of the {len(_secrets(planted))} "
                       f"credentials sent through the {what}", evidence)
    return run


def _path_form(ctx: DrillContext, plant: PreviewPlant) -> tuple[str, dict[str, str], str]:
    return plant.port()["url"], {}, "echo"


def _host_form(ctx: DrillContext, plant: PreviewPlant) -> tuple[str, dict[str, str], str] | None:
    found = plant.host_request()
    return None if found is None else (found[0], {"Host": found[1]}, "/echo")


def _e2b_url_mode(ctx: DrillContext, plant: PreviewPlant) -> tuple[str, dict[str, str], str] | None:
    if ctx.service is None or ctx.service.e2b_url is None:
        return None
    # URL mode routes by headers only the paths envd has; the app echoes any.
    return ctx.service.e2b_url, {"E2b-Sandbox-Id": to_e2b(plant.app_sandbox),
                                 "E2b-Sandbox-Port": str(APP_PORT)}, "/health"


def _e2b_domain_mode(ctx: DrillContext,
                     plant: PreviewPlant) -> tuple[str, dict[str, str], str] | None:
    access = ctx.service
    if access is None or access.e2b_domain is None:
        return None
    base = access.e2b_domain_url or access.e2b_url
    assert base is not None
    return base, {"Host": f"{APP_PORT}-{to_e2b(plant.app_sandbox)}.{access.e2b_domain}"}, "/"


CASES: list[Case] = [
    Case("relay.port-path", "relays", "send the second tenant's public app, at its path URL, "
         "the first tenant's API key, dashboard session, port cookie and token, E2B key and "
         "tokens, and X-Corral-* headers", "the app receives none of them",
         _relay(_path_form, "port proxy's path form"), NEEDS),
    Case("relay.port-host", "relays", "the same at the port's host URL",
         "the app receives none of them", _relay(_host_form, "port proxy's host form"), NEEDS),
    Case("relay.e2b-url", "relays", "the same through the E2B surface's URL mode "
         "(E2b-Sandbox-Id/Port headers)", "the app receives none of them",
         _relay(_e2b_url_mode, "E2B surface (URL mode)"), NEEDS | {"e2b"}),
    Case("relay.e2b-domain", "relays", "the same through the E2B surface's domain mode "
         "(<port>-<sandbox>.<domain>)", "the app receives none of them",
         _relay(_e2b_domain_mode, "E2B surface (domain mode)"), NEEDS | {"e2b-domain"}),
]
