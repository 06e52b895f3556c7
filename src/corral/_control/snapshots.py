"""Snapshots: sealing a workspace into a read-only layer, forking from it, restoring to it,
and deleting snapshots (their layers go when nothing uses them)."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import time
from collections.abc import Iterator

from .._audit.auditor import Auditor
from ..errors import SandboxBusy, SnapshotInUse, UsageError
from ..models import SnapshotInfo
from . import validate
from .egress import network_spec, policy_from
from .layers import Layers
from .locks import WorkspaceLocks
from .processes import ProcessTable
from .records import SandboxRecord
from .sandboxes import Sandboxes, find_snapshot, new_id
from .store import Store
from .tenants import Admission, Tenant

__all__ = ["Snapshots", "is_running"]


def is_running(sandboxes: Sandboxes, processes: ProcessTable, info: SandboxRecord) -> bool:
    """True while a background process or any command (from any process) runs in it."""
    return processes.any_live(info.id) or sandboxes.busy(info)


class Snapshots:
    def __init__(self, *, store: Store, sandboxes: Sandboxes, processes: ProcessTable,
                 layers: Layers, locks: WorkspaceLocks, auditor: Auditor,
                 admission: Admission) -> None:
        self._store = store
        self._sandboxes = sandboxes
        self._processes = processes
        self._layers = layers
        self._locks = locks
        self._auditor = auditor
        self._admission = admission

    def _check_policy(self, info: SandboxRecord, caller: Tenant | None) -> None:
        self._admission.check_policy(
            caller=caller, tenant=info.tenant, template=info.template,
            isolation=info.isolation, resources=info.resources,
            network=policy_from(network_spec(info.network)), secrets=sorted(info.secrets))

    @contextlib.contextmanager
    def _quiet(self, info: SandboxRecord, doing: str) -> Iterator[None]:
        """Hold the workspace exclusively, with nothing running in it (else SandboxBusy)."""
        with self._locks.hold(info.id, exclusive=True):
            if is_running(self._sandboxes, self._processes, info):
                raise SandboxBusy(
                    f"sandbox {info.id} has running commands or background processes; wait "
                    f"for them (or kill them) before {doing}")
            yield

    def _seal(self, info: SandboxRecord) -> str:
        """Seal the sandbox's writable layer into a new read-only layer; return its id."""
        if info.state == "paused":
            raise SandboxBusy(f"sandbox {info.id} is paused; resume() it first")
        backend = self._sandboxes.backend(info)
        with self._quiet(info, "taking a snapshot"):
            layer = new_id("lyr")
            result = backend.seal_workspace(self._sandboxes.spec(info), layer)
            parent = result.layers[1] if len(result.layers) > 1 else None
            self._store.add_layer(layer, parent=parent, bytes_used=result.bytes_used)
            self._store.set_layer(info.id, layer)
        if result.squashed:
            self._layers.collect()
        return layer

    def snapshot(self, sandbox_id: str, *, name: str | None,
                 tenant: str | None) -> SnapshotInfo:
        name = validate.snapshot_name(name)
        info = self._sandboxes.get(sandbox_id, tenant=tenant)
        if name is not None and self._store.snapshot(name, tenant=info.tenant) is not None:
            raise UsageError(f"a snapshot named {name!r} already exists; choose another name or "
                             f"remove it with `corral snapshots rm {name}`")
        started = time.monotonic()
        layer = self._seal(info)
        snap = self._store.add_snapshot(new_id("snap"), name=name, tenant=info.tenant,
                                        layer=layer, template=info.template, sandbox=info.id)
        self._auditor.event(info.id, "snapshot.created", {
            "snapshot": snap.id, "name": name, "layer": layer, "depth": snap.depth,
            "size_bytes": snap.size_bytes,
            "duration_ms": round((time.monotonic() - started) * 1000, 3)})
        self._auditor.count("corral_snapshots_created")
        return snap

    def fork(self, sandbox_id: str, count: int, *, tenant: str | None,
             max_for_tenant: int | None, caller: Tenant | None) -> builtins.list[SandboxRecord]:
        validate.fork_count(count)
        if caller is not None and not caller.is_local:
            tenant = caller.name if tenant is None else tenant
            max_for_tenant = caller.max_sandboxes if max_for_tenant is None else max_for_tenant
        info = self._sandboxes.get(sandbox_id, tenant=tenant)
        self._check_policy(info, caller)  # before sealing: a refused fork changes nothing
        layer = self._seal(info)
        children: list[SandboxRecord] = []
        try:
            for _ in range(count):
                children.append(self._sandboxes.create(
                    template=info.template, resources=info.resources, timeout=None,
                    labels=info.labels, network=network_spec(info.network),
                    secrets=sorted(info.secrets), tenant=info.tenant,
                    max_for_tenant=max_for_tenant, idle_timeout=info.idle_timeout,
                    isolation=info.isolation, snapshot=None, caller=caller, parent_layer=layer,
                    origin={"forked_from": info.id, "layer": layer}))
        except BaseException:
            for child in children:
                with contextlib.suppress(Exception):
                    self._sandboxes.destroy(child, reason="fork failed")
            raise
        self._auditor.event(info.id, "sandbox.forked", {
            "children": [c.id for c in children], "layer": layer})
        return children

    def restore(self, sandbox_id: str, snapshot: str, *, tenant: str | None,
                caller: Tenant | None) -> SandboxRecord:
        if caller is not None and not caller.is_local and tenant is None:
            tenant = caller.name
        info = self._sandboxes.get(sandbox_id, tenant=tenant)
        self._check_policy(info, caller)
        if info.state == "paused":
            raise SandboxBusy(f"sandbox {sandbox_id} is paused; resume() it first")
        snap = self.get(snapshot, tenant=info.tenant)
        layer = self._store.snapshot_layer(snap.id)
        backend = self._sandboxes.backend(info)
        with self._quiet(info, "restoring"):
            info = dataclasses.replace(info, layer=layer)
            backend.reset_workspace(self._sandboxes.spec(info))
            self._store.set_layer(info.id, layer)
        self._layers.collect()
        self._auditor.event(info.id, "snapshot.restored", {
            "snapshot": snap.id, "name": snap.name, "layer": layer})
        return self._sandboxes.get(sandbox_id)

    def get(self, ref: str, *, tenant: str | None) -> SnapshotInfo:
        return find_snapshot(self._store, ref, tenant=tenant)

    def list(self, *, tenant: str | None) -> builtins.list[SnapshotInfo]:
        return self._store.snapshots(tenant=tenant)

    def delete(self, ref: str, *, tenant: str | None) -> None:
        """Delete a snapshot no live sandbox is built on (refused while one is)."""
        snap = self.get(ref, tenant=tenant)
        layer = self._store.snapshot_layer(snap.id)
        with self._layers.lock:
            users = [s.id for s in self._store.list()
                     if layer in self._store.layer_chain(s.layer)]
            if users:
                shown = ", ".join(users[:5]) + (f" and {len(users) - 5} more"
                                                 if len(users) > 5 else "")
                raise SnapshotInUse(
                    f"snapshot {snap.name or snap.id} is in use: sandboxes {shown} are built on "
                    "it; destroy them or restore them to another snapshot first")
            self._store.delete_snapshot(snap.id)
        self._layers.collect()
        self._auditor.event(snap.sandbox, "snapshot.deleted", {
            "snapshot": snap.id, "name": snap.name, "layer": layer})
