"""The audit trail of a sandbox (also after it is gone, to its tenant), and the metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse, StreamingResponse

from ..._audit.log import follow as follow_log
from ..._audit.metrics import render
from ..._control.manager import Manager
from ...errors import SandboxNotFound
from ..auth import Tenant
from ..deps import ManagerDep, TenantDep
from ..schemas import _NDJSON

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/sandboxes/{sandbox_id}/audit", response_class=StreamingResponse,
            responses={200: {"content": _NDJSON, "description": "One event per line."}})
def audit(sandbox_id: str, who: TenantDep, manager: ManagerDep,
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


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(who: TenantDep, manager: ManagerDep) -> PlainTextResponse:
    return PlainTextResponse(render(manager.store),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


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
