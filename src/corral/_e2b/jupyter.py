"""The code interpreter's port (49999) on the E2B surface: ``/execute`` and ``/contexts``, as
e2b-dev/code-interpreter's reference server answers them (E2B-COMPAT.md §8), over Corral's
interpreter service (``manager.interpreter``): the same kernels, contexts and audit events as
the native API.

``/execute`` streams one JSON object per line, in the reference server's order and shapes
(``number_of_executions``, ``stdout``/``stderr`` with an ISO 8601 ``timestamp``, ``result``
with ``is_main_result`` and one key per MIME type, ``error``, ``end_of_execution``), never a
blank line (the SDKs ``json.loads`` every line). Refusals are plain text with the reference
server's statuses: 400 for ``language`` together with ``context_id``, 404 for an unknown
context. A language without a kernel here (Java, Deno, or one the template lacks the runtime
of) is the cell's error in the stream, saying what is available.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from .._control.plane import (
    CodeEvent,
    CountEvent,
    EndEvent,
    ErrorEvent,
    Manager,
    OutputEvent,
    ResultEvent,
)
from .._http.errors import as_jupyter, failure
from ..errors import ContextNotFound, CorralError, InterpreterUnavailable, PathRefused
from ..models import RESULT_MIME, CodeContext
from . import paths
from .common import E2BHTTPError, json_body
from .target import target_of

__all__ = ["result_line", "routes"]

# E2B's own keys for a result's MIME types (``e2b_code_interpreter/models.py:Result``): the
# public Result's attribute names are the same.
_E2B_KEYS = RESULT_MIME
_ALIASES = {"js": "javascript", "ts": "typescript"}  # the reference's normalize_language


def _manager(request: Request) -> Manager:
    manager: Manager = request.app.state.manager
    return manager


def _text(status: int, message: str) -> PlainTextResponse:
    return PlainTextResponse(message, status_code=status)


def _refusal(exc: CorralError) -> PlainTextResponse:
    return _text(*as_jupyter(failure(exc)))


async def _body(request: Request) -> dict[str, Any] | PlainTextResponse:
    try:
        return await json_body(request)
    except E2BHTTPError as exc:  # the REST API's refusal, in this port's plain text
        return _text(exc.status, exc.message)


def _optional_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} must be a string")
    return value


def _language(value: str | None) -> str | None:
    return None if value is None else _ALIASES.get(value.lower(), value.lower())


def _iso(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, tz=dt.UTC).isoformat()


def result_line(data: Mapping[str, Any], *, is_main_result: bool) -> dict[str, Any]:
    """A result as the reference server sends it: one key per known MIME type (``png`` and
    ``jpeg`` base64, ``json`` an object), the others under ``extra``."""
    line: dict[str, Any] = {"type": "result", "is_main_result": is_main_result}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        key = _E2B_KEYS.get(mime)
        if key is None:
            extra[mime] = value
        else:
            line[key] = value
    if extra:
        line["extra"] = extra
    return line


def _line(event: CodeEvent) -> dict[str, Any]:
    if isinstance(event, OutputEvent):
        return {"type": event.stream, "text": event.text, "timestamp": _iso(event.timestamp)}
    if isinstance(event, ResultEvent):
        return result_line(event.data, is_main_result=event.is_main_result)
    if isinstance(event, ErrorEvent):
        return {"type": "error", "name": event.name, "value": event.value,
                "traceback": event.traceback}
    if isinstance(event, CountEvent):
        return {"type": "number_of_executions", "execution_count": event.execution_count}
    return {"type": "end_of_execution"}


def _context_out(context: CodeContext) -> dict[str, Any]:
    return {"id": context.id, "language": context.language, "cwd": paths.to_e2b(context.cwd)}


async def execute(request: Request) -> Response:
    target = target_of(request)
    body = await _body(request)
    if isinstance(body, Response):
        return body
    code = body.get("code")
    if not isinstance(code, str):
        return _text(400, "code is required: a string with the cell's source")
    try:
        context_id = _optional_str(body, "context_id")
        language = _language(_optional_str(body, "language"))
    except ValueError as exc:
        return _text(400, str(exc))
    if context_id is not None and language is not None:
        return _text(400, "Only one of context_id or language can be provided")
    envs = body.get("env_vars")
    if envs is not None and (not isinstance(envs, dict)
                             or not all(isinstance(v, str) for v in envs.values())):
        return _text(400, "env_vars must be an object of strings")
    manager = _manager(request)
    try:
        # The kernel starts here, so a quota or a template without python3 is a status,
        # not a stream that ends at once.
        await run_in_threadpool(manager.interpreter.prepare, target.sandbox_id,
                                context_id=context_id, language=language,
                                caller=target.owner, default_cwd=paths.HOME)
    except ContextNotFound:
        return _text(404, f"Context {context_id} not found")
    except InterpreterUnavailable as exc:
        # The cell's error, not a status: E2B's JS SDK reports any 400 as a bare
        # "400 Bad Request" (it reads no body), so a language the template lacks (or one
        # Corral has no kernel for) would say nothing of why or what to use instead.
        return StreamingResponse(_refused_cell(exc), media_type="application/x-ndjson")
    except CorralError as exc:
        return _refusal(exc)
    # The sandbox's envVars from create reach its code as they reach its commands (E2B's
    # "global" environment), under the cell's own.
    sandbox_envs = request.app.state.e2b.envs(target.sandbox_id)
    if sandbox_envs:
        envs = {**sandbox_envs, **(envs or {})}
    lines = _run(manager, target.sandbox_id, code, context_id=context_id, language=language,
                 envs=envs, caller=target.owner, default_cwd=paths.HOME)
    return StreamingResponse(lines, media_type="application/x-ndjson")


async def _refused_cell(exc: InterpreterUnavailable) -> AsyncIterator[bytes]:
    for line in ({"type": "error", "name": "InterpreterUnavailable", "value": exc.message,
                  "traceback": f"InterpreterUnavailable: {exc.message}"},
                 {"type": "end_of_execution"}):
        yield (json.dumps(line) + "\n").encode()


async def _run(manager: Manager, sandbox_id: str, code: str, **kwargs: Any
               ) -> AsyncIterator[bytes]:
    """The cell runs in a worker thread; each event crosses to the loop as it happens."""
    send, receive = anyio.create_memory_object_stream[dict[str, Any]](math.inf)
    ended = False

    def deliver(line: dict[str, Any] | None) -> None:
        # The client may be gone (its stream closed, the loop ending): the cell still runs
        # to its end in the kernel; what it says is dropped here.
        try:
            anyio.from_thread.run_sync(send.close if line is None else
                                       lambda: send.send_nowait(line))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, RuntimeError):
            pass

    def on_event(event: CodeEvent) -> None:
        nonlocal ended
        ended = ended or isinstance(event, EndEvent)
        deliver(_line(event))

    def work() -> None:
        try:
            manager.interpreter.execute(sandbox_id, code, on_event=on_event, **kwargs)
        except CorralError as exc:  # after the 200: the reference's error line, then the end
            deliver({"type": "error", "name": type(exc).__name__, "value": exc.message,
                     "traceback": ""})
        finally:
            if not ended:
                deliver({"type": "unexpected_end_of_execution"})
            deliver(None)

    async with anyio.create_task_group() as group:
        group.start_soon(_in_thread, work)
        async with receive:
            async for line in receive:
                yield (json.dumps(line) + "\n").encode()


async def _in_thread(work: Any) -> None:
    # Abandoned on cancel (the client went): the cell still ends, at its timeout at worst.
    await anyio.to_thread.run_sync(work, abandon_on_cancel=True,
                                   limiter=anyio.CapacityLimiter(1))


async def create_context(request: Request) -> Response:
    target = target_of(request)
    body = await _body(request)
    if isinstance(body, Response):
        return body
    try:
        language = _language(_optional_str(body, "language"))
        cwd = _optional_str(body, "cwd")
        workspace_cwd = paths.to_workspace(cwd or paths.HOME)
    except ValueError as exc:
        return _text(400, str(exc))
    except PathRefused as exc:
        return _text(400, exc.message)
    try:
        context = await run_in_threadpool(
            _manager(request).interpreter.create_context, target.sandbox_id,
            language=language, cwd=workspace_cwd, caller=target.owner)
    except CorralError as exc:
        return _refusal(exc)
    return JSONResponse(_context_out(context))


async def list_contexts(request: Request) -> Response:
    target = target_of(request)
    try:
        contexts = await run_in_threadpool(_manager(request).interpreter.list_contexts,
                                           target.sandbox_id)
    except CorralError as exc:
        return _refusal(exc)
    return JSONResponse([_context_out(c) for c in contexts])


async def restart_context(request: Request) -> Response:
    return await _on_context(request, "restart")


async def remove_context(request: Request) -> Response:
    return await _on_context(request, "remove")


async def _on_context(request: Request, action: str) -> Response:
    target = target_of(request)
    context_id = request.path_params["context_id"]
    interpreter = _manager(request).interpreter
    call = interpreter.restart_context if action == "restart" else interpreter.remove_context
    try:
        await run_in_threadpool(call, target.sandbox_id, context_id)
    except ContextNotFound:
        return _text(404, f"Context {context_id} not found")
    except CorralError as exc:
        return _refusal(exc)
    return JSONResponse(None)  # the reference's FastAPI handlers return None: 200 null


routes: list[BaseRoute] = [
    Route("/execute", execute, methods=["POST"]),
    Route("/contexts", create_context, methods=["POST"]),
    Route("/contexts", list_contexts, methods=["GET"]),
    Route("/contexts/{context_id}/restart", restart_context, methods=["POST"]),
    Route("/contexts/{context_id}", remove_context, methods=["DELETE"]),
]
