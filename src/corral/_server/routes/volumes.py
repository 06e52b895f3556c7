"""Persistent named volumes: create, list, look up, delete."""

from __future__ import annotations

from fastapi import APIRouter, Response

from ..._control.requests import CreateVolume
from ..._http.deps import ManagerDep, TenantDep, scope
from ...models import VolumeInfo

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/volumes", status_code=201, response_model=VolumeInfo)
def create_volume(body: CreateVolume, who: TenantDep, manager: ManagerDep) -> VolumeInfo:
    """An empty volume of ``size`` (bytes, or ``512M``/``10G``), owned by your tenant."""
    return manager.volumes.create(body.name, body.size, tenant=scope(who) or "local")


@router.get("/v1/volumes", response_model=list[VolumeInfo])
def list_volumes(who: TenantDep, manager: ManagerDep) -> list[VolumeInfo]:
    """Your tenant's volumes."""
    return manager.volumes.list(tenant=scope(who))


@router.get("/v1/volumes/{ref}", response_model=VolumeInfo)
def get_volume(ref: str, who: TenantDep, manager: ManagerDep) -> VolumeInfo:
    """One volume, by id or name."""
    return manager.volumes.get(ref, tenant=scope(who))


@router.delete("/v1/volumes/{ref}", status_code=204)
def delete_volume(ref: str, who: TenantDep, manager: ManagerDep) -> Response:
    """Delete a volume and its data; refused (409) while a sandbox mounts it."""
    manager.volumes.delete(ref, tenant=scope(who))
    return Response(status_code=204)
