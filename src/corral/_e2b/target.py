"""The sandbox a sandbox-plane request addresses, resolved and checked by the app (``app.py``)
before any envd or code-interpreter handler runs."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection

from .._control.plane import Tenant

__all__ = ["ENVD_PORT", "JUPYTER_PORT", "SandboxTarget", "target_of"]

ENVD_PORT = 49983
JUPYTER_PORT = 49999
SCOPE_KEY = "corral.e2b.target"
TENANT_KEY = "corral.e2b.tenant"  # the control plane's caller, from X-API-KEY


@dataclass(frozen=True, slots=True)
class SandboxTarget:
    sandbox_id: str  # Corral's id; the sandbox exists and belongs to ``owner``
    e2b_id: str  # the id the SDK uses
    owner: Tenant  # the sandbox's tenant: the caller for quotas and ceilings
    port: int  # ENVD_PORT or JUPYTER_PORT
    envd_token: str  # signs /files URLs
    authenticated: bool  # the request carried the sandbox's token


def target_of(request: HTTPConnection) -> SandboxTarget:
    target = request.scope.get(SCOPE_KEY)
    if not isinstance(target, SandboxTarget):
        raise RuntimeError("an E2B sandbox-plane handler ran without a resolved sandbox")
    return target
