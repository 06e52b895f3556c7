"""Port connections: ``{"conn", "op": "tcp.connect", "port", "timeout"}`` from the host makes
the agent connect to ``127.0.0.1:<port>`` in the guest and answer ``{"conn", "opened": true}`` or
``{"conn", "closed": true, "error", "kind"}`` (kind ``port_closed`` when nothing accepts in time,
``busy`` past ``MAX_PORT_CONNS``); then they flow as ``conns`` says. They belong to no command
and end with the VM (or a ``resume``)."""

from __future__ import annotations

import errno
import socket
import threading
from typing import TYPE_CHECKING

from .channel import Lane
from .conns import CONN_PENDING, Conn, close, relay_to_host
from .protocol import Message

if TYPE_CHECKING:
    from .agent import Agent

__all__ = ["MAX_PORT_CONNS", "connect"]

MAX_PORT_CONNS = 256


def connect(agent: Agent, message: Message) -> None:
    """Register the connection at once, so a ``closed`` the host sends while it is being
    made finds it; connect on a thread of its own (a full backlog can take seconds)."""
    cid, port, timeout = message.get("conn"), message.get("port"), message.get("timeout", 5)
    if not isinstance(cid, int) or isinstance(cid, bool) or cid >= 0:
        agent.fail(None, "protocol", "tcp.connect: 'conn' must be a negative integer (the "
                   "host's ids; the guest's own are positive)")
        return
    with agent.lock:
        taken = cid in agent.conns
        open_ports = sum(c.command is None for c in agent.conns.values())
    if taken:  # never a ``closed`` for it: the host would take it for the live one's
        agent.fail(None, "protocol", f"tcp.connect: conn {cid} is already open")
        return

    def refuse(kind: str, text: str) -> None:
        agent.channel.send({"conn": cid, "closed": True, "kind": kind, "error": text})

    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        refuse("protocol", "tcp.connect: 'port' must be a TCP port")
        return
    if (not isinstance(timeout, int | float) or isinstance(timeout, bool)
            or not 0 < timeout <= 300):
        refuse("protocol", "tcp.connect: 'timeout' must be seconds in (0, 300]")
        return
    if open_ports >= MAX_PORT_CONNS:
        refuse("busy", f"{MAX_PORT_CONNS} port connections are open, the most a microVM "
               "may have")
        return
    conn = Conn(cid, socket.socket(socket.AF_INET, socket.SOCK_STREAM), None,
                Lane(CONN_PENDING))
    with agent.lock:
        agent.conns[cid] = conn
    threading.Thread(target=_port_open, args=(agent, conn, port, float(timeout)),
                     daemon=True).start()


def _port_open(agent: Agent, conn: Conn, port: int, timeout: float) -> None:
    try:
        conn.sock.settimeout(timeout)
        conn.sock.connect(("127.0.0.1", port))
        conn.sock.settimeout(None)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError as exc:
        timed_out = isinstance(exc, TimeoutError)
        closed = timed_out or exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET)
        close(agent, conn, notify=True, kind="port_closed" if closed else "io",
              error="timed out" if timed_out else (exc.strerror or str(exc)))
        return
    with agent.lock:
        if conn.closed:  # the host gave up meanwhile
            return
        conn.opened.set()
    agent.channel.send({"conn": conn.id, "opened": True})
    relay_to_host(agent, conn)
