"""Sandboxes: create, list, look up, destroy; lifetime, network policy, pause and resume."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from ..._control.requests import CreateSandbox, NetworkRequest, SetTimeout
from ..._http.deps import ManagerDep, TenantDep, owned
from ...models import SandboxInfo

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/sandboxes", status_code=201, response_model=SandboxInfo)
def create_sandbox(body: CreateSandbox, who: TenantDep, manager: ManagerDep) -> SandboxInfo:
    """Create a sandbox: a template, a tier, limits, a lifetime (and what happens at its end), a
    network policy and secrets. It counts against your tenant's quota and ceiling; the answer
    is its record."""
    network = body.network if isinstance(body.network, str) else body.network.model_dump()
    # The snapshot is looked up among this tenant's own, so another's answers 404.
    info = manager.create(template=body.template, resources=body.resources,
                          timeout=body.timeout, labels=body.labels, network=network,
                          secrets=body.secrets, caller=who,
                          idle_timeout=body.idle_timeout,
                          isolation=body.isolation, snapshot=body.snapshot,
                          image=body.image,
                          volumes={name: where if isinstance(where, str) else where.model_dump()
                                   for name, where in body.volumes.items()},
                          data_mounts=body.data_mounts,
                          lifecycle=body.lifecycle.lifecycle() if body.lifecycle else None)
    return (info)


@router.get("/v1/sandboxes", response_model=list[SandboxInfo])
def list_sandboxes(who: TenantDep, manager: ManagerDep,
                   label: Annotated[list[str] | None, Query()] = None) -> list[SandboxInfo]:
    """Your tenant's live sandboxes, optionally only those whose labels match every `label` given
    (`key=value`)."""
    wanted = dict(item.partition("=")[::2] for item in (label or []))
    infos = manager.list(tenant=None if who.name == "local" else who.name)
    return [i for i in infos
            if all(i.labels.get(k) == v for k, v in wanted.items())]


@router.get("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo)
def get_sandbox(sandbox_id: str, who: TenantDep, manager: ManagerDep) -> SandboxInfo:
    """One sandbox's record: state, template, tier, limits, network, labels, when it expires."""
    return owned(manager, sandbox_id, who)


@router.delete("/v1/sandboxes/{sandbox_id}", status_code=204, responses={202: {
    "description": "Accepted: the destroy is still under way and finishes in the background "
                   "(the sandbox is gone for every caller already)."}})
def delete_sandbox(sandbox_id: str, who: TenantDep, manager: ManagerDep) -> Response:
    """Destroy the sandbox: its processes, workspace and network go; its audit trail stays. 202
    when the destroy finishes in the background."""
    owned(manager, sandbox_id, who)
    # A destroy that takes longer than a request should is left to finish on its own: the
    # caller is never held by a sandbox stuck in its destroy.
    return Response(status_code=204 if manager.destroy(sandbox_id) else 202)


@router.post("/v1/sandboxes/{sandbox_id}/timeout", response_model=SandboxInfo)
def set_timeout(sandbox_id: str, body: SetTimeout,
                who: TenantDep, manager: ManagerDep) -> SandboxInfo:
    """Set how many seconds from now the sandbox lives (bounded by the tenant's ceiling); the
    reaper destroys it then."""
    owned(manager, sandbox_id, who)
    return manager.set_timeout(sandbox_id, body.timeout, caller=who)


@router.put("/v1/sandboxes/{sandbox_id}/network", response_model=SandboxInfo)
def set_network(sandbox_id: str, body: NetworkRequest,
                who: TenantDep, manager: ManagerDep) -> SandboxInfo:
    """Replace the sandbox's network policy (allowed hosts, secrets bound to hosts) while it
    runs."""
    owned(manager, sandbox_id, who)
    return manager.set_network(sandbox_id, body.model_dump(), caller=who)


@router.post("/v1/sandboxes/{sandbox_id}/pause", response_model=SandboxInfo)
def pause(sandbox_id: str, who: TenantDep, manager: ManagerDep) -> SandboxInfo:
    """Freeze every process of the sandbox (its lifetime keeps running); commands are refused
    until it is resumed."""
    owned(manager, sandbox_id, who)
    return manager.pause(sandbox_id)


@router.post("/v1/sandboxes/{sandbox_id}/hibernate", response_model=SandboxInfo)
def hibernate(sandbox_id: str, who: TenantDep, manager: ManagerDep) -> SandboxInfo:
    """Release every kernel piece of the sandbox (processes, mounts, loop devices, cgroup,
    network namespace), its files and /tmp kept on disk; woken by resume (or, with
    auto_resume, by the next call). Refused (409) while a process of it runs."""
    owned(manager, sandbox_id, who)
    return manager.hibernate(sandbox_id)


@router.post("/v1/sandboxes/{sandbox_id}/resume", response_model=SandboxInfo)
def resume(sandbox_id: str, who: TenantDep, manager: ManagerDep) -> SandboxInfo:
    """Thaw a paused sandbox or wake a hibernated one; refused while it is over its audit
    budget."""
    owned(manager, sandbox_id, who)
    return manager.resume(sandbox_id)
