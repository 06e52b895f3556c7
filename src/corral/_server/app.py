"""The HTTP API (FastAPI): the embedded control plane, per tenant, over JSON and NDJSON.

Endpoints are plain functions run in the thread pool (the control plane is synchronous); command
output streams as NDJSON lines ``{"type": "stdout"|"stderr", "data": ...}`` ending with
``{"type": "result", ...}``. Errors are ``{"error": <code>, "message": ...}`` with the status the
error class carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import ipaddress
import json
import logging
import os
import queue
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Annotated, Any, Literal

from fastapi import Body, Depends, FastAPI, Query, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .._audit.log import follow as follow_log
from .._audit.metrics import render
from .._backends import BACKENDS
from .._backends.namespace.template import require_template
from .._control import validate
from .._control.manager import Manager
from .._control.validate import MAX_FORKS as _MAX_FORKS
from .._core.resources import TIERS, get_tier
from .._workspace.files import to_relative
from ..errors import (
    AuthError,
    CorralError,
    SandboxNotFound,
    TooLarge,
)
from ..models import CommandResult, SandboxInfo, SnapshotInfo
from .auth import Tenant, TenantDirectory
from .guard import (
    Authenticate,
    BodyLimit,
    BodyLimits,
    HostGuard,
    OriginGuard,
    OwnerFirst,
    ServiceNames,
    scope_tenant,
)
from .terminal import serve_terminal

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

MAX_FILE_BODY = 64 * 1024 * 1024
# JSON bodies are parameters, not data; a command's may carry its stdin (64 MiB in the control
# plane), so that one route gets room for it.
MAX_JSON_BODY = 1024 * 1024
MAX_COMMAND_BODY = 96 * 1024 * 1024
_IN_SANDBOX = r"/v1/sandboxes/[^/]+"
BODY_LIMITS = BodyLimits(default=MAX_JSON_BODY, routes=(
    ("POST", re.compile(_IN_SANDBOX + "/commands"), MAX_COMMAND_BODY,
     "pass large input as a file (PUT .../files/content) and redirect from it"),
    ("POST", re.compile(_IN_SANDBOX + "/processes/[^/]+/input"), MAX_FILE_BODY,
     "send input in several requests"),
    ("PUT", re.compile(_IN_SANDBOX + "/files/content"), MAX_FILE_BODY,
     "upload large trees as a tar (PUT .../archive)"),
    # Streamed into the extractor, which enforces the sandbox's own disk limit.
    ("PUT", re.compile(_IN_SANDBOX + "/archive"), max(t.disk_bytes for t in TIERS.values()),
     "that is the largest disk of any resource tier"),
))


class _Strict(BaseModel):
    # strict: a JSON value of the wrong type is refused, never coerced ("5", true, "yes").
    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorOut(BaseModel):
    """Every error: a stable code (the SDK raises the matching class) and a message."""

    error: str
    message: str


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorOut, "description": why} for status, why in [
        (400, "Invalid input: bad command, path outside /workspace, unknown tier..."),
        (401, "Missing, unknown or revoked API key."),
        (403, "Refused by policy, beyond the tenant's ceiling (ceiling_exceeded: hosts, "
              "templates, tiers, secrets, lifetime), or a browser Origin that is not the "
              "service's own (origin_refused)."),
        (404, "No such sandbox, snapshot, command, process or file (or not the caller's)."),
        (409, "The sandbox is busy (being created, paused, or running something during a "
              "snapshot or restore), or the snapshot is in use."),
        (413, "The body is over its size limit."),
        (421, "The Host header is not one of the service's names."),
        (422, "The request does not match the schema."),
        (429, "A tenant quota (sandboxes, tiers, commands per minute: commands, background "
              "processes and terminals alike) or a sandbox limit."),
        (500, "An internal error."),
        (503, "The host cannot run sandboxes."),
    ]
}
_NDJSON = {"application/x-ndjson": {"schema": {"type": "string"}}}
_BINARY = {"schema": {"type": "string", "format": "binary"}}
_BINARY_BODY = {"requestBody": {"content": {"application/octet-stream": _BINARY}}}
_NonEmpty = Annotated[str, Field(min_length=1)]
_PathQuery = Annotated[str, Query(min_length=1, description="A path in /workspace.")]
_Seconds = Annotated[float, Field(gt=0)]
_SnapshotRef = Annotated[str, Field(min_length=1, description="A snapshot's id or name.")]
# The control plane's own rule (it also refuses names shaped like a snapshot id, with a 400).
_SnapshotName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}$")]


# The schema names the tiers and templates this server has (built from the same tables).
Tier: Any = Literal[tuple(TIERS)]
# Templates are built on the host at any time: the name's shape here, its existence at create.
Template = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,39}$")]
# Only tiers whose backend this build has: a named tier that is missing would fail on import.
# A tier that is here but that the host cannot run (no runsc, say) answers 503.
ISOLATION_TIERS = tuple(name for name, target in BACKENDS.items()
                        if importlib.util.find_spec(target.partition(":")[0]) is not None)
Isolation: Any = Literal[ISOLATION_TIERS]


class NetworkBody(_Strict):
    allow: list[str] = Field(default_factory=list)
    deny: list[str] = Field(default_factory=list)


class CreateSandbox(_Strict):
    template: Template | None = Field(
        default=None, description="Root filesystem: base, or the snapshot's when starting "
                                  "from one.")
    resources: Tier = "small"
    timeout: _Seconds | None = Field(default=None, description="Lifetime in seconds.")
    idle_timeout: _Seconds | None = Field(
        default=None, description="Destroy after this many seconds without activity.")
    labels: dict[str, str] = Field(default_factory=dict)
    network: NetworkBody | Literal["none"] = "none"
    secrets: list[str] = Field(default_factory=list)
    isolation: Isolation | None = Field(
        default=None, description="Isolation tier (default: the server's); `corral doctor` "
                                  "says which this host supports.")
    snapshot: _SnapshotRef | None = Field(
        default=None, description="Start from this snapshot's workspace (id or name).")


class TakeSnapshot(_Strict):
    name: _SnapshotName | None = Field(
        default=None, description="A name unique among your snapshots (default: none).")


class Fork(_Strict):
    count: int = Field(default=1, ge=1, le=_MAX_FORKS, description="How many sandboxes.")


class Restore(_Strict):
    snapshot: _SnapshotRef


# A POST without a body takes one unnamed snapshot, or makes one fork (the models are immutable
# in use, so one shared default each is safe).
_NO_BODY_SNAPSHOT = TakeSnapshot()
_NO_BODY_FORK = Fork()


class RunCommand(_Strict):
    cmd: _NonEmpty | Annotated[list[str], Field(min_length=1)] = Field(
        description="A shell string (bash -c) or an argv list.")
    timeout: _Seconds | None = None
    envs: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    stdin: str | None = None
    context: dict[str, Any] | None = None
    stream: bool = Field(default=False, description="Stream NDJSON events as output arrives.")


class StartProcess(_Strict):
    cmd: _NonEmpty | Annotated[list[str], Field(min_length=1)]
    envs: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    context: dict[str, Any] | None = None


class SetTimeout(_Strict):
    timeout: _Seconds


def _result(result: CommandResult) -> dict[str, Any]:
    return result.to_dict()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _tenant(request: Request) -> Tenant:
    """The caller's tenant, resolved from its key by the Authenticate middleware."""
    return scope_tenant(request.scope)


def _is_protected(path: str) -> bool:
    # Everything but the health check and the API's own description needs a key.
    return path.startswith("/v1/") or path == "/metrics"


def _authenticator(manager: Manager, tenants: TenantDirectory, *, loopback: bool,
                   allow_keyless: bool) -> Any:
    """Auth is required beyond loopback, and on loopback as soon as any key exists, or ever
    existed (unless ``allow_keyless``): revoking the last key must not silently reopen it."""

    def check(header: str | None) -> Tenant:
        store = manager.store
        required = not loopback or store.live_key_count() > 0
        if not required and not allow_keyless and store.keys_have_existed():
            if not header:
                raise AuthError(
                    "an API key is required: every key of this service has been revoked, and "
                    "it does not reopen without keys. Create one (`corral keys create "
                    "TENANT`), or restart it with `corral serve --allow-keyless`")
            required = True
        return tenants.authenticate(header, auth_required=required)

    async def authenticate(header: str | None) -> Tenant:
        return await run_in_threadpool(check, header)

    return authenticate


# Module level: FastAPI resolves string annotations in the module's namespace.
TenantDep = Annotated[Tenant, Depends(_tenant)]


def _owner_check(manager: Manager) -> Any:
    """Whether a sandbox is the tenant's, from the store alone (no side effects: expiry and
    state are the route's own full check)."""

    def check(who: Tenant, sandbox_id: str) -> None:
        info = manager.store.get(sandbox_id)
        if info is None or (who.name != "local" and info.tenant != who.name):
            raise SandboxNotFound(f"sandbox {sandbox_id[:40]} does not exist; `corral ls` "
                                  "lists them")

    async def owner(who: Tenant, sandbox_id: str) -> None:
        await run_in_threadpool(check, who, sandbox_id)

    return owner


def create_app(manager: Manager, *, listen_host: str = "127.0.0.1",
               host_names: Sequence[str] = (), allow_keyless: bool = False) -> FastAPI:
    """The API for ``manager``. Auth is required unless listening on loopback with no keys
    (and none ever, unless ``allow_keyless``). It answers to ``host_names`` besides the listen
    address, ``localhost``, ``127.0.0.1`` and ``[::1]``. Raises ValueError for a malformed
    name."""
    tenants = TenantDirectory(manager.store)
    rules = _field_rules(manager)
    loopback = _is_loopback(listen_host)
    names = ServiceNames.of(listen_host, host_names)
    app = FastAPI(title="Corral", version="0.1.0", responses=_ERRORS,
                  description="Sandboxes for AI agents: commands, files, network policy, audit.")
    app.state.manager = manager
    app.state.tenants = tenants
    app.state.loopback = loopback
    # add_middleware wraps: the last added runs first (Host, body, key, Origin, owner).
    app.add_middleware(OwnerFirst, check=_owner_check(manager))
    app.add_middleware(OriginGuard, names=names)
    app.add_middleware(Authenticate, protected=_is_protected, authenticate=_authenticator(
        manager, tenants, loopback=loopback, allow_keyless=allow_keyless))
    app.add_middleware(BodyLimit, limits=BODY_LIMITS)
    app.add_middleware(HostGuard, names=names)

    @app.exception_handler(CorralError)
    async def corral_error(request: Request, exc: CorralError) -> JSONResponse:
        return JSONResponse({"error": exc.code, "message": exc.message}, status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Raised by the framework itself (unparseable JSON, unknown route, wrong method).
        code = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code, "http_error")
        return JSONResponse({"error": code, "message": str(exc.detail)},
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse({"error": "internal_error",
                             "message": "an internal error occurred; the server log has details"},
                            status_code=500)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Limits the embedded SDK refuses with a specific error are refused with the same one
        # here, so both transports raise the same exception class.
        same = _control_plane_error(rules, exc.errors())
        if same is not None:
            return JSONResponse({"error": same.code, "message": same.message},
                                status_code=same.status)
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                             for e in exc.errors())
        return JSONResponse({"error": "invalid_request", "message": problems}, status_code=422)

    def scope(who: Tenant) -> str | None:
        """The tenant to scope control-plane calls to; None (everything) for local use."""
        return None if who.name == "local" else who.name

    def owned(sandbox_id: str, who: Tenant) -> SandboxInfo:
        return manager.get(sandbox_id, tenant=scope(who))

    # -- sandboxes ----------------------------------------------------------------------------

    @app.post("/v1/sandboxes", status_code=201, response_model=SandboxInfo)
    def create_sandbox(body: CreateSandbox, who: TenantDep) -> SandboxInfo:
        network = body.network if isinstance(body.network, str) else body.network.model_dump()
        # The snapshot is looked up among this tenant's own, so another's answers 404.
        info = manager.create(template=body.template, resources=body.resources,
                              timeout=body.timeout, labels=body.labels, network=network,
                              secrets=body.secrets, caller=who,
                              idle_timeout=body.idle_timeout,
                              isolation=body.isolation, snapshot=body.snapshot)
        return (info)

    @app.get("/v1/sandboxes", response_model=list[SandboxInfo])
    def list_sandboxes(who: TenantDep, label: Annotated[list[str] | None, Query()] = None
                       ) -> list[SandboxInfo]:
        wanted = dict(item.partition("=")[::2] for item in (label or []))
        infos = manager.list(tenant=None if who.name == "local" else who.name)
        return [i for i in infos
                if all(i.labels.get(k) == v for k, v in wanted.items())]

    @app.get("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo)
    def get_sandbox(sandbox_id: str, who: TenantDep) -> SandboxInfo:
        return (owned(sandbox_id, who))

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=204)
    def delete_sandbox(sandbox_id: str, who: TenantDep) -> Response:
        owned(sandbox_id, who)
        manager.destroy(sandbox_id)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/timeout", response_model=SandboxInfo)
    def set_timeout(sandbox_id: str, body: SetTimeout, who: TenantDep) -> SandboxInfo:
        owned(sandbox_id, who)
        return (manager.set_timeout(sandbox_id, body.timeout, caller=who))

    @app.put("/v1/sandboxes/{sandbox_id}/network", response_model=SandboxInfo)
    def set_network(sandbox_id: str, body: NetworkBody, who: TenantDep) -> SandboxInfo:
        owned(sandbox_id, who)
        return (manager.set_network(sandbox_id, body.model_dump(), caller=who))

    @app.post("/v1/sandboxes/{sandbox_id}/pause", response_model=SandboxInfo)
    def pause(sandbox_id: str, who: TenantDep) -> SandboxInfo:
        owned(sandbox_id, who)
        return (manager.pause(sandbox_id))

    @app.post("/v1/sandboxes/{sandbox_id}/resume", response_model=SandboxInfo)
    def resume(sandbox_id: str, who: TenantDep) -> SandboxInfo:
        owned(sandbox_id, who)
        return (manager.resume(sandbox_id))

    # -- snapshots, forks, restore ------------------------------------------------------------

    @app.post("/v1/sandboxes/{sandbox_id}/snapshots", status_code=201,
              response_model=SnapshotInfo)
    def take_snapshot(sandbox_id: str, who: TenantDep,
                      body: Annotated[TakeSnapshot, Body()] = _NO_BODY_SNAPSHOT) -> SnapshotInfo:
        """Seal the workspace's current state as a snapshot (409 while anything runs in it)."""
        return (manager.snapshot(sandbox_id, name=body.name, tenant=scope(who)))

    @app.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201,
              response_model=list[SandboxInfo])
    def fork(sandbox_id: str, who: TenantDep,
             body: Annotated[Fork, Body()] = _NO_BODY_FORK) -> list[SandboxInfo]:
        """``count`` new sandboxes starting from this one's workspace as it is now; they count
        against the tenant's sandbox quota (all or none are made)."""
        children = manager.fork(sandbox_id, body.count, tenant=scope(who), caller=who)
        return children

    @app.post("/v1/sandboxes/{sandbox_id}/restore", response_model=SandboxInfo)
    def restore(sandbox_id: str, body: Restore, who: TenantDep) -> SandboxInfo:
        """Put the workspace back exactly as it was in the snapshot (409 while anything runs)."""
        return (manager.restore(sandbox_id, body.snapshot, tenant=scope(who),
                                             caller=who))

    @app.get("/v1/snapshots", response_model=list[SnapshotInfo])
    def list_snapshots(who: TenantDep) -> list[SnapshotInfo]:
        return manager.list_snapshots(tenant=scope(who))

    @app.get("/v1/snapshots/{ref}", response_model=SnapshotInfo)
    def get_snapshot(ref: str, who: TenantDep) -> SnapshotInfo:
        return (manager.get_snapshot(ref, tenant=scope(who)))

    @app.delete("/v1/snapshots/{ref}", status_code=204)
    def delete_snapshot(ref: str, who: TenantDep) -> Response:
        """Delete a snapshot; refused (409) while a sandbox is built on it."""
        manager.delete_snapshot(ref, tenant=scope(who))
        return Response(status_code=204)

    # -- commands -----------------------------------------------------------------------------

    @app.post("/v1/sandboxes/{sandbox_id}/commands/{command_id}/kill", status_code=204)
    def kill_command(sandbox_id: str, command_id: str, who: TenantDep) -> Response:
        owned(sandbox_id, who)
        manager.kill_command(sandbox_id, command_id)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/commands", response_model=None,
              responses={200: {"content": {"application/json": {}, **_NDJSON},
                               "description": "The result, or NDJSON events with stream=true."}})
    def run_command(sandbox_id: str, body: RunCommand, who: TenantDep
                    ) -> dict[str, Any] | StreamingResponse:
        owned(sandbox_id, who)
        kwargs: dict[str, Any] = {"timeout": body.timeout, "envs": body.envs, "cwd": body.cwd,
                                  "stdin": body.stdin, "context": body.context}
        if not body.stream:
            return _result(manager.run(sandbox_id, body.cmd, caller=who, **kwargs))
        # Refuse bad input (and a spent quota) with a status, before the 200 of a stream is
        # sent; check_run counts the start, so the streamed run does not count it again.
        manager.check_run(sandbox_id, body.cmd, caller=who, **kwargs)
        return StreamingResponse(_stream(manager, sandbox_id, body.cmd, kwargs),
                                 media_type="application/x-ndjson")

    # -- background processes -----------------------------------------------------------------

    @app.post("/v1/sandboxes/{sandbox_id}/processes", status_code=201)
    def start_process(sandbox_id: str, body: StartProcess, who: TenantDep) -> dict[str, Any]:
        owned(sandbox_id, who)
        return manager.processes.start(sandbox_id, body.cmd, envs=body.envs, cwd=body.cwd,
                                       context=body.context, caller=who).to_dict()

    @app.get("/v1/sandboxes/{sandbox_id}/processes")
    def list_processes(sandbox_id: str, who: TenantDep) -> list[dict[str, Any]]:
        owned(sandbox_id, who)
        return [p.to_dict() for p in manager.processes.list(sandbox_id)]

    @app.get("/v1/sandboxes/{sandbox_id}/processes/{process_id}")
    def get_process(sandbox_id: str, process_id: str, who: TenantDep) -> dict[str, Any]:
        owned(sandbox_id, who)
        return manager.processes.get(sandbox_id, process_id).to_dict()

    @app.get("/v1/sandboxes/{sandbox_id}/processes/{process_id}/output",
             response_class=StreamingResponse,
             responses={200: {"content": _NDJSON, "description": "Output events."}})
    def process_output(sandbox_id: str, process_id: str, who: TenantDep, offset: int = 0,
                       follow: bool = False, wait_s: float | None = None) -> StreamingResponse:
        """NDJSON ``{"offset", "stream", "data"}`` from ``offset``; ``follow`` streams until
        the process exits."""
        owned(sandbox_id, who)
        process = manager.processes.get(sandbox_id, process_id)

        def lines() -> Iterator[bytes]:
            for at, stream, text in process.output(max(0, offset), follow=follow,
                                                   wait_s=wait_s):
                yield (json.dumps({"offset": at, "stream": stream, "data": text}) + "\n").encode()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{process_id}/input", status_code=204,
              openapi_extra=_BINARY_BODY)
    async def process_input(sandbox_id: str, process_id: str, request: Request,
                            who: TenantDep) -> Response:
        def target() -> Any:
            owned(sandbox_id, who)
            return manager.processes.get(sandbox_id, process_id)

        # Whose it is before a byte of the body is read.
        process = await run_in_threadpool(target)
        data = await _read_body(request, MAX_FILE_BODY, "input is limited to {} bytes per "
                                "request; send it in several")
        await run_in_threadpool(process.send, data)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{process_id}/kill", status_code=204)
    def kill_process(sandbox_id: str, process_id: str, who: TenantDep) -> Response:
        owned(sandbox_id, who)
        manager.processes.kill(sandbox_id, process_id)
        return Response(status_code=204)

    # -- terminals ----------------------------------------------------------------------------

    @app.websocket("/v1/sandboxes/{sandbox_id}/pty")
    async def pty(websocket: WebSocket, sandbox_id: str, rows: int = 24,
                  cols: int = 80) -> None:
        """A shell on a terminal. Client sends JSON text frames ``{"type": "input", "data"}``,
        ``{"type": "resize", "rows", "cols"}``, ``{"type": "signal", "signal": "INT"|"QUIT"|
        "TSTP"|"KILL"}``; the server sends binary frames of terminal output and, at the end,
        ``{"type": "exit", "exit_code"}``."""
        await serve_terminal(websocket, manager, sandbox_id, rows=rows, cols=cols)

    # -- files --------------------------------------------------------------------------------

    @app.get("/v1/sandboxes/{sandbox_id}/files/content", response_class=Response,
             responses={200: {"content": {"application/octet-stream": _BINARY},
                              "description": "The file's bytes."}})
    def read_file(sandbox_id: str, path: _PathQuery,
                  who: TenantDep) -> Response:
        owned(sandbox_id, who)
        return Response(manager.files(sandbox_id).read(path),
                        media_type="application/octet-stream")

    @app.put("/v1/sandboxes/{sandbox_id}/files/content", openapi_extra=_BINARY_BODY)
    async def write_file(sandbox_id: str, path: Annotated[str, Query(min_length=1)],
                         request: Request, who: TenantDep
                         ) -> dict[str, Any]:
        # Whose it is before a byte of the body is read.
        await run_in_threadpool(owned, sandbox_id, who)
        data = await _read_body(request, MAX_FILE_BODY, "a file upload is limited to {} "
                                "bytes; upload large trees as a tar (PUT .../archive)")

        def write() -> dict[str, Any]:
            owned(sandbox_id, who)  # again: it may have been deleted meanwhile
            return manager.files(sandbox_id).write(path, data).to_dict()

        return await run_in_threadpool(write)

    @app.get("/v1/sandboxes/{sandbox_id}/files")
    def list_files(sandbox_id: str, who: TenantDep, path: str = "/workspace"
                   ) -> list[dict[str, Any]]:
        owned(sandbox_id, who)
        return [e.to_dict() for e in manager.files(sandbox_id).list(path)]

    @app.get("/v1/sandboxes/{sandbox_id}/files/stat")
    def stat_file(sandbox_id: str, path: _PathQuery,
                  who: TenantDep) -> dict[str, Any]:
        owned(sandbox_id, who)
        return manager.files(sandbox_id).stat(path).to_dict()

    @app.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204)
    def remove_file(sandbox_id: str, path: _PathQuery,
                  who: TenantDep) -> Response:
        owned(sandbox_id, who)
        manager.files(sandbox_id).remove(path)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/files/rename")
    def rename_file(sandbox_id: str, src: Annotated[str, Query(min_length=1)],
                    dst: Annotated[str, Query(min_length=1)], who: TenantDep) -> dict[str, Any]:
        owned(sandbox_id, who)
        return manager.files(sandbox_id).rename(src, dst).to_dict()

    @app.put("/v1/sandboxes/{sandbox_id}/archive", openapi_extra={"requestBody": {"content": {
        "application/x-tar": _BINARY, "application/gzip": _BINARY}}})
    async def upload_tar(sandbox_id: str, request: Request, who: TenantDep,
                         path: str = "/workspace") -> dict[str, Any]:
        """Extract a tar (or tar.gz) streamed in the body under ``path``."""
        info = await run_in_threadpool(owned, sandbox_id, who)
        limit = get_tier(info.resources).disk_bytes
        files = await run_in_threadpool(manager.files, sandbox_id)
        read_end, write_end = os.pipe()
        reader = os.fdopen(read_end, "rb")

        def extract() -> dict[str, Any]:
            try:
                return dataclasses.asdict(files.upload(path, reader, max_bytes=limit))
            finally:
                reader.close()

        job = asyncio.ensure_future(run_in_threadpool(extract))
        try:
            async for chunk in request.stream():
                view = memoryview(chunk)
                while view and not job.done():
                    written = await run_in_threadpool(_write_some, write_end, view)
                    view = view[written:]
        except BaseException:
            # The body was cut (over its limit) or the client left: the extractor sees the
            # end of its input; wait for it so its thread and error do not outlive the request.
            os.close(write_end)
            with contextlib.suppress(Exception):
                await job
            raise
        os.close(write_end)
        return await job

    @app.get("/v1/sandboxes/{sandbox_id}/archive", response_class=StreamingResponse,
             responses={200: {"content": {"application/x-tar": _BINARY,
                                          "application/gzip": _BINARY},
                              "description": "The tree as tar (or tar.gz)."}})
    def download_tar(sandbox_id: str, who: TenantDep, path: str = "/workspace",
                     gzip: bool = False) -> StreamingResponse:
        """The tree under ``path`` as a tar stream."""
        info = owned(sandbox_id, who)
        chunks = manager.files(sandbox_id).download(
            path, max_bytes=get_tier(info.resources).disk_bytes, gzip=gzip)
        return StreamingResponse(chunks, media_type="application/gzip" if gzip
                                 else "application/x-tar")

    @app.post("/v1/sandboxes/{sandbox_id}/files/mkdir")
    def make_dir(sandbox_id: str, path: _PathQuery,
                  who: TenantDep) -> dict[str, bool]:
        owned(sandbox_id, who)
        return {"created": manager.files(sandbox_id).make_dir(path)}

    # -- audit and metrics --------------------------------------------------------------------

    @app.get("/v1/sandboxes/{sandbox_id}/audit", response_class=StreamingResponse,
             responses={200: {"content": _NDJSON, "description": "One event per line."}})
    def audit(sandbox_id: str, who: TenantDep,
              type: Annotated[list[str] | None, Query()] = None,  # noqa: A002 - the query name
              since: float | None = None, until: float | None = None,
              command: str | None = None, follow: bool = False) -> StreamingResponse:
        _check_trail_owner(manager, sandbox_id, who)
        if follow:
            path = manager.auditor.path(sandbox_id)
            if not path.exists():
                raise SandboxNotFound(f"no audit trail for {sandbox_id}")

            def live() -> Iterator[bytes]:
                # Heartbeats (empty chunks) return control every second, so a client that went
                # away frees its worker thread instead of holding it until the sandbox ends.
                for event in follow_log(path, types=type, command=command, heartbeat_s=1.0):
                    if event is None:
                        yield b""
                    elif (since is None or event.ts >= since) and (until is None
                                                                   or event.ts <= until):
                        yield (event.model_dump_json() + "\n").encode()

            return StreamingResponse(live(), media_type="application/x-ndjson")
        trail = manager.auditor.trail(sandbox_id, types=type, since=since, until=until,
                                      command=command)
        body = "".join(e.model_dump_json() + "\n" for e in trail.events)
        return StreamingResponse(iter([body.encode()]), media_type="application/x-ndjson",
                                 headers={"x-corral-torn-tail": str(trail.torn_tail).lower()})

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics(who: TenantDep) -> PlainTextResponse:
        return PlainTextResponse(render(manager.store),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def _field_rules(manager: Manager) -> dict[tuple[str, str], Callable[[Any], object]]:
    """The control plane's own rule for each request field the schema constrains, so a value
    the schema refuses is refused with the control plane's error and message (the same class
    the embedded SDK raises), not a second copy of them here."""

    def template(value: Any) -> None:
        require_template(validate.template(value), manager.settings.home / "templates")

    rules: dict[tuple[str, str], Callable[[Any], object]] = {
        ("body", "cmd"): lambda value: validate.command(value, None, None, None),
        ("body", "resources"): get_tier,
        ("body", "template"): template,
        ("body", "timeout"): validate.positive_seconds,
        ("body", "idle_timeout"): lambda value: validate.positive_seconds(value, "idle_timeout"),
        ("body", "isolation"): validate.isolation,
        ("body", "snapshot"): validate.snapshot_ref,
        ("body", "count"): validate.fork_count,
        ("body", "name"): validate.snapshot_name,
    }
    for name in ("path", "src", "dst"):
        rules[("query", name)] = to_relative
    return rules


def _control_plane_error(rules: Mapping[tuple[str, str], Callable[[Any], object]],
                         problems: Sequence[Any]) -> CorralError | None:
    """What the control plane raises for the first schema problem, if it has a rule for it."""
    if not problems:
        return None
    first = problems[0]
    loc = [str(part) for part in first.get("loc", ())]
    rule = rules.get((loc[0], loc[1])) if len(loc) > 1 else None
    if rule is None:
        return None
    try:
        rule(first.get("input"))
    except CorralError as exc:
        return exc
    return None


async def _read_body(request: Request, limit: int, message: str) -> bytes:
    """The body, refused with TooLarge (``message`` formatted with ``limit``) once it is over
    ``limit``: a declared length before reading, a streamed one as it arrives."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(message.format(limit))
    data = bytearray()
    async for chunk in request.stream():
        if len(data) + len(chunk) > limit:
            raise TooLarge(message.format(limit))
        data += chunk
    return bytes(data)


def _write_some(fd: int, data: memoryview) -> int:
    try:
        return os.write(fd, data)
    except BrokenPipeError:
        return len(data)  # the extractor stopped (refusal): drain the rest of the body


def _check_trail_owner(manager: Manager, sandbox_id: str, who: Tenant) -> None:
    if who.name == "local":
        return
    try:
        manager.get(sandbox_id, tenant=who.name)
        return
    except SandboxNotFound:
        pass
    # Gone: the trail's first event says whose it was.
    trail = manager.auditor.trail(sandbox_id, types=["sandbox.created"])
    if not trail.events or trail.events[0].data.get("tenant") != who.name:
        raise SandboxNotFound(f"sandbox {sandbox_id} does not exist")


def _stream(manager: Manager, sandbox_id: str, cmd: str | list[str],
            kwargs: dict[str, Any]) -> Iterator[bytes]:
    """Run in a worker thread; yield NDJSON lines as output arrives, then the result."""
    events: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def work() -> None:
        try:
            result = manager.run(
                sandbox_id, cmd, **kwargs,
                on_stdout=lambda text: events.put({"type": "stdout", "data": text}),
                on_stderr=lambda text: events.put({"type": "stderr", "data": text}))
            events.put({"type": "result", **_result(result)})
        except CorralError as exc:
            events.put({"type": "error", "error": exc.code, "message": exc.message})
        finally:
            events.put(None)

    threading.Thread(target=work, name="corral-command", daemon=True).start()
    while True:
        try:
            event = events.get(timeout=15)
        except queue.Empty:
            # Keep idle connections alive through proxies while a quiet command runs.
            yield b'{"type":"keepalive"}\n'
            continue
        if event is None:
            return
        yield (json.dumps(event) + "\n").encode()
