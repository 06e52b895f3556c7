"""E2B's template-build API (the Template SDK's ``Template.build``) over Corral's Dockerfile
builder: every ``RUN`` inside a Corral build sandbox, the base pulled under the operator's
registry policy (``CORRAL_REGISTRIES``), layers cached by content.

The SDK's flow, and what answers each call:

1. ``POST /v3/templates`` ``{name, tags?, cpuCount?, memoryMB?}`` → 202 ``{templateID,
   buildID, names, tags, aliases, public}``: a build is opened, waiting for its steps.
2. per ``COPY`` step, ``GET /templates/{id}/files/{hash}`` → 201 ``{present, url?, headers?}``;
   when not present, the SDK ``PUT``\\ s a tar of the files to ``url`` (with ``headers``). The
   archive is checked whole before it is kept (no member may land outside its root).
3. ``POST /v2/templates/{id}/builds/{buildID}`` with the steps → 202; the build starts.
4. ``GET /templates/{id}/builds/{buildID}/status?logsOffset=N`` until ``ready`` or ``error``:
   the log entries from N on (at most 100), and on error ``reason {message, step}``, the step
   the SDK points its stack trace at.

Tenancy. A template a tenant builds is its own: its name maps to a Corral template named
``e2b-<hash of tenant and name>``, which only that tenant's ``Sandbox.create("<name>")``
resolves to (:func:`resolve`); another tenant's name is simply unknown to it, and the internal
names are refused on this surface. A tenant whose ceiling lists templates builds only names the
ceiling lists (in their internal form, which the refusal gives).

Kept in memory: open builds and their logs (a restart forgets builds under way; what was built
stays). Kept on disk: the uploaded archives, per tenant, by hash (``$CORRAL_HOME/e2b-templates``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .._control.plane import Manager, Tenant, ceiling_network
from .._images.reference import ImagePolicy, parse_reference
from .._templates.catalog import TAG, current_build, name_lock, pointer, set_current
from ..errors import CorralError
from .common import E2BHTTPError, endpoint, json_body, manager_of, tenant_of
from .target import TENANT_KEY
from .template_build import (
    LEVELS,
    BuildLog,
    Level,
    Plan,
    PlanError,
    TarRefused,
    check_archive,
    plan_build,
    unpack_archive,
)

__all__ = ["MAX_UPLOAD", "UPLOAD_PATH", "resolve", "routes"]

logger = logging.getLogger(__name__)

MAX_UPLOAD = 1024 * 1024 * 1024  # one COPY archive, as uploaded (gzipped)
# A tenant's kept archives are a cache: past this, the oldest go (the SDK uploads again what
# the API says is not present).
MAX_KEPT_PER_TENANT = 8 * 1024 * 1024 * 1024
UPLOAD_PATH = re.compile(r"/templates/[^/]{1,200}/files/[0-9a-f]{64}/upload")
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,127}")
_INTERNAL = re.compile(r"e2b-[0-9a-f]{16}")
_HASH = re.compile(r"[0-9a-f]{64}")
_MAX_OPEN_PER_TENANT = 4  # builds not yet finished
_MAX_TAGS = 10
_UPLOAD_TTL_S = 3600
_KEEP_FINISHED_S = 3600
_UNSTARTED_S = 600  # a build opened and never started is forgotten after this
_PAGE = 100


def internal_name(tenant: str, name: str) -> str:
    """The Corral template a tenant's E2B template name is built as."""
    return "e2b-" + hashlib.sha256(f"{tenant}\0{name}".encode()).hexdigest()[:16]


def _tenant_dir(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()[:16]


@dataclass
class _Build:
    id: str
    tenant: str
    name: str  # the E2B name (no tag)
    tags: tuple[str, ...]
    status: str = "waiting"  # waiting -> building -> ready | error
    log: BuildLog = field(default_factory=BuildLog)
    reason: dict[str, Any] | None = None
    triggered: bool = False
    finished_at: float | None = None
    opened_at: float = field(default_factory=time.monotonic)


class _Registry:
    """The builds under way, their uploads' one-time links, and the one build slot."""

    def __init__(self, home: Path) -> None:
        self.root = home / "e2b-templates"
        self.builds: dict[str, _Build] = {}
        self.uploads: dict[str, tuple[str, str, float]] = {}  # token -> (tenant, hash, expiry)
        self.lock = threading.Lock()
        self.slot = threading.Semaphore(1)  # one build at a time: each runs a sandbox

    def archive(self, tenant: str, files_hash: str) -> Path:
        return self.root / "uploads" / _tenant_dir(tenant) / f"{files_hash}.tar"

    def open(self, tenant: str, name: str, tags: tuple[str, ...]) -> _Build:
        now = time.monotonic()
        with self.lock:
            for key, old in list(self.builds.items()):
                if old.finished_at is not None and now - old.finished_at > _KEEP_FINISHED_S:
                    del self.builds[key]
                elif not old.triggered and now - old.opened_at > _UNSTARTED_S:
                    # Abandoned: the SDK starts a build right after its uploads (a failed
                    # upload leaves one behind, holding one of the tenant's open builds).
                    del self.builds[key]
            open_builds = [b for b in self.builds.values()
                           if b.tenant == tenant and b.finished_at is None]
            if len(open_builds) >= _MAX_OPEN_PER_TENANT:
                raise E2BHTTPError(429, f"{len(open_builds)} template builds of this tenant "
                                   "are open; wait for one to finish")
            build = _Build(id=str(uuid.uuid4()), tenant=tenant, name=name, tags=tags)
            build.log.add(f"Corral build {build.id} of template {name!r}", "debug")
            self.builds[build.id] = build
            return build

    def get(self, tenant: str, template_id: str, build_id: str) -> _Build:
        build = self.builds.get(build_id)
        if build is None or build.tenant != tenant or build.name != template_id:
            raise E2BHTTPError(404, f"build {build_id[:64]!r} of template "
                               f"{template_id[:64]!r} not found")
        return build

    def has_template(self, tenant: str, template_id: str) -> bool:
        return any(b.tenant == tenant and b.name == template_id
                   for b in list(self.builds.values()))


def _registry(request: Request) -> _Registry:
    state = request.app.state
    registry = getattr(state, "e2b_templates", None)
    if registry is None:
        registry = _Registry(manager_of(request).settings.home)
        state.e2b_templates = registry
    assert isinstance(registry, _Registry)
    return registry


def _templates_dir(manager: Manager) -> Path:
    return manager.settings.home / "templates"


def resolve(request: Request, template_id: str) -> str | None:
    """The Corral template (``name[:tag]``) a ``templateID`` names when the caller's tenant
    built it through this API; ``None`` when it did not (the caller's usual names apply)."""
    name, _, tag = template_id.partition(":")
    if _INTERNAL.fullmatch(name):
        raise E2BHTTPError(404, f"template {template_id[:80]!r} not found (name a template "
                           "by the name it was built with)")
    tenant = request.scope.get(TENANT_KEY)
    if not isinstance(tenant, Tenant) or not _NAME.fullmatch(name) or (
            tag and not TAG.fullmatch(tag)):
        return None
    reference = _reference(tenant.name, name, tag)
    templates_dir = _templates_dir(manager_of(request))
    if current_build(templates_dir, reference) is not None:
        return reference
    if current_build(templates_dir, internal_name(tenant.name, name)) is not None:
        raise E2BHTTPError(404, f"template {name!r} has no tag {tag[:64]!r}")
    return None


def _reference(tenant: str, name: str, tag: str) -> str:
    """The Corral reference of a tenant's ``name[:tag]`` (E2B's ``default`` tag: untagged)."""
    return internal_name(tenant, name) + (f":{tag}" if tag and tag != "default" else "")


# -- 1. open a build -----------------------------------------------------------------------------


def _name_and_tags(request: Request, body: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    raw = body.get("name", body.get("alias"))
    if not isinstance(raw, str) or not raw:
        raise E2BHTTPError(400, "name is required: the template's name, e.g. 'my-env' or "
                           "'my-env:v1'")
    name, _, tag = raw.partition(":")
    if not _NAME.fullmatch(name) or _INTERNAL.fullmatch(name):
        raise E2BHTTPError(400, f"invalid template name {name[:80]!r}: use 1-128 lower-case "
                           "letters, digits, '-', '_' or '.', starting with a letter or digit")
    if name in request.app.state.config.templates:
        raise E2BHTTPError(409, f"{name!r} is one of this server's own E2B template names "
                           "(CORRAL_E2B_TEMPLATES); choose another name")
    tags = body.get("tags") or []
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise E2BHTTPError(400, "tags must be a list of strings")
    tags = ([tag] if tag else []) + tags
    if len(tags) > _MAX_TAGS:
        raise E2BHTTPError(400, f"at most {_MAX_TAGS} tags")
    for t in tags:
        if not TAG.fullmatch(t):
            raise E2BHTTPError(400, f"invalid tag {t[:64]!r}: 1-64 letters, digits, '_', "
                               "'.', '-', not starting with '.' or '-'")
    for key, low, high in (("cpuCount", 1, 64), ("memoryMB", 128, 1024 * 1024),
                           ("minFreeDiskMb", 0, 1024 * 1024)):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not low <= value <= high):
            raise E2BHTTPError(400, f"{key} must be a whole number from {low} to {high}")
    unknown = sorted(set(body) - {"name", "alias", "tags", "teamID", "cpuCount", "memoryMB",
                                  "minFreeDiskMb"})
    if unknown:
        raise E2BHTTPError(400, f"unknown field {unknown[0][:40]!r}")
    return name, tuple(dict.fromkeys(tags))


@endpoint
async def request_build(request: Request) -> Response:
    tenant, manager = tenant_of(request), manager_of(request)
    body = await json_body(request)
    name, tags = _name_and_tags(request, body)
    internal = internal_name(tenant.name, name)
    allowed = manager.ceiling_for(tenant).templates
    if allowed is not None and internal not in allowed:
        raise E2BHTTPError(403, f"tenant {tenant.name!r} may run only the templates its "
                           f"ceiling lists; template {name!r} is built as {internal!r}, which "
                           "the operator can add to the ceiling's templates")
    build = _registry(request).open(tenant.name, name, tags)
    for key in ("cpuCount", "memoryMB", "minFreeDiskMb"):
        if body.get(key) is not None:
            build.log.add(f"{key} is not kept with the template: Corral sizes sandboxes by "
                          "resource tier", "warn")
    return JSONResponse({"templateID": name, "buildID": build.id, "public": False,
                         "names": [name], "tags": list(tags) or ["default"],
                         "aliases": [name]}, status_code=202)


@endpoint
async def alias_exists(request: Request) -> Response:
    tenant, manager = tenant_of(request), manager_of(request)
    alias = request.path_params["alias"]
    name, _, tag = alias.partition(":")
    if not _NAME.fullmatch(name) or (tag and not TAG.fullmatch(tag)):
        raise E2BHTTPError(400, f"invalid template name {alias[:80]!r}")
    found = await run_in_threadpool(current_build, _templates_dir(manager),
                                    _reference(tenant.name, name, tag))
    if found is None:
        raise E2BHTTPError(404, f"template {alias!r} not found")
    return JSONResponse({"templateID": name, "public": False})


# -- 2. files -----------------------------------------------------------------------------------


def _files_hash(request: Request) -> str:
    files_hash = request.path_params["hash"]
    if not _HASH.fullmatch(files_hash):
        raise E2BHTTPError(400, "the files hash must be 64 lower-case hex digits (SHA-256)")
    return str(files_hash)


@endpoint
async def upload_link(request: Request) -> Response:
    tenant, registry = tenant_of(request), _registry(request)
    files_hash = _files_hash(request)
    template_id = request.path_params["template_id"]
    if not registry.has_template(tenant.name, template_id):
        raise E2BHTTPError(404, f"template {template_id[:64]!r} has no open build; request "
                           "one first (POST /v3/templates)")
    archive = registry.archive(tenant.name, files_hash)
    if archive.is_file():
        with contextlib.suppress(FileNotFoundError):
            os.utime(archive)  # used: the last to go (_evict)
        return JSONResponse({"present": True}, status_code=201)
    token = secrets.token_urlsafe(24)
    with registry.lock:
        now = time.time()
        for old, (_, _, expiry) in list(registry.uploads.items()):
            if expiry < now:
                del registry.uploads[old]
        registry.uploads[token] = (tenant.name, files_hash, now + _UPLOAD_TTL_S)
    base = str(request.base_url).rstrip("/")
    # The upload is a call of this API like any other: the caller's own key goes with it (the
    # SDK sends only the headers given here), the one-time token binds it to this hash.
    return JSONResponse({"present": False,
                         "url": f"{base}/templates/{template_id}/files/{files_hash}/upload"
                                f"?token={token}",
                         "headers": {"X-API-KEY": request.headers.get("x-api-key", "")}},
                        status_code=201)


@endpoint
async def upload(request: Request) -> Response:
    tenant, registry = tenant_of(request), _registry(request)
    files_hash = _files_hash(request)
    token = request.query_params.get("token", "")
    with registry.lock:
        held = registry.uploads.get(token)
        if held is not None and held[:2] == (tenant.name, files_hash):
            del registry.uploads[token]  # one use; another caller's try never spends it
    if held is None or held[:2] != (tenant.name, files_hash) or held[2] < time.time():
        raise E2BHTTPError(403, "this upload link is not valid (used, expired or another "
                           "tenant's); ask for a new one (GET /templates/{id}/files/{hash})")
    final = registry.archive(tenant.name, files_hash)
    final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, temp = tempfile.mkstemp(prefix=".upload-", dir=final.parent)
    size = 0
    try:
        with os.fdopen(fd, "wb") as sink:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_UPLOAD:
                    raise E2BHTTPError(413, f"an upload may be at most {MAX_UPLOAD} bytes")
                sink.write(chunk)

        def check() -> None:
            with open(temp, "rb") as f:
                check_archive(f)

        try:
            await run_in_threadpool(check)
        except TarRefused as exc:
            raise E2BHTTPError(400, f"the uploaded archive is refused: {exc}") from None
        os.replace(temp, final)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
    await run_in_threadpool(_evict, final)
    return Response(status_code=200)


def _evict(kept: Path) -> None:
    """Remove a tenant's oldest archives (never ``kept``) while they hold more than
    ``MAX_KEPT_PER_TENANT``."""
    archives = []
    for path in kept.parent.glob("*.tar"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        archives.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in archives)
    for _, size, path in sorted(archives):
        if total <= MAX_KEPT_PER_TENANT:
            break
        if path != kept:
            path.unlink(missing_ok=True)
            total -= size


# -- 3. start -----------------------------------------------------------------------------------


@endpoint
async def trigger_build(request: Request) -> Response:
    tenant, manager, registry = tenant_of(request), manager_of(request), _registry(request)
    build = registry.get(tenant.name, request.path_params["template_id"],
                         request.path_params["build_id"])
    with registry.lock:
        if build.triggered:
            raise E2BHTTPError(409, f"build {build.id} was already started")
        build.triggered = True
    try:
        plan = _checked_plan(manager, registry, tenant, await json_body(request), build.id)
    except (E2BHTTPError, CorralError) as exc:
        _fail(build, exc.message, "base")  # a refused build is over: it holds no slot
        raise
    for note in plan.notes:
        build.log.add(note, "warn")
    # A build's RUN steps reach what the tenant's sandboxes may (its ceiling's hosts).
    network = ceiling_network(manager.settings, manager.ceiling_for(tenant).hosts)
    threading.Thread(target=_run, args=(manager, registry, build, plan, network),
                     name=f"e2b-build-{build.id[:8]}", daemon=True).start()
    return Response(status_code=202)


def _checked_plan(manager: Manager, registry: _Registry, tenant: Tenant,
                  body: dict[str, Any], build_id: str) -> Plan:
    try:
        plan = plan_build(body, nonce=build_id.replace("-", ""))
    except PlanError as exc:
        message = f"step {exc.step}: {exc.message}" if exc.step else exc.message
        raise E2BHTTPError(400, message) from None
    policy = ImagePolicy.from_setting(manager.settings.registries,
                                      require_digest=manager.settings.registries_require_digest)
    policy.check(parse_reference(plan.image), allow_local=False)  # ImageRefused -> 403
    for number, files_hash in plan.copies.items():
        if not registry.archive(tenant.name, files_hash).is_file():
            raise E2BHTTPError(400, f"step {number}: the files of hash {files_hash[:12]}... "
                               "were not uploaded (GET /templates/{id}/files/{hash} first)")
    return plan


def _run(manager: Manager, registry: _Registry, build: _Build, plan: Plan,
         network: dict[str, Any] | None) -> None:
    from .._images.build import build_dockerfile

    log = build.log
    with registry.slot:
        build.status = "building"
        internal = internal_name(build.tenant, build.name)
        # The same directory for every build of the template: the builder keys a COPY step
        # by its sources' paths too, so a rebuild with the same files runs nothing.
        work = registry.root / "work" / internal
        try:
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True, mode=0o700)
            context = work / "context"
            context.mkdir(mode=0o755)
            for number, files_hash in plan.copies.items():
                try:
                    unpack_archive(registry.archive(build.tenant, files_hash),
                                   context / f"s{number}")
                except FileNotFoundError:
                    raise TarRefused(f"step {number}: its files left the upload cache while "
                                     "the build waited; build again") from None
            dockerfile = work / "Dockerfile"
            dockerfile.write_text(plan.dockerfile)
            reference = internal + (f":{build.tags[0]}" if build.tags else "")
            result = build_dockerfile(manager, dockerfile, name=reference, context=context,
                                      network=network, on_progress=log.progress(plan))
            templates_dir = _templates_dir(manager)
            with name_lock(templates_dir, internal):
                for tag in build.tags[1:]:
                    set_current(templates_dir, internal, result.template.hash, tag=tag)
            log.add(f"Template {build.name!r} built in {result.duration_s:.1f} s "
                    f"({result.steps_run} steps run, {result.steps_cached} cached)", "info",
                    "finalize")
            build.status = "ready"
        except (CorralError, TarRefused) as exc:
            message = exc.message if isinstance(exc, CorralError) else str(exc)
            _fail(build, message, plan.step_of(message) or log.step)
        except Exception:
            logger.exception("E2B template build %s failed", build.id)
            _fail(build, "the build failed inside Corral; the server log has details",
                  log.step)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            build.finished_at = time.monotonic()


def _fail(build: _Build, message: str, step: str) -> None:
    build.log.add(message, "error", step)
    build.reason = {"message": message, "step": step,
                    "logEntries": [e.to_e2b() for e in build.log.entries[-20:]]}
    build.status = "error"
    build.finished_at = time.monotonic()


# -- 4. status ----------------------------------------------------------------------------------


def _query_int(request: Request, name: str, default: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or int(raw) > high:
        raise E2BHTTPError(400, f"{name} must be a whole number from 0 to {high}")
    return int(raw)


def _query_level(request: Request) -> Level | None:
    raw = request.query_params.get("level")
    if raw is None:
        return None
    for level in LEVELS:
        if raw == level:
            return level
    raise E2BHTTPError(400, f"level must be one of {', '.join(LEVELS)}")


@endpoint
async def build_status(request: Request) -> Response:
    tenant, registry = tenant_of(request), _registry(request)
    build = registry.get(tenant.name, request.path_params["template_id"],
                         request.path_params["build_id"])
    offset = _query_int(request, "logsOffset", 0, 10**9)
    limit = _query_int(request, "limit", _PAGE, _PAGE)
    # The status goes first: entries read after it include all a finished build wrote.
    status, reason = build.status, build.reason
    entries = build.log.page(offset, limit, _query_level(request))
    out: dict[str, Any] = {"templateID": build.name, "buildID": build.id, "status": status,
                           "logs": [], "logEntries": [e.to_e2b() for e in entries]}
    if reason is not None:
        out["reason"] = reason
    return JSONResponse(out)


# -- tags ----------------------------------------------------------------------------------------


def _build_uuid(build_hash: str) -> str:
    """The ``buildID`` (a UUID to the SDKs) of a Corral build, from its 16-hex hash."""
    return str(uuid.UUID(hex=build_hash * 2))


def _owned_name(value: object, what: str) -> tuple[str, str]:
    if not isinstance(value, str):
        raise E2BHTTPError(400, f"{what} must be a template name")
    name, _, tag = value.partition(":")
    if not _NAME.fullmatch(name) or (tag and not TAG.fullmatch(tag)):
        raise E2BHTTPError(400, f"invalid template name {value[:80]!r}")
    return name, tag


def _tag_list(value: object) -> list[str]:
    if not isinstance(value, list) or not value or len(value) > _MAX_TAGS or not all(
            isinstance(t, str) and TAG.fullmatch(t) for t in value):
        raise E2BHTTPError(400, f"tags must be a list of 1-{_MAX_TAGS} tags (1-64 letters, "
                           "digits, '_', '.', '-', not starting with '.' or '-')")
    return list(dict.fromkeys(value))


@endpoint
async def assign_tags(request: Request) -> Response:
    tenant, manager = tenant_of(request), manager_of(request)
    body = await json_body(request)
    name, tag = _owned_name(body.get("target"), "target")
    tags = _tag_list(body.get("tags"))
    templates_dir = _templates_dir(manager)
    internal = internal_name(tenant.name, name)

    def assign() -> str:
        with name_lock(templates_dir, internal):
            built = current_build(templates_dir, _reference(tenant.name, name, tag))
            if built is None:
                raise E2BHTTPError(404, f"template {body['target'][:80]!r} not found")
            for new in tags:
                set_current(templates_dir, internal, built.hash, tag=new)
            return built.hash

    build_hash = await run_in_threadpool(assign)
    return JSONResponse({"tags": tags, "buildID": _build_uuid(build_hash)}, status_code=201)


@endpoint
async def remove_tags(request: Request) -> Response:
    tenant, manager = tenant_of(request), manager_of(request)
    body = await json_body(request)
    name, _ = _owned_name(body.get("name"), "name")
    tags = _tag_list(body.get("tags"))
    templates_dir = _templates_dir(manager)
    internal = internal_name(tenant.name, name)

    def remove() -> None:
        with name_lock(templates_dir, internal):
            missing = [t for t in tags if current_build(templates_dir, f"{internal}:{t}") is None]
            if missing:
                raise E2BHTTPError(404, f"template {name!r} has no tag {missing[0]!r}")
            for t in tags:
                pointer(templates_dir, f"{internal}:{t}").unlink(missing_ok=True)

    await run_in_threadpool(remove)
    return Response(status_code=204)


@endpoint
async def list_tags(request: Request) -> Response:
    tenant, manager = tenant_of(request), manager_of(request)
    name, _ = _owned_name(request.path_params["template_id"], "template")
    templates_dir = _templates_dir(manager)
    internal = internal_name(tenant.name, name)

    def listed() -> list[dict[str, Any]]:
        if current_build(templates_dir, internal) is None:
            raise E2BHTTPError(404, f"template {name!r} not found")
        out = []
        prefix = pointer(templates_dir, f"{internal}:x").name[:-1]
        for entry in sorted(templates_dir.glob(f"{prefix}*")):
            tag = entry.name[len(prefix):]
            built = current_build(templates_dir, f"{internal}:{tag}")
            if built is None or not TAG.fullmatch(tag):
                continue
            created = datetime.fromtimestamp(entry.lstat().st_mtime, UTC).isoformat()
            out.append({"tag": tag, "buildID": _build_uuid(built.hash), "createdAt": created})
        return out

    return JSONResponse(await run_in_threadpool(listed))


routes = [
    Route("/templates/tags", assign_tags, methods=["POST"]),
    Route("/templates/tags", remove_tags, methods=["DELETE"]),
    Route("/templates/{template_id}/tags", list_tags, methods=["GET"]),
    Route("/v3/templates", request_build, methods=["POST"]),
    Route("/templates/aliases/{alias}", alias_exists, methods=["GET"]),
    Route("/templates/{template_id}/files/{hash}", upload_link, methods=["GET"]),
    Route("/templates/{template_id}/files/{hash}/upload", upload, methods=["PUT"]),
    Route("/v2/templates/{template_id}/builds/{build_id}", trigger_build, methods=["POST"]),
    Route("/templates/{template_id}/builds/{build_id}/status", build_status, methods=["GET"]),
]
