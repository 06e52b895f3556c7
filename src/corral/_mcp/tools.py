"""The MCP tools, each written once: an ``async`` function that takes the server's sessions
(``CorralMCP``), the call's context and the tool's arguments, and returns the result's data.

``@tool`` records each with its annotations; ``register`` adds them to a server, bound to its
sessions: the client sees the function's name, docstring and arguments (without the
sessions), and every call runs inside ``CorralMCP.guarded`` (a Corral error becomes a tool
error carrying its code). Arguments are checked by the control plane, as every surface's are;
only what MCP adds is checked here (the volumes the operator let the model mount, the size of
an archive in a JSON-RPC message).
"""

from __future__ import annotations

import base64
import binascii
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import CallToolResult, ToolAnnotations

from .. import errors
from ..models import CommandResult, FileEntry, Lifecycle, PortInfo, SnapshotInfo, VolumeInfo
from .sessions import CorralMCP, VolumeRequest

__all__ = ["ARCHIVE_CAP_BYTES", "FILE_CAP_BYTES", "OUTPUT_CAP_BYTES", "RESULT_CAP_BYTES",
           "register", "tool"]

RESULT_CAP_BYTES = 1024 * 1024
OUTPUT_CAP_BYTES = 64 * 1024
"""Bytes of stdout, and of stderr, one ``run_command`` result carries."""

FILE_CAP_BYTES = 256 * 1024
"""Bytes of a file one ``read_file`` result carries."""
ARCHIVE_CAP_BYTES = 16 * 1024 * 1024  # base64 in a JSON-RPC message: keep it modest

Body = Callable[..., Awaitable[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class _Tool:
    body: Body
    annotations: ToolAnnotations


_TOOLS: list[_Tool] = []


def tool(annotations: ToolAnnotations) -> Callable[[Body], Body]:
    """Make the function a tool of every server ``register`` builds (in this order)."""

    def record(body: Body) -> Body:
        _TOOLS.append(_Tool(body, annotations))
        return body

    return record


def register(mcp: MCPServer[Any], state: CorralMCP) -> None:
    """Add every tool to ``mcp``, bound to ``state``."""
    for entry in _TOOLS:
        mcp.add_tool(_bound(entry.body, state), name=entry.body.__name__,
                     description=inspect.cleandoc(entry.body.__doc__ or ""),
                     annotations=entry.annotations)


def _bound(body: Body, state: CorralMCP) -> Callable[..., Awaitable[CallToolResult]]:
    """``body`` with ``state`` given, guarded; its signature is the body's without ``state``,
    which is what the SDK reads the tool's arguments from."""
    signature = inspect.signature(body, eval_str=True)
    parameters = list(signature.parameters.values())[1:]
    # A tool with a sandbox_id argument may be about the session sandbox (see ``guarded``).
    takes_sandbox = "sandbox_id" in signature.parameters

    async def call(**kwargs: Any) -> CallToolResult:
        sandbox_id = kwargs.get("sandbox_id") if takes_sandbox else ""
        return await state.guarded(kwargs.get("ctx"), sandbox_id,
                                   lambda: body(state, **kwargs))

    call.__name__ = body.__name__
    call.__doc__ = body.__doc__
    call.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=parameters, return_annotation=CallToolResult)
    call.__annotations__ = {p.name: p.annotation for p in parameters} | {
        "return": CallToolResult}
    return call


def _cap(text: str, cap: int, dropped_before: int, what: str) -> tuple[str, int]:
    """``text`` cut to ``cap`` UTF-8 bytes plus a marker; and the bytes dropped in all."""
    data = text.encode()
    dropped = dropped_before
    if len(data) > cap:
        dropped += len(data) - cap
        text = data[:cap].decode(errors="ignore")
    if dropped:
        total = len(data) + dropped_before
        text += (f"\n[corral: {what} truncated: {dropped} bytes dropped, showing the first "
                 f"{total - dropped} of {total}; write it to a file in /workspace and read the "
                 "parts you need]")
    return text, dropped


def _entry(e: FileEntry) -> dict[str, Any]:
    return {"name": e.name, "path": e.path, "type": e.type, "size": e.size}


def _snapshot(snap: SnapshotInfo) -> dict[str, Any]:
    return {"snapshot_id": snap.id, "name": snap.name, "template": snap.template,
            "size_bytes": snap.size_bytes, "depth": snap.depth, "memory": snap.memory}


def _port(info: PortInfo) -> dict[str, Any]:
    return {"sandbox_id": info.sandbox_id, "port": info.port, "public": info.public,
            "url": info.url, "host_url": info.host_url, "token": info.token,
            "token_header": "X-Corral-Port-Token", "signed_url": info.signed_url,
            "signed_expires_at": info.signed_expires_at}


def _volume(info: VolumeInfo) -> dict[str, Any]:
    return {"name": info.name, "volume_id": info.id, "size_bytes": info.size_bytes,
            "used_bytes": info.used_bytes, "mounted_by": info.mounted_by,
            "writer": info.writer}


# -- the tools, in the order clients list them -------------------------------------------------

_WRITES = ToolAnnotations(open_world_hint=False)
_READS = ToolAnnotations(read_only_hint=True, open_world_hint=False)
_DESTROYS = ToolAnnotations(destructive_hint=True, idempotent_hint=True, open_world_hint=False)


@tool(_WRITES)
async def create_sandbox(
    state: CorralMCP, ctx: Context[Any, Any], resources: str = "small",
    timeout_s: float | None = None, allow: list[str] | None = None,
    labels: dict[str, str] | None = None, isolation: str | None = None,
    snapshot: str | None = None, template: str | None = None,
    volumes: dict[str, VolumeRequest] | None = None,
    on_timeout: Literal["kill", "pause"] = "kill", auto_resume: bool = False,
    hibernate_after_s: float | None = None,
) -> dict[str, Any]:
    """Create a sandbox and return its sandbox_id (pass it to the other tools).

    template: root filesystem, "base" (default; from a snapshot, the snapshot's) or one
    the operator allows. resources: tier, "small" or "large". timeout_s: lifetime in
    seconds (default: the tier's). allow: hosts it may reach over HTTP(S) ("pypi.org",
    "*.github.com"); empty means no network. isolation: "namespace" (default) or "gvisor"
    (a user-space kernel in between, where the host supports it). snapshot: start from
    this snapshot's files (its snapshot_id or name). volumes: persistent volumes to mount,
    by name (list_volumes shows those allowed), each at a path under /mnt/ or /workspace/:
    {"cache": "/mnt/cache"}, or {"cache": {"path": "/mnt/cache", "read_only": true}}; a
    volume has one writer or any number of readers (volume_in_use otherwise), and its
    files outlive the sandbox. on_timeout: at the end of its lifetime, "kill" (default)
    destroys it, "pause" freezes it (files and memory kept) for the operator's keep time.
    auto_resume: a command, file or code call resumes it when paused (its lifetime starts
    again) instead of being refused (sandbox_busy; `corral resume` resumes it by hand).
    hibernate_after_s: once paused this long, it is hibernated (nothing of it in the host's
    kernel, files and /tmp on disk, and on the microVM tier its processes' memory; elsewhere
    only with no process running; woken the same way).
    Hosts, templates
    and volumes beyond what the operator allowed are refused (ceiling_exceeded). It is
    destroyed with this MCP session, or by destroy_sandbox."""
    network: dict[str, list[str]] | str = {"allow": list(allow)} if allow else "none"
    mounts = state.volume_mounts(volumes or {})
    # Sent only when asked for, so a plain create still works against an older service.
    # Not validated here: the service judges it (and says what is wrong) like any request.
    lifecycle = Lifecycle.model_construct(
        on_timeout=on_timeout, auto_resume=auto_resume,
        hibernate_after=hibernate_after_s).model_dump(exclude_defaults=True) or None
    sb = await state.create(
        template=template, resources=resources, timeout=timeout_s, labels=labels or {},
        network=network, isolation=isolation, snapshot=snapshot, volumes=mounts or None,
        lifecycle=lifecycle)
    await state.keep(ctx, sandboxes=(sb.id,))
    info = await sb.get_info()
    return {"sandbox_id": sb.id, "template": info.template, "resources": info.resources,
            "expires_at": info.expires_at, "network": info.network, "labels": info.labels,
            "isolation": info.isolation, "mounts": info.mounts,
            "lifecycle": info.lifecycle.to_dict()}


@tool(_WRITES)
async def run_command(
    state: CorralMCP, ctx: Context[Any, Any], command: str, sandbox_id: str | None = None,
    timeout_s: float | None = None, cwd: str | None = None,
) -> dict[str, Any]:
    """Run a bash command in the sandbox (default: this session's) and wait for it.

    Returns exit_code, stdout, stderr, timed_out, duration_s. A non-zero exit_code is a
    result, not an error. stdout and stderr are each capped at 64 KiB; "truncated" says
    whether anything was cut (a "[corral: ... truncated ...]" line marks the cut)."""
    sb = await state.sandbox(ctx, sandbox_id)
    context = {"mcp_request_id": ctx.request_id} if ctx is not None else None
    result: CommandResult = await sb.commands.run(command, timeout=timeout_s, cwd=cwd,
                                                  context=context)
    stdout, out_dropped = _cap(result.stdout, OUTPUT_CAP_BYTES, result.stdout_truncated,
                               "stdout")
    stderr, err_dropped = _cap(result.stderr, OUTPUT_CAP_BYTES, result.stderr_truncated,
                               "stderr")
    # Not the API's result form (CommandResult.to_dict) on purpose: a model's context is the
    # budget, so the text is capped and says so, and the one usage fact it acts on is flat.
    return {
        "sandbox_id": sb.id, "exit_code": result.exit_code, "stdout": stdout,
        "stderr": stderr, "timed_out": result.timed_out,
        "duration_s": round(result.duration_s, 3), "oom_killed": result.usage.oom_killed,
        "truncated": bool(out_dropped or err_dropped),
        "stdout_dropped_bytes": out_dropped, "stderr_dropped_bytes": err_dropped,
        "command_id": result.command_id,
    }


@tool(_WRITES)
async def run_code(
    state: CorralMCP, ctx: Context[Any, Any], code: str, language: str | None = None,
    context_id: str | None = None, sandbox_id: str | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run a cell of code in a stateful kernel in the sandbox (default: this session's):
    variables and imports stay for the next call. language: "python" (default, IPython),
    "bash" (a persistent shell), "javascript", "typescript" (node) or "r"; context_id: a
    context of the sandbox instead.

    Returns text (the cell's value), results (MIME bundles: text/plain, text/html,
    image/png base64, ...; a matplotlib figure is a PNG), stdout, stderr, error (name,
    value, traceback; an exception in the cell is a result, not a tool error) and
    execution_count."""
    sb = await state.sandbox(ctx, sandbox_id)
    execution = await sb.run_code(code, language=language, context=context_id,
                                  timeout=timeout_s)
    stdout, out_dropped = _cap("".join(execution.logs.stdout), OUTPUT_CAP_BYTES, 0, "stdout")
    stderr, err_dropped = _cap("".join(execution.logs.stderr), OUTPUT_CAP_BYTES, 0, "stderr")
    results = []
    for result in execution.results:
        # Each MIME value capped like output: a model reads text, and one huge image or
        # table must not flood its context (the SDK returns them whole).
        data = {mime: value if not isinstance(value, str) or len(value) <= RESULT_CAP_BYTES
                else value[:RESULT_CAP_BYTES] + f"\n[corral: {mime} cut at "
                                                f"{RESULT_CAP_BYTES} characters]"
                for mime, value in result.data.items()}
        results.append({"is_main_result": result.is_main_result, "data": data})
    return {
        "sandbox_id": sb.id, "context_id": execution.context_id,
        "execution_count": execution.execution_count, "text": execution.text,
        "results": results, "stdout": stdout, "stderr": stderr,
        "error": execution.error.to_dict() if execution.error else None,
        "truncated": bool(out_dropped or err_dropped),
        "duration_s": round(execution.duration_s, 3),
    }


@tool(_READS)
async def read_file(state: CorralMCP, ctx: Context[Any, Any], path: str,
                    sandbox_id: str | None = None) -> dict[str, Any]:
    """Read a text file under /workspace (relative paths are relative to it)."""
    sb = await state.sandbox(ctx, sandbox_id)
    data = await sb.files.read(path, format="bytes")
    text, dropped = _cap(data[:FILE_CAP_BYTES + 4].decode(errors="replace"), FILE_CAP_BYTES,
                         max(0, len(data) - FILE_CAP_BYTES - 4), "file")
    return {"sandbox_id": sb.id, "path": path, "content": text, "size": len(data),
            "truncated": bool(dropped)}


@tool(_WRITES)
async def write_file(state: CorralMCP, ctx: Context[Any, Any], path: str, content: str,
                     sandbox_id: str | None = None) -> dict[str, Any]:
    """Write a whole text file under /workspace, creating parent directories."""
    sb = await state.sandbox(ctx, sandbox_id)
    entry = await sb.files.write(path, content)
    return {"sandbox_id": sb.id, **_entry(entry)}


@tool(_READS)
async def list_files(state: CorralMCP, ctx: Context[Any, Any], path: str = "/workspace",
                     sandbox_id: str | None = None) -> dict[str, Any]:
    """List a directory under /workspace: name, path, type and size of each entry."""
    sb = await state.sandbox(ctx, sandbox_id)
    entries = await sb.files.list(path)
    return {"sandbox_id": sb.id, "path": path, "entries": [_entry(e) for e in entries]}


@tool(_WRITES)
async def upload_tar(state: CorralMCP, ctx: Context[Any, Any], archive_base64: str,
                     path: str = "/workspace",
                     sandbox_id: str | None = None) -> dict[str, Any]:
    """Extract a base64 tar or tar.gz under path (absolute names, '..', links leading out,
    hard links and devices are refused)."""
    try:
        archive = base64.b64decode(archive_base64, validate=True)
    except (binascii.Error, ValueError):
        raise errors.UsageError("archive_base64 is not valid base64") from None
    if len(archive) > ARCHIVE_CAP_BYTES:
        raise errors.TooLarge(f"archives over MCP are limited to {ARCHIVE_CAP_BYTES} bytes; "
                              "use the HTTP API for larger trees")
    sb = await state.sandbox(ctx, sandbox_id)
    report = await sb.files.upload(archive, path)
    return {"sandbox_id": sb.id, "path": path, **report}


@tool(_READS)
async def download_tar(state: CorralMCP, ctx: Context[Any, Any], path: str = "/workspace",
                       gzip: bool = True, sandbox_id: str | None = None) -> dict[str, Any]:
    """The tree under path as a base64 tar (gzip by default)."""
    sb = await state.sandbox(ctx, sandbox_id)
    chunks, size = [], 0
    stream = sb.files.download(path, gzip=gzip)
    try:
        async for chunk in stream:
            size += len(chunk)
            if size > ARCHIVE_CAP_BYTES:
                raise errors.TooLarge(
                    f"{path} packs to more than {ARCHIVE_CAP_BYTES} bytes; download a "
                    "smaller directory or use the HTTP API")
            chunks.append(chunk)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    data = b"".join(chunks)
    return {"sandbox_id": sb.id, "path": path, "format": "tar.gz" if gzip else "tar",
            "size": len(data), "archive_base64": base64.b64encode(data).decode()}


@tool(_WRITES)
async def snapshot(state: CorralMCP, ctx: Context[Any, Any], name: str | None = None,
                   sandbox_id: str | None = None, memory: bool = False) -> dict[str, Any]:
    """Save the sandbox's /workspace as it is now (default: this session's sandbox), to go
    back to with restore or to start new sandboxes from; instant whatever its size.

    name: optional, unique among snapshots (letters, digits, _ . -). Nothing may be running
    in the sandbox (sandbox_busy otherwise), unless memory: true (microvm tier only), which
    also saves the running memory and processes, commands included, for forks and
    restores to resume. Snapshots are deleted with this MCP session."""
    sb = await state.sandbox(ctx, sandbox_id)
    snap = await sb.snapshot(name, memory=memory)
    await state.keep(ctx, snapshots=(snap.id,))
    return {"sandbox_id": sb.id, **_snapshot(snap)}


@tool(_WRITES)
async def fork(state: CorralMCP, ctx: Context[Any, Any], count: int = 1,
               sandbox_id: str | None = None, memory: bool = False) -> dict[str, Any]:
    """Make count (1-64) new sandboxes, each starting with a copy of this sandbox's
    /workspace as it is now (default: this session's sandbox), to try several approaches
    side by side. With memory: true (microvm tier only) each also resumes the sandbox's
    running memory and processes. Returns their sandbox_ids ("forks"); pass one as
    sandbox_id to the other tools. They are destroyed with this MCP session, or by
    destroy_sandbox."""
    sb = await state.sandbox(ctx, sandbox_id)
    children = await sb.fork(count, memory=memory)
    await state.keep(ctx, sandboxes=tuple(c.id for c in children))
    return {"sandbox_id": sb.id, "forks": [c.id for c in children]}


@tool(_WRITES)
async def hibernate_sandbox(state: CorralMCP, ctx: Context[Any, Any],
                            sandbox_id: str | None = None) -> dict[str, Any]:
    """Hibernate the sandbox (default: this session's) while you wait (for a user, a long
    think): nothing of it stays in the host's memory or kernel; its files and /tmp are kept.
    On the microVM tier its processes are kept too; on the others it is refused
    (sandbox_busy) while a process of it runs. It wakes on the next run_command,
    run_code or file call when it was created with auto_resume, else on resume_sandbox."""
    sb = await state.sandbox(ctx, sandbox_id)
    await sb.hibernate()
    info = await sb.get_info()
    return {"sandbox_id": sb.id, "state": info.state}


@tool(_WRITES)
async def resume_sandbox(state: CorralMCP, ctx: Context[Any, Any],
                         sandbox_id: str | None = None) -> dict[str, Any]:
    """Wake a paused or hibernated sandbox (default: this session's): its files, /tmp
    and, when it was only paused, its processes are as they were."""
    sb = await state.sandbox(ctx, sandbox_id)
    await sb.resume()
    info = await sb.get_info()
    return {"sandbox_id": sb.id, "state": info.state}


@tool(_DESTROYS)
async def restore(state: CorralMCP, ctx: Context[Any, Any], snapshot: str,
                  sandbox_id: str | None = None) -> dict[str, Any]:
    """Put the sandbox's /workspace back exactly as it was in a snapshot (its snapshot_id
    or name); changes since then that are in no snapshot are lost. Nothing may be running
    in the sandbox."""
    sb = await state.sandbox(ctx, sandbox_id)
    await sb.restore(snapshot)
    return {"sandbox_id": sb.id, "snapshot": snapshot, "restored": True}


@tool(_DESTROYS)
async def destroy_sandbox(state: CorralMCP, ctx: Context[Any, Any],
                          sandbox_id: str | None = None) -> dict[str, Any]:
    """Destroy a sandbox (default: this session's; the next call gets a fresh one)."""
    if sandbox_id is None:
        sandbox_id = state.session_sandbox_id(ctx)
    if sandbox_id is None:
        return {"sandbox_id": None, "destroyed": False}
    await (await state.connect(sandbox_id)).kill()
    state.forget(sandbox_id)  # a remote service's destroy is not heard otherwise
    return {"sandbox_id": sandbox_id, "destroyed": True}


@tool(ToolAnnotations(idempotent_hint=True, open_world_hint=False))
async def expose_port(state: CorralMCP, ctx: Context[Any, Any], port: int,
                      public: bool = False, sandbox_id: str | None = None) -> dict[str, Any]:
    """Make a server in the sandbox (default: this session's) reachable from outside it,
    through the Corral service, HTTP and WebSockets alike; start the server first,
    listening on 0.0.0.0 or 127.0.0.1.

    Returns url (null when this server does not know the service's address), token and
    signed_url. Private by default: a request needs the token in the X-Corral-Port-Token
    header, or a browser opens signed_url once (it expires at signed_expires_at).
    public: true lets anyone with the url in. Exposing again keeps the token."""
    sb = await state.sandbox(ctx, sandbox_id)
    return _port(await sb.ports.expose(port, public=public))


@tool(_READS)
async def list_ports(state: CorralMCP, ctx: Context[Any, Any],
                     sandbox_id: str | None = None) -> dict[str, Any]:
    """The sandbox's exposed ports (default: this session's sandbox), each with its url,
    token and a fresh signed_url."""
    sb = await state.sandbox(ctx, sandbox_id)
    return {"sandbox_id": sb.id, "ports": [_port(p) for p in await sb.ports.list()]}


@tool(_DESTROYS)
async def unexpose_port(state: CorralMCP, ctx: Context[Any, Any], port: int,
                        sandbox_id: str | None = None) -> dict[str, Any]:
    """Stop serving a port of the sandbox (default: this session's); its token and signed
    links stop working at once."""
    sb = await state.sandbox(ctx, sandbox_id)
    await sb.ports.unexpose(port)
    return {"sandbox_id": sb.id, "port": port, "unexposed": True}


@tool(_READS)
async def list_volumes(state: CorralMCP, ctx: Context[Any, Any]) -> dict[str, Any]:
    """The persistent volumes this server lets you mount (create_sandbox's volumes): name,
    size_bytes, used_bytes, the sandboxes mounting each (mounted_by, and writer, the one
    mounting it read-write) and writable (false: mount it read-only)."""
    if not state.volumes:  # nothing to show: no need to open the data directory for it
        return {"volumes": []}
    found = await (await state.opened()).list_volumes()
    return {"volumes": [{**_volume(v), "writable": not state.volumes[v.name]}
                        for v in found if v.name in state.volumes]}
