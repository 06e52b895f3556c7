"""Everything the SDK does that is not I/O: request bodies, response parsing into the public
models, error mapping from the wire ``code``, and the NDJSON command stream's events.

Both HTTP transports (``_async/http.py`` and its generated ``_sync/http.py``) and both façades use
these; nothing here awaits, blocks or opens anything.
"""

from __future__ import annotations

import base64
import dataclasses
import inspect
import json
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, overload

from .._audit.events import AuditEvent
from .._audit.log import AuditTrail
from .._workspace.files import to_relative
from ..backends import OutputCallback, OutputCut
from ..errors import (
    CorralError,
    SnapshotNotFound,
    TransportError,
    UsageError,
    VolumeNotFound,
    error_class,
)
from ..models import (
    CodeContext,
    CommandResult,
    Execution,
    ExecutionError,
    FileEntry,
    Lifecycle,
    OutputMessage,
    Result,
    SandboxInfo,
    SnapshotInfo,
    Usage,
)

__all__ = [
    "NO_RESULT", "AsyncCodeCallback", "AsyncErrorCallback", "AsyncMessageCallback",
    "AsyncOutputCallback", "AsyncResultCallback", "CodeCallback", "CodeItem", "CodeStream",
    "ErrorCallback", "MessageCallback", "ResultCallback",
    "CommandStream", "code_body", "code_context", "code_item", "Output", "OutputCallback",
    "ProcessInfo", "adeliver", "audit_params", "audit_trail", "check_format", "command_result",
    "create_body", "deliver", "encodable", "error_for", "file_data", "lifecycle_body",
    "network_body",
    "process_body", "process_event", "run_body", "sandbox_info", "shaped", "snapshot_info",
    "snapshot_path", "snapshot_ref", "unreachable",
]

#: Called with each piece of output; a plain function, or an ``async def`` (then awaited).
AsyncOutputCallback = Callable[[str], Awaitable[None] | None]

#: ``"text"`` (default): ``stdout``/``stderr`` only; ``"bytes"``: also the exact bytes.
Output = Literal["text", "bytes"]

NO_RESULT = "the command's stream ended without a result"

ProcessInfo = dict[str, Any]
"""``{id, state ("running"|"exited"), exit_code, command_id, output_bytes, ...}``."""


_V = TypeVar("_V")

#: What a cell's callbacks get: ``("stdout"|"stderr", OutputMessage)``, ``("result",
#: Result)``, ``("error", ExecutionError)``.
CodeItem = tuple[str, OutputMessage | Result | ExecutionError]
#: The transports' one callback for a cell's events; the façade dispatches to on_stdout, ...
AsyncCodeCallback = Callable[[CodeItem], Awaitable[None] | None]
CodeCallback = Callable[[CodeItem], object]
#: A cell's callbacks on the façades: plain functions, or ``async def`` (awaited), in order.
AsyncMessageCallback = Callable[[OutputMessage], Awaitable[None] | None]
MessageCallback = Callable[[OutputMessage], object]
AsyncResultCallback = Callable[[Result], Awaitable[None] | None]
ResultCallback = Callable[[Result], object]
AsyncErrorCallback = Callable[[ExecutionError], Awaitable[None] | None]
ErrorCallback = Callable[[ExecutionError], object]


def deliver(callback: Callable[[_V], object] | None, text: _V) -> None:
    if callback is not None:
        callback(text)


async def adeliver(callback: Callable[[_V], Awaitable[None] | None] | None, text: _V) -> None:
    """Call ``callback`` with ``text``, awaiting it if it is a coroutine function."""
    if callback is not None:
        outcome = callback(text)
        if inspect.isawaitable(outcome):
            await outcome


# -- arguments ----------------------------------------------------------------------------------


@overload
def snapshot_ref(snapshot: str | SnapshotInfo) -> str: ...
@overload
def snapshot_ref(snapshot: str | SnapshotInfo | None) -> str | None: ...
def snapshot_ref(snapshot: str | SnapshotInfo | None) -> str | None:
    return snapshot.id if isinstance(snapshot, SnapshotInfo) else snapshot


def check_format(format: str) -> None:
    if format not in ("text", "bytes"):
        raise UsageError(f"format must be 'text' or 'bytes', not {format!r}")


def check_output(output: str) -> None:
    if output not in ("text", "bytes"):
        raise UsageError(f"output must be 'text' or 'bytes', not {output!r}")


def file_data(data: object) -> bytes:
    if isinstance(data, str):
        return data.encode()
    if not isinstance(data, bytes | bytearray | memoryview):
        raise UsageError(f"data must be str or bytes, not {type(data).__name__}")
    return bytes(data)


def shaped(result: CommandResult, output: str) -> CommandResult:
    """The result as the caller asked for it: the exact bytes only with ``output="bytes"``."""
    if output == "bytes" or result.stdout_bytes is None:
        return result
    return dataclasses.replace(result, stdout_bytes=None, stderr_bytes=None)


# -- responses ----------------------------------------------------------------------------------


def sandbox_info(data: Mapping[str, Any]) -> SandboxInfo:
    return SandboxInfo.model_validate(data)  # the wire schema itself; unknown fields ignored


def snapshot_info(data: Mapping[str, Any]) -> SnapshotInfo:
    return SnapshotInfo.model_validate(data)


def file_entry(data: Mapping[str, Any]) -> FileEntry:
    return FileEntry(**data)


def _b64(data: Mapping[str, Any], key: str) -> bytes | None:
    value = data.get(key)
    return None if value is None else base64.b64decode(value)


def command_result(data: Mapping[str, Any], *, stdout: str | None = None,
                   stderr: str | None = None) -> CommandResult:
    return CommandResult(
        exit_code=data["exit_code"],
        stdout=data["stdout"] if stdout is None else stdout,
        stderr=data["stderr"] if stderr is None else stderr,
        timed_out=data["timed_out"], duration_s=data["duration_s"],
        usage=Usage(**data["usage"]), stdout_truncated=data.get("stdout_truncated", 0),
        stderr_truncated=data.get("stderr_truncated", 0), command_id=data.get("command_id", ""),
        stdout_bytes=_b64(data, "stdout_b64"), stderr_bytes=_b64(data, "stderr_b64"))


def error_for(status_code: int, content: bytes) -> CorralError | None:
    """The exception a response stands for (``None`` below 400), from the body's wire code."""
    if status_code < 400:
        return None
    try:
        body = json.loads(content)
        code, message = body["error"], body["message"]
    except (ValueError, KeyError, TypeError):
        text = content.decode("utf-8", errors="replace")
        code, message = "transport_error", f"HTTP {status_code}: {text[:300]}"
    return error_class(code)(message)


def unreachable(base_url: object, exc: Exception) -> TransportError:
    return TransportError(f"cannot reach the Corral service at {base_url}: {exc}; check "
                          "CORRAL_URL and that `corral serve` runs")


def audit_trail(text: str, torn_tail: str | None) -> AuditTrail:
    events = [AuditEvent.model_validate_json(line) for line in text.splitlines() if line.strip()]
    return AuditTrail(events=events, torn_tail=torn_tail == "true")


# -- requests -----------------------------------------------------------------------------------


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@contextmanager
def encodable(kwargs: Mapping[str, Any]) -> Iterator[None]:
    """Refuse, as a Corral error, a string no request can carry: a lone surrogate, which is
    how Python hands over a name with bytes that are not UTF-8 (``os.listdir``, ``sys.argv``).
    A path gets the very PathRefused the service would give; anything else a UsageError."""
    for part in (kwargs.get("params"), kwargs.get("json")):
        for key, value in (part.items() if isinstance(part, Mapping) else ()):
            if key in ("path", "src", "dst") and isinstance(value, str) and not _is_utf8(value):
                to_relative(value)
    try:
        yield
    except UnicodeEncodeError as exc:
        shown = exc.object[:80]
        if isinstance(shown, str):
            shown = shown.encode("utf-8", "backslashreplace").decode("utf-8")
        raise UsageError(f"a value in the request is not valid UTF-8 ({exc.reason} at "
                         f"position {exc.start} of {shown!r}); pass UTF-8 text") from None


def create_body(*, template: str | None, resources: str, timeout: float | None,
                labels: Mapping[str, str] | None, network: Any,
                secrets: Sequence[str] | None, idle_timeout: float | None = None,
                isolation: str | None = None, snapshot: str | None = None,
                image: str | None = None, volumes: Mapping[str, Any] | None = None,
                data_mounts: Mapping[str, Any] | None = None,
                lifecycle: Mapping[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"resources": resources, "timeout": timeout,
                            "labels": dict(labels or {}), "network": network or "none",
                            "secrets": list(secrets or []), "idle_timeout": idle_timeout}
    # Sent only when chosen, so a plain create still works against a server that predates them
    # (it refuses unknown fields); the server picks the defaults (base, or the snapshot's).
    for key, value in (("template", template), ("isolation", isolation),
                       ("snapshot", snapshot), ("image", image)):
        if value is not None:
            body[key] = value
    if volumes:
        body["volumes"] = dict(volumes)
    if data_mounts:
        body["data_mounts"] = dict(data_mounts)
    if lifecycle is not None:
        body["lifecycle"] = dict(lifecycle)
    return body


def lifecycle_body(lifecycle: Lifecycle | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A create's ``lifecycle`` as the request carries it, on every transport: a ``Lifecycle``
    or a plain dict (E2B's form, ``{"on_timeout": "pause", "auto_resume": True}``), which the
    control plane's request model then checks (a misspelt key is refused, not ignored)."""
    if lifecycle is None:
        return None
    if isinstance(lifecycle, Lifecycle):
        return lifecycle.to_dict()
    if isinstance(lifecycle, Mapping):
        return dict(lifecycle)
    raise UsageError(f"lifecycle must be a Lifecycle or a dict such as {{'on_timeout': "
                     f"'pause', 'auto_resume': True}}, not {type(lifecycle).__name__}")


def port_number(port: object) -> int:
    """A port as a URL segment: refused here as the control plane would, so a value that is
    no number never names another route."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise UsageError(f"port must be a TCP port number (1-65535), not {port!r}")
    return port


def volume_path(ref: str) -> str:
    """``/v1/volumes/{ref}``; a ref that cannot be one path segment is no volume's."""
    from urllib.parse import quote

    if not isinstance(ref, str) or not ref:
        raise UsageError(f"a volume is named by its name or id, not {ref!r}")
    if "/" in ref or ref in (".", ".."):
        raise VolumeNotFound(f"no volume {ref!r}; `corral volumes ls` lists them")
    return f"/v1/volumes/{quote(ref, safe='')}"


def snapshot_path(ref: str) -> str:
    """``/v1/snapshots/{ref}``, answering here what the control plane would for refs that
    cannot be one path segment (the URL would name another route)."""
    from urllib.parse import quote

    if not isinstance(ref, str) or not ref:
        raise UsageError(f"a snapshot is named by its id or name, not {ref!r}")
    if "/" in ref or ref in (".", ".."):  # no id or name has these
        raise SnapshotNotFound(f"snapshot {ref!r} does not exist; `corral snapshots ls` "
                               "lists them")
    return f"/v1/snapshots/{quote(ref, safe='')}"


def network_body(network: Any) -> dict[str, Any]:
    return {"allow": [], "deny": []} if network in (None, "none") else dict(network)


def audit_params(types: Sequence[str] | None, since: float | None, until: float | None,
                 command: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {"type": list(types or [])}
    for key, value in (("since", since), ("until", until), ("command", command)):
        if value is not None:
            params[key] = value
    return params


def run_body(cmd: str | Sequence[str], *, timeout: float | None,
             envs: Mapping[str, str] | None, cwd: str | None, stdin: str | bytes | None,
             context: Mapping[str, Any] | None, stream: bool,
             output: str = "text") -> dict[str, Any]:
    if isinstance(stdin, bytes | bytearray):
        try:
            stdin = bytes(stdin).decode()
        except UnicodeDecodeError:
            raise UsageError("stdin over the remote API must be UTF-8 text; write binary "
                             "data with files.write() instead") from None
    body = {"cmd": cmd if isinstance(cmd, str) else list(cmd), "timeout": timeout,
            "envs": dict(envs or {}), "cwd": cwd, "stdin": stdin,
            "context": dict(context) if context else None, "stream": stream}
    if output != "text":  # only when asked: a server that predates it refuses the field
        body["output"] = output
    return body


def process_body(cmd: str | Sequence[str], *, envs: Mapping[str, str] | None,
                 cwd: str | None, context: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"cmd": cmd if isinstance(cmd, str) else list(cmd), "envs": dict(envs or {}),
            "cwd": cwd, "context": dict(context) if context else None}


def process_event(line: str) -> tuple[int, str, str] | None:
    if not line.strip():
        return None
    event = json.loads(line)
    return event["offset"], event["stream"], event["data"]


@dataclass
class CommandStream:
    """The client side of the NDJSON command stream: ``feed`` each line; it says what to hand
    to which callback, and assembles the result from the events (the ``result`` line carries
    only what the events did not: the closing cut notice, the exact bytes when asked)."""

    parts: dict[str, list[str]] = field(default_factory=lambda: {"stdout": [], "stderr": []})
    result: CommandResult | None = None

    def feed(self, line: str) -> tuple[str, str] | None:
        """``(stream, text)`` to deliver, or ``None``; an error event is raised."""
        if not line.strip():
            return None
        event = json.loads(line)
        kind = event.get("type")
        if kind in ("stdout", "stderr"):
            self.parts[kind].append(event["data"])
            return kind, event["data"]
        if kind == "truncated":
            # The server sends the notice's text too: it is kept output, on its own line.
            cut = OutputCut(event["stream"], event["limit"],
                            newline=str(event.get("data", "")).startswith("\n"))
            self.parts[event["stream"]].append(cut)
            return event["stream"], cut
        if kind == "result":
            texts = {name: None if name in event else
                     "".join(self.parts[name]) + event.get(f"{name}_tail", "")
                     for name in ("stdout", "stderr")}
            self.result = command_result(event, **texts)
        elif kind == "error":
            raise error_class(event["error"])(event["message"])
        return None

    def finished(self) -> CommandResult:
        if self.result is None:
            raise TransportError(NO_RESULT)
        return self.result


# -- the code interpreter ---------------------------------------------------------------------


def code_body(code: str, *, context_id: str | None, language: str | None,
              envs: Mapping[str, str] | None, timeout: float | None) -> dict[str, Any]:
    return {"code": code, "context": context_id, "language": language,
            "envs": dict(envs) if envs else None, "timeout": timeout}


def code_context(data: Mapping[str, Any]) -> CodeContext:
    return CodeContext.model_validate(data)


def code_item(event: Mapping[str, Any]) -> CodeItem | None:
    """The callback item for one event line of a cell (``None`` for the others)."""
    kind = event.get("type")
    if kind in ("stdout", "stderr"):
        return kind, OutputMessage(text=event["text"], timestamp=event["timestamp"],
                                   error=kind == "stderr")
    if kind == "result":
        return "result", Result(is_main_result=bool(event.get("is_main_result")),
                                data=dict(event.get("data") or {}))
    if kind == "execution_error":
        return "error", ExecutionError(name=event["name"], value=event["value"],
                                       traceback=event.get("traceback", ""))
    return None


@dataclass
class CodeStream:
    """The client side of the NDJSON cell stream: ``feed`` each line; the last line is the
    ``execution`` (the whole ``Execution``), or an ``error`` (raised, as the service raised)."""

    execution: Execution | None = None

    def feed(self, line: str) -> CodeItem | None:
        if not line.strip():
            return None
        event = json.loads(line)
        kind = event.get("type")
        if kind == "execution":
            self.execution = Execution.model_validate(event["execution"])
            return None
        if kind == "error":
            raise error_class(event["error"])(event["message"])
        return code_item(event)

    def finished(self) -> Execution:
        if self.execution is None:
            raise TransportError("the cell's stream ended without its execution")
        return self.execution
