"""Snapshots: sealing a workspace into a read-only layer, forking from it, restoring to it,
and deleting snapshots (their layers go when nothing uses them).

A memory snapshot (``memory=True``, a tier with ``MemorySnapshots``) also saves the running
sandbox's memory and processes as a memory image, at one instant, while commands run; a
sandbox started from it (fork, create, restore) resumes that image over its layer."""

from __future__ import annotations

import builtins
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator

from .._audit.auditor import Auditor
from .._core.diskfull import insufficient, is_disk_full
from .._core.failpoints import failpoint
from ..errors import (
    DiskFullError,
    SandboxBusy,
    SnapshotInUse,
    SnapshotNotFound,
    UsageError,
)
from ..models import SnapshotInfo
from . import validate
from .admission import Admission, check_sandbox_count
from .egress import network_spec, policy_from
from .intents import Intents
from .layers import Layers
from .locks import WorkspaceLocks
from .memimages import capable, check_resumable
from .processes import ProcessTable
from .records import ASLEEP, SandboxRecord, new_id
from .sandboxes import Sandboxes, find_snapshot
from .store import Store
from .tenants import Tenant

__all__ = ["Snapshots", "is_running"]

logger = logging.getLogger(__name__)


def is_running(sandboxes: Sandboxes, processes: ProcessTable, info: SandboxRecord) -> bool:
    """True while a background process or any command (from any process) runs in it."""
    return processes.any_live(info.id) or sandboxes.busy(info)


class Snapshots:
    def __init__(self, *, store: Store, sandboxes: Sandboxes, processes: ProcessTable,
                 layers: Layers, locks: WorkspaceLocks, auditor: Auditor,
                 admission: Admission, intents: Intents) -> None:
        self._store = store
        self._intents = intents
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
    def _quiet(self, info: SandboxRecord, doing: str) -> Iterator[SandboxRecord]:
        """Hold the workspace exclusively, with nothing running in it (else SandboxBusy);
        yields the sandbox's record as it is now, under the lock. Not ``info``: a snapshot or
        fork that held the lock before us has sealed a layer since ``info`` was read, and
        sealing by a stale layer stack would drop that layer (the workspace lost its files
        to two forks at once from two threads)."""
        with self._locks.hold(info.id, exclusive=True):
            fresh = self._sandboxes.get(info.id)
            if is_running(self._sandboxes, self._processes, fresh):
                raise SandboxBusy(
                    f"sandbox {info.id} has running commands or background processes; wait "
                    f"for them (or kill them) before {doing}")
            yield fresh

    def _seal(self, info: SandboxRecord, operation: str) -> str:
        """Seal the sandbox's writable layer into a new read-only layer; return its id. Under
        an intent record (``intents``): a crash at any step leaves the layer recorded and the
        sandbox on it, or the sandbox as it was, never its files in an unrecorded layer."""
        if info.state in ASLEEP:
            raise SandboxBusy(f"sandbox {info.id} is {info.state}; resume() it first")
        backend = self._sandboxes.backend(info)
        with self._quiet(info, "taking a snapshot") as fresh:
            layer = new_id("lyr")
            intent = self._store.begin_intent("seal", info.id, layer=layer, operation=operation)
            with self._settled_on_error(intent):
                result = backend.seal_workspace(self._sandboxes.spec(fresh), layer)
            parent = result.layers[1] if len(result.layers) > 1 else None
            self._store.seal_done(info.id, layer, parent=parent, bytes_used=result.bytes_used,
                                  intent=intent)
            failpoint("seal.recorded")
        if result.squashed:
            self._layers.collect()
        return layer

    @contextlib.contextmanager
    def _settled_on_error(self, intent: str) -> Iterator[None]:
        """An intent whose change failed here is finished or undone here too (the tier undoes
        what it can of a failed step; this makes the store agree). If even that fails, the
        record stays for the next start's recovery."""
        try:
            yield
        except BaseException as exc:
            record = next((i for i in self._store.intents() if i["id"] == intent), None)
            if record is not None:
                try:
                    self._intents.resolve(record)
                except Exception:
                    logger.exception("an interrupted %s (%s) is left to recovery",
                                     record["kind"], intent)
            if is_disk_full(exc) and not isinstance(exc, DiskFullError):
                raise insufficient(self._store.path.parent, str(exc)[:200]) from exc
            raise

    def _seal_memory(self, info: SandboxRecord) -> tuple[str, str]:
        """Seal the writable layer and save the running sandbox's memory as a memory image,
        commands running or not; return (layer, image). The image is recorded unsettled
        (before it exists, so no sweep takes it for a leftover, and no collect takes it
        before anything names it): the caller settles it once a snapshot or child does."""
        if info.state in ASLEEP:
            raise SandboxBusy(f"sandbox {info.id} is {info.state}; resume() it before a memory "
                              "snapshot (its memory is saved running)")
        backend = capable(self._sandboxes.backend(info), "snapshot(memory=True)")
        with self._locks.sealing(info.id):
            info = self._sandboxes.get(info.id)  # as it is now: see _quiet
            layer, image = new_id("lyr"), new_id("mem")
            self._store.add_memory_image(image, layer=layer, isolation=info.isolation,
                                         resources=info.resources, template=info.template)
            intent = self._store.begin_intent("seal", info.id, layer=layer,
                                         operation="memory snapshot")
            try:
                with self._settled_on_error(intent):
                    result = backend.snapshot_memory(self._sandboxes.spec(info), layer, image)
            except BaseException:
                with contextlib.suppress(Exception):
                    backend.remove_memory_image(image)  # whatever a failed save left
                self._store.delete_memory_image(image)
                raise
            parent = result.layers[1] if len(result.layers) > 1 else None
            self._store.seal_done(info.id, layer, parent=parent, bytes_used=result.bytes_used,
                                  intent=intent)
        if result.squashed:
            self._layers.collect()
        return layer, image

    def snapshot(self, sandbox_id: str, *, name: str | None, tenant: str | None,
                 memory: bool = False) -> SnapshotInfo:
        name = validate.snapshot_name(name)
        info = self._sandboxes.get(sandbox_id, tenant=tenant)
        if name is not None and self._store.snapshot(name, tenant=info.tenant) is not None:
            raise UsageError(f"a snapshot named {name!r} already exists; choose another name or "
                             f"remove it with `corral snapshots rm {name}`")
        started = time.monotonic()
        image: str | None = None
        if memory:
            layer, image = self._seal_memory(info)
        else:
            layer = self._seal(info, "snapshot")
        failpoint("snapshot.sealed")
        try:
            snap = self._store.add_snapshot(new_id("snap"), name=name, tenant=info.tenant,
                                            layer=layer, template=info.template,
                                            sandbox=info.id, memory_image=image)
        except BaseException:
            if image is not None:  # nothing names it (a name taken meanwhile): it goes now
                self._store.settle_memory_image(image)
                self._layers.collect()
            raise
        if image is not None:
            self._store.settle_memory_image(image)
        self._auditor.event(info.id, "snapshot.created", {
            "snapshot": snap.id, "name": name, "layer": layer, "depth": snap.depth,
            "size_bytes": snap.size_bytes, "memory": memory,
            **({"memory_image": image} if image is not None else {}),
            "duration_ms": round((time.monotonic() - started) * 1000, 3)})
        self._auditor.count("corral_snapshots_created")
        return snap

    def fork(self, sandbox_id: str, count: int, *, tenant: str | None,
             max_for_tenant: int | None, caller: Tenant | None,
             memory: bool = False) -> builtins.list[SandboxRecord]:
        validate.fork_count(count)
        if caller is not None and not caller.is_local:
            tenant = caller.name if tenant is None else tenant
        max_for_tenant = self._admission.sandbox_limit(caller, max_for_tenant)
        info = self._sandboxes.get(sandbox_id, tenant=tenant)
        self._check_policy(info, caller)  # before sealing: a refused fork changes nothing
        if max_for_tenant is not None:  # so is a fork past the quota (each insert decides)
            check_sandbox_count(info.tenant, self._store.count_sandboxes(info.tenant),
                                max_for_tenant, adding=count)
        if memory:
            capable(self._sandboxes.backend(info), "fork(memory=True)")  # before sealing too
        children: list[SandboxRecord] = []
        image: str | None = None
        if memory:
            layer, image = self._seal_memory(info)
        else:
            layer = self._seal(info, "fork")
        failpoint("fork.sealed")
        origin: dict[str, object] = {"forked_from": info.id, "layer": layer}
        if image is not None:
            origin["memory_image"] = image

        def child() -> SandboxRecord:
            made = self._sandboxes.create(
                template=info.template, resources=info.resources, timeout=None,
                labels=info.labels, network=network_spec(info.network),
                secrets=sorted(info.secrets), tenant=info.tenant,
                max_for_tenant=max_for_tenant, idle_timeout=info.idle_timeout,
                isolation=info.isolation, snapshot=None, caller=caller,
                parent_layer=layer, origin=origin, memory_image=image,
                # A volume has one writer: children get the read-only mounts only.
                mounts=[m for m in info.mounts if m["read_only"]], lifecycle=info.lifecycle)
            failpoint("fork.child-made")
            return made

        try:
            # The children start side by side, a few at a time: a microVM child's start is
            # seconds of mostly one CPU, and each other tier's is a few processes' work.
            workers = min(count, max(2, os.cpu_count() or 1))
            with concurrent.futures.ThreadPoolExecutor(workers, "corral-fork") as pool:
                futures = [pool.submit(child) for _ in range(count)]  # all end with the pool
            children = [f.result() for f in futures if f.exception() is None]
            for future in futures:
                if (failed := future.exception()) is not None:
                    raise failed
        except BaseException:
            for made in children:
                with contextlib.suppress(Exception):
                    self._sandboxes.destroy(made, reason="fork failed")
            if image is not None:  # nothing names it: it goes now
                self._store.settle_memory_image(image)
                self._layers.collect()
            raise
        if image is not None:  # the children name it now
            self._store.settle_memory_image(image)
        self._auditor.event(info.id, "sandbox.forked", {
            "children": [c.id for c in children], "layer": layer, "memory": memory,
            **({"memory_image": image} if image is not None else {})})
        return children

    def restore(self, sandbox_id: str, snapshot: str, *, tenant: str | None,
                caller: Tenant | None) -> SandboxRecord:
        if caller is not None and not caller.is_local and tenant is None:
            tenant = caller.name
        info = self._sandboxes.get(sandbox_id, tenant=tenant)
        self._check_policy(info, caller)
        if info.state in ASLEEP:
            raise SandboxBusy(f"sandbox {sandbox_id} is {info.state}; resume() it first")
        snap = self.get(snapshot, tenant=info.tenant)
        layer = self._store.snapshot_layer(snap.id)
        image = self._store.snapshot_memory_image(snap.id)
        backend = self._sandboxes.backend(info)
        if image is not None:
            # The tier restarts the sandbox from the image: its memory and processes too.
            capable(backend, "restoring a memory snapshot")
            recorded = self._store.memory_image(image)
            if recorded is None:
                raise SnapshotNotFound(f"memory image {image} of snapshot {snapshot} is gone; "
                                       "take the snapshot again")
            check_resumable(recorded, snapshot=snapshot, template=info.template,
                            resources=info.resources, isolation=info.isolation)
        with self._quiet(info, "restoring") as fresh:
            info = dataclasses.replace(fresh, layer=layer, memory_image=image)
            # Begun, a restore has dropped the writable layer: a crash's only way on is forward.
            intent = self._store.begin_intent("restore", info.id, layer=layer, memory_image=image,
                                         operation="restore")
            with self._settled_on_error(intent):
                backend.reset_workspace(self._sandboxes.spec(info))
                failpoint("restore.reset")
            self._store.restore_done(info.id, layer, memory_image=image, intent=intent)
        self._layers.collect()
        self._auditor.event(info.id, "snapshot.restored", {
            "snapshot": snap.id, "name": snap.name, "layer": layer, "memory": image is not None,
            **({"memory_image": image} if image is not None else {})})
        return self._sandboxes.get(sandbox_id)

    def get(self, ref: str, *, tenant: str | None) -> SnapshotInfo:
        return find_snapshot(self._store, ref, tenant=tenant)

    def list(self, *, tenant: str | None) -> builtins.list[SnapshotInfo]:
        return self._store.snapshots(tenant=tenant)

    def delete(self, ref: str, *, tenant: str | None) -> None:
        """Delete a snapshot no live sandbox is built on (refused while one is)."""
        snap = self.get(ref, tenant=tenant)
        layer = self._store.snapshot_layer(snap.id)
        image = self._store.snapshot_memory_image(snap.id)
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
            "snapshot": snap.id, "name": snap.name, "layer": layer, "memory": image is not None,
            **({"memory_image": image} if image is not None else {})})
