"""A terminal over WebSocket: a shell on a PTY inside the sandbox, bridged frame by frame."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from .._audit.recorder import new_command_id
from .._control.plane import Manager
from .._http.guard import scope_tenant
from ..backends import ProcessIO
from ..errors import CorralError, UsageError

__all__ = ["serve_terminal"]

# Control characters the terminal turns into signals for the foreground process group.
_SIGNAL_KEYS = {"INT": b"\x03", "QUIT": b"\x1c", "TSTP": b"\x1a"}
_MAX_SIZE = 1000


async def _deny(websocket: WebSocket, error: CorralError) -> None:
    """Refuse the handshake with the error's status and JSON body, so a client reads why (as
    from any endpoint); a server without the denial extension can only close."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(JSONResponse(
            {"error": error.code, "message": error.message}, status_code=error.status))
    else:
        await websocket.close(code=4000 + min(error.status, 999), reason=error.message[:120])


async def serve_terminal(websocket: WebSocket, manager: Manager, sandbox_id: str, *,
                         rows: int, cols: int) -> None:
    try:
        # Same auth as every endpoint: the Authorization header of the handshake.
        who = scope_tenant(websocket.scope)
        manager.get(sandbox_id, tenant=None if who.name == "local" else who.name)
        if not (0 < rows <= _MAX_SIZE and 0 < cols <= _MAX_SIZE):
            raise UsageError(f"rows and cols must be 1..{_MAX_SIZE}")
        # A terminal is a start of code like any command: the same quota, counted before a
        # shell runs.
        manager.admit(who)
    except CorralError as exc:
        await _deny(websocket, exc)
        return
    await websocket.accept()
    loop = asyncio.get_running_loop()
    output: asyncio.Queue[bytes | dict[str, Any]] = asyncio.Queue()
    ready = threading.Event()
    io_box: list[ProcessIO] = []

    def started(io: ProcessIO) -> None:
        io_box.append(io)
        ready.set()

    command_id = new_command_id()

    def emit(text: str) -> None:
        loop.call_soon_threadsafe(output.put_nowait, text.encode())

    def kill() -> None:
        try:
            manager.kill_command(sandbox_id, command_id)
        except CorralError:
            pass  # already gone

    def run() -> None:
        try:
            result = manager.run(
                sandbox_id, ["/bin/bash", "-il"], pty=(rows, cols), on_start=started,
                lifetime=True, envs={"TERM": "xterm-256color"}, on_stdout=emit,
                command_id=command_id)
            final: dict[str, Any] = {"type": "exit", "exit_code": result.exit_code}
        except CorralError as exc:
            final = {"type": "error", "error": exc.code, "message": exc.message}
        ready.set()
        loop.call_soon_threadsafe(output.put_nowait, final)

    worker = threading.Thread(target=run, name="corral-pty", daemon=True)
    worker.start()
    await asyncio.to_thread(ready.wait, 30)

    async def pump_out() -> None:
        while True:
            item = await output.get()
            if isinstance(item, dict):
                await websocket.send_text(json.dumps(item))
                await websocket.close()
                return
            await websocket.send_bytes(item)

    async def pump_in() -> None:
        while True:
            message = json.loads(await websocket.receive_text())
            io = io_box[0] if io_box else None
            if io is None:
                continue
            kind = message.get("type")
            if kind == "input":
                io.write(str(message.get("data", "")).encode())
            elif kind == "resize":
                io.resize(max(1, min(int(message["rows"]), _MAX_SIZE)),
                          max(1, min(int(message["cols"]), _MAX_SIZE)))
            elif kind == "signal":
                name = str(message.get("signal", "")).upper()
                if name == "KILL":
                    await asyncio.to_thread(kill)
                elif name in _SIGNAL_KEYS:
                    io.write(_SIGNAL_KEYS[name])

    sender = asyncio.create_task(pump_out())
    receiver = asyncio.create_task(pump_in())
    done, pending = await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    if receiver in done:
        # The client went away: end the shell and everything it started.
        await asyncio.to_thread(kill)
    for task in done:
        error = task.exception()
        if error is not None and not isinstance(error, WebSocketDisconnect | RuntimeError):
            raise error
