"""The audit trail of a sandbox (also after it is gone, to its tenant), and the metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse, StreamingResponse

from ..._audit.log import follow_batches, tail_offset
from ..._audit.metrics import render
from ..._control.plane import Manager, Tenant
from ..._http.deps import ManagerDep, TenantDep
from ...errors import SandboxNotFound
from ..params import FloatText, IntText
from ..schemas import _NDJSON

__all__ = ["router"]

router = APIRouter()

_FOLLOW_POLL_S = 0.05


@router.get("/v1/sandboxes/{sandbox_id}/audit", response_class=StreamingResponse,
            responses={200: {"content": _NDJSON, "description": "One event per line."}})
def audit(sandbox_id: str, who: TenantDep, manager: ManagerDep,
          type: Annotated[list[str] | None, Query()] = None,  # noqa: A002 - the query name
          since: Annotated[float | None, FloatText] = None,
          until: Annotated[float | None, FloatText] = None,
          command: str | None = None, follow: bool = False,
          tail: Annotated[int | None, IntText, Query(ge=1, le=1_000_000, description=(
              "Only the last N lines of the trail (then, with follow, what comes next): a "
              "long trail's end without reading all of it."))] = None) -> StreamingResponse:
    """The sandbox's audit trail as NDJSON events (commands, files, network, lifecycle), also
    after it is destroyed; `follow` streams new events."""
    _check_trail_owner(manager, sandbox_id, who)
    if follow:
        path = manager.auditor.path(sandbox_id)
        if not path.exists():
            raise SandboxNotFound(f"no audit trail for {sandbox_id}")
        start = tail_offset(path, tail) if tail is not None else 0

        def live() -> Iterator[bytes]:
            # Heartbeats (empty chunks) return control every second, so a client that went
            # away frees its worker thread instead of holding it until the sandbox ends. A
            # 50 ms poll: an event reaches a watching page well within 0.2 s.
            for batch in follow_batches(path, types=type, command=command, heartbeat_s=1.0,
                                        poll_s=_FOLLOW_POLL_S, start=start):
                yield "".join(event.model_dump_json() + "\n" for event in batch
                              if (since is None or event.ts >= since) and (
                                  until is None or event.ts <= until)).encode()

        return StreamingResponse(live(), media_type="application/x-ndjson")
    trail = manager.auditor.trail(sandbox_id, types=type, since=since, until=until,
                                  command=command)
    events = trail.events[-tail:] if tail is not None else trail.events
    body = "".join(e.model_dump_json() + "\n" for e in events)
    return StreamingResponse(iter([body.encode()]), media_type="application/x-ndjson",
                             headers={"x-corral-torn-tail": str(trail.torn_tail).lower()})


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(who: TenantDep, manager: ManagerDep) -> PlainTextResponse:
    """Prometheus metrics (text exposition format): sandboxes, commands, egress, the reaper."""
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
