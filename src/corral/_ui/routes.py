"""The dashboard's routes on ``corral serve``: its page and assets under ``/ui``, sign-in and
sign-out, the few reads the API lacks (a page of the caller's sandboxes, the live list's
event stream), and ``/docs`` with the Swagger UI the package ships (it worked only online
before: FastAPI's default loads it from a CDN).

Everything else the dashboard shows or does goes through the ordinary ``/v1`` API with the
session cookie (``session``), so tenancy, quotas, ceilings and the audit trail apply to it
exactly as to any client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from .._control.plane import LOCAL_TENANT, Manager, Tenant
from .._http.deps import ManagerDep, TenantDep
from .._http.guard import UI_HEADER
from .._templates.catalog import list_builds
from ..errors import (
    AuthError,
    CorralError,
    PolicyError,
    SandboxBusy,
    SandboxNotFound,
    UsageError,
)
from ..models import SandboxInfo
from .session import SESSION_S, UISessions, session_cookie_name

__all__ = ["PAGE_MAX", "STATIC", "SandboxPage", "install", "install_pages", "sandbox_page"]

STATIC = Path(__file__).resolve().parent / "static"
# The page may load and connect to nothing but this service (its own assets, its own API).
# Inline styles: xterm.js sizes its rows with <style> elements (no script can come of them).
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; "
        "font-src 'self'; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
        "form-action 'self'")
_PAGE_HEADERS = {"content-security-policy": _CSP, "x-content-type-options": "nosniff",
                 "referrer-policy": "no-referrer", "cache-control": "no-store"}
_LIVE_TYPES = ("sandbox.", "snapshot.")
PAGE_MAX = 500


class SignIn(BaseModel):
    key: str = Field(min_length=1, max_length=200, description="A `ck_` API key.")


class SandboxPage(BaseModel):
    total: int
    offset: int
    items: list[SandboxInfo]
    #: the page's running sandboxes' CPU seconds so far and memory now, by id
    usage: dict[str, dict[str, float]] = Field(default_factory=dict)


def install(app: FastAPI, sessions: UISessions | None) -> None:
    """Add the dashboard, ``/docs`` and their assets to ``app``."""
    install_pages(app, sessions)
    app.include_router(_ui_router())


def install_pages(app: FastAPI, sessions: UISessions | None) -> None:
    """What of the dashboard needs no control plane: the page, its assets, ``/docs``,
    sign-in and -out, who is signed in (the cluster gateway serves these too)."""
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="ui-static")
    app.include_router(_docs_router())
    app.include_router(_page_router(sessions))


def sandbox_page(infos: list[SandboxInfo], *, q: str, offset: int, limit: int) -> SandboxPage:
    """A page of sandboxes, newest first, filtered by ``q`` (a substring of the id, template,
    tier, isolation, state or a label)."""
    if q:
        needle = q.lower()
        infos = [i for i in infos if needle in _haystack(i)]
    infos = sorted(infos, key=lambda i: (-i.created_at, i.id))
    return SandboxPage(total=len(infos), offset=offset, items=infos[offset:offset + limit])


def _docs_router() -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get("/docs")
    def docs() -> FileResponse:
        # Swagger UI set up by docs.js (no inline script: the page's CSP allows none); it sends
        # a key given with Authorize, else the dashboard session this browser holds.
        return FileResponse(STATIC / "docs.html", headers=_PAGE_HEADERS)

    return router


def _page_router(sessions: UISessions | None) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get("/ui")
    @router.get("/ui/")
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers=_PAGE_HEADERS)

    @router.post("/ui/session")
    def sign_in(body: SignIn, request: Request) -> JSONResponse:
        if request.headers.get(UI_HEADER.decode()) != "1":
            raise AuthError("sign in from the dashboard's page (its request carries "
                            "`X-Corral-UI: 1`)")
        if sessions is None:
            raise UsageError("this service has no dashboard sessions (a cluster node)")
        cookie, tenant = sessions.sign_in(body.key)
        answer = JSONResponse({"tenant": tenant.name})
        answer.set_cookie(session_cookie_name(request.scope), cookie, max_age=SESSION_S,
                          path="/", httponly=True,
                          samesite="strict", secure=request.url.scheme == "https")
        return answer

    @router.delete("/ui/session", status_code=204)
    def sign_out(request: Request) -> Response:
        answer = Response(status_code=204)
        answer.delete_cookie(session_cookie_name(request.scope), path="/", httponly=True,
                             samesite="strict", secure=request.url.scheme == "https")
        return answer

    @router.get("/ui/api/me")
    def me(who: TenantDep) -> dict[str, Any]:
        return {"tenant": who.name, "operator": who.is_local,
                "max_sandboxes": who.max_sandboxes, "tiers": list(who.tiers)}

    return router


def _ui_router() -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get("/ui/api/sandboxes", response_model=SandboxPage)
    def sandboxes(who: TenantDep, manager: ManagerDep,
                  offset: Annotated[int, Query(ge=0)] = 0,
                  limit: Annotated[int, Query(ge=1, le=PAGE_MAX)] = 100,
                  q: Annotated[str, Query(max_length=200)] = "") -> SandboxPage:
        """A page of the caller's sandboxes (``sandbox_page``), with what each running one
        uses now."""
        page = sandbox_page(manager.list(tenant=None if who.is_local else who.name), q=q,
                            offset=offset, limit=limit)
        for info in page.items:
            if info.state == "running":
                with contextlib.suppress(CorralError):
                    now = manager.usage_now(info.id)
                    if now is not None:
                        page.usage[info.id] = now
        return page

    @router.get("/ui/api/sandboxes/{sandbox_id}/family")
    def family(sandbox_id: str, who: TenantDep, manager: ManagerDep) -> dict[str, Any]:
        """The sandbox's family: up to the sandbox it descends from (by fork or snapshot),
        then down through every fork and snapshot, as read from their audit trails."""
        return _family(manager, sandbox_id, None if who.is_local else who.name)

    @router.get("/ui/api/egress")
    def egress(who: TenantDep, manager: ManagerDep,
               limit: Annotated[int, Query(ge=1, le=200)] = 20) -> dict[str, Any]:
        """Egress decisions across the caller's live sandboxes, grouped by host, rule and
        verdict, refused first: where a prompt-injected agent shows itself."""
        groups: dict[tuple[str, str, str], dict[str, Any]] = {}
        for info in manager.list(tenant=None if who.is_local else who.name):
            trail = manager.auditor.trail(info.id, types=["egress.decision", "egress.summary"])
            for event in trail.events:
                d, count = event.data, 1
                if event.type == "egress.summary":  # a flood's count past its first few
                    hosts = (d.get("distinct") or {}).get("host") or []
                    d, count = {**(d.get("sample") or {}), "host": ", ".join(hosts)}, \
                        int(d.get("count", 0))
                key = (str(d.get("host", "")), str(d.get("rule", "")), str(d.get("verdict", "")))
                group = groups.setdefault(key, {"host": key[0], "rule": key[1],
                                                "verdict": key[2], "count": 0,
                                                "sandboxes": set(), "last": 0.0})
                group["count"] += count
                group["sandboxes"].add(info.id)
                group["last"] = max(group["last"], event.ts)
        ranked = sorted(groups.values(), key=lambda g: (g["verdict"] == "allowed", -g["count"],
                                                        g["host"]))
        return {"groups": [{**g, "sandboxes": sorted(g["sandboxes"])[:10]}
                           for g in ranked[:limit]]}

    @router.get("/ui/api/templates")
    def templates(who: TenantDep, manager: ManagerDep) -> list[dict[str, Any]]:
        """The templates and pulled images sandboxes can start from, each marked with
        whether the caller's ceiling allows it (host paths left out)."""
        allowed = manager.ceiling_for(who).templates
        builds = []
        for build in list_builds(manager.settings.home / "templates"):
            entry = {k: v for k, v in build.to_dict().items() if k != "path"}
            entry["allowed"] = allowed is None or build.name in allowed
            builds.append(entry)
        return builds

    @router.get("/ui/api/tenants")
    def tenants(who: TenantDep, manager: ManagerDep) -> list[dict[str, Any]]:
        """Every tenant with its limits, its live sandboxes and its keys' ids (operator)."""
        _operator(who)
        live: dict[str, int] = {}
        for record in manager.records():
            live[record.tenant] = live.get(record.tenant, 0) + 1
        keys: dict[str, list[dict[str, Any]]] = {}
        for key in manager.tenants.keys():
            keys.setdefault(key["tenant"], []).append(key)
        rows = [{"name": t.name, "max_sandboxes": t.max_sandboxes, "tiers": list(t.tiers),
                 "commands_per_minute": t.commands_per_minute,
                 "ceiling": t.ceiling.to_json(), "live_sandboxes": live.get(t.name, 0),
                 "keys": keys.get(t.name, [])}
                for t in manager.tenants.tenants()]
        rows.append({"name": LOCAL_TENANT, "operator": True, "live_sandboxes": live.get(
            LOCAL_TENANT, 0), "keys": keys.get(LOCAL_TENANT, [])})
        return rows

    @router.get("/ui/api/drill")
    def drill_categories(who: TenantDep, manager: ManagerDep) -> dict[str, Any]:
        """The drill's categories, in its own order, each with its number of cases: what the
        drill page offers to run."""
        _operator(who)
        return {"categories": drills.categories(manager)}

    @router.post("/ui/api/drill", status_code=202)
    def start_drill(body: DrillRequest, who: TenantDep, manager: ManagerDep) -> dict[str, Any]:
        """Run the drill against this service's own configuration, in a process of its own
        (``corral drill --json``), as the operator; one at a time."""
        _operator(who)
        drills.check(manager, body.categories)
        return drills.start(manager, body.categories)

    @router.get("/ui/api/drill/{run_id}")
    def drill_status(run_id: str, who: TenantDep) -> dict[str, Any]:
        _operator(who)
        return drills.status(run_id)

    @router.get("/ui/api/stream")
    async def stream(request: Request, who: TenantDep, manager: ManagerDep) -> StreamingResponse:
        """Server-sent events, one per lifecycle change of the caller's sandboxes
        (``{"sandbox": id, "type": ...}``), and a comment every 15 s to keep it open."""
        return StreamingResponse(_changes(request, manager, who.name, who.is_local),
                                 media_type="text/event-stream",
                                 headers={"cache-control": "no-store"})

    return router


_FAMILY_MAX = 200


def _family(manager: Manager, sandbox_id: str, tenant: str | None) -> dict[str, Any]:
    def created(sid: str) -> dict[str, Any] | None:
        events = manager.auditor.trail(sid, types=["sandbox.created"]).events
        return dict(events[0].data) if events else None

    first = created(sandbox_id)
    if first is None or (tenant is not None and first.get("tenant") != tenant):
        raise SandboxNotFound(f"sandbox {sandbox_id} does not exist")
    root, origin, hops = sandbox_id, first, 0
    while hops < 50:  # up: the sandbox this one was forked or started from
        parent = origin.get("forked_from")
        if parent is None and origin.get("snapshot"):
            snap = manager.store.snapshot(str(origin["snapshot"]), tenant=tenant)
            parent = snap.sandbox if snap is not None else None
        above = created(str(parent)) if parent else None
        if above is None or (tenant is not None and above.get("tenant") != tenant):
            break
        root, origin, hops = str(parent), above, hops + 1
    live = {i.id: i.state for i in manager.list(tenant=tenant)}
    # Live sandboxes started from a snapshot, by snapshot: a trail's first line says so.
    started_from: dict[str, list[str]] = {}
    for sid in list(live)[:_FAMILY_SCAN_MAX]:
        began = _first_event(manager.auditor.path(sid))
        if began is not None and began.get("snapshot") and not began.get("forked_from"):
            started_from.setdefault(str(began["snapshot"]), []).append(sid)
    nodes: list[dict[str, Any]] = []
    queue: list[tuple[str, str | None, str]] = [(root, None, "root")]
    seen: set[str] = set()
    while queue and len(nodes) < _FAMILY_MAX:
        sid, parent, via = queue.pop(0)
        if sid in seen:
            continue
        seen.add(sid)
        nodes.append({"id": sid, "parent": parent, "via": via,
                      "state": live.get(sid, "gone")})
        for event in manager.auditor.trail(sid, types=["sandbox.forked", "snapshot.created",
                                                       "snapshot.restored"]).events:
            if event.type == "sandbox.forked":
                queue.extend((child, sid, "fork") for child in event.data.get("children", []))
            else:
                taken = str(event.data.get("snapshot"))
                nodes.append({"id": taken, "parent": sid, "via": event.type.split(".")[1],
                              "name": event.data.get("name"), "at": event.ts})
                if event.type == "snapshot.created":
                    queue.extend((child, taken, "started")
                                 for child in started_from.get(taken, []))
    return {"root": root, "sandbox": sandbox_id, "nodes": nodes}


_FAMILY_SCAN_MAX = 2000


def _first_event(path: Path) -> dict[str, Any] | None:
    """A trail's first event's data (``sandbox.created``), reading its first line only."""
    try:
        with open(path, "rb") as f:
            line = f.readline(1 << 20)
        data = json.loads(line).get("data")
    except (OSError, ValueError, AttributeError):
        return None
    return data if isinstance(data, dict) else None


def _operator(who: Tenant) -> None:
    if not who.is_local:
        raise PolicyError("only the operator may do this (a key from `corral keys create "
                          "--operator`, or the keyless service on loopback)")


# A category's spelling; which names exist is the drill's to say (``categories``, ``check``),
# so the dashboard does not import the drill package.
_CategoryName = Annotated[str, Field(min_length=1, max_length=40, pattern=r"^[a-z0-9][a-z0-9-]*$")]


class DrillRequest(BaseModel):
    categories: list[_CategoryName] = Field(default_factory=list, max_length=16,
                                            description="Only these categories (all if empty).")


class _Drills:
    """The drill runs started from the dashboard, one at a time, each ``corral drill --json``
    in a process of its own over the service's data directory (the CLI's drill, unchanged).

    The drill sits above the surfaces (``_drill`` runs them), so this surface never imports
    it: what it knows of the drill, it asks the drill's command."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, dict[str, Any]] = {}
        self._listing = threading.Lock()
        self._categories: list[dict[str, Any]] | None = None

    def categories(self, manager: Manager) -> list[dict[str, Any]]:
        """``{"name", "cases"}`` for each category with cases, in the drill's order: listed
        once by ``corral drill --list`` (about a second), then kept, since the drill's cases
        are the installed package's."""
        with self._listing:
            if self._categories is None:
                done = _list_cases(manager, ())
                if done.returncode != 0:
                    said = _said(done) or f"it exited with {done.returncode}"
                    raise CorralError(f"the drill could not list its cases: {said}"[:500])
                counts: dict[str, int] = {}
                for case in json.loads(done.stdout):
                    counts[case["category"]] = counts.get(case["category"], 0) + 1
                self._categories = [{"name": n, "cases": c} for n, c in counts.items()]
            return self._categories

    def check(self, manager: Manager, categories: Sequence[str]) -> None:
        """Refuse unknown category names, with the drill's own message, before a run is
        started."""
        if not categories or {c["name"] for c in self.categories(manager)}.issuperset(
                categories):
            return
        # The drill says why, in its words (``--list`` with them lists cases, starts nothing).
        done = _list_cases(manager, categories)
        if done.returncode != 0:
            raise UsageError((_said(done) or "the drill refused these categories "
                              f"(exit {done.returncode})")[:500])

    def start(self, manager: Manager, categories: Sequence[str]) -> dict[str, Any]:
        with self._lock:
            if any(run["state"] == "running" for run in self._runs.values()):
                raise SandboxBusy("a drill is running already: wait for its report")
            run_id = f"drill_{secrets.token_hex(6)}"
            env = _drill_env(manager)
            proc = subprocess.Popen(_drill_argv(categories), env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL)
            run = {"id": run_id, "state": "running", "started_at": time.time(),
                   "categories": list(categories), "report": None, "error": None}
            self._runs = {k: v for k, v in self._runs.items() if v["state"] == "running"}
            self._runs[run_id] = run
        threading.Thread(target=self._wait, args=(run, proc), daemon=True,
                         name="corral-ui-drill").start()
        return {k: v for k, v in run.items() if k != "report"}

    def _wait(self, run: dict[str, Any], proc: subprocess.Popen[bytes]) -> None:
        try:
            out, err = proc.communicate(timeout=_DRILL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # its pipes held open by what it started
                out, err = b"", b"the drill was killed at its timeout"
        try:
            run["report"] = json.loads(out)
        except ValueError:
            run["error"] = (err.decode(errors="replace")[-2000:] or
                            f"the drill exited with {proc.returncode} and no report")
        run["finished_at"] = time.time()
        run["state"] = "done"

    def status(self, run_id: str) -> dict[str, Any]:
        with self._lock:
            run = self._runs.get(run_id)
        if run is None:
            raise UsageError(f"no drill run {run_id[:40]!r} (runs are kept until the next one)")
        return dict(run)


def _list_cases(manager: Manager, categories: Sequence[str]
                ) -> subprocess.CompletedProcess[bytes]:
    """``corral drill --json --list``, of ``categories`` (all if none)."""
    env = _drill_env(manager)  # the service's own, as the drill's run gets
    try:
        return subprocess.run(_drill_argv(categories, "--list"), env=env,
                              capture_output=True, stdin=subprocess.DEVNULL,
                              timeout=_DRILL_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise SandboxBusy("the drill did not list its cases in "
                          f"{_DRILL_CHECK_TIMEOUT_S} s; try again") from exc


def _said(done: subprocess.CompletedProcess[bytes]) -> str | None:
    """Why the drill's command refused: its last ``Error:`` line, if it wrote one."""
    said = [line.strip() for line in done.stderr.decode(errors="replace").splitlines()
            if line.strip().startswith("Error:")]
    return said[-1].removeprefix("Error:").strip() if said else None


def _drill_argv(categories: Sequence[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "corral", "drill", "--json", *extra,
            *(arg for c in categories for arg in ("--category", c))]


def _drill_env(manager: Manager) -> dict[str, str]:
    """The drill is Corral itself (``python -m corral drill``): it gets the service's own
    environment (the operator's, never a caller's), with this service's data directory and
    uid range in place of any other ``CORRAL_*``."""
    settings = manager.settings
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    return env | {"CORRAL_HOME": str(settings.home), "CORRAL_UID_START":
                  str(settings.uid_start), "CORRAL_UID_COUNT": str(settings.uid_count)}


drills = _Drills()
_DRILL_TIMEOUT_S = 900
_DRILL_CHECK_TIMEOUT_S = 60


def _haystack(info: SandboxInfo) -> str:
    return " ".join([info.id, info.template, info.resources, info.isolation, info.state,
                     *(f"{k}={v}" for k, v in info.labels.items())]).lower()


async def _changes(request: Request, manager: Manager, tenant: str,
                   operator: bool) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    news: asyncio.Queue[tuple[str, str]] = asyncio.Queue(maxsize=10_000)

    def heard(sandbox_id: str, type_: str) -> None:
        if type_.startswith(_LIVE_TYPES):
            # A loop closed before this stream's end ran (a server stopped): nobody listens.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_offer, news, (sandbox_id, type_))

    stop = manager.auditor.listen(heard)
    # Whose a sandbox is, remembered: a destroyed one is no longer in the store.
    mine: dict[str, bool] = {info.id: True for info in await run_in_threadpool(
        lambda: manager.list(tenant=None if operator else tenant))}
    try:
        yield b": corral live list\n\n"
        while not await request.is_disconnected():
            try:
                sandbox_id, type_ = await asyncio.wait_for(news.get(), timeout=15)
            except TimeoutError:
                yield b": keep-alive\n\n"
                continue
            if sandbox_id not in mine:
                record = await run_in_threadpool(manager.record, sandbox_id)
                if record is None:
                    continue  # gone before we knew whose: never shown, nothing to remove
                mine[sandbox_id] = operator or record.tenant == tenant
            if mine[sandbox_id]:
                data = json.dumps({"sandbox": sandbox_id, "type": type_})
                yield f"event: change\ndata: {data}\n\n".encode()
    finally:
        stop()


def _offer(queue: asyncio.Queue[tuple[str, str]], item: tuple[str, str]) -> None:
    try:
        queue.put_nowait(item)
    except asyncio.QueueFull:
        pass  # a client this far behind reloads its page of the list anyway
