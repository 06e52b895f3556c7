"""MCP sessions: which sandboxes and snapshots belong to which MCP session, the session
sandbox, and the ceiling the model is held to (see ``server`` for the rules).

The tools (``tools``) reach sandboxes only through ``CorralMCP``: ``sandbox`` (a named one, or
the session's, made on first use), ``create`` (within the MCP ceiling), ``own`` (what a tool
made goes with its session) and ``guarded`` (Corral errors become tool errors).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.to_thread
from mcp.server.mcpserver import Context
from mcp_types import CallToolResult, TextContent
from pydantic import BaseModel, ConfigDict

from .. import errors
from .._control.plane import LOCAL_TENANT, Admission, Ceiling, local_tenant
from .._egress.policy import NetworkPolicy
from .._http.errors import Failure, as_tool_error, failure
from .._sdk._aembedded import AsyncEmbeddedTransport
from .._sdk._async.http import AsyncHTTPTransport
from .._sdk._async.sandbox import AsyncSandbox
from .._sdk._async.transport import AsyncTransport
from .._sdk._embedded import embedded_target

__all__ = ["DEFAULT_CEILING", "CorralMCP", "SessionRequired", "Transport", "VolumeMount",
           "VolumeRequest", "mcp_ceiling"]

log = logging.getLogger(__name__)


Transport = Literal["stdio", "http"]

SESSION_LABELS = {"origin": "corral-mcp"}

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



def _ok(data: dict[str, Any]) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=json.dumps(data))],
                          structured_content=data)


def _error(failed: Failure) -> CallToolResult:
    text, structured = as_tool_error(failed)
    return CallToolResult(content=[TextContent(type="text", text=text)],
                          structured_content=structured, is_error=True)




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

    async def opened(self) -> AsyncTransport:
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
                self._unsubscribe = target.on_destroyed(self.forget)
        return self._opened

    async def connect(self, sandbox_id: str) -> AsyncSandbox:
        return await AsyncSandbox.connect(sandbox_id, transport=await self.opened())

    # --- sessions -------------------------------------------------------------------------

    def session_key(self, ctx: Context[Any, Any] | None) -> str | None:
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
                await self.destroy_ids(set(session.owned))
                await self.delete_snapshots(set(session.snapshots))

    async def destroy_ids(self, ids: set[str]) -> None:
        for sandbox_id in sorted(ids):
            try:
                await (await self.connect(sandbox_id)).kill()
            except errors.SandboxNotFound:
                pass
            except Exception:  # keep destroying the others
                log.exception("could not destroy sandbox %s", sandbox_id)

    async def delete_snapshots(self, ids: set[str]) -> None:
        """Delete snapshots; run after their session's sandboxes are gone."""
        for snapshot_id in sorted(ids):
            try:
                await (await self.opened()).delete_snapshot(snapshot_id)
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
                await self.destroy_ids(ids)
                await self.delete_snapshots(snapshots)
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
            return await self.connect(sandbox_id)
        key = self.session_key(ctx)
        if key is None:
            raise SessionRequired(
                "this client has no MCP session (sessionless protocol), so there is no session "
                "sandbox; call create_sandbox and pass its sandbox_id")
        session = self._session(ctx, key)
        async with session.lock:
            if session.sandbox is None:
                sb = await self.create(labels=SESSION_LABELS)
                await self.check_open(sb)
                session.sandbox = sb
                session.owned.add(sb.id)
            return session.sandbox

    async def create(self, **kwargs: Any) -> AsyncSandbox:
        """A sandbox made on the caller's behalf, within the MCP ceiling."""
        transport = await self.opened()
        if isinstance(transport, AsyncHTTPTransport):
            # A remote service applies its key's tenant's ceiling and cannot know this one
            # (its create takes none), so the control plane's rule is applied here first.
            network = kwargs.get("network")
            Admission(self.ceiling).check_create(
                caller=None, tenant=LOCAL_TENANT, template=kwargs.get("template"),
                isolation=kwargs.get("isolation"), resources=kwargs.get("resources"),
                lifetime_s=kwargs.get("timeout"),
                network=NetworkPolicy.build(network["allow"]) if isinstance(network, dict)
                else None)
        return await AsyncSandbox.create(transport=transport, **kwargs)

    async def check_open(self, sb: AsyncSandbox) -> None:
        """A sandbox created while the server shut down is destroyed at once."""
        if self._closed:
            with anyio.CancelScope(shield=True):
                await sb.kill()
            raise errors.UsageError("the MCP server is shutting down")

    async def keep(self, ctx: Context[Any, Any] | None, *, sandboxes: tuple[str, ...] = (),
                   snapshots: tuple[str, ...] = ()) -> None:
        """Record what a tool made, so it goes with the calling session (or at shutdown);
        made while the server shut down, it goes at once."""
        if self._closed:
            with anyio.CancelScope(shield=True):
                await self.destroy_ids(set(sandboxes))
                await self.delete_snapshots(set(snapshots))
            raise errors.UsageError("the MCP server is shutting down")
        self._own(ctx, sandboxes=sandboxes, snapshots=snapshots)

    def session_sandbox_id(self, ctx: Context[Any, Any] | None) -> str | None:
        """The calling session's sandbox, if it has one now (none is made for asking)."""
        key = self.session_key(ctx)
        session = self._sessions.get(key) if key is not None else None
        return None if session is None or session.sandbox is None else session.sandbox.id

    def _own(self, ctx: Context[Any, Any] | None, *, sandboxes: tuple[str, ...] = (),
             snapshots: tuple[str, ...] = ()) -> None:
        key = self.session_key(ctx)
        if key is None:
            self._unowned.update(sandboxes)
            self._unowned_snapshots.update(snapshots)
        else:
            session = self._session(ctx, key)
            session.owned.update(sandboxes)
            session.snapshots.update(snapshots)

    def forget(self, sandbox_id: str) -> None:
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
            failed = failure(exc)
            key = self.session_key(ctx) if sandbox_id is None else None
            session = self._sessions.get(key) if key is not None else None
            if isinstance(exc, errors.SandboxNotFound) and session is not None:
                # The session sandbox expired (TTL) or was removed: the next call gets a new
                # one. Its destroy's listener may have forgotten it already (``forget``).
                if session.sandbox is not None:
                    self.forget(session.sandbox.id)
                failed = replace(failed, message=f"{failed.message}; the session's next call "
                                                 "creates a new session sandbox (its files are "
                                                 "gone)")
            return _error(failed)
        except OSError as exc:
            # Its own words under a code of its own (a tool result carries no status).
            return _error(Failure(500, "os_error", f"{exc.strerror or exc}", exc))

    def volume_mounts(self, volumes: Mapping[str, VolumeRequest]
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
