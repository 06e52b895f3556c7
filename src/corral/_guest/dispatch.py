"""The agent's main loop: the reader parses and routes each line, and never blocks. A
command (``exec``) gets its own thread; file and lifecycle ops get one each, at most
``MAX_INFLIGHT`` at once (past that, ``busy`` rather than queue); the ops on a running command
and on a write handle only queue work on its lane (``channel.Lane``), so they are answered in
the order they came."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

from . import commands, conns, fs, lifecycle, ports
from .agent import MAX_INFLIGHT, Agent
from .exec import run as run_command
from .protocol import MAX_LINE, AgentError, Message

__all__ = ["dispatch", "serve"]

Handler = Callable[[Agent, int, Message], None]
_INLINE: dict[str, Handler] = {**lifecycle.INLINE_OPS, **commands.OPS, **fs.INLINE_OPS}
_THREADED: dict[str, Handler] = {**fs.THREADED_OPS, **lifecycle.THREADED_OPS}


def serve(agent: Agent) -> None:
    """Answer the host until the channel ends (a test's socket; the port never does)."""
    agent.ready()
    for line in agent.channel.lines():
        if line is None:
            agent.channel.send({"id": None, "error": {
                "kind": "protocol", "message": f"a line over {MAX_LINE} bytes was dropped"}})
        elif line == b"":
            agent.ready()
        else:
            dispatch(agent, line)


def dispatch(agent: Agent, line: bytes) -> None:
    try:
        message = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        agent.fail(None, "protocol", "the line is not JSON")
        return
    if not isinstance(message, dict):
        agent.fail(None, "protocol", "a message must be a JSON object")
        return
    if "conn" in message and "op" not in message:
        conns.from_host(agent, message)
        return
    if "conn" in message and message.get("op") == "tcp.connect":
        ports.connect(agent, message)
        return
    rid = message.get("id")
    op = message.get("op")
    if not isinstance(rid, int) or isinstance(rid, bool) or not isinstance(op, str):
        agent.fail(rid if isinstance(rid, int) else None, "protocol",
                   "a request needs an integer 'id' and a string 'op'")
        return
    if op == "exec":
        with agent.lock:  # here, so a kill read right after the exec finds it
            agent.starting.add(rid)
        threading.Thread(target=_exec_thread, args=(agent, rid, message), daemon=True).start()
        return
    inline = _INLINE.get(op)
    if inline is not None:
        try:
            inline(agent, rid, message)
        except AgentError as exc:
            agent.fail(rid, exc.kind, exc.message)
        return
    threaded = _THREADED.get(op)
    if threaded is None:
        agent.fail(rid, "protocol", f"unknown op {op!r}")
        return
    if not agent.inflight.acquire(blocking=False):
        agent.fail(rid, "busy", f"over {MAX_INFLIGHT} operations are in flight; retry")
        return
    threading.Thread(target=_threaded, args=(agent, threaded, rid, message),
                     daemon=True).start()


def _threaded(agent: Agent, handler: Handler, rid: int, message: Message) -> None:
    try:
        handler(agent, rid, message)
    except AgentError as exc:
        agent.fail(rid, exc.kind, exc.message)
    except Exception as exc:
        agent.fail(rid, "io", f"{message.get('op')} failed: {exc!r}")
    finally:
        agent.inflight.release()


def _exec_thread(agent: Agent, rid: int, request: Message) -> None:
    try:
        run_command(agent, rid, request)
    except AgentError as exc:
        agent.fail(rid, exc.kind, exc.message)
    except Exception as exc:
        agent.fail(rid, "io", f"exec failed: {exc!r}")
    finally:
        with agent.lock:
            agent.starting.discard(rid)
            agent.kill_pending.discard(rid)
