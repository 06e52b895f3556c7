"""The MCP server behind ``corral mcp``: sandboxes as tools for any MCP client.

Tools: ``create_sandbox``, ``run_command``, ``read_file``, ``write_file``, ``list_files``,
``upload_tar``, ``download_tar``, ``snapshot``, ``fork``, ``restore``, ``destroy_sandbox``,
``expose_port``, ``list_ports``, ``unexpose_port`` and ``list_volumes``. Every tool but
``create_sandbox`` and ``list_volumes`` takes an optional ``sandbox_id``.

The session sandbox
    A call without ``sandbox_id`` uses the *session sandbox*: created on the session's first such
    call (``small`` tier, default TTL, no network), reused by its later calls, destroyed when the
    session ends. Over stdio the session is the server process (one client per process); over
    Streamable HTTP it is the ``Mcp-Session-Id`` session, which ends on the client's DELETE, the
    SDK's idle timeout (30 minutes without a request) or server shutdown. Clients speaking the
    sessionless 2026-07-28 protocol over HTTP have no session to key on: they get a
    ``session_required`` error and must call ``create_sandbox`` and pass ``sandbox_id``.

    Sandboxes made with ``create_sandbox`` or ``fork`` belong to the session that made them and
    are destroyed with it too (or, when there is no session, at server shutdown). So do snapshots
    made with ``snapshot``: they are deleted after the session's sandboxes, unless a sandbox from
    elsewhere is built on one (snapshots have no TTL, and an agent left alone could fill the
    disk with them otherwise). Every sandbox still carries
    its TTL: when the server is killed without a chance to clean up (SIGKILL, power loss), its
    sandboxes live at most until their TTL, after which any Corral process (or ``corral reap``)
    removes them.

    A ``sandbox_id`` may name any live sandbox of the data directory, as with the CLI: ids are
    unguessable (``sbx_`` + 12 random characters) and act as capabilities.

The model is the caller
    Whatever a tool's arguments ask for, an injected model may have written, so the server
    applies a ceiling of its own, tighter than the operator's: by default no network, the
    ``base`` template, no secrets and no volumes (``CeilingExceeded`` beyond). The operator
    widens it when starting the server (``corral mcp --allow-host pypi.org --template python
    --volume cache``). Volumes get a bound of their own because they outlive the session: one
    the model may write is a way to leave something for whoever mounts it next, and their
    names, unlike sandbox ids, are no secret. ``list_volumes`` shows only those the model may
    mount. A tool call with an argument the tool does not take is refused, never ignored.

Errors
    A Corral error becomes a tool error result (``isError``) whose text is ``code: message`` and
    whose structured content is ``{"code": ..., "message": ...}``; no tracebacks reach the client.
    A non-zero exit code is a normal result, not an error.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, ConfigDict, model_validator

from .. import errors
from .._control.tenants import Ceiling, check, local_tenant
from .._core.homelock import InstanceLock, hold_home
from .._egress.policy import NetworkPolicy
from .._sdk._aembedded import AsyncEmbeddedTransport
from .._sdk._async.http import AsyncHTTPTransport
from .._sdk._async.sandbox import AsyncSandbox
from .._sdk._async.transport import AsyncTransport
from .._sdk._embedded import embedded_target
from ..models import CommandResult, FileEntry, PortInfo, SnapshotInfo, VolumeInfo
from .lifeline import die_with_parent, watch_parent
from .where import Where, allowed_text

__all__ = ["DEFAULT_CEILING", "OUTPUT_CAP_BYTES", "CorralMCP", "build_server", "mcp_ceiling",
           "serve"]

log = logging.getLogger(__name__)

RESULT_CAP_BYTES = 1024 * 1024
OUTPUT_CAP_BYTES = 64 * 1024
"""Bytes of stdout, and of stderr, one ``run_command`` result carries."""

FILE_CAP_BYTES = 256 * 1024
ARCHIVE_CAP_BYTES = 16 * 1024 * 1024  # base64 in a JSON-RPC message: keep it modest
"""Bytes of a file one ``read_file`` result carries."""

Transport = Literal["stdio", "http"]

_SESSION_LABELS = {"origin": "corral-mcp"}

DEFAULT_CEILING = Ceiling(hosts=(), templates=("base",), secrets=())
"""What a model may ask for over MCP unless the operator widens it: no network, ``base``."""


def mcp_ceiling(*, hosts: tuple[str, ...] = (), templates: tuple[str, ...] = (),
                secrets: tuple[str, ...] = (), max_lifetime_s: int | None = None) -> Ceiling:
    """``DEFAULT_CEILING`` widened by what the operator names (``base`` stays allowed)."""
    return Ceiling.build(hosts=hosts, templates=("base", *templates), secrets=secrets,
                         max_lifetime_s=max_lifetime_s)


class SessionRequired(errors.UsageError):
    code = "session_required"


class VolumeMount(BaseModel):
    """Where ``create_sandbox`` mounts one volume, when read-only or a mapping is wanted."""

    model_config = ConfigDict(extra="forbid")

    path: str
    read_only: bool = False


VolumeRequest = str | VolumeMount
"""A mount point (read-write), or ``{"path": ..., "read_only": true}``."""


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


def _ok(data: dict[str, Any]) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=json.dumps(data))],
                          structured_content=data)


def _error(code: str, message: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=f"{code}: {message}")],
                          structured_content={"code": code, "message": message}, is_error=True)


@dataclass
class _Session:
    sandbox: AsyncSandbox | None = None
    owned: set[str] = field(default_factory=set)
    snapshots: set[str] = field(default_factory=set)
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    hooked: bool = False


class CorralMCP:
    """The server's state: which sandboxes belong to which MCP session."""

    def __init__(self, home: Path | None, transport: Transport,
                 ceiling: Ceiling = DEFAULT_CEILING,
                 volumes: Mapping[str, bool] | None = None) -> None:
        self.home = home
        self.transport = transport
        self.ceiling = ceiling
        # Volume name -> whether the model may only read it; none unless the operator names
        # them (the control plane's ceiling has no volume bound, so this one is applied here).
        self.volumes: dict[str, bool] = dict(volumes or {})
        # The operator's tenant, bounded by the MCP ceiling (the server default fills in the
        # fields it leaves open): the control plane enforces it like any tenant's.
        self.caller = local_tenant(ceiling)
        self._sessions: dict[str, _Session] = {}
        self._unowned: set[str] = set()  # made by sessionless clients: destroyed at shutdown
        self._unowned_snapshots: set[str] = set()  # likewise, deleted at shutdown
        self._closed = False
        self._opened: AsyncTransport | None = None
        self._unsubscribe: Callable[[], None] | None = None

    async def _transport(self) -> AsyncTransport:
        """One transport for the server's life: the control plane in-process (with the MCP
        caller, so its ceiling is enforced there), or the service at ``CORRAL_URL``."""
        if self._opened is None:
            target = await anyio.to_thread.run_sync(embedded_target, self.home, None, None)
            if isinstance(target, tuple):
                self._opened = AsyncHTTPTransport(*target)
            else:
                self._opened = AsyncEmbeddedTransport(target, caller=self.caller)
                # A session's sandbox destroyed by anyone (its TTL, the reaper, the CLI in
                # this process) is forgotten at once; the next call makes a new one.
                self._unsubscribe = target.on_destroyed(self._forget)
        return self._opened

    async def _connect(self, sandbox_id: str) -> AsyncSandbox:
        return await AsyncSandbox.connect(sandbox_id, transport=await self._transport())

    # --- sessions -------------------------------------------------------------------------

    def _session_key(self, ctx: Context[Any, Any] | None) -> str | None:
        """The MCP session this call belongs to; None for a sessionless (2026-07-28) client."""
        if self.transport == "stdio":
            return "stdio"
        if ctx is None:
            return None
        # The server-assigned Mcp-Session-Id of the connection. The SDK has no public accessor
        # for a tool's connection yet, hence getattr, falling back to the (validated) header.
        connection = getattr(ctx.request_context.session, "_connection", None)
        if connection is not None:
            return getattr(connection, "session_id", None) or None
        headers = ctx.headers
        return (headers.get("mcp-session-id") if headers is not None else None) or None

    def _session(self, ctx: Context[Any, Any] | None, key: str) -> _Session:
        session = self._sessions.setdefault(key, _Session())
        if not session.hooked and ctx is not None and self.transport == "http":
            # The SDK unwinds a connection's exit_stack when its session ends (DELETE, idle
            # timeout, shutdown); without it the session's sandboxes go at shutdown (or TTL).
            connection = getattr(ctx.request_context.session, "_connection", None)
            exit_stack = getattr(connection, "exit_stack", None)
            if exit_stack is not None and getattr(connection, "session_id", None) == key:
                exit_stack.push_async_callback(self._end_session, key)
                session.hooked = True
        return session

    async def _end_session(self, key: str) -> None:
        session = self._sessions.pop(key, None)
        if session is not None:
            with anyio.CancelScope(shield=True):
                await self._destroy_ids(set(session.owned))
                await self._delete_snapshots(set(session.snapshots))

    async def _destroy_ids(self, ids: set[str]) -> None:
        for sandbox_id in sorted(ids):
            try:
                await (await self._connect(sandbox_id)).kill()
            except errors.SandboxNotFound:
                pass
            except Exception:  # keep destroying the others
                log.exception("could not destroy sandbox %s", sandbox_id)

    async def _delete_snapshots(self, ids: set[str]) -> None:
        """Delete snapshots; run after their session's sandboxes are gone."""
        for snapshot_id in sorted(ids):
            try:
                await (await self._transport()).delete_snapshot(snapshot_id)
            except errors.SnapshotNotFound:
                pass
            except errors.SnapshotInUse:
                # A sandbox made from it outside the session (a CLI user, another client):
                # deleting it is theirs to decide, `corral snapshots rm` once they are done.
                log.info("kept snapshot %s: a sandbox outside the session uses it", snapshot_id)
            except Exception:  # keep deleting the others
                log.exception("could not delete snapshot %s", snapshot_id)

    async def shutdown(self) -> None:
        """Destroy every sandbox a session made; run when the server stops."""
        self._closed = True
        ids, snapshots = set(self._unowned), set(self._unowned_snapshots)
        for session in self._sessions.values():
            ids |= session.owned
            snapshots |= session.snapshots
        self._sessions.clear()
        self._unowned.clear()
        self._unowned_snapshots.clear()
        with anyio.CancelScope(shield=True):
            if ids or snapshots:
                await self._destroy_ids(ids)
                await self._delete_snapshots(snapshots)
            if self._unsubscribe is not None:
                self._unsubscribe()
                self._unsubscribe = None
            if self._opened is not None:
                await self._opened.aclose()
                self._opened = None

    async def sandbox(self, ctx: Context[Any, Any] | None,
                      sandbox_id: str | None) -> AsyncSandbox:
        """The named sandbox, or the session sandbox (created on first use)."""
        if sandbox_id is not None:
            return await self._connect(sandbox_id)
        key = self._session_key(ctx)
        if key is None:
            raise SessionRequired(
                "this client has no MCP session (sessionless protocol), so there is no session "
                "sandbox; call create_sandbox and pass its sandbox_id")
        session = self._session(ctx, key)
        async with session.lock:
            if session.sandbox is None:
                sb = await self._create(labels=_SESSION_LABELS)
                await self._check_open(sb)
                session.sandbox = sb
                session.owned.add(sb.id)
            return session.sandbox

    async def _create(self, **kwargs: Any) -> AsyncSandbox:
        """A sandbox made on the caller's behalf, within the MCP ceiling."""
        transport = await self._transport()
        if isinstance(transport, AsyncHTTPTransport):
            # A remote service enforces its own tenant's ceiling; this one is applied first.
            network = kwargs.get("network")
            check(self.ceiling, template=kwargs.get("template"),
                  isolation=kwargs.get("isolation"), resources=kwargs.get("resources"),
                  lifetime_s=kwargs.get("timeout"),
                  network=NetworkPolicy.build(network["allow"]) if isinstance(network, dict)
                  else None)
        return await AsyncSandbox.create(transport=transport, **kwargs)

    async def _check_open(self, sb: AsyncSandbox) -> None:
        """A sandbox created while the server shut down is destroyed at once."""
        if self._closed:
            with anyio.CancelScope(shield=True):
                await sb.kill()
            raise errors.UsageError("the MCP server is shutting down")

    def _own(self, ctx: Context[Any, Any] | None, *, sandboxes: tuple[str, ...] = (),
             snapshots: tuple[str, ...] = ()) -> None:
        """Record what a tool made, so it goes with the calling session (or at shutdown)."""
        key = self._session_key(ctx)
        if key is None:
            self._unowned.update(sandboxes)
            self._unowned_snapshots.update(snapshots)
        else:
            session = self._session(ctx, key)
            session.owned.update(sandboxes)
            session.snapshots.update(snapshots)

    def _forget(self, sandbox_id: str) -> None:
        """Drop a destroyed sandbox from the sessions (also on a destroy's own thread)."""
        self._unowned.discard(sandbox_id)
        for session in list(self._sessions.values()):
            session.owned.discard(sandbox_id)
            if session.sandbox is not None and session.sandbox.id == sandbox_id:
                session.sandbox = None

    async def guarded(self, ctx: Context[Any, Any] | None, sandbox_id: str | None,
                      body: Callable[[], Awaitable[dict[str, Any]]]) -> CallToolResult:
        """Run a tool body; Corral errors become tool errors carrying their code."""
        try:
            return _ok(await body())
        except errors.CorralError as exc:
            key = self._session_key(ctx) if sandbox_id is None else None
            session = self._sessions.get(key) if key is not None else None
            if (isinstance(exc, errors.SandboxNotFound) and session is not None
                    and session.sandbox is not None):
                # The session sandbox expired (TTL) or was removed: the next call gets a new one.
                self._forget(session.sandbox.id)
                return _error(exc.code, f"{exc.message}; the session's next call creates a new "
                                        "session sandbox (its files are gone)")
            return _error(exc.code, exc.message)
        except OSError as exc:
            return _error("os_error", f"{exc.strerror or exc}")

    def _volume_mounts(self, volumes: Mapping[str, VolumeRequest]
                       ) -> dict[str, str | dict[str, Any]]:
        """``volumes`` as the SDK takes them, each one the operator let the model mount, the
        way it let it (``CeilingExceeded`` otherwise)."""
        mounts: dict[str, str | dict[str, Any]] = {}
        for name, where in volumes.items():
            read_only_only = self.volumes.get(name)
            if read_only_only is None:
                allowed = ", ".join(sorted(self.volumes)) or "none"
                raise errors.CeilingExceeded(
                    f"volume {name!r} is not one this MCP server may mount (allowed: "
                    f"{allowed}; the operator allows more with corral mcp --volume NAME)")
            if isinstance(where, VolumeMount):
                path, read_only = where.path, where.read_only
            else:
                path, read_only = where, False
            if read_only_only and not read_only:
                raise errors.CeilingExceeded(
                    f"volume {name!r} may only be mounted read-only here; pass "
                    '{"path": ..., "read_only": true}')
            mounts[name] = {"path": path, "read_only": True} if read_only else path
        return mounts

    # --- tools ----------------------------------------------------------------------------

    async def create_sandbox(
        self, ctx: Context[Any, Any] | None, resources: str, timeout_s: float | None,
        allow: list[str], labels: dict[str, str], isolation: str | None = None,
        snapshot: str | None = None, template: str | None = None,
        volumes: Mapping[str, VolumeRequest] | None = None,
    ) -> dict[str, Any]:
        network: dict[str, list[str]] | str = {"allow": list(allow)} if allow else "none"
        mounts = self._volume_mounts(volumes or {})
        sb = await self._create(
            template=template, resources=resources, timeout=timeout_s, labels=labels,
            network=network, isolation=isolation, snapshot=snapshot, volumes=mounts or None)
        await self._check_open(sb)
        self._own(ctx, sandboxes=(sb.id,))
        info = await sb.get_info()
        return {"sandbox_id": sb.id, "template": info.template, "resources": info.resources,
                "expires_at": info.expires_at, "network": info.network, "labels": info.labels,
                "isolation": info.isolation, "mounts": info.mounts}

    async def run_command(
        self, ctx: Context[Any, Any] | None, command: str, sandbox_id: str | None,
        timeout_s: float | None, cwd: str | None,
    ) -> dict[str, Any]:
        sb = await self.sandbox(ctx, sandbox_id)
        context = {"mcp_request_id": ctx.request_id} if ctx is not None else None
        result: CommandResult = await sb.commands.run(command, timeout=timeout_s, cwd=cwd,
                                                      context=context)
        stdout, out_dropped = _cap(result.stdout, OUTPUT_CAP_BYTES, result.stdout_truncated,
                                   "stdout")
        stderr, err_dropped = _cap(result.stderr, OUTPUT_CAP_BYTES, result.stderr_truncated,
                                   "stderr")
        return {
            "sandbox_id": sb.id, "exit_code": result.exit_code, "stdout": stdout,
            "stderr": stderr, "timed_out": result.timed_out,
            "duration_s": round(result.duration_s, 3), "oom_killed": result.usage.oom_killed,
            "truncated": bool(out_dropped or err_dropped),
            "stdout_dropped_bytes": out_dropped, "stderr_dropped_bytes": err_dropped,
            "command_id": result.command_id,
        }

    async def run_code(
        self, ctx: Context[Any, Any] | None, code: str, language: str | None,
        context_id: str | None, sandbox_id: str | None, timeout_s: float | None,
    ) -> dict[str, Any]:
        sb = await self.sandbox(ctx, sandbox_id)
        execution = await sb.run_code(code, language=language, context=context_id,
                                      timeout=timeout_s)
        stdout, out_dropped = _cap("".join(execution.logs.stdout), OUTPUT_CAP_BYTES, 0,
                                   "stdout")
        stderr, err_dropped = _cap("".join(execution.logs.stderr), OUTPUT_CAP_BYTES, 0,
                                   "stderr")
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

    async def read_file(self, ctx: Context[Any, Any] | None, path: str,
                        sandbox_id: str | None) -> dict[str, Any]:
        sb = await self.sandbox(ctx, sandbox_id)
        data = await sb.files.read(path, format="bytes")
        text, dropped = _cap(data[:FILE_CAP_BYTES + 4].decode(errors="replace"), FILE_CAP_BYTES,
                             max(0, len(data) - FILE_CAP_BYTES - 4), "file")
        return {"sandbox_id": sb.id, "path": path, "content": text, "size": len(data),
                "truncated": bool(dropped)}

    async def write_file(self, ctx: Context[Any, Any] | None, path: str, content: str,
                         sandbox_id: str | None) -> dict[str, Any]:
        sb = await self.sandbox(ctx, sandbox_id)
        entry = await sb.files.write(path, content)
        return {"sandbox_id": sb.id, **_entry(entry)}

    async def list_files(self, ctx: Context[Any, Any] | None, path: str,
                         sandbox_id: str | None) -> dict[str, Any]:
        sb = await self.sandbox(ctx, sandbox_id)
        entries = await sb.files.list(path)
        return {"sandbox_id": sb.id, "path": path, "entries": [_entry(e) for e in entries]}

    async def upload(self, ctx: Context[Any, Any] | None, archive_base64: str, path: str,
                     sandbox_id: str | None) -> dict[str, Any]:
        try:
            archive = base64.b64decode(archive_base64, validate=True)
        except (binascii.Error, ValueError):
            raise errors.UsageError("archive_base64 is not valid base64") from None
        if len(archive) > ARCHIVE_CAP_BYTES:
            raise errors.TooLarge(f"archives over MCP are limited to {ARCHIVE_CAP_BYTES} bytes; "
                                  "use the HTTP API for larger trees")
        sb = await self.sandbox(ctx, sandbox_id)
        report = await sb.files.upload(archive, path)
        return {"sandbox_id": sb.id, "path": path, **report}

    async def download(self, ctx: Context[Any, Any] | None, path: str, gzip: bool,
                       sandbox_id: str | None) -> dict[str, Any]:
        sb = await self.sandbox(ctx, sandbox_id)

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

    async def snapshot(self, ctx: Context[Any, Any] | None, name: str | None,
                       sandbox_id: str | None, memory: bool = False) -> dict[str, Any]:
        sb = await self.sandbox(ctx, sandbox_id)
        snap = await sb.snapshot(name, memory=memory)
        if self._closed:  # taken while the server shut down: gone at once, as in _check_open
            with anyio.CancelScope(shield=True):
                await self._delete_snapshots({snap.id})
            raise errors.UsageError("the MCP server is shutting down")
        self._own(ctx, snapshots=(snap.id,))
        return {"sandbox_id": sb.id, **_snapshot(snap)}

    async def fork(self, ctx: Context[Any, Any] | None, count: int,
                   sandbox_id: str | None, memory: bool = False) -> dict[str, Any]:
        sb = await self.sandbox(ctx, sandbox_id)
        children = await sb.fork(count, memory=memory)
        if self._closed:  # made while the server shut down: gone at once, as in _check_open
            with anyio.CancelScope(shield=True):
                await self._destroy_ids({c.id for c in children})
            raise errors.UsageError("the MCP server is shutting down")
        self._own(ctx, sandboxes=tuple(c.id for c in children))
        return {"sandbox_id": sb.id, "forks": [c.id for c in children]}

    async def restore(self, ctx: Context[Any, Any] | None, snapshot: str,
                      sandbox_id: str | None) -> dict[str, Any]:
        sb = await self.sandbox(ctx, sandbox_id)
        await sb.restore(snapshot)
        return {"sandbox_id": sb.id, "snapshot": snapshot, "restored": True}

    async def expose_port(self, ctx: Context[Any, Any] | None, port: int, public: bool,
                          sandbox_id: str | None) -> dict[str, Any]:
        sb = await self.sandbox(ctx, sandbox_id)
        return _port(await sb.ports.expose(port, public=public))

    async def list_ports(self, ctx: Context[Any, Any] | None,
                         sandbox_id: str | None) -> dict[str, Any]:
        sb = await self.sandbox(ctx, sandbox_id)
        return {"sandbox_id": sb.id, "ports": [_port(p) for p in await sb.ports.list()]}

    async def unexpose_port(self, ctx: Context[Any, Any] | None, port: int,
                            sandbox_id: str | None) -> dict[str, Any]:
        sb = await self.sandbox(ctx, sandbox_id)
        await sb.ports.unexpose(port)
        return {"sandbox_id": sb.id, "port": port, "unexposed": True}

    async def list_volumes(self) -> dict[str, Any]:
        if not self.volumes:  # nothing to show: no need to open the data directory for it
            return {"volumes": []}
        found = await (await self._transport()).list_volumes()
        return {"volumes": [{**_volume(v), "writable": not self.volumes[v.name]}
                            for v in found if v.name in self.volumes]}

    async def destroy_sandbox(self, ctx: Context[Any, Any] | None,
                              sandbox_id: str | None) -> dict[str, Any]:
        if sandbox_id is None:
            key = self._session_key(ctx)
            session = self._sessions.get(key) if key is not None else None
            if session is None or session.sandbox is None:
                return {"sandbox_id": None, "destroyed": False}
            sandbox_id = session.sandbox.id
        sb = await self._connect(sandbox_id)
        await sb.kill()
        self._forget(sandbox_id)
        return {"sandbox_id": sandbox_id, "destroyed": True}


_INSTRUCTIONS = """\
Corral runs shell commands and file operations in isolated Linux sandboxes (no network unless \
allowed, one writable directory /workspace, hard CPU/memory/time limits). Calls without \
sandbox_id share one sandbox per MCP session, created on first use and destroyed when the \
session ends. Output is capped at 64 KiB per stream; a non-zero exit code is a normal result. \
expose_port makes a server in a sandbox reachable by URL (with a token unless public)."""


def _refuser(tool: str, taken: list[str]) -> Callable[[Any], Any]:
    def refuse_unknown(data: Any) -> Any:
        unknown = sorted(set(data) - set(taken)) if isinstance(data, dict) else []
        if unknown:
            raise ValueError(
                f"unknown argument{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(repr(u) for u in unknown)} for {tool}; it takes: "
                f"{', '.join(taken) or 'nothing'}")
        return data

    return refuse_unknown


def _forbid_unknown_arguments(mcp: MCPServer[Any]) -> None:
    """Make every tool refuse arguments it does not take (the SDK ignores them otherwise, so
    a misspelt or invented field would silently do the default). The schema says so too."""
    for tool in mcp._tool_manager.list_tools():
        base: type[BaseModel] = tool.fn_metadata.arg_model
        taken = sorted(f.alias or n for n, f in base.model_fields.items())
        strict = type(base.__name__, (base,), {
            "__module__": base.__module__,
            "model_config": ConfigDict(**{**base.model_config, "extra": "forbid"}),
            # Before validation, so the message names the field and lists the right ones.
            "_refuse_unknown": model_validator(mode="before")(_refuser(tool.name, taken)),
        })
        tool.fn_metadata.arg_model = strict
        tool.parameters["additionalProperties"] = False


def build_server(home: Path | None, transport: Transport,
                 ceiling: Ceiling = DEFAULT_CEILING,
                 volumes: Mapping[str, bool] | None = None, where: Where | None = None,
                 ) -> tuple[MCPServer[Any], CorralMCP]:
    """The MCP server with Corral's tools, and the state behind them; ``ceiling`` bounds
    what the tools may ask for (default: ``DEFAULT_CEILING``), ``volumes`` names the volumes
    the model may mount (name -> read-only only; default none); ``where``, said in the
    instructions, is where its sandboxes live."""
    state = CorralMCP(home, transport, ceiling, volumes)
    instructions = _INSTRUCTIONS
    if where is not None:
        # The client (and its user) see at initialize which data directory this is: the one
        # an MCP client's missing environment picked is otherwise found out much later.
        instructions += (f"\n\nThis server: {where.describe()}. The model may use: "
                         f"{allowed_text(ceiling, volumes or {})}.")

    @asynccontextmanager
    async def lifespan(_: MCPServer[Any]) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await state.shutdown()

    from .. import __version__

    mcp: MCPServer[Any] = MCPServer("corral", version=__version__, instructions=instructions,
                                    lifespan=lifespan, log_level="WARNING")

    @mcp.tool(annotations=ToolAnnotations(open_world_hint=False))
    async def create_sandbox(
        ctx: Context[Any, Any], resources: str = "small", timeout_s: float | None = None,
        allow: list[str] | None = None, labels: dict[str, str] | None = None,
        isolation: str | None = None, snapshot: str | None = None,
        template: str | None = None, volumes: dict[str, VolumeRequest] | None = None,
    ) -> CallToolResult:
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
        files outlive the sandbox. Hosts, templates and volumes beyond what the operator
        allowed are refused (ceiling_exceeded). It is destroyed with this MCP session, or by
        destroy_sandbox."""
        return await state.guarded(ctx, "", lambda: state.create_sandbox(
            ctx, resources, timeout_s, allow or [], labels or {}, isolation, snapshot,
            template, volumes))

    @mcp.tool(annotations=ToolAnnotations(open_world_hint=False))
    async def run_command(
        ctx: Context[Any, Any], command: str, sandbox_id: str | None = None,
        timeout_s: float | None = None, cwd: str | None = None,
    ) -> CallToolResult:
        """Run a bash command in the sandbox (default: this session's) and wait for it.

        Returns exit_code, stdout, stderr, timed_out, duration_s. A non-zero exit_code is a
        result, not an error. stdout and stderr are each capped at 64 KiB; "truncated" says
        whether anything was cut (a "[corral: ... truncated ...]" line marks the cut)."""
        return await state.guarded(ctx, sandbox_id, lambda: state.run_command(
            ctx, command, sandbox_id, timeout_s, cwd))

    @mcp.tool(annotations=ToolAnnotations(open_world_hint=False))
    async def run_code(
        ctx: Context[Any, Any], code: str, language: str | None = None,
        context_id: str | None = None, sandbox_id: str | None = None,
        timeout_s: float | None = None,
    ) -> CallToolResult:
        """Run a cell of code in a stateful kernel in the sandbox (default: this session's):
        variables and imports stay for the next call. language: "python" (default, IPython),
        "bash" (a persistent shell), "javascript", "typescript" (node) or "r"; context_id: a
        context of the sandbox instead.

        Returns text (the cell's value), results (MIME bundles: text/plain, text/html,
        image/png base64, ...; a matplotlib figure is a PNG), stdout, stderr, error (name,
        value, traceback; an exception in the cell is a result, not a tool error) and
        execution_count."""
        return await state.guarded(ctx, sandbox_id, lambda: state.run_code(
            ctx, code, language, context_id, sandbox_id, timeout_s))

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def read_file(ctx: Context[Any, Any], path: str,
                        sandbox_id: str | None = None) -> CallToolResult:
        """Read a text file under /workspace (relative paths are relative to it)."""
        return await state.guarded(ctx, sandbox_id,
                                   lambda: state.read_file(ctx, path, sandbox_id))

    @mcp.tool(annotations=ToolAnnotations(open_world_hint=False))
    async def write_file(ctx: Context[Any, Any], path: str, content: str,
                         sandbox_id: str | None = None) -> CallToolResult:
        """Write a whole text file under /workspace, creating parent directories."""
        return await state.guarded(ctx, sandbox_id,
                                   lambda: state.write_file(ctx, path, content, sandbox_id))

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def list_files(ctx: Context[Any, Any], path: str = "/workspace",
                         sandbox_id: str | None = None) -> CallToolResult:
        """List a directory under /workspace: name, path, type and size of each entry."""
        return await state.guarded(ctx, sandbox_id,
                                   lambda: state.list_files(ctx, path, sandbox_id))

    @mcp.tool(annotations=ToolAnnotations(open_world_hint=False))
    async def upload_tar(ctx: Context[Any, Any], archive_base64: str,
                         path: str = "/workspace",
                         sandbox_id: str | None = None) -> CallToolResult:
        """Extract a base64 tar or tar.gz under path (absolute names, '..', links leading out,
        hard links and devices are refused)."""
        return await state.guarded(ctx, sandbox_id,
                                   lambda: state.upload(ctx, archive_base64, path, sandbox_id))

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def download_tar(ctx: Context[Any, Any], path: str = "/workspace", gzip: bool = True,
                           sandbox_id: str | None = None) -> CallToolResult:
        """The tree under path as a base64 tar (gzip by default)."""
        return await state.guarded(ctx, sandbox_id,
                                   lambda: state.download(ctx, path, gzip, sandbox_id))

    @mcp.tool(annotations=ToolAnnotations(open_world_hint=False))
    async def snapshot(ctx: Context[Any, Any], name: str | None = None,
                       sandbox_id: str | None = None, memory: bool = False) -> CallToolResult:
        """Save the sandbox's /workspace as it is now (default: this session's sandbox), to go
        back to with restore or to start new sandboxes from; instant whatever its size.

        name: optional, unique among snapshots (letters, digits, _ . -). Nothing may be running
        in the sandbox (sandbox_busy otherwise), unless memory: true (microvm tier only), which
        also saves the running memory and processes, commands included, for forks and
        restores to resume. Snapshots are deleted with this MCP session."""
        return await state.guarded(ctx, sandbox_id,
                                   lambda: state.snapshot(ctx, name, sandbox_id, memory))

    @mcp.tool(annotations=ToolAnnotations(open_world_hint=False))
    async def fork(ctx: Context[Any, Any], count: int = 1,
                   sandbox_id: str | None = None, memory: bool = False) -> CallToolResult:
        """Make count (1-64) new sandboxes, each starting with a copy of this sandbox's
        /workspace as it is now (default: this session's sandbox), to try several approaches
        side by side. With memory: true (microvm tier only) each also resumes the sandbox's
        running memory and processes. Returns their sandbox_ids ("forks"); pass one as
        sandbox_id to the other tools. They are destroyed with this MCP session, or by
        destroy_sandbox."""
        return await state.guarded(ctx, sandbox_id,
                                   lambda: state.fork(ctx, count, sandbox_id, memory))

    @mcp.tool(annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=True,
                                          open_world_hint=False))
    async def restore(ctx: Context[Any, Any], snapshot: str,
                      sandbox_id: str | None = None) -> CallToolResult:
        """Put the sandbox's /workspace back exactly as it was in a snapshot (its snapshot_id
        or name); changes since then that are in no snapshot are lost. Nothing may be running
        in the sandbox."""
        return await state.guarded(ctx, sandbox_id,
                                   lambda: state.restore(ctx, snapshot, sandbox_id))

    @mcp.tool(annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=True,
                                          open_world_hint=False))
    async def destroy_sandbox(ctx: Context[Any, Any],
                              sandbox_id: str | None = None) -> CallToolResult:
        """Destroy a sandbox (default: this session's; the next call gets a fresh one)."""
        return await state.guarded(ctx, sandbox_id,
                                   lambda: state.destroy_sandbox(ctx, sandbox_id))

    @mcp.tool(annotations=ToolAnnotations(idempotent_hint=True, open_world_hint=False))
    async def expose_port(ctx: Context[Any, Any], port: int, public: bool = False,
                          sandbox_id: str | None = None) -> CallToolResult:
        """Make a server in the sandbox (default: this session's) reachable from outside it,
        through the Corral service, HTTP and WebSockets alike; start the server first,
        listening on 0.0.0.0 or 127.0.0.1.

        Returns url (null when this server does not know the service's address), token and
        signed_url. Private by default: a request needs the token in the X-Corral-Port-Token
        header, or a browser opens signed_url once (it expires at signed_expires_at).
        public: true lets anyone with the url in. Exposing again keeps the token."""
        return await state.guarded(ctx, sandbox_id,
                                   lambda: state.expose_port(ctx, port, public, sandbox_id))

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def list_ports(ctx: Context[Any, Any],
                         sandbox_id: str | None = None) -> CallToolResult:
        """The sandbox's exposed ports (default: this session's sandbox), each with its url,
        token and a fresh signed_url."""
        return await state.guarded(ctx, sandbox_id,
                                   lambda: state.list_ports(ctx, sandbox_id))

    @mcp.tool(annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=True,
                                          open_world_hint=False))
    async def unexpose_port(ctx: Context[Any, Any], port: int,
                            sandbox_id: str | None = None) -> CallToolResult:
        """Stop serving a port of the sandbox (default: this session's); its token and signed
        links stop working at once."""
        return await state.guarded(ctx, sandbox_id,
                                   lambda: state.unexpose_port(ctx, port, sandbox_id))

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def list_volumes(ctx: Context[Any, Any]) -> CallToolResult:
        """The persistent volumes this server lets you mount (create_sandbox's volumes): name,
        size_bytes, used_bytes, the sandboxes mounting each (mounted_by, and writer, the one
        mounting it read-write) and writable (false: mount it read-only)."""
        return await state.guarded(ctx, "", state.list_volumes)

    _forbid_unknown_arguments(mcp)
    return mcp, state


async def _serve_stdio(mcp: MCPServer[Any], state: CorralMCP, parent: int,
                       lock: InstanceLock | None) -> None:
    """Serve one client on stdin/stdout until it closes stdin, it dies, or a signal arrives."""
    async with anyio.create_task_group() as tg:

        async def on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
                async for signum in sigs:
                    # The SDK reads stdin in a worker thread that cancellation cannot interrupt,
                    # so clean up here, then die of the signal as if it had not been caught.
                    await state.shutdown()
                    if lock is not None:
                        lock.release()
                    signal.signal(signum, signal.SIG_DFL)
                    os.kill(os.getpid(), signum)

        tg.start_soon(on_signal)
        # A killed client: the kernel's SIGTERM (die_with_parent), or this watch, ends the
        # server like a SIGTERM would, when stdin does not end because others hold its pipe.
        tg.start_soon(watch_parent, parent)
        await mcp.run_stdio_async()
        tg.cancel_scope.cancel()


async def _serve_http(mcp: MCPServer[Any], host: str, port: int) -> None:
    import uvicorn

    app = mcp.streamable_http_app(host=host)
    # A bounded graceful shutdown: open SSE streams would otherwise hold SIGTERM forever.
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=5)
    await uvicorn.Server(config).serve()


def serve(home: Path | None, transport: Transport, host: str = "127.0.0.1",
          port: int = 8765, ceiling: Ceiling = DEFAULT_CEILING,
          volumes: Mapping[str, bool] | None = None, where: Where | None = None,
          share_home: bool = False) -> None:
    """Run the server until the client leaves (stdio) or a signal arrives.

    Says on stderr where its sandboxes live (``where``), then holds the data directory's
    instance lock for its life: ``ConfigError`` when another instance (``corral serve``,
    another ``corral mcp``) holds it, unless ``share_home``."""
    # First thing: a client killed while this starts must not leave it running.
    parent = die_with_parent() if transport == "stdio" else 0
    if where is not None:
        print(f"corral mcp: {where.describe()}; the model may use: "
              f"{allowed_text(ceiling, volumes or {})}", file=sys.stderr, flush=True)
    lock = None
    if home is not None:
        lock = hold_home(home, f"corral mcp ({transport})", share=share_home)
        for other in lock.others:
            print(f"corral mcp: sharing the data directory with {other.describe()} "
                  "(--share-home)", file=sys.stderr, flush=True)
    try:
        mcp, state = build_server(home, transport, ceiling, volumes, where)
        if transport == "stdio":
            anyio.run(_serve_stdio, mcp, state, parent, lock)
            return
        if host not in ("127.0.0.1", "localhost", "::1"):
            print(f"corral mcp: listening on {host}, beyond this host; the MCP endpoint has no "
                  "authentication: anyone who reaches it can run commands in sandboxes",
                  file=sys.stderr)
        print(f"corral mcp: Streamable HTTP on http://{host}:{port}/mcp", file=sys.stderr)
        anyio.run(_serve_http, mcp, host, port)
    finally:
        if lock is not None:
            lock.release()
