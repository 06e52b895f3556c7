"""Commands: run (to completion, or streamed as NDJSON) and kill."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse

from ..._control.manager import Manager
from ...errors import CorralError
from ...models import CommandResult
from ..deps import ManagerDep, TenantDep, owned
from ..schemas import _NDJSON, RunCommand

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/sandboxes/{sandbox_id}/commands/{command_id}/kill", status_code=204)
def kill_command(sandbox_id: str, command_id: str, who: TenantDep, manager: ManagerDep) -> Response:
    owned(manager, sandbox_id, who)
    manager.kill_command(sandbox_id, command_id)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/commands", response_model=None,
             responses={200: {"content": {"application/json": {}, **_NDJSON},
                              "description": "The result, or NDJSON events with stream=true."}})
def run_command(sandbox_id: str, body: RunCommand, who: TenantDep, manager: ManagerDep
                ) -> dict[str, Any] | StreamingResponse:
    owned(manager, sandbox_id, who)
    kwargs: dict[str, Any] = {"timeout": body.timeout, "envs": body.envs, "cwd": body.cwd,
                              "stdin": body.stdin, "context": body.context}
    if not body.stream:
        return _result(manager.run(sandbox_id, body.cmd, caller=who, **kwargs))
    # Refuse bad input (and a spent quota) with a status, before the 200 of a stream is
    # sent; check_run counts the start, so the streamed run does not count it again.
    manager.check_run(sandbox_id, body.cmd, caller=who, **kwargs)
    return StreamingResponse(_stream(manager, sandbox_id, body.cmd, kwargs),
                             media_type="application/x-ndjson")


def _result(result: CommandResult) -> dict[str, Any]:
    return result.to_dict()


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
