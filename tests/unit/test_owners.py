"""Ownership below the surfaces: the control plane's run refuses another tenant's sandbox by
itself (the HTTP route no longer checks first), and the remembered owners the HTTP body guard
reads on its event loop. Over the memory backend: no root."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from corral._control.manager import Manager
from corral._control.owners import Owners
from corral._control.tenants import TenantDirectory, local_tenant
from corral.errors import SandboxNotFound
from corral.testing import memory_manager


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Manager]:
    manager = memory_manager(tmp_path / "home")
    yield manager
    for info in manager.records():
        manager._destroy(info, reason="cleanup")
    manager.close()


def test_a_run_by_another_tenant_is_refused_as_if_the_sandbox_did_not_exist(
        plane: Manager) -> None:
    tenants = TenantDirectory(plane.store)
    acme, other = tenants.add_tenant("acme"), tenants.add_tenant("other")
    sandbox = plane.create(caller=acme)
    with pytest.raises(SandboxNotFound, match="does not exist"):
        plane.run(sandbox.id, ["true"], caller=other)
    with pytest.raises(SandboxNotFound, match="does not exist"):
        plane.check_run(sandbox.id, ["true"], caller=other)
    assert plane.run(sandbox.id, ["true"], caller=acme).exit_code == 0
    # The operator reaches every tenant's sandboxes.
    assert plane.run(sandbox.id, ["true"], caller=local_tenant()).exit_code == 0


def test_an_owner_is_remembered_once_read_and_an_unknown_id_is_not(plane: Manager) -> None:
    tenants = TenantDirectory(plane.store)
    sandbox = plane.create(caller=tenants.add_tenant("acme"))
    assert plane.owner(sandbox.id, known_only=True) is None  # nothing read yet
    assert plane.owner(sandbox.id) == "acme"
    assert plane.owner(sandbox.id, known_only=True) == "acme"
    # Still the owner's after it is gone: a destroyed sandbox's id is never given again, and
    # the route's own check answers "not found".
    plane.destroy(sandbox.id)
    assert plane.owner(sandbox.id, known_only=True) == "acme"
    assert plane.owner("sbx_000000000000") is None
    assert plane.owner("sbx_000000000000", known_only=True) is None


def test_the_remembered_owners_are_bounded(plane: Manager) -> None:
    owners = Owners(plane.store, keep=2)
    made = [plane.create().id for _ in range(3)]
    for sandbox_id in made:
        assert owners.of(sandbox_id) == "local"
    assert owners.known(made[0]) is None  # the oldest went first
    assert owners.known(made[1]) == owners.known(made[2]) == "local"


def test_key_presence_is_live_and_ever_in_one_read(plane: Manager) -> None:
    store = plane.store
    assert store.key_presence() == (False, False)
    tenants = TenantDirectory(store)
    tenants.add_tenant("acme")
    key_id, _ = tenants.create_key("acme")
    assert store.key_presence() == (True, True)
    store.revoke_key(key_id)
    # Revoking the last key does not reopen a loopback service (keys_have_existed).
    assert store.key_presence() == (False, True)


def test_the_http_body_guard_refuses_another_tenants_sandbox_from_memory_too(
        plane: Manager) -> None:
    import asyncio

    import httpx

    from corral._server.app import create_app

    tenants = TenantDirectory(plane.store)
    tenants.add_tenant("acme")
    tenants.add_tenant("other")
    acme_key, other_key = (tenants.create_key(name)[1] for name in ("acme", "other"))
    sandbox = plane.create(caller=tenants.get("acme")).id
    app = create_app(plane)

    async def post(key: str) -> httpx.Response:
        async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app, client=("127.0.0.1", 5000)),
                base_url="http://127.0.0.1", headers={"authorization": f"Bearer {key}"}) as c:
            return await c.post(f"/v1/sandboxes/{sandbox}/commands", json={"cmd": ["true"]})

    async def calls() -> list[httpx.Response]:
        # Refused before anything is known (a store read), then from memory (acme's call
        # made the owner known), and the owner's own call goes through.
        return [await post(other_key), await post(acme_key), await post(other_key)]

    refused, allowed, refused_again = asyncio.run(calls())
    assert allowed.status_code == 200 and allowed.json()["exit_code"] == 0
    for answer in (refused, refused_again):
        assert answer.status_code == 404 and "does not exist" in answer.json()["message"]
    assert plane.owner(sandbox, known_only=True) == "acme"
