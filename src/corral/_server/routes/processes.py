"""Background processes: start, list, read output (from an offset), send input, kill; and
terminals over a websocket."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request, Response, WebSocket
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..._control.plane import Manager
from ..._control.requests import StartProcess
from ..._http.bodies import MAX_FILE_BODY, read_body
from ..._http.deps import ManagerDep, TenantDep, owned
from ...models import ProcessInfo
from ..schemas import _BINARY_BODY, _NDJSON
from ..terminal import serve_terminal

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/sandboxes/{sandbox_id}/processes", status_code=201,
             response_model=ProcessInfo)
def start_process(sandbox_id: str, body: StartProcess,
                  who: TenantDep, manager: ManagerDep) -> ProcessInfo:
    """Start a background process (optionally on a PTY); it outlives the request and is listed,
    read, written and killed by id."""
    owned(manager, sandbox_id, who)
    return manager.processes.start(sandbox_id, body.cmd, envs=body.envs, cwd=body.cwd,
                                   context=body.context, caller=who).info()


@router.get("/v1/sandboxes/{sandbox_id}/processes", response_model=list[ProcessInfo])
def list_processes(sandbox_id: str, who: TenantDep, manager: ManagerDep) -> list[ProcessInfo]:
    """The sandbox's background processes."""
    owned(manager, sandbox_id, who)
    return [p.info() for p in manager.processes.list(sandbox_id)]


@router.get("/v1/sandboxes/{sandbox_id}/processes/{process_id}", response_model=ProcessInfo)
def get_process(sandbox_id: str, process_id: str,
                who: TenantDep, manager: ManagerDep) -> ProcessInfo:
    """One background process: its command, state and exit code."""
    owned(manager, sandbox_id, who)
    return manager.processes.get(sandbox_id, process_id).info()


@router.get("/v1/sandboxes/{sandbox_id}/processes/{process_id}/output",
            response_class=StreamingResponse,
            responses={200: {"content": _NDJSON, "description": "Output events."}})
def process_output(sandbox_id: str, process_id: str,
                   who: TenantDep, manager: ManagerDep, offset: int = 0,
                   follow: bool = False, wait_s: float | None = None) -> StreamingResponse:
    """NDJSON ``{"offset", "stream", "data"}`` from ``offset``; ``follow`` streams until
    the process exits."""
    owned(manager, sandbox_id, who)
    process = manager.processes.get(sandbox_id, process_id)

    def lines() -> Iterator[bytes]:
        for at, stream, text in process.output(max(0, offset), follow=follow,
                                               wait_s=wait_s):
            yield (json.dumps({"offset": at, "stream": stream, "data": text}) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.post("/v1/sandboxes/{sandbox_id}/processes/{process_id}/input", status_code=204,
             openapi_extra=_BINARY_BODY)
async def process_input(sandbox_id: str, process_id: str, request: Request,
                        who: TenantDep, manager: ManagerDep) -> Response:
    """Write the request body to the process's stdin (or its terminal)."""
    def target() -> Any:
        owned(manager, sandbox_id, who)
        return manager.processes.get(sandbox_id, process_id)

    # Whose it is before a byte of the body is read.
    process = await run_in_threadpool(target)
    data = await read_body(request, MAX_FILE_BODY, "input is limited to {} bytes per "
                           "request; send it in several")
    await run_in_threadpool(process.send, data)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/processes/{process_id}/kill", status_code=204)
def kill_process(sandbox_id: str, process_id: str, who: TenantDep, manager: ManagerDep) -> Response:
    """Kill a background process and its children."""
    owned(manager, sandbox_id, who)
    manager.processes.kill(sandbox_id, process_id)
    return Response(status_code=204)


@router.websocket("/v1/sandboxes/{sandbox_id}/pty")
async def pty(websocket: WebSocket, sandbox_id: str, rows: int = 24,
              cols: int = 80) -> None:
    """A shell on a terminal. Client sends JSON text frames ``{"type": "input", "data"}``,
    ``{"type": "resize", "rows", "cols"}``, ``{"type": "signal", "signal": "INT"|"QUIT"|
    "TSTP"|"KILL"}``; the server sends binary frames of terminal output and, at the end,
    ``{"type": "exit", "exit_code"}``."""
    manager: Manager = websocket.app.state.manager
    await serve_terminal(websocket, manager, sandbox_id, rows=rows, cols=cols)
