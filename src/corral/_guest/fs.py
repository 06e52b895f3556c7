"""The ``fs.*`` ops: each a request answered with one reply, except ``fs.list`` and ``fs.walk``,
which can exceed the line limit (100 000 entries) and so send ``{"id", "more": [ENTRY...]}``
batches of at most ``BATCH_ENTRIES`` before the final ``{"id", "ok": [ENTRY...]}`` (the result
is the concatenation), and the writes: ``fs.write_begin`` opens a handle, whose chunks, end and
abort go through its lane in order. A handle that failed (``no_space``...) is gone: later ops
on it get a ``protocol`` error naming it."""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .channel import Lane
from .protocol import AgentError, Message
from .workspace import Files

if TYPE_CHECKING:
    from .agent import Agent

__all__ = ["BATCH_ENTRIES", "INLINE_OPS", "THREADED_OPS"]

BATCH_ENTRIES = 2000
MAX_HANDLES = 64
WRITE_PENDING = 16 << 20


def _op_write_chunk(agent: Agent, rid: int, request: Message) -> None:
    hid, handle = agent.handle(request)
    text = request.get("data")
    try:
        data = base64.b64decode(text if isinstance(text, str) else "!", validate=True)
    except (binascii.Error, ValueError):
        raise AgentError("protocol", "fs.write_chunk: 'data' must be base64 text") from None

    def work() -> None:
        if handle.fd < 0:
            agent.fail(rid, "protocol", f"no open write handle {hid}")
            return
        try:
            Files.write_chunk(handle, data)
        except AgentError as exc:
            agent.drop_handle(hid, handle)
            agent.fail(rid, exc.kind, exc.message)
            return
        agent.reply(rid, True)
    if not handle.lane.submit(work, len(data)):
        agent.fail(rid, "busy", f"over {WRITE_PENDING} bytes are pending on handle {hid}; wait "
                   "for earlier chunks to be acknowledged")


def _op_write_end(agent: Agent, rid: int, request: Message) -> None:
    hid, handle = agent.handle(request)
    mtime = request.get("mtime")

    def work() -> None:
        if handle.fd < 0:
            agent.fail(rid, "protocol", f"no open write handle {hid}")
            return
        try:
            entry = agent.files.write_end(handle, mtime)
        except AgentError as exc:
            agent.fail(rid, exc.kind, exc.message)
            agent.drop_handle(hid, handle)
            return
        with agent.lock:
            agent.handles.pop(hid, None)
        with contextlib.suppress(OSError):
            os.close(handle.dir_fd)
        handle.lane.close()
        agent.reply(rid, entry)
    handle.lane.submit(work, 0)


def _op_write_abort(agent: Agent, rid: int, request: Message) -> None:
    hid, handle = agent.handle(request)

    def work() -> None:
        agent.drop_handle(hid, handle)
        agent.reply(rid, True)
    handle.lane.submit(work, 0)


def _send_entries(agent: Agent, rid: int, entries: Iterator[Message]) -> None:
    batch: list[Message] = []
    for entry in entries:
        batch.append(entry)
        if len(batch) >= BATCH_ENTRIES:
            agent.channel.send({"id": rid, "more": batch})
            batch = []
    agent.reply(rid, batch)


def _op_fs(agent: Agent, rid: int, request: Message) -> None:
    op = request["op"]
    files = agent.files
    path = request.get("path")
    if op == "fs.stat":
        agent.reply(rid, files.stat(path))
    elif op == "fs.exists":
        agent.reply(rid, files.exists(path))
    elif op == "fs.list":
        _send_entries(agent, rid, files.listing(path))
    elif op == "fs.walk":
        _send_entries(agent, rid, files.walk(path))
    elif op == "fs.readlink":
        agent.reply(rid, files.readlink(path))
    elif op == "fs.read":
        agent.reply(rid, files.read(path, request.get("offset", 0), request.get("length")))
    elif op == "fs.symlink":
        agent.reply(rid, files.symlink(path, request.get("target")))
    elif op == "fs.remove":
        files.remove(path)
        agent.reply(rid, True)
    elif op == "fs.rename":
        agent.reply(rid, files.rename(request.get("src"), request.get("dst")))
    elif op == "fs.mkdir":
        agent.reply(rid, files.make_dir(path))
    elif op == "fs.write_begin":
        with agent.lock:
            if len(agent.handles) >= MAX_HANDLES:
                raise AgentError("busy", f"over {MAX_HANDLES} file writes are open; end some")
        follow = request.get("follow_symlinks", True)
        if not isinstance(follow, bool):
            raise AgentError("protocol", "fs.write_begin: 'follow_symlinks' must be a bool")
        handle = files.write_begin(path, request.get("mode", 0o644), follow,
                                   Lane(WRITE_PENDING))
        hid = agent.new_id()
        with agent.lock:
            agent.handles[hid] = handle
        agent.reply(rid, {"handle": hid})


# The writes only queue on their handle's lane: read inline, in channel order.
INLINE_OPS = {"fs.write_chunk": _op_write_chunk, "fs.write_end": _op_write_end,
              "fs.write_abort": _op_write_abort}
THREADED_OPS = {op: _op_fs for op in (
    "fs.stat", "fs.exists", "fs.list", "fs.walk", "fs.readlink", "fs.read", "fs.symlink",
    "fs.remove", "fs.rename", "fs.mkdir", "fs.write_begin")}
