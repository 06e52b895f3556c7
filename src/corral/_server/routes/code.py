"""The code interpreter: run a cell (NDJSON stream) and the contexts it runs in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse

from ..._control.plane import CodeEvent, Manager, Tenant, event_line
from ..._control.requests import CreateCodeContext, RunCode
from ..._http.deps import ManagerDep, TenantDep, owned
from ...models import CodeContext
from ..schemas import _NDJSON
from ..streaming import ndjson_stream

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/sandboxes/{sandbox_id}/code", response_model=None,
             responses={200: {"content": _NDJSON, "description": (
                 "NDJSON events as the cell runs: stdout/stderr {text, timestamp}, result "
                 "{is_main_result, data: MIME bundle}, execution_error {name, value, "
                 "traceback}, execution_count, end; then execution {execution: Execution}, "
                 "or error {error, message}.")}})
def run_code(sandbox_id: str, body: RunCode, who: TenantDep, manager: ManagerDep
             ) -> StreamingResponse:
    """Run a cell in the code interpreter (Python, JavaScript, TypeScript, R, bash kernels) and
    stream NDJSON: stdout, stderr, results (text, images, ...) and errors as they come, the
    whole execution last."""
    owned(manager, sandbox_id, who)
    # Refused with a status before the 200 of the stream: an unknown context or language, a
    # spent quota, a template that cannot run the kernel.
    manager.interpreter.prepare(sandbox_id, context_id=body.context, language=body.language,
                                caller=who)
    return StreamingResponse(_stream(manager, sandbox_id, body, who),
                             media_type="application/x-ndjson")


def _stream(manager: Manager, sandbox_id: str, body: RunCode, who: Tenant) -> Iterator[bytes]:
    """The cell's events as they come, the whole ``Execution`` last."""

    def work(emit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        def on_event(event: CodeEvent) -> None:
            emit(event_line(event))

        execution = manager.interpreter.execute(
            sandbox_id, body.code, context_id=body.context, language=body.language,
            envs=body.envs, timeout=body.timeout, caller=who, on_event=on_event)
        return {"type": "execution", "execution": execution.to_dict()}

    return ndjson_stream(work, what=f"the code stream of {sandbox_id}", thread_name="corral-code")


@router.post("/v1/sandboxes/{sandbox_id}/code/contexts", response_model=CodeContext,
             status_code=201)
def create_context(sandbox_id: str, body: CreateCodeContext, who: TenantDep,
                   manager: ManagerDep) -> CodeContext:
    """Start a code context: a kernel of its own (language, cwd) whose variables persist between
    cells."""
    owned(manager, sandbox_id, who)
    return manager.interpreter.create_context(sandbox_id, language=body.language,
                                              cwd=body.cwd, caller=who)


@router.get("/v1/sandboxes/{sandbox_id}/code/contexts", response_model=list[CodeContext])
def list_contexts(sandbox_id: str, who: TenantDep, manager: ManagerDep) -> list[CodeContext]:
    """The sandbox's code contexts."""
    owned(manager, sandbox_id, who)
    return manager.interpreter.list_contexts(sandbox_id)


@router.post("/v1/sandboxes/{sandbox_id}/code/contexts/{context_id}/restart",
             response_model=CodeContext)
def restart_context(sandbox_id: str, context_id: str, who: TenantDep,
                    manager: ManagerDep) -> CodeContext:
    """Restart a context's kernel: its state is dropped, the context id stays."""
    owned(manager, sandbox_id, who)
    return manager.interpreter.restart_context(sandbox_id, context_id)


@router.delete("/v1/sandboxes/{sandbox_id}/code/contexts/{context_id}", status_code=204)
def remove_context(sandbox_id: str, context_id: str, who: TenantDep,
                   manager: ManagerDep) -> Response:
    """Stop a context's kernel and forget it."""
    owned(manager, sandbox_id, who)
    manager.interpreter.remove_context(sandbox_id, context_id)
    return Response(status_code=204)
