"""A node's copies of other nodes' snapshots, so a sandbox can start from any snapshot on any
node.

A snapshot lives where it was taken. A sandbox started from it elsewhere needs its workspace
there: the snapshot's node exports it once (``export_snapshot``: the workspace a sandbox
started from it sees, as a tar), Ray carries the tar from that node's object store to the
other node's, never through the gateway, and the other node seals it into a snapshot of its
own (``SnapshotCopies.make``), owned by the same tenant, from the same template. Every later
sandbox started from that snapshot on that node starts from the copy: a snapshot's layers
cross the network once per node.

The origin → copy map lives in the node's data directory, so it outlives the node's agent;
a copy deleted meanwhile is made again. Memory snapshots do not travel (the memory image is
the node's own): a sandbox from one is placed on the snapshot's node.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from .._control.plane import Manager
from ..errors import SnapshotNotFound, UsageError

__all__ = ["EXPORT_LABEL", "Exported", "SnapshotCopies", "export_snapshot"]

#: The label on the short-lived sandboxes that carry a snapshot between nodes, so their lines
#: in the audit trail say why they existed.
EXPORT_LABEL = "corral.cluster/snapshot-copy"


@dataclass(frozen=True, slots=True)
class Exported:
    """A snapshot's workspace on its way to another node."""

    origin: str  # the snapshot's id on its own node
    tenant: str
    template: str
    workspace: bytes  # a tar of /workspace


def export_snapshot(manager: Manager, ref: str, tenant: str | None) -> Exported:
    """The snapshot's workspace as a tar (``tenant``'s snapshot; anyone's with None)."""
    snap = manager.get_snapshot(ref, tenant=tenant)
    if snap.memory:
        raise UsageError(f"snapshot {snap.name or snap.id} holds a running sandbox's memory, "
                         "which stays on its own node: start sandboxes from it there")
    owner = manager.store.snapshot_tenant(snap.id)
    if owner is None:
        raise SnapshotNotFound(f"snapshot {ref!r} was deleted meanwhile")
    carrier = manager.create(snapshot=snap.id, tenant=owner, labels={EXPORT_LABEL: "export"})
    try:
        workspace = b"".join(manager.download(carrier.id, "/workspace"))
    finally:
        manager.destroy(carrier.id)
    return Exported(snap.id, owner, snap.template, workspace)


class SnapshotCopies:
    """This node's copies of snapshots from other nodes. Thread-safe."""

    def __init__(self, manager: Manager, home: Path) -> None:
        self._manager = manager
        self._path = home / "cluster-snapshot-copies.json"
        self._lock = threading.Lock()
        self._making: dict[str, threading.Lock] = {}

    def _load(self) -> dict[str, str]:
        try:
            loaded = json.loads(self._path.read_text())
        except FileNotFoundError:
            return {}
        return {str(k): str(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {}

    def _save(self, copies: dict[str, str]) -> None:
        temp = self._path.with_suffix(".tmp")
        temp.write_text(json.dumps(copies, sort_keys=True))
        os.replace(temp, self._path)

    def find(self, origin: str) -> str | None:
        """The copy of snapshot ``origin`` here, if there is one still."""
        with self._lock:
            local = self._load().get(origin)
        if local is None:
            return None
        try:
            self._manager.get_snapshot(local)
        except SnapshotNotFound:
            return None
        return local

    def make(self, exported: Exported) -> str:
        """The copy of ``exported``'s snapshot here: made from it unless another call made it
        first (one copy per node, however many creates ask at once)."""
        with self._lock:
            making = self._making.setdefault(exported.origin, threading.Lock())
        with making:
            found = self.find(exported.origin)
            if found is not None:
                return found
            carrier = self._manager.create(template=exported.template, tenant=exported.tenant,
                                           labels={EXPORT_LABEL: exported.origin})
            try:
                self._manager.upload(carrier.id, "/workspace", io.BytesIO(exported.workspace))
                local = self._manager.snapshot(carrier.id, tenant=exported.tenant).id
            finally:
                self._manager.destroy(carrier.id)
            with self._lock:
                copies = self._load()
                copies[exported.origin] = local
                self._save(copies)
            return local

    def drop(self, origin: str) -> bool:
        """Delete the copy of ``origin`` here (``SnapshotInUse`` while a sandbox is built on
        it, and the copy stays). False when there was none."""
        with self._lock:
            copies = self._load()
            local = copies.get(origin)
            if local is None:
                return False
            with contextlib.suppress(SnapshotNotFound):
                self._manager.delete_snapshot(local)
            del copies[origin]
            self._save(copies)
            return True

    def all(self) -> dict[str, str]:
        """origin → copy, for every copy here."""
        with self._lock:
            return self._load()
