"""Connections relayed over the channel: the egress tunnel's (a command's, opened by the guest,
positive ids) and port connections (the host's, to a server in the guest, negative ids, so the
two never meet). Both carry ``{"conn", "data"}``, ``eof`` and ``closed``; port connections also
``{"conn", "ack": n}`` each way once n bytes reached the far socket, so neither side has more than
``PORT_WINDOW`` bytes unacked in flight and a slow reader slows the sender instead of filling a
queue."""

from __future__ import annotations

import base64
import binascii
import contextlib
import socket
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .channel import Lane
from .protocol import CHUNK, Message, b64

if TYPE_CHECKING:
    from .agent import Agent
    from .commands import Command

__all__ = ["CONN_PENDING", "Conn", "close", "from_host", "relay_to_host"]

PORT_WINDOW = 256 << 10
CONN_PENDING = 4 << 20


@dataclass
class Conn:
    id: int
    sock: socket.socket
    command: Command | None  # None: a port connection the host opened (outlives commands)
    lane: Lane
    opened: threading.Event = field(default_factory=threading.Event)
    refused: bool = False
    guest_eof: bool = False
    host_eof: bool = False
    closed: bool = False
    # Port connections: bytes sent to the host that it has not yet delivered to its client.
    unacked: int = 0
    acked: threading.Condition = field(default_factory=threading.Condition)


def relay_to_host(agent: Agent, conn: Conn) -> None:
    """What the guest end of an open connection sends, until its EOF (or an error)."""
    while True:
        if conn.command is None:
            with conn.acked:
                while conn.unacked >= PORT_WINDOW and not conn.closed:
                    conn.acked.wait()
        try:
            data = conn.sock.recv(CHUNK)
        except OSError as exc:
            close(agent, conn, notify=True, error=exc.strerror)
            return
        if conn.closed:
            return
        if not data:
            conn.guest_eof = True
            agent.channel.send({"conn": conn.id, "eof": True})
            if conn.host_eof:
                close(agent, conn, notify=True)
            return
        if conn.command is None:
            with conn.acked:
                conn.unacked += len(data)
        agent.channel.send({"conn": conn.id, "data": b64(data)})


def close(agent: Agent, conn: Conn, *, notify: bool, error: str | None = None,
          kind: str | None = None) -> None:
    with agent.lock:
        if conn.closed:
            return
        conn.closed = True
        agent.conns.pop(conn.id, None)
        if conn.command is not None:
            conn.command.conns.discard(conn.id)
    conn.opened.set()
    with conn.acked:
        conn.acked.notify_all()
    with contextlib.suppress(OSError):
        conn.sock.shutdown(socket.SHUT_RDWR)
    conn.sock.close()
    conn.lane.close()
    if notify:
        message: Message = {"conn": conn.id, "closed": True}
        if error:
            message["error"] = error
        if kind:
            message["kind"] = kind
        agent.channel.send(message)


def from_host(agent: Agent, message: Message) -> None:
    cid = message.get("conn")
    with agent.lock:
        conn = agent.conns.get(cid) if isinstance(cid, int) else None
    if conn is None:
        return  # closed meanwhile: the host learns it from our closed message
    if message.get("opened") is True:
        conn.opened.set()
    elif message.get("closed") is True:
        conn.refused = not conn.opened.is_set()
        close(agent, conn, notify=False)
    elif (isinstance(message.get("ack"), int) and not isinstance(message["ack"], bool)
          and conn.command is None):
        with conn.acked:
            conn.unacked = max(0, conn.unacked - message["ack"])
            conn.acked.notify_all()
    elif message.get("eof") is True:
        def half_close() -> None:
            conn.host_eof = True
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_WR)
            if conn.guest_eof:
                close(agent, conn, notify=True)
        conn.lane.submit(half_close, 0)
    elif isinstance(message.get("data"), str):
        try:
            data = base64.b64decode(message["data"], validate=True)
        except (binascii.Error, ValueError):
            close(agent, conn, notify=True, error="the host sent data that is not "
                  "base64")
            return

        def deliver() -> None:
            if conn.closed:
                return
            try:
                conn.sock.sendall(data)
            except OSError as exc:
                close(agent, conn, notify=True, error=exc.strerror)
                return
            if conn.command is None:
                agent.channel.send({"conn": conn.id, "ack": len(data)})
        if not conn.lane.submit(deliver, len(data)):
            close(agent, conn, notify=True, error=f"the guest side is not reading "
                  f"(over {CONN_PENDING} bytes pending)")
