"""Snapshots, forks and restores."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Response

from ..._control.requests import Fork, Restore, TakeSnapshot
from ..._http.deps import ManagerDep, TenantDep, scope
from ...models import SandboxInfo, SnapshotInfo

__all__ = ["router"]

router = APIRouter()
# A POST without a body takes one unnamed snapshot, or makes one fork (the models are
# frozen: one shared default each).
_NO_BODY_SNAPSHOT = TakeSnapshot()
_NO_BODY_FORK = Fork()


@router.post("/v1/sandboxes/{sandbox_id}/snapshots", status_code=201,
             response_model=SnapshotInfo)
def take_snapshot(sandbox_id: str, who: TenantDep, manager: ManagerDep,
                  body: Annotated[TakeSnapshot, Body()] = _NO_BODY_SNAPSHOT) -> SnapshotInfo:
    """Seal the workspace's current state as a snapshot (409 while anything runs in it);
    with ``memory``, the running sandbox's memory and processes too, while they run."""
    return manager.snapshot(sandbox_id, name=body.name, tenant=scope(who), memory=body.memory)


@router.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201,
             response_model=list[SandboxInfo])
def fork(sandbox_id: str, who: TenantDep, manager: ManagerDep,
         body: Annotated[Fork, Body()] = _NO_BODY_FORK) -> list[SandboxInfo]:
    """``count`` new sandboxes starting from this one's workspace as it is now; they count
    against the tenant's sandbox quota (all or none are made)."""
    children = manager.fork(sandbox_id, body.count, tenant=scope(who), caller=who,
                            memory=body.memory)
    return children


@router.post("/v1/sandboxes/{sandbox_id}/restore", response_model=SandboxInfo)
def restore(sandbox_id: str, body: Restore, who: TenantDep, manager: ManagerDep) -> SandboxInfo:
    """Put the workspace back exactly as it was in the snapshot (409 while anything runs)."""
    return (manager.restore(sandbox_id, body.snapshot, tenant=scope(who),
                                         caller=who))


@router.get("/v1/snapshots", response_model=list[SnapshotInfo])
def list_snapshots(who: TenantDep, manager: ManagerDep) -> list[SnapshotInfo]:
    """Your tenant's snapshots, newest first."""
    return manager.list_snapshots(tenant=scope(who))


@router.get("/v1/snapshots/{ref}", response_model=SnapshotInfo)
def get_snapshot(ref: str, who: TenantDep, manager: ManagerDep) -> SnapshotInfo:
    """One snapshot, by id or name."""
    return manager.get_snapshot(ref, tenant=scope(who))


@router.delete("/v1/snapshots/{ref}", status_code=204)
def delete_snapshot(ref: str, who: TenantDep, manager: ManagerDep) -> Response:
    """Delete a snapshot; refused (409) while a sandbox is built on it."""
    manager.delete_snapshot(ref, tenant=scope(who))
    return Response(status_code=204)
