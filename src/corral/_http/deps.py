"""What the routes depend on: the control plane, the caller's tenant, and ownership."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .._control.plane import Manager, Tenant
from ..models import SandboxInfo
from .guard import scope_tenant

__all__ = ["ManagerDep", "TenantDep", "owned", "scope"]


# async: resolved on the event loop, without a thread-pool hop per request.
async def _manager(request: Request) -> Manager:
    manager: Manager = request.app.state.manager
    return manager


async def _tenant(request: Request) -> Tenant:
    """The caller's tenant, resolved from its key by the Authenticate middleware."""
    return scope_tenant(request.scope)


# Module level: FastAPI resolves string annotations in the module's namespace.
ManagerDep = Annotated[Manager, Depends(_manager)]
TenantDep = Annotated[Tenant, Depends(_tenant)]


def scope(who: Tenant) -> str | None:
    """The tenant to scope control-plane calls to; None (everything) for local use."""
    return None if who.name == "local" else who.name


def owned(manager: Manager, sandbox_id: str, who: Tenant) -> SandboxInfo:
    """The sandbox, if it is the caller's (else SandboxNotFound, as if it did not exist)."""
    return manager.get(sandbox_id, tenant=scope(who))
