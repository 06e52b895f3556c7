"""The MCP server behind ``corral mcp``: sandboxes as tools for any MCP client.

Tools: ``create_sandbox``, ``run_command``, ``read_file``, ``write_file``, ``list_files``,
``upload_tar``, ``download_tar``, ``snapshot``, ``fork``, ``restore``, ``destroy_sandbox``,
``expose_port``, ``list_ports``, ``unexpose_port``, ``run_code`` and ``list_volumes``, each
written once in ``tools``; the sessions behind them are ``sessions``. Every tool but
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

import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from mcp.server.mcpserver import MCPServer
from pydantic import BaseModel, ConfigDict, model_validator

from .._control.plane import Ceiling
from .._core.homelock import InstanceLock, hold_home
from .lifeline import die_with_parent, watch_parent
from .sessions import DEFAULT_CEILING, CorralMCP, Transport, mcp_ceiling
from .tools import OUTPUT_CAP_BYTES, register
from .where import Where, allowed_text

__all__ = ["DEFAULT_CEILING", "OUTPUT_CAP_BYTES", "CorralMCP", "build_server", "mcp_ceiling",
           "serve"]


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
    register(mcp, state)
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
