"""Exposed ports: expose, list, unexpose. The proxy itself is ``_http.portproxy``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query, Request, Response

from ..._control.plane import PortURLs
from ..._control.requests import ExposePort
from ..._http.deps import ManagerDep, TenantDep, scope
from ...models import PortInfo
from ..params import FloatText, IntText

__all__ = ["router"]

router = APIRouter()
# A POST without a body exposes a private port (the models are frozen: one shared default).
_NO_BODY = ExposePort()

PortPath = Annotated[int, IntText]


def _urls(request: Request, manager: ManagerDep) -> PortURLs:
    # The URL the caller reached the service at, unless the operator named one.
    configured = manager.ports.urls
    base = configured.base or str(request.base_url).rstrip("/")
    return PortURLs(base=base, domain=configured.domain)


@router.post("/v1/sandboxes/{sandbox_id}/ports/{port}", status_code=201,
             response_model=PortInfo)
def expose_port(sandbox_id: str, port: PortPath, request: Request, who: TenantDep,
                manager: ManagerDep,
                body: Annotated[ExposePort, Body()] = _NO_BODY) -> PortInfo:
    """Serve the sandbox's port through the proxy (idempotent); private unless ``public``.
    The answer holds its URLs, its token and a signed link for a browser."""
    return manager.ports.expose(sandbox_id, port, public=body.public,
                                link_ttl_s=body.link_ttl, tenant=scope(who),
                                urls=_urls(request, manager))


@router.get("/v1/sandboxes/{sandbox_id}/ports", response_model=list[PortInfo])
def list_ports(sandbox_id: str, request: Request, who: TenantDep, manager: ManagerDep,
               link_ttl: Annotated[float | None, Query(gt=0), FloatText] = None) -> list[PortInfo]:
    """The exposed ports, each with fresh signed links."""
    return manager.ports.list(sandbox_id, tenant=scope(who), link_ttl_s=link_ttl,
                              urls=_urls(request, manager))


@router.delete("/v1/sandboxes/{sandbox_id}/ports/{port}", status_code=204)
def unexpose_port(sandbox_id: str, port: PortPath, who: TenantDep,
                  manager: ManagerDep) -> Response:
    """Stop serving the port; its token and links stop working at once."""
    manager.ports.unexpose(sandbox_id, port, tenant=scope(who))
    return Response(status_code=204)
