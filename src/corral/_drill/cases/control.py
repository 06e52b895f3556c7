"""Control plane: the HTTP API as an attacker holding one tenant's key (or none) sees it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import httpx

from ..case import Case
from ..context import DrillContext
from ..model import Evidence, Outcome

Run = Callable[[DrillContext], Outcome]
SERVICE = frozenset({"service"})
OTHER = frozenset({"service", "other-tenant"})


def _client(ctx: DrillContext, key: str | None) -> httpx.Client:
    assert ctx.service is not None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=ctx.service.url, headers=headers, timeout=30)


def _status_case(method: str, path: str, *, key: str, ok: tuple[int, ...],
                 body: Any = None, content: bytes | None = None,
                 headers: dict[str, str] | None = None) -> Run:
    """Held when the answer's status is one of ``ok`` (never 2xx, never 5xx)."""
    def run(ctx: DrillContext) -> Outcome:
        assert ctx.service is not None
        use = {"own": ctx.service.api_key, "other": ctx.service.other_api_key,
               "none": None}.get(key, key)
        url = path.format(sbx=ctx.service_sandbox or "sbx_000000000000")
        with _client(ctx, use) as client:
            response = client.request(method, url, json=body, content=content,
                                      headers=headers)
        shown = f"{method} {url.split('?')[0]} -> {response.status_code} {response.text[:120]}"
        evidence = (Evidence("response", shown),)
        if response.status_code in ok:
            return Outcome("held", shown, evidence)
        return Outcome("breached" if response.status_code < 500 else "error", shown, evidence)
    return run


def _cross_tenant_run(ctx: DrillContext) -> Outcome:
    """Tenant B runs a command in tenant A's sandbox: refused, and A's trail shows nothing."""
    assert ctx.service is not None and ctx.service_sandbox is not None
    path = f"/v1/sandboxes/{ctx.service_sandbox}"
    with _client(ctx, ctx.service.api_key) as own:
        before = own.get(f"{path}/audit").text.count('"command.started"')
    with _client(ctx, ctx.service.other_api_key) as other:
        response = other.post(f"{path}/commands", json={"cmd": "cat /workspace/*"})
    with _client(ctx, ctx.service.api_key) as own:
        after = own.get(f"{path}/audit").text.count('"command.started"')
    evidence = (Evidence("response", f"POST {path}/commands as tenant B -> "
                                     f"{response.status_code}"),
                Evidence("observation", f"tenant A's trail: {before} command(s) before, "
                                        f"{after} after",
                         sandbox=ctx.service_sandbox))
    if response.status_code != 404 or after != before:
        return Outcome("breached", f"tenant B reached tenant A's sandbox "
                       f"({response.status_code})", evidence)
    return Outcome("held", "404, and nothing ran in tenant A's sandbox", evidence)


def _cross_tenant_list(ctx: DrillContext) -> Outcome:
    assert ctx.service is not None and ctx.service_sandbox is not None
    with _client(ctx, ctx.service.other_api_key) as other:
        response = other.get("/v1/sandboxes")
        snapshots = other.get("/v1/snapshots")
    seen = ctx.service_sandbox in response.text or ctx.service_sandbox in snapshots.text
    evidence = (Evidence("response", f"GET /v1/sandboxes as tenant B -> {response.status_code}, "
                                     f"{len(response.json()) if response.is_success else '?'} "
                                     "sandboxes"),)
    if seen:
        return Outcome("breached", "tenant B's listing shows tenant A's sandbox", evidence)
    return Outcome("held", "tenant A's sandbox is not in tenant B's listings", evidence)


# A call about a tenant's own sandbox held up longer than this is a call held by a stuck state.
_PROMPT_S = 30.0


class _Refused(Exception):
    """A step of a case answered what the case cannot accept."""


def _step(evidence: list[Evidence], what: str, call: Callable[[], httpx.Response],
          ok: tuple[int, ...]) -> httpx.Response:
    """One call, answered within ``_PROMPT_S`` with one of ``ok``, else ``_Refused``."""
    started = time.monotonic()
    try:
        response = call()
    except httpx.TimeoutException:
        raise _Refused(f"{what}: no answer in {_PROMPT_S:.0f} s") from None
    shown = (f"{what} -> {response.status_code} in {time.monotonic() - started:.1f} s"
             f"{'' if response.status_code in ok else ' ' + response.text[:120]}")
    evidence.append(Evidence("response", shown))
    if response.status_code not in ok:
        raise _Refused(shown)
    return response


def _paused_with_helpers(api: httpx.Client, evidence: list[Evidence]) -> str:
    """A sandbox of the drill's tier with its resident helper and a background process up,
    then paused (its processes frozen)."""
    made = _step(evidence, "create", lambda: api.post("/v1/sandboxes", json={"timeout": 300}),
                 (201,))
    sandbox = str(made.json()["id"])
    for _ in range(2):  # the second command starts the tier's resident helper
        _step(evidence, "run true", lambda: api.post(f"/v1/sandboxes/{sandbox}/commands",
                                                     json={"cmd": "true"}), (200,))
    _step(evidence, "start sleep 600 in the background", lambda: api.post(
        f"/v1/sandboxes/{sandbox}/processes", json={"cmd": "sleep 600"}), (201,))
    _step(evidence, "pause", lambda: api.post(f"/v1/sandboxes/{sandbox}/pause"), (200,))
    return sandbox


def _paused_past_lifetime(ctx: DrillContext) -> Outcome:
    """Paused sandboxes, one destroyed and one left to reach its lifetime: every call about
    them and about the tenant's other sandboxes answers promptly, none with a 5xx (a stuck
    destroy once held such calls for minutes, or answered 500)."""
    assert ctx.service is not None
    evidence: list[Evidence] = []
    made: list[str] = []
    with _client(ctx, ctx.service.api_key) as api:
        api.timeout = httpx.Timeout(_PROMPT_S)
        try:
            made += [_paused_with_helpers(api, evidence) for _ in range(2)]
            expiring, deleted = made
            _step(evidence, "DELETE the paused one", lambda: api.delete(
                f"/v1/sandboxes/{deleted}"), (202, 204))
            _step(evidence, "set the other's lifetime to 1 s", lambda: api.post(
                f"/v1/sandboxes/{expiring}/timeout", json={"timeout": 1}), (200,))
            deadline = time.monotonic() + 4 * _PROMPT_S
            while _step([], "GET it until it has expired", lambda: api.get(
                    f"/v1/sandboxes/{expiring}"), (200, 404)).status_code == 200:
                if time.monotonic() > deadline:
                    raise _Refused("the paused sandbox outlived its lifetime")
                time.sleep(0.5)
            evidence.append(Evidence("observation", "gone once past its lifetime, paused"))
            _step(evidence, "set its lifetime again", lambda: api.post(
                f"/v1/sandboxes/{expiring}/timeout", json={"timeout": 60}), (404,))
            fresh = str(_step(evidence, "create another", lambda: api.post(
                "/v1/sandboxes", json={}), (201,)).json()["id"])
            made.append(fresh)
            _step(evidence, "run in it", lambda: api.post(
                f"/v1/sandboxes/{fresh}/commands", json={"cmd": "true"}), (200,))
            _step(evidence, "DELETE it", lambda: api.delete(f"/v1/sandboxes/{fresh}"),
                  (202, 204))
        except _Refused as refused:
            return Outcome("breached", str(refused), tuple(evidence))
        finally:
            for sandbox in made:
                with contextlib.suppress(httpx.HTTPError):
                    api.delete(f"/v1/sandboxes/{sandbox}")
    return Outcome("held", "every call answered at once; the paused sandbox expired and was "
                   "destroyed", tuple(evidence))


def _wake(ctx: DrillContext) -> Outcome:
    """Tenant A's sandbox sleeps (paused, resumed by calls): tenant B's call must neither
    reach nor wake it, and when A's own call wakes it, it is the same sandbox: the same uid,
    network policy and files (issue 40)."""
    assert ctx.service is not None
    with _client(ctx, ctx.service.api_key) as own, \
            _client(ctx, ctx.service.other_api_key) as other:
        made = own.post("/v1/sandboxes", json={
            "timeout": 120, "lifecycle": {"on_timeout": "pause", "auto_resume": True}})
        if made.status_code != 201:
            return Outcome("error", f"create -> {made.status_code} {made.text[:200]}")
        path = f"/v1/sandboxes/{made.json()['id']}"
        try:
            before = own.post(f"{path}/commands", json={
                "cmd": "echo kept > /workspace/w.txt; id -u"}).json()["stdout"].strip()
            policy = own.get(path).json()["network"]
            own.post(f"{path}/pause").raise_for_status()
            refused = other.post(f"{path}/commands", json={"cmd": "true"})
            asleep = own.get(path).json()["state"]
            woken = own.post(f"{path}/commands", json={"cmd": "cat /workspace/w.txt; id -u"})
            after = woken.json().get("stdout", "").split() if woken.is_success else []
            state = own.get(path).json()
        finally:
            own.delete(path)
    evidence = (Evidence("response", f"tenant B's command -> {refused.status_code}; state "
                                     f"after it: {asleep}"),
                Evidence("observation", f"uid {before} before the sleep; after the wake: "
                                        f"{after}, state {state.get('state')}"))
    if refused.status_code != 404 or asleep != "paused":
        return Outcome("breached", "another tenant's call reached or woke the sleeping "
                       "sandbox", evidence)
    if after != ["kept", before] or state.get("network") != policy:
        return Outcome("breached", "the woken sandbox is not the one that slept (files, uid "
                       "or network policy differ)", evidence)
    return Outcome("held", "tenant B got 404 and did not wake it; tenant A's call woke the "
                   "same sandbox (files, uid, network policy)", evidence)


_FAKE_KEY = "ck_drill0000000000.0000000000000000000000000000000000000000000000000000"

CASES = [
    Case("ctl.missing-key", "control", "call the API with no key", "401",
         _status_case("GET", "/v1/sandboxes", key="none", ok=(401,)), SERVICE),
    Case("ctl.forged-key", "control", "call the API with a well-formed but forged key", "401",
         _status_case("GET", "/v1/sandboxes", key=_FAKE_KEY, ok=(401,)), SERVICE),
    Case("ctl.malformed-auth", "control", "send a malformed Authorization header (Basic, "
         "empty, 8 KB of junk)", "401 or 400",
         _status_case("GET", "/v1/sandboxes", key="none", ok=(400, 401, 431),
                      headers={"Authorization": "Basic " + "A" * 8000}), SERVICE),
    Case("ctl.other-tenant-get", "control", "read another tenant's sandbox by its id",
         "404 (it does not exist, as far as this tenant can tell)",
         _status_case("GET", "/v1/sandboxes/{sbx}", key="other", ok=(404,)), OTHER),
    Case("ctl.other-tenant-files", "control", "read another tenant's files by sandbox id",
         "404", _status_case("GET", "/v1/sandboxes/{sbx}/files/content?path=/workspace/a.txt",
                             key="other", ok=(404,)), OTHER),
    Case("ctl.other-tenant-destroy", "control", "destroy another tenant's sandbox", "404",
         _status_case("DELETE", "/v1/sandboxes/{sbx}", key="other", ok=(404,)), OTHER),
    Case("ctl.other-tenant-run", "control", "run a command in another tenant's sandbox",
         "404, and its audit trail shows nothing", _cross_tenant_run, OTHER),
    Case("ctl.other-tenant-list", "control", "list sandboxes and snapshots as another tenant",
         "the other tenant's are not listed", _cross_tenant_list, OTHER),
    Case("ctl.other-tenant-wake", "control", "wake another tenant's sleeping sandbox (paused, "
         "resumed by calls) with a command", "404, it stays paused, and its owner's call "
         "wakes the same sandbox (files, uid, network policy)", _wake, OTHER),
    Case("ctl.oversized-body", "control", "send a 70 MB command body (over the 64 MiB stdin "
         "limit)", "refused with 413 or 400",
         _status_case("POST", "/v1/sandboxes/{sbx}/commands", key="own", ok=(400, 413, 422),
                      body={"cmd": "true", "stdin": "A" * 70_000_000}), SERVICE),
    Case("ctl.malformed-json", "control", "send broken JSON", "4xx, not a crash",
         _status_case("POST", "/v1/sandboxes", key="own", ok=(400, 422),
                      content=b'{"resources": "small",', headers={
                          "Content-Type": "application/json"}), SERVICE),
    Case("ctl.unknown-fields", "control", "ask for fields the API does not have "
         "(privileged, host network)", "refused (strict request models)",
         _status_case("POST", "/v1/sandboxes", key="own", ok=(400, 422),
                      body={"resources": "small", "privileged": True,
                            "network": "host"}), SERVICE),
    Case("ctl.bad-ids", "control", "path tricks in ids (../, encoded slashes)", "404 or 400",
         _status_case("GET", "/v1/sandboxes/..%2F..%2Fetc%2Fpasswd", key="own",
                      ok=(400, 404, 422)), SERVICE),
    Case("ctl.paused-expiry", "control", "pause sandboxes with their helpers and background "
         "processes up, delete one and let one reach its lifetime while paused",
         f"every call about them and about the tenant's other sandboxes answers within "
         f"{_PROMPT_S:.0f} s and none with a 5xx; the paused one is gone at its lifetime",
         _paused_past_lifetime, SERVICE),
    Case("ctl.file-path-escape", "control", "read /etc/passwd through the files API with ../",
         "refused", _status_case("GET", "/v1/sandboxes/{sbx}/files/content?path=../../etc/passwd",
                                 key="own", ok=(400, 403, 404)), SERVICE),
]
