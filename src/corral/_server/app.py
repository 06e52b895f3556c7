"""The HTTP API (FastAPI): the embedded control plane, per tenant, over JSON and NDJSON.

This module assembles the app: the issue-11 middlewares (``corral._http.guard``), the error
handlers, and one router per resource (``routes/``). Endpoints are plain functions run in the
thread pool (the control plane is synchronous); command output streams as NDJSON lines
``{"type": "stdout"|"stderr", "data": ...}`` ending with ``{"type": "result", ...}``. Errors
are ``{"error": <code>, "message": ...}`` with the status the error class carries. The
dashboard is mounted on it by ``corral._serve.app``, not here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .._control.plane import Manager, PortURLs, Tenant, TenantDirectory
from .._control.requests import refusal
from .._http.bodies import BODY_LIMITS, MAX_COMMAND_BODY, MAX_FILE_BODY, MAX_JSON_BODY
from .._http.errorlog import ServerErrorLog
from .._http.errors import as_native, failure
from .._http.guard import (
    AnyName,
    Authenticate,
    BodyLimit,
    HostGuard,
    OriginGuard,
    OwnerFirst,
    ServiceNames,
)
from .._http.keys import is_loopback, is_protected, key_authenticator
from .._http.portproxy import PortProxy, PortRouting
from ..errors import CorralError, SandboxNotFound
from .openapi import TAGS, describe
from .routes import (
    audit,
    code,
    commands,
    files,
    ports,
    processes,
    sandboxes,
    snapshots,
    volumes,
)
from .schemas import _ERRORS

# The body limits are part of the service's contract; importable from here, as before.
__all__ = ["BODY_LIMITS", "LOOPBACK_PORTS_DOMAIN", "MAX_COMMAND_BODY", "MAX_FILE_BODY",
           "MAX_JSON_BODY", "create_app"]


#: The ports domain of a service only browsers on this machine reach, when it names none.
LOOPBACK_PORTS_DOMAIN = "localhost"


def _owner_check(manager: Manager) -> Any:
    """Whether a sandbox is the tenant's, with no side effect (expiry and state are the route's
    own full check). A sandbox's tenant never changes, so once the control plane has read it
    the answer comes from memory, on the event loop: no thread, no store read."""

    async def owner(who: Tenant, sandbox_id: str) -> None:
        tenant = manager.owner(sandbox_id, known_only=True)
        if tenant is None:
            tenant = await run_in_threadpool(manager.owner, sandbox_id)
        if tenant is None or (who.scope is not None and tenant != who.scope):
            raise SandboxNotFound(f"sandbox {sandbox_id[:40]} does not exist; `corral ls` "
                                  "lists them")

    return owner


def create_app(manager: Manager, *, listen_host: str = "127.0.0.1",
               host_names: Sequence[str] = (), allow_keyless: bool = False,
               ports_domain: str | None = None, tenants: TenantDirectory | None = None,
               sessions: Callable[[str], Tenant] | None = None) -> FastAPI:
    """The API for ``manager``. Auth is required unless listening on loopback with no keys
    (and none ever, unless ``allow_keyless``). It answers to ``host_names`` besides the listen
    address, ``localhost``, ``127.0.0.1`` and ``[::1]``. Raises ValueError for a malformed
    name. ``tenants``: who callers are, instead of the keys in ``manager``'s store (a cluster
    node's: the gateways' signed callers); with it, every call needs one, and any Host is
    answered (``AnyName``: the gateway judged it). ``sessions``: the tenant a dashboard
    session cookie belongs to (``corral._serve`` passes the dashboard's; used only with this
    service's own keys). The dashboard's pages are not this module's: ``corral._serve.app``
    mounts them."""
    own_keys = tenants is None
    tenants = tenants or manager.tenants
    loopback = is_loopback(listen_host) and own_keys
    names = ServiceNames.of(listen_host, host_names) if own_keys else AnyName()
    # /docs is the dashboard module's, from assets in the package; ReDoc would need a CDN.
    app = FastAPI(title="Corral", version="0.1.0", responses=_ERRORS, docs_url=None,
                  redoc_url=None, openapi_tags=[{"name": name, "description": text}
                                                for name, text in TAGS.items()],
                  description="Sandboxes for AI agents: commands, files, network policy, "
                              "audit. Authenticate with `Authorization: Bearer ck_...` (an API "
                              "key); errors are `{\"error\": code, \"message\"}`.")
    describe(app)
    app.state.manager = manager
    app.state.tenants = tenants
    app.state.loopback = loopback
    # add_middleware wraps: the last added runs first (Host, body, key, Origin, owner).
    app.add_middleware(OwnerFirst, check=_owner_check(manager))
    app.add_middleware(OriginGuard, names=names)
    app.add_middleware(Authenticate, protected=is_protected, authenticate=key_authenticator(
        manager.store, tenants, loopback=loopback, allow_keyless=allow_keyless),
        session=_session_authenticator(sessions) if sessions and own_keys else None)
    app.add_middleware(BodyLimit, limits=BODY_LIMITS)
    app.add_middleware(HostGuard, names=names)
    # Inside the port routing: a sandbox's app's own 5xx answers are not the service's.
    app.add_middleware(ServerErrorLog, surface="api")
    # Outermost: an exposed port's requests are the sandbox's app's, not the service's.
    if ports_domain is None and own_keys and manager.ports.urls.domain is None and \
            is_loopback(listen_host) and not any(n.strip() for n in host_names):
        # Browsers keep every name under localhost on loopback: a page a sandbox serves gets
        # an origin of its own there, never the service's (docs/ports-and-volumes.md).
        ports_domain = LOOPBACK_PORTS_DOMAIN
    if ports_domain is not None:
        manager.ports.configure(PortURLs(base=manager.ports.urls.base, domain=ports_domain))
    app.add_middleware(PortRouting, proxy=PortProxy(manager, tenants), names=names)

    # Every failure is answered in Corral's own JSON (``corral._http.errors``): a Corral error,
    # the framework's own refusal (unparseable JSON, unknown route, wrong method), the request
    # models' refusal, and an exception nobody meant (a 500 that says nothing of it).
    @app.exception_handler(CorralError)
    @app.exception_handler(StarletteHTTPException)
    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        status, body = as_native(failure(exc, where=f"{request.method} {request.url.path}"))
        headers = exc.headers if isinstance(exc, StarletteHTTPException) else None
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # A control plane rule's error (the class the embedded SDK raises), or the shape's
        # problems as one InvalidRequestError.
        status, body = as_native(failure(refusal(exc.errors())))
        return JSONResponse(body, status_code=status)

    # Included in this order, the order of the OpenAPI document's paths.
    for module in (sandboxes, snapshots, commands, processes, code, files, ports, volumes, audit):
        app.include_router(module.router, tags=[module.__name__.rpartition(".")[2]])

    @app.get("/healthz", tags=["service"], openapi_extra={"security": []})
    def healthz() -> dict[str, str]:
        """200 with `{"status": "ok"}` while the service runs; needs no key."""
        return {"status": "ok"}

    return app


def _session_authenticator(sessions: Callable[[str], Tenant]) -> Any:
    async def authenticate(cookie: str) -> Tenant:
        return await run_in_threadpool(sessions, cookie)

    return authenticate


