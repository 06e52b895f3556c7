"""Commands: run (to completion, or streamed as NDJSON) and kill."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse

from ..._control.plane import Manager
from ..._control.requests import RunCommand
from ..._http.deps import ManagerDep, TenantDep, owned
from ...backends import OutputCut
from ...models import CommandResult
from ..schemas import _NDJSON
from ..streaming import ndjson_stream

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/sandboxes/{sandbox_id}/commands/{command_id}/kill", status_code=204)
def kill_command(sandbox_id: str, command_id: str, who: TenantDep, manager: ManagerDep) -> Response:
    """Kill a running command (its whole process group) by the id its stream announced."""
    owned(manager, sandbox_id, who)
    manager.kill_command(sandbox_id, command_id)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/commands", response_model=None,
             responses={200: {"content": {"application/json": {}, **_NDJSON},
                              "description": "The result, or NDJSON events with stream=true."}})
def run_command(sandbox_id: str, body: RunCommand, who: TenantDep, manager: ManagerDep
                ) -> dict[str, Any] | StreamingResponse:
    """Run a command to completion and answer its result, or with `stream` answer NDJSON: output
    events as they come, the result last. Limits, cwd, env and stdin are per command."""
    # The control plane's run refuses another tenant's sandbox itself (caller=who).
    kwargs: dict[str, Any] = {"timeout": body.timeout, "envs": body.envs, "cwd": body.cwd,
                              "stdin": body.stdin, "context": body.context}
    if not body.stream:
        return _result_out(manager.run(sandbox_id, body.cmd, caller=who, **kwargs),
                           body.output)
    # Refuse bad input (and a spent quota) with a status, before the 200 of a stream is
    # sent; check_run counts the start, so the streamed run does not count it again.
    manager.check_run(sandbox_id, body.cmd, caller=who, **kwargs)
    return StreamingResponse(_stream(manager, sandbox_id, body.cmd, kwargs, body.output),
                             media_type="application/x-ndjson")


def _result_out(result: CommandResult, output: str,
                streamed: dict[str, str] | None = None) -> dict[str, Any]:
    """A result on the wire. ``output="bytes"`` adds the exact bytes, base64-encoded. After a
    stream (``streamed``: the text each stream's events carried), the text is not sent again:
    only ``{stream}_tail``, what the events did not carry (the closing cut notice)."""
    data = result.to_dict(exact_bytes=output == "bytes")
    for name, sent in (streamed or {}).items():
        text: str = data[name]
        if text.startswith(sent):  # else (never expected): send it whole, as before
            del data[name]
            data[f"{name}_tail"] = text[len(sent):]
    return data


def _stream(manager: Manager, sandbox_id: str, cmd: str | list[str],
            kwargs: dict[str, Any], output_kind: str = "text") -> Iterator[bytes]:
    """Run in a worker thread; yield NDJSON lines as output arrives, then the result.

    Events: ``{"type": "stdout"|"stderr", "data"}`` (each piece of output once), ``{"type":
    "truncated", "stream", "limit"}`` when a stream reaches its cap (live, not only at the
    end), ``{"type": "keepalive"}``, then ``{"type": "result", ...}`` without the output the
    events carried, or ``{"type": "error", "error", "message"}``."""
    sent: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def work(emit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        def output(stream: str) -> Callable[[str], None]:
            def on_output(text: str) -> None:
                sent[stream].append(text)
                if isinstance(text, OutputCut):
                    # Its text is in the result as well: sent with the event, not again after.
                    emit({"type": "truncated", "stream": text.stream, "limit": text.limit,
                          "data": str(text)})
                else:
                    emit({"type": stream, "data": text})
            return on_output

        result = manager.run(sandbox_id, cmd, **kwargs, on_stdout=output("stdout"),
                             on_stderr=output("stderr"))
        streamed = {name: "".join(parts) for name, parts in sent.items()}
        return {"type": "result", **_result_out(result, output_kind, streamed)}

    return ndjson_stream(work, what=f"the command stream of {sandbox_id}",
                         thread_name="corral-command")
