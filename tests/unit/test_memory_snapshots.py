"""Memory snapshots (``snapshot(memory=True)``, ``fork(memory=True)``, create and restore from
one) above the backend, over ``MemoryVMBackend`` (the ``MemorySnapshots`` capability as
bookkeeping) and, for the refusals, the plain ``MemoryBackend`` (a tier without it): the
control plane, the store, the layer collector, and every surface (embedded and HTTP SDK, async
SDK, CLI, MCP). The microvm tier itself is tested with the tier."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from corral import AsyncSandbox, Sandbox
from corral._cli.main import cli
from corral._control.manager import Manager
from corral._control.store import Store
from corral._sdk._embedded import EmbeddedTransport
from corral._serve.app import create_app
from corral.errors import (
    QuotaExceeded,
    SandboxBusy,
    SandboxNotFound,
    SnapshotInUse,
    SnapshotNotFound,
    UsageError,
)
from corral.testing import (
    MemoryBackend,
    MemoryVMBackend,
    asgi_transport,
    async_asgi_transport,
    memory_manager,
)

from ..integration.servers import Server


@pytest.fixture
def vm() -> MemoryVMBackend:
    return MemoryVMBackend(uid_start=100_000, uid_count=100)


@pytest.fixture
def manager(tmp_path: Path, vm: MemoryVMBackend) -> Iterator[Manager]:
    manager = memory_manager(tmp_path / "vm", backend=vm)
    yield manager
    for info in manager.list():
        manager.destroy(info.id)
    manager.close()


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[Manager]:
    """A control plane on a tier without memory snapshots."""
    manager = memory_manager(tmp_path / "plain", backend=MemoryBackend(uid_start=100_000,
                                                                        uid_count=100))
    yield manager
    for info in manager.list():
        manager.destroy(info.id)
    manager.close()


def _events(manager: Manager, sandbox_id: str, kind: str) -> list[dict[str, Any]]:
    return [e.data for e in manager.auditor.trail(sandbox_id).events if e.type == kind]


class _Running:
    """A command (``sleep``) running in a sandbox on another thread, for as long as the block;
    joined (it ends by itself, bounded) on the way out."""

    def __init__(self, manager: Manager, sandbox_id: str, vm: MemoryBackend) -> None:
        self._manager, self._id, self._vm = manager, sandbox_id, vm
        self._thread = threading.Thread(
            target=manager.run, args=(sandbox_id, "sleep 1.5"), kwargs={"timeout": 5},
            daemon=True)

    def __enter__(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 5
        spec = self._manager.sandboxes.spec(self._manager.sandboxes.get(self._id))
        while not self._vm.busy(spec):
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.01)

    def __exit__(self, *exc: object) -> None:
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()


# -- the control plane ---------------------------------------------------------------------


def test_a_memory_snapshot_is_taken_while_a_command_runs(manager: Manager,
                                                         vm: MemoryVMBackend) -> None:
    sb = manager.create()
    manager.files(sb.id).write("state.txt", b"before")
    with _Running(manager, sb.id, vm):
        with pytest.raises(SandboxBusy):  # a disk snapshot still waits for quiet
            manager.snapshot(sb.id)
        snap = manager.snapshot(sb.id, name="warm", memory=True)
    assert snap.memory is True and snap.name == "warm"
    assert [(s, busy) for s, _l, _i, busy in vm.memory_snapshots] == [(sb.id, True)]
    (_, layer, image, _) = vm.memory_snapshots[0]
    assert vm.memory_image_ids() == [image]
    created = _events(manager, sb.id, "snapshot.created")
    assert created[-1]["memory"] is True and created[-1]["memory_image"] == image
    assert created[-1]["layer"] == layer
    # The parent ran on: it is on the new layer, and resumed from nothing.
    record = manager.sandboxes.get(sb.id)
    assert record.layer == layer and record.memory_image is None
    assert manager.get_snapshot("warm").memory is True
    assert [s.memory for s in manager.list_snapshots()] == [True]
    disk = manager.snapshot(sb.id)
    assert disk.memory is False
    assert _events(manager, sb.id, "snapshot.created")[-1]["memory"] is False


def test_create_from_a_memory_snapshot_resumes_its_image(manager: Manager,
                                                         vm: MemoryVMBackend) -> None:
    sb = manager.create()
    manager.files(sb.id).write("state.txt", b"at-the-instant")
    snap = manager.snapshot(sb.id, memory=True)
    manager.files(sb.id).write("state.txt", b"later")
    image = vm.memory_snapshots[0][2]
    child = manager.create(snapshot=snap.id)
    record = manager.sandboxes.get(child.id)
    assert record.memory_image == image and vm.resumed_from(child.id) == image
    assert manager.sandboxes.spec(record).memory_image == image
    assert manager.get(child.id).memory_image == image  # what every surface shows
    assert manager.files(child.id).read("state.txt") == b"at-the-instant"
    created = _events(manager, child.id, "sandbox.created")[0]
    assert created["memory_image"] == image and created["snapshot"] == snap.id
    # A memory image is a running machine: it resumes only as it was taken.
    with pytest.raises(UsageError, match="resources='small'"):
        manager.create(snapshot=snap.id, resources="large")
    with pytest.raises(UsageError, match="isolation='namespace'"):
        manager.create(snapshot=snap.id, isolation="gvisor")
    # Once the child's workspace moves on (a disk seal), it no longer names the image.
    manager.snapshot(child.id)
    assert manager.sandboxes.get(child.id).memory_image is None
    assert manager.get(child.id).memory_image is None


def test_fork_with_memory_resumes_every_child_and_the_image_goes_with_them(
        manager: Manager, vm: MemoryVMBackend) -> None:
    sb = manager.create()
    manager.files(sb.id).write("a.txt", b"shared")
    with _Running(manager, sb.id, vm):
        children = manager.fork(sb.id, 3, memory=True)
    (_, layer, image, busy) = vm.memory_snapshots[0]
    assert busy is True
    assert {vm.resumed_from(c.id) for c in children} == {image}
    assert vm.resumed_from(sb.id) is None
    for child in children:
        assert manager.files(child.id).read("a.txt") == b"shared"
        origin = _events(manager, child.id, "sandbox.created")[0]
        assert origin["forked_from"] == sb.id and origin["memory_image"] == image
    forked = _events(manager, sb.id, "sandbox.forked")[0]
    assert forked["memory"] is True and forked["memory_image"] == image
    assert len(forked["children"]) == 3
    # Without memory, a fork of a running sandbox is refused as before.
    with _Running(manager, sb.id, vm), pytest.raises(SandboxBusy):
        manager.fork(sb.id, 1)
    # No snapshot names the image: it lives while a child does.
    for child in children[:2]:
        manager.destroy(child.id)
    assert vm.memory_image_ids() == [image]
    manager.destroy(children[2].id)
    assert vm.memory_image_ids() == []
    assert image not in manager.store.memory_image_ids()
    assert layer in vm.layer_ids()  # the parent still stands on the layer


def test_restore_of_a_memory_snapshot_restarts_from_its_image(manager: Manager,
                                                              vm: MemoryVMBackend) -> None:
    sb = manager.create()
    manager.files(sb.id).write("x", b"one")
    mem = manager.snapshot(sb.id, memory=True)
    image = vm.memory_snapshots[0][2]
    manager.files(sb.id).write("x", b"two")
    disk = manager.snapshot(sb.id)
    restored = manager.restore(sb.id, mem.id)
    assert restored.layer == manager.store.snapshot_layer(mem.id)
    assert vm.resumed_from(sb.id) == image
    assert manager.sandboxes.get(sb.id).memory_image == image
    assert manager.files(sb.id).read("x") == b"one"
    event = _events(manager, sb.id, "snapshot.restored")[-1]
    assert event["memory"] is True and event["memory_image"] == image
    # Back to a disk snapshot: a fresh start over its layer, no image.
    manager.restore(sb.id, disk.id)
    assert vm.resumed_from(sb.id) is None and manager.sandboxes.get(sb.id).memory_image is None
    assert manager.files(sb.id).read("x") == b"two"
    # Restoring, like a disk restore, waits for quiet.
    with _Running(manager, sb.id, vm), pytest.raises(SandboxBusy):
        manager.restore(sb.id, mem.id)


def test_a_paused_sandbox_is_refused(manager: Manager) -> None:
    sb = manager.create()
    manager.pause(sb.id)
    with pytest.raises(SandboxBusy, match="paused; resume"):
        manager.snapshot(sb.id, memory=True)
    with pytest.raises(SandboxBusy, match="paused; resume"):
        manager.fork(sb.id, 2, memory=True)
    assert manager.list_snapshots() == [] and len(manager.list()) == 1


def test_a_tier_without_the_capability_refuses_and_changes_nothing(plain: Manager) -> None:
    sb = plain.create()
    for call in (lambda: plain.snapshot(sb.id, memory=True),
                 lambda: plain.fork(sb.id, 2, memory=True)):
        with pytest.raises(UsageError, match="microvm tier") as refused:
            call()
        assert "namespace tier" in str(refused.value)
    assert plain.list_snapshots() == [] and len(plain.list()) == 1
    assert plain.store.layer_ids() == set()


def test_deleting_a_memory_snapshot_removes_its_image_once_unused(manager: Manager,
                                                                  vm: MemoryVMBackend) -> None:
    sb = manager.create()
    snap = manager.snapshot(sb.id, name="m", memory=True)
    image = vm.memory_snapshots[0][2]
    child = manager.create(snapshot="m")
    manager.restore(sb.id, snap.id)  # the parent too now stands on it
    with pytest.raises(SnapshotInUse):
        manager.delete_snapshot("m")
    manager.destroy(child.id)
    manager.destroy(sb.id)
    manager.delete_snapshot("m")
    assert vm.memory_image_ids() == [] and manager.store.memory_image_ids() == set()
    assert manager.store.snapshot_layer(snap.id) is None
    assert manager.store.layer_ids() == set() and vm.layer_ids() == []
    deleted = _events(manager, sb.id, "snapshot.deleted")[-1]
    assert deleted["memory"] is True and deleted["memory_image"] == image


def test_quotas_and_tenancy_hold_as_for_disk_snapshots(manager: Manager,
                                                       vm: MemoryVMBackend) -> None:
    sb = manager.create(tenant="alice")
    with pytest.raises(QuotaExceeded):
        manager.fork(sb.id, 3, memory=True, tenant="alice", max_for_tenant=2)
    # All or none: no child stayed, and the image no child came to use is gone.
    assert [s.id for s in manager.list(tenant="alice")] == [sb.id]
    assert vm.memory_image_ids() == []
    snap = manager.snapshot(sb.id, memory=True, tenant="alice")
    with pytest.raises(SandboxNotFound):
        manager.snapshot(sb.id, memory=True, tenant="bob")
    with pytest.raises(SnapshotNotFound):
        manager.get_snapshot(snap.id, tenant="bob")
    with pytest.raises(SnapshotNotFound):
        manager.create(snapshot=snap.id, tenant="bob")
    assert manager.create(snapshot=snap.id, tenant="alice").id


def test_a_store_from_before_memory_snapshots_opens_with_disk_snapshots(tmp_path: Path) -> None:
    path = tmp_path / "corral.db"
    Store(path).close()
    db = sqlite3.connect(path)
    db.executescript("""
        ALTER TABLE snapshots DROP COLUMN memory_image;
        ALTER TABLE sandboxes DROP COLUMN memory_image;
        DROP TABLE memory_images;
        INSERT INTO layers VALUES ('lyr_old', NULL, 1, 10, 1.0);
        INSERT INTO snapshots VALUES ('snap_old', 'old', 'local', 'lyr_old', 'base', 'sbx_x', 1.0);
    """)
    db.close()
    store = Store(path)
    try:
        (snap,) = store.snapshots(tenant=None)
        assert (snap.id, snap.memory) == ("snap_old", False)
        assert store.snapshot_memory_image("snap_old") is None
        assert store.unused_memory_images() == []
        assert store.unused_layers() == []  # the snapshot still holds its layer
    finally:
        store.close()


# -- the surfaces ----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["embedded", "http"])
def test_the_sync_sdk(manager: Manager, plain: Manager, vm: MemoryVMBackend,
                      where: str) -> None:
    def transport(m: Manager) -> Any:
        return EmbeddedTransport(m) if where == "embedded" else asgi_transport(create_app(m))

    with Sandbox.create(transport=transport(manager)) as sb:
        sb.files.write("f.txt", "kept")
        snap = sb.snapshot("s1", memory=True)
        assert snap.memory is True
        assert [s.memory for s in Sandbox.list_snapshots(transport=transport(manager))] == [True]
        forks = sb.fork(2, memory=True)
        image = vm.memory_snapshots[-1][2]
        try:
            assert {vm.resumed_from(f.id) for f in forks} == {image}
            assert forks[0].files.read("f.txt") == "kept"
        finally:
            for f in forks:
                f.kill()
        with Sandbox.create(snapshot=snap, transport=transport(manager)) as child:
            assert vm.resumed_from(child.id) == vm.memory_snapshots[0][2]
        sb.restore(snap)
        assert vm.resumed_from(sb.id) == vm.memory_snapshots[0][2]
        assert sb.snapshot().memory is False
        # The trail, as the surface returns it, says which snapshots held memory.
        created = sb.audit.events(types=["snapshot.created"])
        assert [e.data["memory"] for e in created] == [True, False]
        assert created[0].data["memory_image"] == vm.memory_snapshots[0][2]
        (forked,) = sb.audit.events(types=["sandbox.forked"])
        assert forked.data["memory"] is True
    with Sandbox.create(transport=transport(plain)) as other:
        with pytest.raises(UsageError, match="microvm tier"):
            other.snapshot(memory=True)
        with pytest.raises(UsageError, match="microvm tier"):
            other.fork(1, memory=True)


def test_the_async_sdk_over_http(manager: Manager, plain: Manager,
                                 vm: MemoryVMBackend) -> None:
    async def main() -> None:
        async with await AsyncSandbox.create(
                transport=async_asgi_transport(create_app(manager))) as sb:
            snap = await sb.snapshot(memory=True)
            assert snap.memory is True
            (child,) = await sb.fork(1, memory=True)
            assert vm.resumed_from(child.id) == vm.memory_snapshots[-1][2]
            await child.kill()
        async with await AsyncSandbox.create(
                transport=async_asgi_transport(create_app(plain))) as other:
            with pytest.raises(UsageError, match="microvm tier"):
                await other.snapshot(memory=True)

    asyncio.run(main())


def test_the_cli_against_a_service(manager: Manager, plain: Manager,
                                   vm: MemoryVMBackend) -> None:
    runner = CliRunner()
    with Server(manager) as server:
        env = {"CORRAL_URL": server.url}
        sb = manager.create()
        made = runner.invoke(cli, ["snapshot", sb.id, "--memory", "--name", "cli", "--json"],
                             env=env)
        assert made.exit_code == 0, made.output
        assert json.loads(made.output)["memory"] is True
        listed = runner.invoke(cli, ["snapshots", "ls", "--json"], env=env)
        assert [s["memory"] for s in json.loads(listed.output)] == [True]
        table = runner.invoke(cli, ["snapshots", "ls"], env=env)
        assert "MEMORY" in table.output and "yes" in table.output
        forked = runner.invoke(cli, ["fork", sb.id, "--memory", "-n", "2", "--json"], env=env)
        assert forked.exit_code == 0, forked.output
        ids = [c["id"] for c in json.loads(forked.output)]
        assert {vm.resumed_from(i) for i in ids} == {vm.memory_snapshots[-1][2]}
    with Server(plain) as server:
        other = plain.create()
        refused = runner.invoke(cli, ["snapshot", other.id, "--memory"],
                                env={"CORRAL_URL": server.url})
        assert refused.exit_code != 0 and "microvm tier" in refused.output


def test_the_mcp_tools(manager: Manager, plain: Manager, vm: MemoryVMBackend) -> None:
    from corral._mcp.server import build_server
    from corral._sdk._aembedded import AsyncEmbeddedTransport

    async def main(over: Manager) -> tuple[dict[str, Any], ...]:
        mcp, state = build_server(None, "stdio")
        state._opened = AsyncEmbeddedTransport(over, caller=state.caller)
        results = []
        for tool, args in (("create_sandbox", {}), ("snapshot", {"memory": True}),
                           ("fork", {"count": 2, "memory": True})):
            result = await mcp.call_tool(tool, args)
            results.append(dict(result.structured_content or {}))  # type: ignore[union-attr]
        await state.shutdown()
        return tuple(results)

    _, snap, forks = asyncio.run(main(manager))
    assert snap["memory"] is True and len(forks["forks"]) == 2
    image = vm.memory_snapshots[0][2]
    assert vm.memory_snapshots[1][2] != image  # the fork took its own image
    assert manager.list() == [] and vm.memory_image_ids() == []  # gone with the session
    _, refused, _ = asyncio.run(main(plain))
    assert refused["code"] == "usage_error" and "microvm tier" in refused["message"]


def test_the_e2b_surface_maps_memory_snapshots(manager: Manager, plain: Manager,
                                               vm: MemoryVMBackend) -> None:
    from starlette.testclient import TestClient

    from corral._control.tenants import TenantDirectory
    from corral._e2b.app import E2BConfig, create_e2b_app

    def client_and_key(m: Manager) -> tuple[TestClient, dict[str, str]]:
        tenants = TenantDirectory(m.store)
        tenants.add_tenant("acme")
        key = tenants.create_key("acme", e2b=True)[1]
        return (TestClient(create_e2b_app(m, E2BConfig.build()), base_url="http://127.0.0.1"),
                {"X-API-KEY": key})

    client, h = client_and_key(manager)
    with client:
        sid = client.post("/v2/sandboxes", headers=h,
                          json={"templateID": "base"}).json()["sandboxID"]
        snap = client.post(f"/sandboxes/{sid}/snapshots", headers=h, json={"memory": True})
        assert snap.status_code == 201, snap.text
        image = vm.memory_snapshots[-1][2]
        (record,) = manager.list_snapshots()
        assert record.memory is True
        child = client.post("/v2/sandboxes", headers=h,
                            json={"templateID": snap.json()["snapshotID"]})
        assert child.status_code == 201, child.text
        resumed = [vm.resumed_from(s.id) for s in manager.list()]
        assert resumed.count(image) == 1
        forks = client.post(f"/sandboxes/{sid}/fork", headers=h,
                            json={"count": 2, "memory": True})
        assert forks.status_code == 201, forks.text
        assert [vm.resumed_from(s.id) for s in manager.list()].count(
            vm.memory_snapshots[-1][2]) == 2
        bad = client.post(f"/sandboxes/{sid}/snapshots", headers=h, json={"memory": "yes"})
        assert bad.status_code == 400 and "true or false" in bad.json()["message"]
    client, h = client_and_key(plain)
    with client:
        sid = client.post("/v2/sandboxes", headers=h,
                          json={"templateID": "base"}).json()["sandboxID"]
        refused = client.post(f"/sandboxes/{sid}/snapshots", headers=h, json={"memory": True})
        assert refused.status_code == 400 and "microvm tier" in refused.json()["message"]
        plain_snap = client.post(f"/sandboxes/{sid}/snapshots", headers=h, json={})
        assert plain_snap.status_code == 201


class _FailingVM(MemoryVMBackend):
    """Saves part of an image, then fails (a QEMU that died mid-migration)."""

    def snapshot_memory(self, spec: Any, layer_id: str, image_id: str) -> Any:
        with self._lock:
            self._images[image_id] = layer_id
        raise SandboxBusy("the VM stopped answering")


def test_a_failed_memory_snapshot_leaves_no_record_and_no_image(tmp_path: Path) -> None:
    vm = _FailingVM()
    manager = memory_manager(tmp_path, backend=vm)
    try:
        sb = manager.create()
        for call in (lambda: manager.snapshot(sb.id, memory=True),
                     lambda: manager.fork(sb.id, 2, memory=True)):
            with pytest.raises(SandboxBusy, match="stopped answering"):
                call()
        assert vm.memory_image_ids() == [] and manager.store.memory_image_ids() == set()
        assert manager.list_snapshots() == [] and len(manager.list()) == 1
        assert manager.sandboxes.get(sb.id).layer is None
    finally:
        manager.close()


def test_the_sweep_removes_images_without_a_record_only(manager: Manager,
                                                        vm: MemoryVMBackend) -> None:
    sb = manager.create()
    manager.snapshot(sb.id, memory=True)
    (kept,) = vm.memory_image_ids()
    # Being made right now elsewhere: recorded (unsettled) before the tier makes it.
    manager.store.add_memory_image("mem_inflight0000", layer="lyr_inflight0000",
                                   isolation="namespace", resources="small", template="base")
    with vm._lock:
        vm._images["mem_inflight0000"] = "lyr_inflight0000"
        vm._images["mem_orphan000000"] = "lyr_gone"  # a crash between making and recording
    removed = manager.recover()
    assert "memory image mem_orphan000000" in removed
    assert vm.memory_image_ids() == sorted([kept, "mem_inflight0000"])
    # An unsettled image is not collected while young, and is once a crash has aged it.
    manager.snapshots._layers.collect()
    assert "mem_inflight0000" in vm.memory_image_ids()
    with manager.store._tx() as db:
        db.execute("UPDATE memory_images SET created_at = 0 WHERE id = 'mem_inflight0000'")
    manager.snapshots._layers.collect()
    assert vm.memory_image_ids() == [kept]
