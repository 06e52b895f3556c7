"""E2B's control-plane REST API (E2B-COMPAT §4) over Corral's lifecycle, snapshot and fork
services, with E2B's statuses and ``{"code", "message"}`` errors.

Every call acts as the tenant of the ``X-API-KEY`` (``app.py``); another tenant's sandbox is
"not found". What Corral lacks answers in E2B's error shape with a message saying so.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import logging
import math
import os
import re
import threading
import time
from collections import deque
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .._control.plane import ASLEEP, Manager, Tenant, ceiling_network
from .._control.requests import SetTimeout
from .._core.resources import get_tier
from .._ids import from_e2b, to_e2b
from ..errors import (
    CorralError,
    SandboxNotFound,
    SnapshotInUse,
    SnapshotNotFound,
)
from ..models import SandboxInfo, SnapshotInfo
from .bodies import (
    ForkBody,
    NetworkUpdate,
    NewSandbox,
    ResumeBody,
    SnapshotBody,
)
from .common import (
    E2BHTTPError,
    endpoint,
    json_body,
    manager_of,
    tenant_of,
)
from .state import E2BSandbox, E2BState
from .tokens import SandboxTokens

logger = logging.getLogger(__name__)

__all__ = ["ENVD_VERSION", "MetricSamples", "routes", "sandbox_domain"]

# What Corral's envd implements, in the SDKs' version gates (E2B-COMPAT §6.6): CloseStdin,
# octet-stream and gzip uploads, recursive watch; not file metadata (0.6.2) or watch entries.
ENVD_VERSION = "0.5.7"
DEFAULT_TIMEOUT_S = 300  # E2B's default when create omits it (SandboxBase.default_sandbox_timeout)
_MAX_PAGE = 100
def _sandbox_id(request: Request) -> str:
    e2b_id = request.path_params["sandbox_id"]
    corral_id = from_e2b(e2b_id)
    if corral_id is None:
        raise E2BHTTPError(404, f"sandbox {e2b_id[:64]!r} not found")
    return corral_id


def _owner_filter(tenant: Tenant) -> str | None:
    """The ``tenant=`` the control plane filters by: the operator sees every tenant's."""
    return None if tenant.is_local else tenant.name


def _owned(manager: Manager, tenant: Tenant, corral_id: str) -> SandboxInfo:
    try:
        return manager.get(corral_id, tenant=_owner_filter(tenant))
    except SandboxNotFound:
        raise E2BHTTPError(404, f"sandbox {to_e2b(corral_id)!r} not found") from None


# -- shapes --------------------------------------------------------------------------------------


def _rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")


def _e2b_state(info: SandboxInfo) -> str:
    """E2B knows two states: a hibernated sandbox is "paused" there (its resume wakes it)."""
    return "paused" if info.state in ASLEEP else "running"


def _internet(info: SandboxInfo) -> bool:
    return bool(info.network.get("allow"))


_HOST = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9.\-]+)(?::(\d{1,5}))?")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def sandbox_domain(request: Request) -> str | None:
    """The ``domain`` a sandbox's answer carries: the SDKs build ``<port>-<id>.<domain>``
    from it for ``get_host`` and, below code interpreter 2.9.0, for ``https://`` code
    execution, whatever ``E2B_SANDBOX_URL`` says (E2B-COMPAT §2.2-2.3).

    Domain mode: the domain. URL mode over TLS: ``corral@HOST:PORT`` (the listener as the
    caller reached it), so ``https://49999-<id>.corral@HOST:PORT`` reaches this listener with
    no DNS, naming its sandbox in the URL's user part (``app._url_mode_sandbox``). Plain URL
    mode on loopback: ``localhost:PORT``, so ``get_host`` is ``<port>-<id>.localhost:PORT``,
    which browsers and curl send to loopback. Otherwise None (the SDK's ``E2B_DOMAIN``)."""
    config = request.app.state.config
    if config.domain is not None:
        return str(config.domain)
    host = request.headers.get("host", "").strip().lower()
    parsed = _HOST.fullmatch(host)
    if parsed is None:
        return None
    if request.url.scheme == "https":
        return f"corral@{host}"
    name, port = parsed.group(1), parsed.group(2)
    # `*.localhost` reaches 127.0.0.1 and ::1 only: not a listener on another loopback address.
    arrived = (request.scope.get("server") or ("",))[0]
    if (name != "localhost" and not _is_loopback(name.strip("[]"))) or arrived not in (
            "127.0.0.1", "::1"):
        return None
    return f"localhost:{port}" if port else "localhost"


def _sandbox(request: Request, info: SandboxInfo, extra: E2BSandbox | None) -> dict[str, Any]:
    tokens: SandboxTokens = request.app.state.tokens
    return {
        "templateID": extra.template_id if extra else info.template,
        "sandboxID": to_e2b(info.id),
        "alias": extra.template_id if extra else info.template,
        "clientID": "corral",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": tokens.envd(info.id),
        "trafficAccessToken": tokens.traffic(info.id),
        "domain": sandbox_domain(request),
    }


def _detail(request: Request, info: SandboxInfo, extra: E2BSandbox | None) -> dict[str, Any]:
    tier = get_tier(info.resources)
    return {
        **_sandbox(request, info, extra),
        "startedAt": _rfc3339(info.created_at),
        "endAt": _rfc3339(info.expires_at),
        "cpuCount": max(1, math.ceil(tier.cpus)),
        "memoryMB": tier.memory_bytes // (1024 * 1024),
        "diskSizeMB": tier.disk_bytes // (1024 * 1024),
        "state": _e2b_state(info),
        "metadata": dict(info.labels),
        "allowInternetAccess": _internet(info),
        "lifecycle": {"onTimeout": info.lifecycle.on_timeout,
                      "autoResume": info.lifecycle.auto_resume},
        "volumeMounts": [{"name": m["source"], "path": m["target"]} for m in info.mounts
                         if m["kind"] == "volume"],
    }


def _snapshot(snap: SnapshotInfo) -> dict[str, Any]:
    return {"snapshotID": to_e2b(snap.id), "names": [snap.name] if snap.name else []}


# -- create ------------------------------------------------------------------------------------


def _template(request: Request, template_id: str) -> tuple[str | None, str | None]:
    """(Corral template, snapshot id) for E2B's ``templateID``."""
    snapshot = from_e2b(template_id)
    if snapshot is not None and snapshot.startswith("snap_"):
        return None, snapshot
    from .templates import resolve  # one the caller's tenant built (POST /v3/templates)

    if (built := resolve(request, template_id)) is not None:
        return built, None
    templates: Mapping[str, str] = request.app.state.config.templates
    return templates.get(template_id, template_id), None


def _network(request: Request, allow_out: list[str], internet_asked: bool | None,
             tenant: Tenant) -> dict[str, Any] | None:
    """Corral's egress policy for E2B's ``network.allowOut`` and ``allow_internet_access``.

    Corral never gives raw internet: "internet" means the hosts the tenant's ceiling allows,
    and nothing when it allows none (the gateway then refuses every connection, saying why).
    """
    internet = None
    if internet_asked:
        manager = manager_of(request)
        # With pip and npm pointed at the operator's index when the ceiling covers it, so a
        # kernel's `!pip install` finds packages where the tenant may reach them.
        internet = ceiling_network(manager.settings, manager.ceiling_for(tenant).hosts)
    allow = sorted({*allow_out, *(internet or {}).get("allow", ())})
    if not allow:
        return None
    return {**(internet or {}), "allow": allow}


@endpoint
async def create_sandbox(request: Request) -> Response:
    asked = NewSandbox.read(await json_body(request))
    tenant = tenant_of(request)
    manager = manager_of(request)
    template, snapshot = _template(request, asked.template_id)
    timeout = DEFAULT_TIMEOUT_S if asked.timeout is None else asked.timeout
    network = _network(request, asked.network.allow_out, asked.allow_internet_access, tenant)

    def create() -> SandboxInfo:
        info = manager.create(template=template, snapshot=snapshot, timeout=timeout,
                              labels=asked.metadata, network=network, caller=tenant,
                              volumes=asked.volume_mounts or None, lifecycle=asked.lifecycle)
        state: E2BState = request.app.state.e2b
        state.remember(E2BSandbox(
            id=info.id, template_id=asked.template_id, envs=dict(asked.env_vars),
            internet=asked.allow_internet_access,
            auto_pause=asked.auto_pause))
        return info

    info = await run_in_threadpool(create)
    request.app.state.e2b_metrics.watch(info.id)  # E2B samples from the start
    extra = request.app.state.e2b.get(info.id)
    return JSONResponse(_sandbox(request, info, extra), status_code=201)


# -- read ------------------------------------------------------------------------------------------


@endpoint
async def get_sandbox(request: Request) -> Response:
    manager, tenant = manager_of(request), tenant_of(request)
    info = await run_in_threadpool(_owned, manager, tenant, _sandbox_id(request))
    return JSONResponse(_detail(request, info, request.app.state.e2b.get(info.id)))


def _metadata_filter(raw: str | None) -> dict[str, str]:
    if not raw:
        return {}
    return dict(parse_qsl(raw, keep_blank_values=True))


def _page_token(token: str | None) -> tuple[float, str] | None:
    if not token:
        return None
    try:
        created, _, sandbox_id = base64.urlsafe_b64decode(token.encode() + b"==").decode(
            ).partition(" ")
        return float(created), sandbox_id
    except (ValueError, UnicodeDecodeError, binascii.Error):
        raise E2BHTTPError(400, "nextToken is not one this server gave out") from None


def _next_token(info: SandboxInfo) -> str:
    raw = f"{info.created_at!r} {info.id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


async def _list(request: Request, *, paginated: bool) -> Response:
    manager, tenant = manager_of(request), tenant_of(request)
    query = request.query_params
    wanted = _metadata_filter(query.get("metadata"))
    states = {s.strip() for s in (query.get("state") or "").split(",") if s.strip()}
    if paginated and not states:
        states = {"running", "paused"}
    if not paginated:
        states = {"running"}
    unknown = states - {"running", "paused"}
    if unknown:
        raise E2BHTTPError(400, f"state {sorted(unknown)}: use running and/or paused")
    limit = _parse_limit(query.get("limit")) if query.get("limit") else _MAX_PAGE
    after = _page_token(query.get("nextToken"))
    descending = (query.get("order") or "asc").lower() == "desc"

    def listed() -> list[SandboxInfo]:
        return manager.list(tenant=_owner_filter(tenant))

    items = [info for info in await run_in_threadpool(listed)
             if _e2b_state(info) in states
             and info.state != "destroying"
             and all(info.labels.get(k) == v for k, v in wanted.items())]
    items.sort(key=lambda i: (i.created_at, i.id), reverse=descending)
    if after is not None:
        items = [i for i in items if ((i.created_at, i.id) < after if descending
                                      else (i.created_at, i.id) > after)]
    page = items[:limit] if paginated else items
    headers = {}
    if paginated and len(items) > len(page) and page:
        headers["x-next-token"] = _next_token(page[-1])
    state: E2BState = request.app.state.e2b
    return JSONResponse([_detail(request, info, state.get(info.id)) for info in page],
                        headers=headers)


def _parse_limit(raw: str | None) -> int:
    try:
        value = int(raw or "")
    except ValueError:
        raise E2BHTTPError(400, f"limit must be an integer, not {raw!r}") from None
    if not 1 <= value <= _MAX_PAGE:
        raise E2BHTTPError(400, f"limit must be between 1 and {_MAX_PAGE}")
    return value


@endpoint
async def list_sandboxes_v2(request: Request) -> Response:
    return await _list(request, paginated=True)


@endpoint
async def list_sandboxes_v1(request: Request) -> Response:
    return await _list(request, paginated=False)


# -- change -------------------------------------------------------------------------------------


@endpoint
async def kill_sandbox(request: Request) -> Response:
    manager, tenant = manager_of(request), tenant_of(request)
    corral_id = _sandbox_id(request)

    def kill() -> None:
        _owned(manager, tenant, corral_id)
        manager.destroy(corral_id)  # its E2B state goes with it (state.follow_destroys)

    await run_in_threadpool(kill)
    return Response(status_code=204)


@endpoint
async def set_timeout(request: Request) -> Response:
    manager, tenant = manager_of(request), tenant_of(request)
    corral_id = _sandbox_id(request)
    body = await json_body(request)
    timeout = SetTimeout.parse({"timeout": body.get("timeout")}).timeout

    def change() -> None:
        _owned(manager, tenant, corral_id)
        manager.set_timeout(corral_id, timeout, caller=tenant)

    await run_in_threadpool(change)
    return Response(status_code=204)


async def _connect(request: Request, *, resume_only: bool) -> Response:
    manager, tenant = manager_of(request), tenant_of(request)
    corral_id = _sandbox_id(request)
    asked = ResumeBody.read(await json_body(request))
    timeout = asked.timeout

    def connect() -> tuple[SandboxInfo, bool]:
        info = _owned(manager, tenant, corral_id)
        resumed = info.state in ASLEEP
        if resume_only and not resumed:
            raise E2BHTTPError(409, f"sandbox {to_e2b(corral_id)} is already running")
        if resumed:
            info = manager.resume(corral_id)
        # Connect only ever extends the life (E2B: "only extends the TTL").
        if timeout is not None and time.time() + timeout > info.expires_at:
            info = manager.set_timeout(corral_id, timeout, caller=tenant)
        return info, resumed

    info, resumed = await run_in_threadpool(connect)
    notice = asked.lifecycle_notice(info.lifecycle)
    extra = request.app.state.e2b.get(info.id)
    return JSONResponse(_sandbox(request, info, extra), status_code=201 if resumed else 200,
                        headers={"X-Corral-Notice": notice} if notice else None)


@endpoint
async def connect_sandbox(request: Request) -> Response:
    return await _connect(request, resume_only=False)


@endpoint
async def resume_sandbox(request: Request) -> Response:
    return await _connect(request, resume_only=True)


@endpoint
async def pause_sandbox(request: Request) -> Response:
    manager, tenant = manager_of(request), tenant_of(request)
    corral_id = _sandbox_id(request)
    await json_body(request)

    def pause() -> None:
        info = _owned(manager, tenant, corral_id)
        if info.state in ASLEEP:
            raise E2BHTTPError(409, f"sandbox {to_e2b(corral_id)} is already paused")
        manager.pause(corral_id)

    await run_in_threadpool(pause)
    return Response(status_code=204)


@endpoint
async def sandbox_metrics(request: Request) -> Response:
    manager, tenant = manager_of(request), tenant_of(request)
    corral_id = _sandbox_id(request)
    query = request.query_params
    start, end = _epoch(query.get("start")), _epoch(query.get("end"))
    info = await run_in_threadpool(_owned, manager, tenant, corral_id)
    samples: MetricSamples = request.app.state.e2b_metrics
    samples.watch(corral_id)
    await run_in_threadpool(samples.take, info)
    # ``end`` is whole seconds the SDK floors from its clock just before the call: a second
    # of slack keeps the sample this call took when ``end`` is "now".
    return JSONResponse([m for m in samples.of(corral_id)
                         if (start is None or m["timestampUnix"] >= start)
                         and (end is None or m["timestampUnix"] <= end + 1)])


def _epoch(raw: str | None) -> int | None:
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise E2BHTTPError(400, f"start and end are Unix seconds, not {raw[:40]!r}") from None


class MetricSamples:
    """Samples of each sandbox's CPU, memory and disk, as E2B takes them: every 5 s from the
    sandbox's create on this surface (or from the first ``get_metrics`` of one made elsewhere),
    and whenever a caller asks (at most once a second); up to 3600 kept per sandbox, in memory.

    CPU is the sandbox cgroup's CPU time since the sandbox's previous sample (since its start
    for the first) over the wall time between, per CPU of its tier; memory is the cgroup's
    ``memory.current`` (page cache included, so ``memCache`` is 0) against the tier's limit;
    disk is the workspace filesystem's use against its size. A tier that cannot measure a
    sandbox (``usage_now`` None) gets no samples. One daemon thread samples the watched
    sandboxes, started on the first ``watch`` and ended by ``close``."""

    _KEEP = 3600
    _MIN_GAP_S = 1.0
    INTERVAL_S = 5.0

    def __init__(self, manager: Manager) -> None:
        self._manager = manager
        self._series: dict[str, deque[dict[str, Any]]] = {}
        self._last: dict[str, tuple[float, float]] = {}  # id -> (wall, cpu seconds)
        self._watched: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def of(self, sandbox_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._series.get(sandbox_id, ()))

    def watch(self, sandbox_id: str) -> None:
        """Sample the sandbox every ``INTERVAL_S`` until it is gone."""
        with self._lock:
            self._watched.add(sandbox_id)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="corral-e2b-metrics",
                                                daemon=True)
                self._thread.start()

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=10)

    def take(self, info: SandboxInfo) -> None:
        with self._lock:
            self._take(info)

    def _run(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            with self._lock:
                watched = sorted(self._watched)
            for sandbox_id in watched:
                try:
                    info = self._manager.get(sandbox_id)
                except CorralError:  # gone: its samples go with it
                    self._forget(sandbox_id)
                    continue
                except Exception:  # the sampler must outlive one bad read
                    # Said once: the sandbox is no longer sampled unasked (its next
                    # get_metrics watches it again), so a lasting failure (the control plane
                    # closed under a listener never shut down) does not repeat every 5 s.
                    logger.exception("sampling sandbox %s for E2B metrics failed", sandbox_id)
                    self._forget(sandbox_id)
                    continue
                if info.state == "running":
                    self.take(info)

    def _forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._watched.discard(sandbox_id)
            self._series.pop(sandbox_id, None)
            self._last.pop(sandbox_id, None)

    def _take(self, info: SandboxInfo) -> None:
        manager = self._manager
        now = time.time()
        last = self._last.get(info.id)
        if last is not None and now - last[0] < self._MIN_GAP_S:
            return
        tier = get_tier(info.resources)
        cpus = max(1, math.ceil(tier.cpus))
        usage = manager.usage_now(info.id)
        if usage is None:  # a tier that cannot measure it (the microVM's): no sample, not 0s
            return
        cpu_s = float(usage.get("cpu_s", 0.0))
        since, before = last if last is not None else (info.created_at, 0.0)
        pct = 100.0 * max(0.0, cpu_s - before) / max(now - since, 1e-3) / cpus
        disk_used, disk_total = self._disk(manager, info.id, tier.disk_bytes)
        series = self._series.setdefault(info.id, deque(maxlen=self._KEEP))
        series.append({
            "timestamp": _rfc3339(now), "timestampUnix": int(now), "cpuCount": cpus,
            "cpuUsedPct": round(min(pct, 100.0), 2),
            "memUsed": int(usage.get("memory_bytes", 0)), "memTotal": tier.memory_bytes,
            "memCache": 0, "diskUsed": disk_used, "diskTotal": disk_total})
        self._last[info.id] = (now, cpu_s)

    @staticmethod
    def _disk(manager: Manager, sandbox_id: str, size: int) -> tuple[int, int]:
        # The host tiers' backends know the workspace's mount on the host (``workspace_root``,
        # theirs, not the protocol's); elsewhere its use is unknown (0).
        try:
            record = manager.sandboxes.get(sandbox_id)
            root = getattr(manager.sandboxes.backend(record), "workspace_root", None)
            if root is None:
                return 0, size
            point = root(manager.sandboxes.spec(record))
            if not os.path.ismount(point):
                return 0, size
            stat = os.statvfs(point)
        except (OSError, CorralError):
            return 0, size
        # The image may be made larger than the tier's disk (room for layers): the tier's
        # size is the sandbox's limit.
        return ((stat.f_blocks - stat.f_bfree) * stat.f_frsize,
                min(size, stat.f_blocks * stat.f_frsize))


@endpoint
async def update_network(request: Request) -> Response:
    manager, tenant = manager_of(request), tenant_of(request)
    corral_id = _sandbox_id(request)
    asked = NetworkUpdate.read(await json_body(request))
    network = _network(request, asked.allow_out, asked.allow_internet_access, tenant)

    def change() -> None:
        _owned(manager, tenant, corral_id)
        manager.set_network(corral_id, network, caller=tenant)

    await run_in_threadpool(change)
    return Response(status_code=204)


# -- snapshots and forks --------------------------------------------------------------------


@endpoint
async def create_snapshot(request: Request) -> Response:
    manager, tenant = manager_of(request), tenant_of(request)
    corral_id = _sandbox_id(request)
    asked = SnapshotBody.read(await json_body(request))
    name, memory = asked.name, asked.memory

    def snap() -> SnapshotInfo:
        _owned(manager, tenant, corral_id)
        # E2B's memory snapshot is Corral's: the microvm tier saves the running machine, and
        # a sandbox created from the snapshot (templateID) resumes it; other tiers refuse.
        return manager.snapshot(corral_id, name=name,
                                tenant=_owner_filter(tenant), memory=memory)

    return JSONResponse(_snapshot(await run_in_threadpool(snap)), status_code=201)


@endpoint
async def list_snapshots(request: Request) -> Response:
    manager, tenant = manager_of(request), tenant_of(request)
    query = request.query_params
    sandbox = from_e2b(query.get("sandboxID") or "") if query.get("sandboxID") else None
    name = query.get("name")
    limit = _parse_limit(query.get("limit")) if query.get("limit") else _MAX_PAGE
    after = query.get("nextToken")

    def listed() -> list[SnapshotInfo]:
        return manager.list_snapshots(tenant=_owner_filter(tenant))

    items = sorted((s for s in await run_in_threadpool(listed)
                    if (sandbox is None or s.sandbox == sandbox)
                    and (name is None or s.name == name)), key=lambda s: (s.created_at, s.id))
    if after:
        ids = [s.id for s in items]
        corral_after = from_e2b(after)
        items = items[ids.index(corral_after) + 1:] if corral_after in ids else []
    page = items[:limit]
    headers = {"x-next-token": to_e2b(page[-1].id)} if len(items) > len(page) else {}
    return JSONResponse([_snapshot(s) for s in page], headers=headers)


@endpoint
async def delete_snapshot(request: Request) -> Response:
    manager, tenant = manager_of(request), tenant_of(request)
    snapshot = from_e2b(request.path_params["template_id"])
    if snapshot is None or not snapshot.startswith("snap_"):
        raise E2BHTTPError(404, "no such snapshot; Corral's E2B surface deletes snapshots only "
                           "(remove a template with `corral templates rm`)")

    def delete() -> None:
        manager.delete_snapshot(snapshot, tenant=_owner_filter(tenant))

    try:
        await run_in_threadpool(delete)
    except SnapshotNotFound:
        raise E2BHTTPError(404, f"snapshot {to_e2b(snapshot)!r} not found") from None
    except SnapshotInUse as exc:
        raise E2BHTTPError(409, exc.message) from None
    return Response(status_code=204)


@endpoint
async def fork_sandbox(request: Request) -> Response:
    manager, tenant = manager_of(request), tenant_of(request)
    corral_id = _sandbox_id(request)
    asked = ForkBody.read(await json_body(request))
    count, timeout, memory = asked.count, asked.timeout, asked.memory

    def fork() -> list[SandboxInfo]:
        _owned(manager, tenant, corral_id)
        children = manager.fork(corral_id, count,
                                tenant=_owner_filter(tenant), caller=tenant, memory=memory)
        parent = request.app.state.e2b.get(corral_id)
        for child in children:
            if parent is not None:
                request.app.state.e2b.remember(E2BSandbox(
                    id=child.id, template_id=parent.template_id, envs=parent.envs,
                    internet=parent.internet, auto_pause=parent.auto_pause))
        if timeout is not None:
            children = [manager.set_timeout(c.id, timeout, caller=tenant) for c in children]
        return children

    children = await run_in_threadpool(fork)
    state: E2BState = request.app.state.e2b
    return JSONResponse([{"sandbox": _sandbox(request, c, state.get(c.id))} for c in children],
                        status_code=201)


@endpoint
async def not_offered(request: Request) -> Response:
    what = request.url.path.split("/")[1]
    raise E2BHTTPError(404 if request.method == "GET" else 501,
                       f"Corral's E2B surface does not offer /{what}: templates are built with "
                       "the Template SDK (POST /v3/templates) or `corral templates build`, and "
                       "listed with `corral templates ls`; volumes come with Corral issue 16")


routes = [
    Route("/v2/sandboxes", create_sandbox, methods=["POST"]),
    Route("/sandboxes", create_sandbox, methods=["POST"]),
    Route("/v2/sandboxes", list_sandboxes_v2, methods=["GET"]),
    Route("/sandboxes", list_sandboxes_v1, methods=["GET"]),
    Route("/sandboxes/{sandbox_id}", get_sandbox, methods=["GET"]),
    Route("/sandboxes/{sandbox_id}", kill_sandbox, methods=["DELETE"]),
    Route("/sandboxes/{sandbox_id}/timeout", set_timeout, methods=["POST"]),
    Route("/v2/sandboxes/{sandbox_id}/connect", connect_sandbox, methods=["POST"]),
    Route("/sandboxes/{sandbox_id}/connect", connect_sandbox, methods=["POST"]),
    Route("/sandboxes/{sandbox_id}/resume", resume_sandbox, methods=["POST"]),
    Route("/sandboxes/{sandbox_id}/pause", pause_sandbox, methods=["POST"]),
    Route("/sandboxes/{sandbox_id}/metrics", sandbox_metrics, methods=["GET"]),
    Route("/sandboxes/{sandbox_id}/network", update_network, methods=["PUT"]),
    Route("/sandboxes/{sandbox_id}/snapshots", create_snapshot, methods=["POST"]),
    Route("/snapshots", list_snapshots, methods=["GET"]),
    Route("/templates/{template_id}", delete_snapshot, methods=["DELETE"]),
    Route("/sandboxes/{sandbox_id}/fork", fork_sandbox, methods=["POST"]),
    Route("/templates", not_offered, methods=["GET", "POST"]),
    Route("/volumes", not_offered, methods=["GET", "POST"]),
]
