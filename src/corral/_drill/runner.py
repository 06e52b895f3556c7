"""Runs the cases against a target and collects the report."""

from __future__ import annotations

import contextlib
import secrets as _secrets
import time
from collections.abc import Callable, Iterator, Sequence

from .canary import Canary, host_address
from .case import Case
from .cases import all_cases
from .context import BAIT_BOUND, POISONED_DOCUMENT, DrillContext, bait_rules
from .model import CaseResult, DrillReport, Outcome
from .target import DrillTarget, ServiceAccess

__all__ = ["run_drill", "select_cases"]

Progress = Callable[[CaseResult, int, int], None]


def select_cases(ids: Sequence[str] = (), categories: Sequence[str] = ()) -> list[Case]:
    """All cases, or those whose id starts with one of ``ids`` and whose category is in
    ``categories``."""
    cases = all_cases()
    if ids:
        cases = [c for c in cases if any(c.id.startswith(i) for i in ids)]
    if categories:
        cases = [c for c in cases if c.category in categories]
    return cases


@contextlib.contextmanager
def _control_plane(target: DrillTarget) -> Iterator[ServiceAccess | None]:
    """The service to probe: the target's own, or (embedded, with host access) a throwaway
    local one."""
    if target.service is not None:
        yield target.service
    elif "admin" in target.capabilities and target.home is not None:
        from .._settings import Settings
        from .service import local_service

        with local_service(Settings(home=target.home)) as access:
            yield access
    else:
        yield None


def _service_sandbox(access: ServiceAccess) -> str | None:
    """A sandbox of the service's first tenant, for the cross-tenant cases."""
    import httpx

    headers = {"Authorization": f"Bearer {access.api_key}"} if access.api_key else {}
    with httpx.Client(base_url=access.url, headers=headers, timeout=60) as client:
        response = client.post("/v1/sandboxes", json={"labels": {"corral-drill": "tenant-a"}})
        if response.status_code != 201:
            return None
        sandbox_id = str(response.json()["id"])
        client.put(f"/v1/sandboxes/{sandbox_id}/files/content",
                   params={"path": "/workspace/a.txt"}, content=b"tenant A's data\n")
        return sandbox_id


def _drop_service_sandbox(access: ServiceAccess, sandbox_id: str) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {access.api_key}"} if access.api_key else {}
    with contextlib.suppress(httpx.HTTPError):
        httpx.delete(f"{access.url}/v1/sandboxes/{sandbox_id}", headers=headers, timeout=60)


@contextlib.contextmanager
def _planted(target: DrillTarget, allow: Sequence[str]) -> Iterator[DrillContext]:
    canary = Canary()
    secret_name: str | None = None
    secret_value: str | None = None
    ctx: DrillContext | None = None
    try:
        if "admin" in target.capabilities:
            secret_name = f"CORRAL_DRILL_{_secrets.token_hex(4).upper()}"
            secret_value = f"drill-host-secret-{_secrets.token_hex(12)}"
            target.add_secret(secret_name, secret_value, [BAIT_BOUND])
        fake_secret = f"drill-planted-{_secrets.token_hex(12)}"
        attacker = target.create(
            network={"allow": [*allow, *bait_rules(canary.tcp_port)]},
            secrets=[secret_name] if secret_name else (),
            labels={"corral-drill": "attacker"})
        victim = target.create(network="none", labels={"corral-drill": "victim"})
        victim_secret = f"drill-victim-{_secrets.token_hex(12)}"
        victim.write("/workspace/victim-notes.txt", f"api key: {victim_secret}\n")
        attacker.write("/workspace/NOTES.md", POISONED_DOCUMENT.format(
            port=canary.tcp_port, port_literal=f"2130706433:{canary.tcp_port}",
            secret=fake_secret))
        ctx = DrillContext(target=target, attacker=attacker, victim=victim, canary=canary,
                           fake_secret=fake_secret, victim_secret=victim_secret,
                           host_secret_name=secret_name, host_secret_value=secret_value,
                           host_address=host_address())
        with _control_plane(target) as access:
            ctx.service = access
            if access is not None:
                ctx.service_sandbox = _service_sandbox(access)
                if access.e2b_url is not None and access.e2b_api_key is not None:
                    from .e2bplant import E2BPlant

                    ctx.e2b = E2BPlant(access)
                if access.api_key is not None and access.other_api_key is not None:
                    from .preview import PreviewPlant

                    isolation = target.describe().get("isolation")
                    ctx.preview = PreviewPlant(
                        access, None if isolation in (None, "default") else str(isolation))
            try:
                yield ctx
            finally:
                if ctx.preview is not None:
                    ctx.preview.close()
                if ctx.e2b is not None:
                    ctx.e2b.close()
                if access is not None and ctx.service_sandbox is not None:
                    _drop_service_sandbox(access, ctx.service_sandbox)
    finally:
        if ctx is not None:
            for sb in [*ctx.scratch, ctx.attacker, ctx.victim]:
                with contextlib.suppress(Exception):
                    sb.kill()
        target.close()
        if secret_name is not None:
            with contextlib.suppress(Exception):
                target.remove_secret(secret_name)
        canary.close()


# What a skipped case's missing need is, and how to give it.
_NEEDS = {
    "preview": "a service and two tenants' keys (with --url, --api-key and --other-api-key)",
    "browser": "a browser to open pages in (Playwright and the host's Chromium)",
    "e2b": "an E2B surface (`corral serve --e2b-port`; with --url, CORRAL_DRILL_E2B_URL and "
           "CORRAL_DRILL_E2B_API_KEY)",
    "e2b-other": "a second tenant's e2b_ key (CORRAL_DRILL_E2B_OTHER_API_KEY)",
    "e2b-ceiling": "an e2b_ key of the tenant held to the drill's ceiling "
                   "(CORRAL_DRILL_E2B_CEILING_API_KEY)",
    "e2b-domain": "an E2B surface in domain mode (`--e2b-domain`; CORRAL_DRILL_E2B_DOMAIN)",
}


def _run_case(case: Case, ctx: DrillContext, capabilities: frozenset[str]) -> CaseResult:
    started = time.monotonic()
    missing = sorted(n for n in case.needs if n not in capabilities)
    if missing:
        named = ", ".join(f"{n} ({_NEEDS[n]})" if n in _NEEDS else n for n in missing)
        outcome = Outcome("skipped", f"needs {named}, which this target lacks")
    else:
        try:
            outcome = case.run(ctx)
        except Exception as exc:  # a case that cannot run says why; the drill goes on
            outcome = Outcome("error", f"{type(exc).__name__}: {exc}")
    return CaseResult(id=case.id, category=case.category, tries=case.tries,
                      held_when=case.held_when, verdict=outcome.verdict,
                      observed=outcome.observed, evidence=outcome.evidence,
                      duration_s=time.monotonic() - started)


def run_drill(target: DrillTarget, *, cases: Sequence[Case] | None = None,
              allow: Sequence[str] = (), progress: Progress | None = None) -> DrillReport:
    """Plant the bait, run every case (resource abuse last: it is the roughest), clean up."""
    chosen = list(cases if cases is not None else all_cases())
    chosen.sort(key=lambda c: c.category == "resources")
    report = DrillReport(target={**target.describe(), "allow": list(allow)})
    started = time.monotonic()
    capabilities = target.capabilities
    with _planted(target, allow) as ctx:
        if _has_python(ctx):
            capabilities |= {"python3"}
        if ctx.service is not None:
            capabilities |= {"service"}
            if ctx.service_sandbox:
                capabilities |= {"service-sandbox"}
            if ctx.service.other_api_key and ctx.service_sandbox:
                capabilities |= {"other-tenant"}
            if ctx.e2b is not None:
                capabilities |= {"e2b"}
                if ctx.service.e2b_other_api_key:
                    capabilities |= {"e2b-other"}
                if ctx.service.e2b_ceiling_api_key:
                    capabilities |= {"e2b-ceiling"}
                if ctx.service.e2b_domain:
                    capabilities |= {"e2b-domain"}
            if ctx.preview is not None:
                capabilities |= {"preview"}
        from .browser import missing

        if missing() is None:
            capabilities |= {"browser"}
        for index, case in enumerate(chosen, 1):
            result = _run_case(case, ctx, capabilities)
            report.results.append(result)
            if progress is not None:
                progress(result, index, len(chosen))
    report.duration_s = time.monotonic() - started
    return report


def _has_python(ctx: DrillContext) -> bool:
    return ctx.run("command -v python3 >/dev/null").exit_code == 0
