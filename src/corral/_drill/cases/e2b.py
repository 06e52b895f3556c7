"""E2B: the E2B dialect's listener (``corral serve --e2b-port``) as a hostile caller sees it.

The E2B SDKs reach Corral through a second listener with an authentication of its own: an
``e2b_`` key in ``X-API-KEY`` on the control plane, and, per sandbox, an ``X-Access-Token``
(envd) or a traffic token (the code interpreter) on the sandbox plane, which is routed by the
``E2b-Sandbox-Id`` header; ``/files`` alone may go without a token when its URL is signed. These
cases aim at the seams that dialect adds: keys, other tenants' sandbox ids, one sandbox's token
with another's id, tokenless calls, forged and expired signatures, gone sandboxes, ceilings
reached through E2B's create body (``allow_internet_access``, ``network.allowOut``), oversized
bodies before authentication, and foreign Host names.

Bounded like the caller cases: bodies claim 1 GiB but at most 4 MiB is sent, every request has a
timeout, everything stays on loopback, and every sandbox a case makes is killed at the end of
the drill (``E2BPlant.close``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import secrets as _secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import httpx

from ..case import Case
from ..context import DrillContext, drill_ceiling
from ..e2bplant import TIMEOUT, E2BPlant, Which
from ..model import Evidence, Outcome, Verdict
from .caller import _CLAIMED, send_oversized

__all__ = ["CASES"]

Run = Callable[[DrillContext], Outcome]

ENVD_PORT = 49983
JUPYTER_PORT = 49999
E2B = frozenset({"e2b"})
OTHER = frozenset({"e2b", "e2b-other"})
CEILING = frozenset({"e2b", "e2b-ceiling"})
DOMAIN = frozenset({"e2b", "e2b-domain"})
_GONE_MESSAGE = "The sandbox was not found"


def _plant(ctx: DrillContext) -> E2BPlant:
    if ctx.e2b is None:
        raise RuntimeError("this target has no E2B surface")
    return ctx.e2b


def _corral_id(e2b_id: str) -> str:
    from ..._ids import from_e2b

    found = from_e2b(e2b_id)
    if found is None:
        raise RuntimeError(f"{e2b_id!r} is not a sandbox id of Corral's E2B surface")
    return found


# -- what answers look like ----------------------------------------------------------------


def _shown(response: httpx.Response) -> str:
    request = response.request
    where = request.headers.get("e2b-sandbox-port")
    return (f"{request.method} {request.url.path}" + (f" (port {where})" if where else "")
            + f" -> {response.status_code} {response.text[:120]}")


def _body(response: httpx.Response) -> Any:
    with contextlib.suppress(ValueError):
        return response.json()
    return None


def _e2b_error(response: httpx.Response, status: int) -> bool:
    """E2B's error shape, which the SDKs parse: ``{"code": status, "message": "..."}``."""
    body = _body(response)
    return (response.status_code == status and isinstance(body, dict)
            and body.get("code") == status and isinstance(body.get("message"), str)
            and bool(body["message"]))


def _unauthenticated(response: httpx.Response) -> bool:
    """401 in the shape of its path: a Connect error on RPC paths, E2B's elsewhere."""
    body = _body(response)
    if response.request.url.path.startswith(("/process.", "/filesystem.")):
        return (response.status_code == 401 and isinstance(body, dict)
                and body.get("code") == "unauthenticated")
    return _e2b_error(response, 401)


def _not_served(response: httpx.Response) -> bool:
    """The router's own 404: the endpoint does not exist on this target (nothing was read)."""
    body = _body(response)
    return (response.status_code == 404 and isinstance(body, dict)
            and "no such endpoint" in str(body.get("message", "")))


def _verdict(answers: Sequence[tuple[httpx.Response, bool]], held: str,
             extra: Sequence[Evidence] = (), labels: Sequence[str] = ()) -> Outcome:
    """Held when every answer is as expected (``ok``); ``labels`` name what each one tried."""
    named = [f"{labels[i]}: " if i < len(labels) else "" for i in range(len(answers))]
    evidence = tuple(Evidence("response", f"{named[i]}{_shown(r)}")
                     for i, (r, _) in enumerate(answers)) + tuple(extra)
    wrong = [(named[i], r) for i, (r, ok) in enumerate(answers) if not ok]
    if not wrong:
        return Outcome("held", held, evidence)
    label, worst = max(wrong, key=lambda w: w[1].is_success)
    verdict: Verdict = "breached" if any(r.is_success for _, r in wrong) or all(
        r.status_code < 500 for _, r in wrong) else "error"
    return Outcome(verdict, f"{len(wrong)} of {len(answers)} answers were not the refusal "
                   f"expected: {label}{_shown(worst)}", evidence)


def _plane(plant: E2BPlant, e2b_id: str, method: str, path: str, *,
           token: str | None = None, port: int = ENVD_PORT,
           headers: Mapping[str, str] | None = None, body: Any = None,
           params: Mapping[str, str] | None = None) -> httpx.Response:
    """One sandbox-plane request in URL mode (E2B-COMPAT §2): routed by the headers."""
    sent = {"E2b-Sandbox-Id": e2b_id, "E2b-Sandbox-Port": str(port), **(headers or {})}
    if token is not None:
        sent["X-Access-Token"] = token
    if path.startswith(("/process.", "/filesystem.")):
        sent.setdefault("Connect-Protocol-Version", "1")
    with plant.client(None) as api:
        return api.request(method, path, headers=sent, params=params,
                           json=body if body is not None else None)


# -- keys -------------------------------------------------------------------------------------


def _key_case(variants: Callable[[E2BPlant], Sequence[tuple[str, Mapping[str, str]]]],
              held: str) -> Run:
    """GET /v2/sandboxes with each variant's headers: every one 401, E2B-shaped."""
    def run(ctx: DrillContext) -> Outcome:
        plant = _plant(ctx)
        answers, labels = [], []
        for label, headers in variants(plant):
            with plant.client(None) as api:
                response = api.get("/v2/sandboxes", headers=dict(headers))
            answers.append((response, _e2b_error(response, 401)))
            labels.append(label)
        return _verdict(answers, held, labels=labels)
    return run


def _malformed_keys(plant: E2BPlant) -> list[tuple[str, Mapping[str, str]]]:
    own = plant.key("a")
    token = plant.sandbox("a")["envdAccessToken"]
    return [
        ("not hex", {"X-API-KEY": "e2b_nothex"}),
        ("one digit short", {"X-API-KEY": own[:-1]}),
        ("one digit long", {"X-API-KEY": own + "0"}),
        ("upper-case", {"X-API-KEY": own.upper()}),
        ("a Bearer prefix", {"X-API-KEY": f"Bearer {own}"}),
        ("in Authorization instead", {"Authorization": f"Bearer {own}"}),
        ("a sandbox's envd token as the key", {"X-API-KEY": str(token)}),
        ("4 KB of junk", {"X-API-KEY": "e2b_" + "f" * 4096}),
    ]


# -- another tenant's key on the first tenant's sandbox ----------------------------------------


def _trail(ctx: DrillContext, corral_id: str) -> list[dict[str, Any]] | None:
    """The first tenant's audit trail of its sandbox, read with its Corral key (None when the
    drill has no Corral key of that tenant)."""
    assert ctx.service is not None
    headers = ({"Authorization": f"Bearer {ctx.service.api_key}"}
               if ctx.service.api_key else {})
    with httpx.Client(base_url=ctx.service.url, headers=headers, timeout=TIMEOUT) as api:
        response = api.get(f"/v1/sandboxes/{corral_id}/audit")
    if response.status_code != 200:
        return None
    events = []
    for line in response.text.splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return events


_OTHER_OPS: dict[str, tuple[str, str, Any]] = {
    "get": ("GET", "/sandboxes/{id}", None),
    "connect": ("POST", "/v2/sandboxes/{id}/connect", {"timeout": 60}),
    "timeout": ("POST", "/sandboxes/{id}/timeout", {"timeout": 5}),
    "pause": ("POST", "/sandboxes/{id}/pause", {}),
    "snapshot": ("POST", "/sandboxes/{id}/snapshots", {"name": "drill-stolen"}),
    "fork": ("POST", "/sandboxes/{id}/fork", {"count": 1}),
    "network": ("PUT", "/sandboxes/{id}/network", {"allowOut": ["evil.drill.invalid"]}),
    "kill": ("DELETE", "/sandboxes/{id}", None),
}


def _other_tenant(op: str) -> Run:
    """Tenant B aims ``op`` at tenant A's sandbox: 404 (no such sandbox, as far as B can tell),
    nothing of A's in the answer, A's sandbox still running with its deadline unchanged, and
    nothing new in A's trail."""
    method, path, body = _OTHER_OPS[op]

    def run(ctx: DrillContext) -> Outcome:
        plant = _plant(ctx)
        a = plant.sandbox("a")
        e2b_id = str(a["sandboxID"])
        corral_id = _corral_id(e2b_id)
        with plant.client(plant.key("a")) as own:
            before = own.get(f"/sandboxes/{e2b_id}").json()
        trail_before = _trail(ctx, corral_id)
        with plant.client(plant.key("b")) as other:
            response = other.request(method, path.format(id=e2b_id),
                                     json=body if body is not None else None)
        with plant.client(plant.key("a")) as own:
            after = own.get(f"/sandboxes/{e2b_id}")
        trail_after = _trail(ctx, corral_id)
        state = _body(after) if after.status_code == 200 else None
        alive = isinstance(state, dict) and state.get("state") == "running"
        same_end = alive and isinstance(state, dict) and state.get("endAt") == before.get(
            "endAt")
        leaked = [name for name in ("envdAccessToken", "trafficAccessToken")
                  if str(a[name]) in response.text]
        evidence = [Evidence("response", f"as tenant B: {_shown(response)}"),
                    Evidence("response", f"as tenant A afterwards: GET /sandboxes/{e2b_id} -> "
                                         f"{after.status_code} state="
                                         f"{state.get('state') if state else None}")]
        new: list[str] = []
        if trail_before is not None and trail_after is not None:
            seen = {e.get("seq") for e in trail_before}
            new = [f"#{e.get('seq')} {e.get('type')}" for e in trail_after
                   if e.get("seq") not in seen]
            evidence.append(Evidence(
                "observation", f"tenant A's trail: {len(trail_before)} events before, "
                f"{len(trail_after)} after" + (f", new: {new[:4]}" if new else ""),
                sandbox=corral_id))
        problems = []
        if not _e2b_error(response, 404):
            problems.append(f"answered {response.status_code}, not 404")
        if leaked:
            problems.append(f"the answer carries A's {', '.join(leaked)}")
        if not alive:
            problems.append("A's sandbox is no longer running")
        elif not same_end:
            problems.append(f"A's deadline moved ({before.get('endAt')} -> "
                            f"{state.get('endAt') if state else None})")
        if new:
            problems.append(f"A's trail has new events {new[:4]}")
        if problems:
            return Outcome("breached" if response.status_code < 500 else "error",
                           f"tenant B's {op} of A's sandbox: " + "; ".join(problems),
                           tuple(evidence))
        return Outcome("held", "404 for tenant B; A's sandbox still running, its deadline "
                       "and trail untouched", tuple(evidence))
    return run


def _other_tenant_list(ctx: DrillContext) -> Outcome:
    plant = _plant(ctx)
    e2b_id = str(plant.sandbox("a")["sandboxID"])
    with plant.client(plant.key("b")) as other:
        listed = [other.get("/v2/sandboxes"), other.get("/sandboxes"),
                  other.get("/snapshots", params={"sandboxID": e2b_id})]
    answers = [(r, r.status_code in (200, 400, 404) and e2b_id not in r.text) for r in listed]
    return _verdict(answers, "tenant A's sandbox is in none of tenant B's listings")


# -- tokens on the sandbox plane -------------------------------------------------------------------


def _token_swap(victim: Which) -> Run:
    """A's tokens with the id of another sandbox (``a2``: the same tenant's; ``b``: another
    tenant's): every door of the sandbox plane answers 401."""
    def run(ctx: DrillContext) -> Outcome:
        plant = _plant(ctx)
        a, other = plant.sandbox("a"), plant.sandbox(victim)
        target, token = str(other["sandboxID"]), str(a["envdAccessToken"])
        # The door opens with the victim's own token, so a 401 below is the token's doing.
        control = _plane(plant, target, "GET", "/health", token=str(other["envdAccessToken"]))
        if control.status_code != 204:
            return Outcome("error", f"the sandbox's own token is refused too, so this case "
                           f"proves nothing: {_shown(control)}", (Evidence("response",
                                                                  _shown(control)),))
        answers = [
            _plane(plant, target, "GET", "/health", token=token),
            _plane(plant, target, "POST", "/process.Process/List", token=token, body={}),
            _plane(plant, target, "POST", "/filesystem.Filesystem/Stat", token=token,
                   body={"path": "/home/user"}),
            _plane(plant, target, "GET", "/files", token=token,
                   params={"path": "/home/user/.bashrc", "username": "user"}),
            _plane(plant, target, "GET", "/health", port=JUPYTER_PORT, headers={
                "E2B-Traffic-Access-Token": str(a["trafficAccessToken"])}),
            _plane(plant, target, "POST", "/execute", port=JUPYTER_PORT, token=token,
                   body={"code": "print(1)"}),
        ]
        whose = "the same tenant's" if victim == "a2" else "another tenant's"
        return _verdict([(r, _unauthenticated(r)) for r in answers],
                        f"every request with A's token and {whose} sandbox id was refused "
                        f"401 (the victim's own token opens /health: 204)",
                        (Evidence("response", f"control, the victim's own token: "
                                              f"{_shown(control)}"),))
    return run


def _no_token(ctx: DrillContext) -> Outcome:
    plant = _plant(ctx)
    e2b_id = str(plant.sandbox("a")["sandboxID"])
    answers = [
        _plane(plant, e2b_id, "POST", "/process.Process/List", body={}),
        _plane(plant, e2b_id, "POST", "/process.Process/Start", body={
            "process": {"cmd": "/bin/bash", "args": ["-l", "-c", "id"]}}),
        _plane(plant, e2b_id, "POST", "/filesystem.Filesystem/Stat",
               body={"path": "/home/user"}),
        _plane(plant, e2b_id, "GET", "/health"),
        _plane(plant, e2b_id, "POST", "/execute", port=JUPYTER_PORT, body={"code": "1"}),
        _plane(plant, e2b_id, "GET", "/health", port=JUPYTER_PORT),
    ]
    return _verdict([(r, _unauthenticated(r)) for r in answers],
                    "every tokenless request was refused 401 before any handler")


def _token_routing(ctx: DrillContext) -> Outcome:
    """Routing by token alone (URL mode, SDKs 2.7–2.20 after connect: no E2b-Sandbox-Id) and a
    sandbox's headers on the control plane: a token names only its own live sandbox, and never
    stands in for an API key."""
    plant = _plant(ctx)
    a = plant.sandbox("a")
    e2b_id, token = str(a["sandboxID"]), str(a["envdAccessToken"])
    created = plant.create(plant.key("a"))
    if created.status_code != 201:
        return Outcome("error", f"could not create the sandbox to kill: {_shown(created)}")
    dead = str(created.json()["envdAccessToken"])
    plant.kill(plant.key("a"), str(created.json()["sandboxID"]))
    rpc = {"Connect-Protocol-Version": "1"}
    with plant.client(None) as api:
        own = api.post("/process.Process/List", json={}, headers={**rpc, "X-Access-Token": token})
        if own.status_code != 200:
            return Outcome("error", f"A's own token alone does not route to A, so this case "
                           f"proves nothing: {_shown(own)}", (Evidence("response", _shown(own)),))
        answers = [
            (api.post("/process.Process/List", json={}, headers={
                **rpc, "X-Access-Token": _secrets.token_hex(24)}), "a guessed token"),
            (api.post("/process.Process/List", json={}, headers={
                **rpc, "X-Access-Token": dead}), "a killed sandbox's token"),
            (api.get("/health", headers={"X-Access-Token": token[:-1] + (
                "0" if token[-1] != "0" else "1")}), "A's token with its last digit changed"),
        ]
        sandbox_headers = {"E2b-Sandbox-Id": e2b_id, "X-Access-Token": token}
        no_key = api.get(f"/sandboxes/{e2b_id}", headers=sandbox_headers)
        with plant.client(plant.key("b")) as other:
            other_key = other.get(f"/sandboxes/{e2b_id}", headers=sandbox_headers)
    checked = [(r, _unauthenticated(r)) for r, _ in answers] + [
        (no_key, _e2b_error(no_key, 401)), (other_key, _e2b_error(other_key, 404))]
    return _verdict(checked, "no token but A's own routes anywhere; A's id and token on the "
                    "control plane open nothing without A's key",
                    (Evidence("response", f"control, A's own token alone: {_shown(own)}"),),
                    labels=[label for _, label in answers] + [
                        "A's id and token, no key, control plane",
                        "A's id and token, B's key, control plane"])


# -- signed /files URLs ------------------------------------------------------------------------


def _signature(path: str, operation: str, user: str, token: str, expiration: int) -> str:
    """E2B's URL signature (E2B-COMPAT §3; ``e2b/sandbox/signature.py``)."""
    raw = f"{path}:{operation}:{user}:{token}:{expiration}"
    digest = base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode()
    return "v1_" + digest.rstrip("=")


_SIGNED_PATH = "/home/user/.corral-drill-signed"


def _signed_get(plant: E2BPlant, signature: str, expiration: int,
                e2b_id: str | None) -> httpx.Response:
    """A tokenless, signed GET /files: routed by the header, or (URL mode as the SDKs send a
    signed URL, E2B-COMPAT P3) by nothing but the signature."""
    params = {"path": _SIGNED_PATH, "username": "user", "signature": signature,
              "signature_expiration": str(expiration)}
    if e2b_id is not None:
        return _plane(plant, e2b_id, "GET", "/files", params=params)
    with plant.client(None) as api:
        return api.get("/files", params=params)


def _signed(kind: Literal["forged", "expired", "other-sandbox", "unsigned"]) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        plant = _plant(ctx)
        a = plant.sandbox("a")
        e2b_id, token = str(a["sandboxID"]), str(a["envdAccessToken"])
        now = int(time.time())
        good = _signature(_SIGNED_PATH, "read", "user", token, now + 600)
        if kind == "unsigned":
            answers = [_plane(plant, e2b_id, "GET", "/files",
                              params={"path": _SIGNED_PATH, "username": "user"})]
        elif kind == "forged":
            forged = _signature(_SIGNED_PATH, "read", "user", _secrets.token_hex(24), now + 600)
            answers = [_signed_get(plant, forged, now + 600, e2b_id),
                       _signed_get(plant, forged, now + 600, None)]
        elif kind == "expired":
            expired = _signature(_SIGNED_PATH, "read", "user", token, now - 60)
            answers = [_signed_get(plant, expired, now - 60, e2b_id),
                       _signed_get(plant, expired, now - 60, None)]
        else:  # A's valid signature, presented for the same tenant's other sandbox
            answers = [_signed_get(plant, good, now + 600, str(plant.sandbox("a2")["sandboxID"]))]
        # Where /files is served, A's valid signature opens it: the refusals above are the
        # signature's doing, not a formula the server does not know.
        control = _signed_get(plant, good, now + 600, e2b_id)
        evidence = [Evidence("response", f"control, A's valid signature: {_shown(control)}")]
        served = not _not_served(control)
        if served and control.status_code == 401:
            return Outcome("error", f"a valid signature is refused too, so this case proves "
                           f"nothing: {_shown(control)}", tuple(evidence))
        checked = [(r, _unauthenticated(r) or (not served and _not_served(r)))
                   for r in answers]
        held = ("refused 401" if served else
                "refused (this target does not serve /files yet: 401 at the gate, 404 past it)")
        what = {"unsigned": "neither token nor signature", "forged": "a forged signature",
                "expired": "an expired signature",
                "other-sandbox": "A's signature for another sandbox"}[kind]
        return _verdict(checked, f"{what}: {held}", evidence)
    return run


# -- gone sandboxes ---------------------------------------------------------------------------


def _gone(ctx: DrillContext) -> Outcome:
    """A killed sandbox, one that never existed and a malformed id: E2B's 502 not-found answer,
    at once (not a 500, not a hang); the control plane says 404."""
    plant = _plant(ctx)
    key = plant.key("a")
    created = plant.create(key)
    if created.status_code != 201:
        return Outcome("error", f"could not create the sandbox to kill: {_shown(created)}")
    e2b_id, token = str(created.json()["sandboxID"]), str(created.json()["envdAccessToken"])
    killed = plant.kill(key, e2b_id)
    if killed != 204:
        return Outcome("error", f"DELETE /sandboxes/{e2b_id} -> {killed}, not 204")
    never = "sbx-" + _secrets.token_hex(6)
    answers = []
    started = time.monotonic()
    for sid, path, body in ((e2b_id, "/health", None), (e2b_id, "/process.Process/List", {}),
                            (e2b_id, "/filesystem.Filesystem/Stat", {"path": "/home/user"}),
                            (never, "/health", None), ("..%2F..%2Fetc", "/health", None)):
        try:
            response = _plane(plant, sid, "GET" if body is None else "POST", path,
                              token=token, body=body)
        except httpx.TimeoutException:
            return Outcome("breached", f"{path} for {sid} hung (no answer in {TIMEOUT} s)")
        shape = _body(response)
        answers.append((response, response.status_code == 502 and shape == {
            "sandboxId": sid, "message": _GONE_MESSAGE, "code": 502}))
    with plant.client(key) as api:
        info = api.get(f"/sandboxes/{e2b_id}")
    answers.append((info, _e2b_error(info, 404)))
    took = time.monotonic() - started
    return _verdict(answers, f"502 {{sandboxId, message, code}} for the killed, the unknown "
                    f"and the malformed id, 404 on the control plane, in {took:.2f} s",
                    (Evidence("observation", f"killed {e2b_id} (204) before asking"),))


# -- ceilings through E2B's create body ------------------------------------------------------------


def _beyond_ceiling(body: Mapping[str, Any], what: str) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        plant = _plant(ctx)
        response = plant.create(plant.key("ceiling"), body)
        shown = f"create with {what}: {_shown(response)}"
        evidence = (Evidence("response", shown),)
        if response.status_code == 201:
            plant.kill(plant.key("ceiling"), str(response.json()["sandboxID"]))
            return Outcome("breached", shown, evidence)
        if _e2b_error(response, 403) and "ceiling" in response.text.lower():
            return Outcome("held", shown, evidence)
        return Outcome("error", f"refused, but not by the ceiling in E2B's shape: {shown}",
                       evidence)
    return run


# -- allow_internet_access ----------------------------------------------------------------------

# Whether the sandbox has a way out: a route (found with a UDP connect, which sends nothing) to a
# documentation address, and a request for an unlisted name through the proxy it was given.
_NET_PROBE = """
import os, socket, urllib.error, urllib.request
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(("198.51.100.7", 80))
    print("route via", s.getsockname()[0])
except OSError as e:
    print("no route", e.errno)
proxy = os.environ.get("HTTP_PROXY")
print("proxy", bool(proxy))
if proxy:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy}))
    try:
        with opener.open("http://internet.drill.invalid/", timeout=5) as r:
            print("status", r.status)
    except urllib.error.HTTPError as e:
        print("status", e.code)
    except Exception as e:
        print("error", type(e).__name__)
"""


def _internet(tenant: Literal["a", "ceiling"]) -> Run:
    """E2B's ``allow_internet_access: true`` for a tenant: Corral never hands out raw internet;
    the sandbox gets at most the hosts its tenant's ceiling lists (none for the first tenant,
    the drill's one bait host for the ceiling tenant)."""
    def run(ctx: DrillContext) -> Outcome:
        assert ctx.service is not None
        plant = _plant(ctx)
        native_key = ctx.service.api_key if tenant == "a" else ctx.service.ceiling_api_key
        expected = set() if tenant == "a" else set(drill_ceiling().hosts or ())
        created = plant.create(plant.key(tenant), {"allow_internet_access": True})
        if created.status_code != 201:
            return Outcome("error", f"could not create the sandbox: {_shown(created)}")
        e2b_id = str(created.json()["sandboxID"])
        corral_id = _corral_id(e2b_id)
        headers = {"Authorization": f"Bearer {native_key}"} if native_key else {}
        with httpx.Client(base_url=ctx.service.url, headers=headers, timeout=60) as api:
            info = api.get(f"/v1/sandboxes/{corral_id}")
            if info.status_code != 200:
                return Outcome("error", f"the native API does not show {corral_id} to the "
                               f"same tenant's Corral key (are the keys one tenant's?): "
                               f"{info.status_code} {info.text[:120]}")
            network = info.json().get("network") or {}
            ran = api.post(f"/v1/sandboxes/{corral_id}/commands", json={
                "cmd": ["python3", "-c", _NET_PROBE], "timeout": 30})
            result = ran.json() if ran.status_code == 200 else {}
            out = str(result.get("stdout", ""))
            trail, decisions = _audit(api, corral_id, str(result.get("command_id") or ""))
        allow = set(network.get("allow") or [])
        evidence = [
            Evidence("response", f"E2B create with allow_internet_access: true -> "
                                 f"{created.status_code} {e2b_id}"),
            Evidence("response", f"native GET /v1/sandboxes/{corral_id}: network "
                                 f"{json.dumps(network)[:120]}"),
            Evidence("observation", f"in the sandbox: {' | '.join(out.split(chr(10)))[:160]}",
                     sandbox=corral_id),
            *trail]
        if ran.status_code != 200:
            return Outcome("error", f"the probe did not run: {ran.status_code} {ran.text[:120]}",
                           tuple(evidence))
        problems = []
        if allow - expected:
            problems.append(f"the sandbox may reach {sorted(allow - expected)}, beyond the "
                            f"tenant's ceiling {sorted(expected) or 'of no hosts'}")
        if "route via" in out:
            problems.append("it has a route to the internet")
        status = next((line.split()[1] for line in out.splitlines()
                       if line.startswith("status")), None)
        if status is not None and status != "403":
            problems.append(f"an unlisted host answered {status} through the gateway")
        if any(verdict != "denied" for verdict in decisions):
            problems.append(f"the gateway decided {sorted(set(decisions))}, not only denied")
        if "proxy True" in out and "denied" not in decisions:
            problems.append("the gateway recorded no denial for the unlisted host")
        if "no route" not in out:
            return Outcome("error", f"the probe printed nothing usable: {out[:160]!r}",
                           tuple(evidence))
        if problems:
            return Outcome("breached", "; ".join(problems), tuple(evidence))
        how = ("no allow rule, no proxy, no route" if not allow and "proxy False" in out else
               f"only {sorted(allow)}; the gateway denied internet.drill.invalid; no route")
        return Outcome("held", f"asked for internet, got {how}", tuple(evidence))
    return run


def _audit(api: httpx.Client, sandbox: str, command: str) -> tuple[list[Evidence], list[str]]:
    """The sandbox's creation (its network policy) and the command's gateway decisions, from
    its trail on the service (cited as observations: the trail is the service's), and the
    decisions' verdicts."""
    found, verdicts = [], []
    for line in api.get(f"/v1/sandboxes/{sandbox}/audit").text.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            kind, data = event.get("type"), event.get("data") or {}
            if kind == "sandbox.created":
                found.append(Evidence("observation", f"audit #{event.get('seq')} {kind}: "
                                      f"network {json.dumps(data.get('network'))[:100]}",
                                      sandbox=sandbox))
            elif kind == "egress.decision" and (not command or event.get("command") == command
                                                or data.get("command") == command):
                verdicts.append(str(data.get("verdict")))
                found.append(Evidence("observation", f"audit #{event.get('seq')} {kind} "
                                      f"{data.get('verdict')} {data.get('host')}:"
                                      f"{data.get('port')} rule={data.get('rule')}",
                                      sandbox=sandbox))
            elif kind == "command.finished" and event.get("command") == command:
                found.append(Evidence("observation", f"audit #{event.get('seq')} {kind}: exit "
                                      f"{data.get('exit_code')}", sandbox=sandbox))
    return found, verdicts


# -- bounded bodies, foreign hosts ---------------------------------------------------------------


def _oversized(where: Literal["control", "rpc", "files"]) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        plant = _plant(ctx)
        headers: dict[str, str] = {}
        path = "/v2/sandboxes"
        ok: tuple[int, ...] = (401, 413)
        if where != "control":
            headers = {"E2b-Sandbox-Id": str(plant.sandbox("a")["sandboxID"]),
                       "E2b-Sandbox-Port": str(ENVD_PORT)}
            path = "/filesystem.Filesystem/Stat"
        if where == "files":
            # The one tokenless door (its body limit is the workspace's size), with a forged
            # signature; 404 where /files is not served yet, answered before the body too.
            forged = _signature(_SIGNED_PATH, "write", "user", _secrets.token_hex(24),
                                int(time.time()) + 600)
            path = (f"/files?path=/home/user/.corral-drill-big&username=user&signature={forged}"
                    f"&signature_expiration={int(time.time()) + 600}")
            ok = (401, 404, 413)
        status, sent, line = send_oversized(plant.url, "POST", path, headers)
        shown = (f"POST {path.split('?')[0]} claiming {_CLAIMED} bytes, no token -> "
                 f"{line or 'no answer'} after {sent} bytes of body sent")
        evidence = (Evidence("response", shown),)
        if status is None:
            return Outcome("breached", f"no answer after {sent} bytes: the server was still "
                           "reading a body it had not authorised", evidence)
        return Outcome("held" if status in ok else "breached", shown, evidence)
    return run


def _foreign_host(ctx: DrillContext) -> Outcome:
    plant = _plant(ctx)
    a = plant.sandbox("a")
    with plant.client(plant.key("a")) as api:
        control = api.get("/v2/sandboxes", headers={"Host": "evil.test"})
    envd = _plane(plant, str(a["sandboxID"]), "GET", "/health",
                  token=str(a["envdAccessToken"]), headers={"Host": "evil.test"})
    return _verdict([(control, _e2b_error(control, 421)), (envd, _e2b_error(envd, 421))],
                    "421 for Host: evil.test on both planes (DNS rebinding)")


# -- domain mode: routed by Host ----------------------------------------------------------------


def _by_host(plant: E2BPlant, host: str, method: str, path: str, *,
             headers: Mapping[str, str] | None = None, body: Any = None) -> httpx.Response:
    """One request to the domain-mode listener naming ``host`` (as `<port>-<id>.<domain>`
    would arrive through DNS and TLS; the routing is by the header alone)."""
    access = plant.access
    with httpx.Client(base_url=access.e2b_domain_url or plant.url, timeout=TIMEOUT) as api:
        return api.request(method, path, headers={"Host": host, **(headers or {})},
                           json=body if body is not None else None)


def _domain(ctx: DrillContext) -> str:
    domain = _plant(ctx).access.e2b_domain
    if domain is None:
        raise RuntimeError("this target's E2B surface has no domain")
    return domain


def _domain_mismatch(ctx: DrillContext) -> Outcome:
    """``Host`` names one sandbox (or port), the ``E2b-Sandbox-*`` headers another: refused
    400, rather than routed by either."""
    plant, domain = _plant(ctx), _domain(ctx)
    a, a2 = plant.sandbox("a"), plant.sandbox("a2")
    token = str(a["envdAccessToken"])
    host = f"{ENVD_PORT}-{a['sandboxID']}.{domain}"
    # The Host alone routes A's token to A: the listener is in domain mode.
    control = _by_host(plant, host, "GET", "/health", headers={"X-Access-Token": token})
    if control.status_code != 204:
        return Outcome("error", f"the domain-mode listener does not route {host} with A's own "
                       f"token, so this case proves nothing: {_shown(control)}",
                       (Evidence("response", _shown(control)),))
    answers = [
        _by_host(plant, host, "GET", "/health", headers={
            "X-Access-Token": token, "E2b-Sandbox-Id": str(a2["sandboxID"])}),
        _by_host(plant, host, "POST", "/process.Process/List", body={}, headers={
            "X-Access-Token": token, "E2b-Sandbox-Id": str(a2["sandboxID"]),
            "Connect-Protocol-Version": "1"}),
        _by_host(plant, host, "GET", "/health", headers={
            "X-Access-Token": token, "E2b-Sandbox-Id": str(a["sandboxID"]),
            "E2b-Sandbox-Port": str(JUPYTER_PORT)}),
    ]
    return _verdict([(r, r.status_code == 400) for r in answers],
                    "400 when Host and E2b-Sandbox-Id/-Port disagree",
                    (Evidence("response", f"control, Host {host} and A's token: "
                                          f"{_shown(control)}"),),
                    labels=["A's host, A2's id", "A's host, A2's id (RPC)",
                            "A's host, port 49999 header"])


def _domain_token_swap(ctx: DrillContext) -> Outcome:
    plant, domain = _plant(ctx), _domain(ctx)
    a = plant.sandbox("a")
    token = str(a["envdAccessToken"])
    answers, labels = [], []
    for victim in ("a2", "b") if ctx.service and ctx.service.e2b_other_api_key else ("a2",):
        host = f"{ENVD_PORT}-{plant.sandbox(victim)['sandboxID']}.{domain}"
        for method, path, body in (("GET", "/health", None),
                                   ("POST", "/filesystem.Filesystem/Stat", {"path": "/"})):
            answers.append(_by_host(plant, host, method, path, body=body, headers={
                "X-Access-Token": token, "Connect-Protocol-Version": "1"}))
            labels.append(f"Host of {victim}")
    return _verdict([(r, _unauthenticated(r)) for r in answers],
                    "A's token on another sandbox's host name: 401", labels=labels)


def _domain_hosts(ctx: DrillContext) -> Outcome:
    plant, domain = _plant(ctx), _domain(ctx)
    a = plant.sandbox("a")
    token = {"X-Access-Token": str(a["envdAccessToken"])}
    wrong = [f"{ENVD_PORT}-{a['sandboxID']}.evil.test",
             f"{ENVD_PORT}-{a['sandboxID']}.{domain}.evil.test",
             f"{ENVD_PORT}-{a['sandboxID']}.x{domain}", "evil.test"]
    answers = [(_by_host(plant, host, "GET", "/health", headers=token), True) for host in wrong]
    answers = [(r, _e2b_error(r, 421)) for r, _ in answers]
    never = f"sbx-{_secrets.token_hex(6)}"
    gone = _by_host(plant, f"{ENVD_PORT}-{never}.{domain}", "GET", "/health", headers=token)
    answers.append((gone, gone.status_code == 502 and _body(gone) == {
        "sandboxId": never, "message": _GONE_MESSAGE, "code": 502}))
    return _verdict(answers, "421 for host names outside the domain; 502 not-found for an "
                    "unknown sandbox's", labels=[*wrong, "an unknown sandbox's host"])


CASES = [
    # Keys on the control plane.
    Case("e2b.wrong-key", "e2b", "call the E2B API with a well-formed key nobody issued",
         "401 {code, message}", _key_case(lambda p: [("forged", {
             "X-API-KEY": "e2b_" + _secrets.token_hex(24)})], "a forged key is refused 401"),
         E2B),
    Case("e2b.no-key", "e2b", "call the E2B API with no X-API-KEY", "401 {code, message}",
         _key_case(lambda p: [("none", {})], "no key is refused 401"), E2B),
    Case("e2b.malformed-key", "e2b", "keys that are almost right: not hex, one digit short or "
         "long, upper-case, a Bearer prefix, in Authorization, a sandbox's envd token, 4 KB",
         "every one 401 {code, message}",
         _key_case(_malformed_keys, "every malformed key is refused 401"), E2B),
    # Another tenant's key on A's sandbox (kill last: were it to work, A would be gone).
    Case("e2b.other-tenant-list", "e2b", "list sandboxes (v1, v2) and A's snapshots with "
         "tenant B's key", "A's sandbox is in none of them", _other_tenant_list, OTHER),
    *(Case(f"e2b.other-tenant-{op}", "e2b", f"{op} tenant A's sandbox with tenant B's key",
           "404, and A's sandbox still running, deadline and trail untouched",
           _other_tenant(op), OTHER) for op in _OTHER_OPS),
    # Tokens on the sandbox plane.
    Case("e2b.token-same-tenant", "e2b", "A's envd and traffic tokens with the id of another "
         "sandbox of the same tenant: /health, process.Process/List, filesystem.Filesystem/"
         "Stat, /files, the code interpreter", "401 on every one", _token_swap("a2"), E2B),
    Case("e2b.token-other-tenant", "e2b", "A's tokens with the id of another tenant's sandbox",
         "401 on every one", _token_swap("b"), OTHER),
    Case("e2b.no-token", "e2b", "RPCs, /health and /execute with no token",
         "401 on every one (Connect's unauthenticated on RPC paths)", _no_token, E2B),
    Case("e2b.token-only-routing", "e2b", "envd calls with a token and no sandbox id (a guessed "
         "token, a killed sandbox's, A's off by one digit); A's id and token on the control "
         "plane in place of a key", "401 (404 with another tenant's key)", _token_routing,
         OTHER),
    Case("e2b.files-unsigned", "e2b", "GET /files with neither token nor signature", "401",
         _signed("unsigned"), E2B),
    Case("e2b.files-forged-signature", "e2b", "GET /files with a signature made from a guessed "
         "token (routed by header, and by signature alone)", "401", _signed("forged"), E2B),
    Case("e2b.files-expired-signature", "e2b", "GET /files with A's real signature, expired a "
         "minute ago", "401", _signed("expired"), E2B),
    Case("e2b.files-other-sandbox-signature", "e2b", "A's valid signature for the same tenant's "
         "other sandbox", "401", _signed("other-sandbox"), E2B),
    Case("e2b.gone-sandbox", "e2b", "RPCs to a killed sandbox (with its old token), an unknown "
         "id and a malformed one", "502 {sandboxId, message, code} at once; 404 on the "
         "control plane", _gone, E2B),
    # Ceilings and internet.
    Case("e2b.ceiling-template", "e2b", "E2B create of code-interpreter-v1 by a tenant whose "
         "ceiling allows only base", "403 {code, message} naming the ceiling",
         _beyond_ceiling({"templateID": "code-interpreter-v1"}, "templateID "
                         "code-interpreter-v1"), CEILING),
    Case("e2b.ceiling-lifetime", "e2b", "E2B create with a 2 h timeout beyond the ceiling's "
         "hour", "403 naming the ceiling", _beyond_ceiling({"timeout": 7200}, "timeout 7200"),
         CEILING),
    Case("e2b.ceiling-allow-out", "e2b", "E2B create with network.allowOut beyond the "
         "ceiling's hosts (a host, a wildcard)", "403 naming the ceiling",
         _beyond_ceiling({"network": {"allowOut": ["evil.drill.invalid", "*.drill.invalid"]}},
                         "network.allowOut evil.drill.invalid, *.drill.invalid"), CEILING),
    Case("e2b.internet-no-hosts", "e2b", "allow_internet_access: true for a tenant whose "
         "ceiling lists no hosts; probe from inside through the native API",
         "no allow rule, no proxy, no route", _internet("a"),
         frozenset({"e2b", "service", "python3"})),
    Case("e2b.internet-ceiling", "e2b", "allow_internet_access: true for the ceiling tenant; "
         "an unlisted host through the gateway", "only the ceiling's hosts; the gateway "
         "denies the rest (its audit decision)", _internet("ceiling"),
         frozenset({"e2b", "e2b-ceiling", "service", "python3"})),
    # Bounded before trusted, and the browser.
    Case("e2b.body-control", "e2b", "POST /v2/sandboxes claiming 1 GiB without a key (at "
         "most 4 MiB sent)", "401 or 413 before the body", _oversized("control"), E2B),
    Case("e2b.body-rpc", "e2b", "a Connect RPC claiming 1 GiB without a token",
         "401 or 413 before the body", _oversized("rpc"), E2B),
    Case("e2b.body-files", "e2b", "POST /files (the upload door, no token, forged signature) "
         "claiming 1 GiB", "401 or 413 before the body", _oversized("files"), E2B),
    Case("e2b.host-rebinding", "e2b", "the E2B API and a sandbox's envd with Host: evil.test",
         "421 on both", _foreign_host, E2B),
    # Domain mode.
    Case("e2b.domain-host-header-mismatch", "e2b", "Host naming sandbox A, E2b-Sandbox-Id "
         "(or -Port) naming another", "400, routed by neither", _domain_mismatch, DOMAIN),
    Case("e2b.domain-token-swap", "e2b", "A's token on another sandbox's host name "
         "(49983-<id>.<domain>)", "401", _domain_token_swap, DOMAIN),
    Case("e2b.domain-foreign-hosts", "e2b", "host names that end like the domain but are not "
         "in it, and an unknown sandbox's host", "421; 502 not-found", _domain_hosts, DOMAIN),
]
