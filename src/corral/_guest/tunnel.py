"""The egress tunnel's guest end: a command with an ``egress_port`` gets a listener on
``127.0.0.1:<port>`` in the guest (its proxy), and each connection to it is relayed to the host
(``{"conn", "op": "tcp.open", "port"}``), where the egress gateway applies the sandbox's policy.
The connections end with their command."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import TYPE_CHECKING

from .channel import Lane
from .conns import CONN_PENDING, Conn, close, relay_to_host
from .system import log

if TYPE_CHECKING:
    from .agent import Agent
    from .commands import Command

__all__ = ["close_for_command", "listen"]

MAX_CONNS_PER_COMMAND = 64


def listen(agent: Agent, command: Command, port: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        log(f"cannot listen on 127.0.0.1:{port} for command {command.id}: {exc.strerror}")
        return
    command.listener = sock
    threading.Thread(target=_accept, args=(agent, command, sock, port), daemon=True).start()


def _accept(agent: Agent, command: Command, listener: socket.socket, port: int) -> None:
    while not command.done.is_set():
        try:
            client, _ = listener.accept()
        except OSError:
            return  # the listener was shut down with the command
        if command.done.is_set() or len(command.conns) >= MAX_CONNS_PER_COMMAND:
            client.close()
            continue
        conn = Conn(agent.new_id(), client, command, Lane(CONN_PENDING))
        with agent.lock:
            agent.conns[conn.id] = conn
            command.conns.add(conn.id)
        threading.Thread(target=_conn_reader, args=(agent, conn, port), daemon=True).start()


def _conn_reader(agent: Agent, conn: Conn, port: int) -> None:
    agent.channel.send({"conn": conn.id, "op": "tcp.open", "port": port})
    if not conn.opened.wait(30) or conn.refused:
        close(agent, conn, notify=not conn.refused and not conn.closed,
              error="the host did not open the tunnel")
        return
    relay_to_host(agent, conn)


def close_for_command(agent: Agent, command: Command) -> None:
    if command.listener is not None:
        with contextlib.suppress(OSError):
            command.listener.shutdown(socket.SHUT_RDWR)
        command.listener.close()
    with agent.lock:
        conns = [agent.conns[c] for c in command.conns if c in agent.conns]
    for conn in conns:
        close(agent, conn, notify=not command.detached, error="the command ended")
