"""Admission (issue 39, R4): a create is planned, then carried out, so a caller refused by its
quota or ceiling gets nothing pulled, built or written; the sandboxes-per-tenant count stays
race-free (decided in the store's insert transaction), and the rules live in one module.
Over the memory backend: no root."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from corral._control import admission
from corral._control.admission import (
    Admission,
    CommandWindows,
    check_sandbox_count,
    volume_slot,
)
from corral._control.manager import Manager
from corral._control.store import Store
from corral._control.tenants import Ceiling, Tenant, TenantDirectory, local_tenant
from corral._images import pull
from corral.errors import CeilingExceeded, QuotaExceeded


@pytest.fixture
def pulls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every image pull asked for (none may reach a registry here)."""
    asked: list[str] = []

    def pull_image(reference: str, *args: Any, **kwargs: Any) -> Any:
        asked.append(reference)
        raise AssertionError(f"pulled {reference} for a caller that is refused")

    monkeypatch.setattr(pull, "pull_image", pull_image)
    return asked


def _tenant(manager: Manager, **quota: Any) -> Tenant:
    return TenantDirectory(manager.store).add_tenant("acme", **quota)


def test_a_tenant_at_its_sandbox_limit_is_refused_before_any_pull(
        manager: Manager, pulls: list[str]) -> None:
    acme = _tenant(manager, max_sandboxes=1)
    manager.create(caller=acme)
    with pytest.raises(QuotaExceeded, match="already has 1 sandboxes"):
        manager.create(caller=acme, image="docker.io/library/alpine:3.20")
    assert pulls == []
    assert len(manager.list(tenant="acme")) == 1


@pytest.mark.parametrize(("quota", "ask", "refused"), [
    ({"tiers": ["small"]}, {"resources": "large"}, QuotaExceeded),
    ({"ceiling": Ceiling(templates=("base",))}, {}, CeilingExceeded),
    ({"ceiling": Ceiling(hosts=())}, {"network": {"allow": ["pypi.org"]}}, CeilingExceeded),
    ({"ceiling": Ceiling(max_lifetime_s=60)}, {"timeout": 600}, CeilingExceeded),
])
def test_a_tenant_beyond_its_tiers_or_ceiling_is_refused_before_any_pull(
        manager: Manager, pulls: list[str], quota: dict[str, Any], ask: dict[str, Any],
        refused: type[Exception]) -> None:
    acme = _tenant(manager, **quota)
    with pytest.raises(refused):
        manager.create(caller=acme, image="docker.io/library/alpine:3.20", **ask)
    assert pulls == []
    assert manager.store.list() == []


def test_the_image_ceiling_message_names_the_image_and_what_to_do(manager: Manager,
                                                                   pulls: list[str]) -> None:
    acme = _tenant(manager, ceiling=Ceiling(templates=("base", "python")))
    with pytest.raises(CeilingExceeded) as refused:
        manager.create(caller=acme, image="alpine")
    assert "image 'alpine'" in str(refused.value) and "corral tenants set" in str(refused.value)
    assert pulls == []


def test_two_creates_racing_for_the_last_slot_cannot_both_win(
        manager: Manager, monkeypatch: pytest.MonkeyPatch) -> None:
    acme = _tenant(manager, max_sandboxes=3)
    racers = 8
    # Every create reads the count before any of them inserts: only the insert's own
    # transaction can tell them apart.
    barrier = threading.Barrier(racers, timeout=30)
    counted = manager.store.count_sandboxes

    def count_together(tenant: str) -> int:
        count = counted(tenant)
        barrier.wait()
        return count

    monkeypatch.setattr(manager.store, "count_sandboxes", count_together)
    made: list[str] = []
    refused: list[Exception] = []

    def create() -> None:
        try:
            made.append(manager.create(caller=acme).id)
        except QuotaExceeded as exc:
            refused.append(exc)

    threads = [threading.Thread(target=create) for _ in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(made) == 3 and len(refused) == racers - 3
    assert counted("acme") == 3


def test_two_stores_of_one_data_directory_cannot_both_take_the_last_slot(
        tmp_path: Path) -> None:
    # Two processes' stores: the count is decided in each insert's (immediate) transaction.
    first, second = Store(tmp_path / "corral.db"), Store(tmp_path / "corral.db")
    slot = Admission.sandbox_slot("acme", 1)
    results: list[object] = []
    barrier = threading.Barrier(2, timeout=30)

    def insert(store: Store, sandbox_id: str) -> None:
        barrier.wait()
        try:
            results.append(store.insert(sandbox_id=sandbox_id, template="base",
                                        resources="small", ttl_s=60.0, labels={},
                                        allocate_uid=lambda taken: 1000 + len(taken),
                                        tenant="acme", admit=slot))
        except QuotaExceeded as exc:
            results.append(exc)

    threads = [threading.Thread(target=insert, args=(store, f"sbx_race{i}"))
               for i, store in enumerate((first, second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sum(isinstance(r, QuotaExceeded) for r in results) == 1
    assert first.count_sandboxes("acme") == 1
    first.close()
    second.close()


def test_the_rules_in_one_place() -> None:
    rules = Admission(Ceiling())
    acme = Tenant("acme", max_sandboxes=2, tiers=("small",), commands_per_minute=1)
    assert rules.sandbox_limit(acme, None) == 2
    assert rules.sandbox_limit(acme, 5) == 5  # a gateway's own
    assert rules.sandbox_limit(None, None) is None
    assert rules.sandbox_limit(local_tenant(), None) is None
    assert Admission.sandbox_slot("acme", None) is None
    check_sandbox_count("acme", 1, 2)
    with pytest.raises(QuotaExceeded, match="its limit"):
        check_sandbox_count("acme", 2, 2)
    rules.check_tier(acme, "small")
    rules.check_tier(None, "large")  # the operator: no quotas
    with pytest.raises(QuotaExceeded, match="'large' tier"):
        rules.check_tier(acme, "large")
    rules.admit(acme)
    with pytest.raises(QuotaExceeded, match="1 commands per minute"):
        rules.admit(acme)
    rules.admit(local_tenant())
    assert isinstance(rules.starts, CommandWindows)
    assert admission.__all__ == ["Admission", "CommandWindows", "check_sandbox_count",
                                 "volume_slot"]


@pytest.mark.parametrize(("ask", "ceiling"), [
    ({"network": {"allow": ["pypi.org"]}}, "hosts ceiling"),
    ({"template": "python"}, "template ceiling"),
])
def test_mcp_against_a_remote_service_applies_its_ceiling_by_the_same_rule(
        ask: dict[str, Any], ceiling: str) -> None:
    from corral._mcp.sessions import CorralMCP
    from corral._sdk._async.http import AsyncHTTPTransport

    async def main() -> None:
        state = CorralMCP(None, "stdio")
        # Nothing listens there: a refusal must come before any request.
        state._opened = AsyncHTTPTransport("http://127.0.0.1:9")
        try:
            with pytest.raises(CeilingExceeded, match=ceiling):
                await state.create(**ask)
        finally:
            await state.shutdown()

    asyncio.run(main())


def test_volume_quotas_are_judged_by_admission() -> None:
    assert volume_slot("local", 10, max_count=1, max_bytes=1) is None  # the operator
    judge = volume_slot("acme", 100, max_count=2, max_bytes=250)
    assert judge is not None
    judge(1, 150)
    with pytest.raises(QuotaExceeded, match="already has 2 volumes"):
        judge(2, 0)
    with pytest.raises(QuotaExceeded, match="would add up to 251 bytes"):
        judge(1, 151)


def test_a_fork_past_the_quota_is_refused_before_anything_is_sealed(manager: Manager) -> None:
    acme = _tenant(manager, max_sandboxes=3)
    parent = manager.create(caller=acme)
    with pytest.raises(QuotaExceeded, match="3 more would pass it"):
        manager.fork(parent.id, 3, caller=acme)
    assert manager.store.layer_ids() == set()
    assert [s.id for s in manager.list(tenant="acme")] == [parent.id]
    assert len(manager.fork(parent.id, 2, caller=acme)) == 2
