"""The drill's E2B cases without root: skipped (saying why) where there is no E2B surface; held
against the real E2B app over the in-memory backend, on real loopback sockets; and breached
against a surface whose gate has been broken on purpose (so each kind of case can fail)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from corral._audit.events import AuditEvent
from corral._control.manager import Manager
from corral._control.tenants import TenantDirectory
from corral._core.resources import TIERS
from corral._drill.context import drill_ceiling
from corral._drill.model import DrillReport
from corral._drill.runner import run_drill, select_cases
from corral._drill.service import E2B_DOMAIN
from corral._drill.target import ServiceAccess
from corral._e2b.app import E2BApp, E2BConfig, create_e2b_app
from corral._ids import from_e2b
from corral.models import CommandResult, Usage

from ..integration.servers import Server

E2B_CASES = select_cases(categories=["e2b"])
# They run commands in a sandbox (through the native API): the memory backend runs none.
NEED_A_SANDBOX = {"e2b.internet-no-hosts", "e2b.internet-ceiling"}


class _Nothing:
    """A stand-in for the drill's own attacker and victim: these cases never use them."""

    def __init__(self, number: int) -> None:
        self._id = f"nothing-{number}"

    @property
    def id(self) -> str:
        return self._id

    def run(self, cmd: str | Sequence[str], *, timeout: float = 30,
            envs: Mapping[str, str] | None = None) -> CommandResult:
        return CommandResult(exit_code=1, stdout="", stderr="", timed_out=False, duration_s=0,
                             usage=Usage(wall_s=0, cpu_s=0, peak_memory_bytes=0,
                                         oom_killed=False))

    def write(self, path: str, data: str | bytes) -> None:
        pass

    def read(self, path: str) -> bytes:
        return b""

    def upload_tar(self, data: bytes, path: str = "/workspace") -> None:
        pass

    def events(self, *, command: str | None = None,
               types: Sequence[str] | None = None) -> list[AuditEvent]:
        return []

    def kill(self) -> None:
        pass


class _Target:
    def __init__(self, service: ServiceAccess | None) -> None:
        self._service = service
        self._made = 0

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset()

    @property
    def home(self) -> Path | None:
        return None

    @property
    def service(self) -> ServiceAccess | None:
        return self._service

    def describe(self) -> dict[str, Any]:
        return {"transport": "test"}

    def create(self, *, network: Any, secrets: Sequence[str] = (),
               labels: Mapping[str, str] | None = None) -> _Nothing:
        self._made += 1
        return _Nothing(self._made)

    def add_secret(self, name: str, value: str, hosts: Sequence[str]) -> None:
        raise NotImplementedError

    def remove_secret(self, name: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _verdicts(report: DrillReport) -> dict[str, str]:
    return {r.id: r.verdict for r in report.results}


def test_without_an_e2b_surface_the_cases_are_skipped_saying_why() -> None:
    report = run_drill(_Target(None), cases=E2B_CASES)
    assert len(report.results) == len(E2B_CASES) >= 25
    assert {r.verdict for r in report.results} == {"skipped"}
    assert all("E2B surface" in r.observed and "--e2b-port" in r.observed
               for r in report.results)
    assert report.ok


@pytest.fixture
def keys(manager: Manager) -> dict[str, str]:
    tenants = TenantDirectory(manager.store)
    tenants.add_tenant("a", max_sandboxes=10)
    tenants.add_tenant("b", max_sandboxes=4)
    tenants.add_tenant("c", max_sandboxes=4, tiers=sorted(TIERS), ceiling=drill_ceiling())
    found = {}
    for name in ("a", "b", "c"):
        found[name] = tenants.create_key(name)[1]
        found[f"e2b-{name}"] = tenants.create_key(name, e2b=True)[1]
    return found


def _drill(manager: Manager, keys: dict[str, str], e2b_app: ASGIApp, *,
           with_e2b: bool = True, other: bool = True) -> DrillReport:
    domain_app = create_e2b_app(manager, E2BConfig.build(domain=E2B_DOMAIN))
    with Server(manager) as native, Server(manager, e2b_app) as e2b, \
            Server(manager, domain_app) as by_domain:
        access = ServiceAccess(
            native.url, keys["a"], keys["b"], ceiling_api_key=keys["c"],
            e2b_url=e2b.url if with_e2b else None, e2b_api_key=keys["e2b-a"],
            e2b_other_api_key=keys["e2b-b"] if other else None,
            e2b_ceiling_api_key=keys["e2b-c"], e2b_domain=E2B_DOMAIN,
            e2b_domain_url=by_domain.url)
        return run_drill(_Target(access), cases=E2B_CASES)


def test_the_cases_hold_against_the_e2b_surface(manager: Manager,
                                                keys: dict[str, str]) -> None:
    app = create_e2b_app(manager, E2BConfig.build())
    report = _drill(manager, keys, app)
    verdicts = _verdicts(report)
    assert {i: v for i, v in verdicts.items() if i not in NEED_A_SANDBOX} == {
        c.id: "held" for c in E2B_CASES if c.id not in NEED_A_SANDBOX}, [
        (r.id, r.observed) for r in report.results if r.verdict != "held"]
    assert {verdicts[i] for i in NEED_A_SANDBOX} == {"skipped"}  # no python3 in _Nothing
    assert all(r.evidence for r in report.results if r.verdict == "held")
    # Every sandbox the cases made through the E2B API is gone.
    assert [i for i in manager.list() if i.labels.get("corral-drill") == "e2b"] == []


def test_a_surface_without_its_e2b_url_or_second_key_skips_what_needs_them(
        manager: Manager, keys: dict[str, str]) -> None:
    app = create_e2b_app(manager, E2BConfig.build())
    assert set(_verdicts(_drill(manager, keys, app, with_e2b=False)).values()) == {"skipped"}
    verdicts = _verdicts(_drill(manager, keys, app, other=False))
    assert verdicts["e2b.other-tenant-get"] == "skipped"
    assert verdicts["e2b.token-other-tenant"] == "skipped"
    assert verdicts["e2b.token-same-tenant"] == "held"


class _Rewrite:
    """A broken gate: rewrites one request header before the real app sees it."""

    def __init__(self, app: E2BApp, rewrite: Any) -> None:
        self._app = app
        self._rewrite = rewrite

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            self._rewrite(headers)
            scope = {**scope, "headers": list(headers.items())}
        await self._app(scope, receive, send)


def test_a_gate_that_ignores_sandbox_tokens_is_caught(manager: Manager,
                                                      keys: dict[str, str]) -> None:
    app = create_e2b_app(manager, E2BConfig.build())

    def any_token_opens(headers: dict[bytes, bytes]) -> None:
        sandbox = headers.get(b"e2b-sandbox-id")
        corral_id = from_e2b(sandbox.decode()) if sandbox else None
        if corral_id is not None:
            headers[b"x-access-token"] = app.tokens.envd(corral_id).encode()

    verdicts = _verdicts(_drill(manager, keys, _Rewrite(app, any_token_opens)))
    assert verdicts["e2b.token-same-tenant"] == "breached"
    assert verdicts["e2b.token-other-tenant"] == "breached"
    assert verdicts["e2b.no-token"] == "breached"
    assert verdicts["e2b.domain-token-swap"] == "held"  # the domain listener is not broken
    assert verdicts["e2b.other-tenant-get"] == "held"  # the control plane is still sound


def test_a_gate_that_lets_one_tenant_in_as_another_is_caught(manager: Manager,
                                                             keys: dict[str, str]) -> None:
    app = create_e2b_app(manager, E2BConfig.build())

    def b_is_a(headers: dict[bytes, bytes]) -> None:
        if headers.get(b"x-api-key") == keys["e2b-b"].encode():
            headers[b"x-api-key"] = keys["e2b-a"].encode()

    report = _drill(manager, keys, _Rewrite(app, b_is_a))
    verdicts = _verdicts(report)
    for op in ("get", "connect", "timeout", "pause", "snapshot", "fork", "list"):
        assert verdicts[f"e2b.other-tenant-{op}"] == "breached", (op, report.results)
