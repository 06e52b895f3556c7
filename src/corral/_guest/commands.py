"""A running command (``Command``) and the ops on it: ``stdin``, ``stdin_close`` and
``resize`` (through its stdin lane, in order), ``signal``, ``kill``, ``procs``, ``freeze`` and
``attach`` (a new connection takes a command over, after a wake from hibernation). A
command is named by ``target`` (the exec's id) or ``tag`` (the host's command id: a kill from
another host process names it)."""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import os
import socket
import struct
import subprocess
import termios
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .channel import Channel, Lane
from .protocol import AgentError, Message
from .system import cgroup_pids, log, write_text

if TYPE_CHECKING:
    from .agent import Agent

__all__ = ["OPS", "STDIN_PENDING", "Command", "command_pid", "remove_cgroup"]

STDIN_PENDING = 8 << 20


@dataclass
class Command:
    id: int
    cgroup: str
    proc: subprocess.Popen[bytes]
    pid: int
    leader: int | None
    master: int | None = None
    stdin: int | None = None
    stdin_lane: Lane | None = None
    killed: bool = False
    detached: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    listener: socket.socket | None = None
    conns: set[int] = field(default_factory=set)
    tag: str | None = None  # the host's command id: a kill from another host process names it
    # What it would have sent while a wake from hibernation waits for the host to ``attach``
    # (None: it sends at once). Its id changes at the attach: both under ``lock``.
    held: list[Message] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def emit(self, channel: Channel, fields: Message) -> None:
        """Send ``fields`` as this command's message, or hold it for the host's attach."""
        with self.lock:
            if self.held is not None:
                self.held.append(fields)
            else:
                channel.send({"id": self.id, **fields})

    def close_fds(self) -> None:
        """Close stdin and the PTY; only ever run on the stdin lane."""
        for fd in {self.master, self.stdin} - {None}:
            assert fd is not None
            with contextlib.suppress(OSError):
                os.close(fd)
        self.master = self.stdin = None

    def kill_tree(self) -> None:
        with contextlib.suppress(OSError):
            write_text(os.path.join(self.cgroup, "cgroup.kill"), "1")


def command_pid(cgroup: str) -> int | None:
    """The command's pid here: the process of its group that is pid 2 of its namespace
    (1 is the launcher's init); it leads the command's session and process group."""
    for pid in cgroup_pids(cgroup):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        if line.split()[-1] == "2":
                            return pid
                        break
        except OSError:
            continue
    return None


def remove_cgroup(path: str) -> None:
    for _ in range(200):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
    log(f"cannot remove cgroup {path}")


def _op_stdin(agent: Agent, rid: int, request: Message) -> None:
    command = agent.running(request)
    data_text = request.get("data")
    if not isinstance(data_text, str):
        raise AgentError("protocol", "stdin: 'data' must be base64 text")
    try:
        data = base64.b64decode(data_text, validate=True)
    except (binascii.Error, ValueError):
        raise AgentError("protocol", "stdin: 'data' is not base64") from None
    if command is None or command.stdin_lane is None:
        agent.reply(rid, False)
        return
    target = command

    def deliver() -> None:
        fd = target.stdin
        if fd is None:
            agent.reply(rid, False)
            return
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            agent.reply(rid, True)
        except OSError:  # the command closed its stdin or ended
            agent.reply(rid, False)
    if not command.stdin_lane.submit(deliver, len(data)):
        agent.fail(rid, "busy", f"the command is not reading its stdin (over {STDIN_PENDING} "
                   "bytes pending); wait for earlier writes to be acknowledged")


def _op_stdin_close(agent: Agent, rid: int, request: Message) -> None:
    command = agent.running(request)
    if command is None or command.stdin_lane is None:
        agent.reply(rid, False)
        return
    target = command

    def close() -> None:
        if target.master is not None:
            # A PTY has no half-close: the line discipline's EOF character (^D) is its end.
            with contextlib.suppress(OSError):
                os.write(target.master, b"\x04")
        elif target.stdin is not None:
            with contextlib.suppress(OSError):
                os.close(target.stdin)
            target.stdin = None
        agent.reply(rid, True)
    command.stdin_lane.submit(close, 0)


def _op_resize(agent: Agent, rid: int, request: Message) -> None:
    rows, cols = request.get("rows"), request.get("cols")
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 < n < 65536
               for n in (rows, cols)):
        raise AgentError("protocol", "resize: 'rows' and 'cols' must be integers 1..65535")
    command = agent.running(request)
    if command is None or command.master is None or command.stdin_lane is None:
        agent.reply(rid, False)
        return
    target = command

    def resize() -> None:
        if target.master is None:
            agent.reply(rid, False)
            return
        try:
            fcntl.ioctl(target.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        except OSError:
            agent.reply(rid, False)
            return
        agent.reply(rid, True)
    command.stdin_lane.submit(resize, 0)


def _op_signal(agent: Agent, rid: int, request: Message) -> None:
    number = request.get("signal")
    if not isinstance(number, int) or isinstance(number, bool) or not 0 < number < 65:
        raise AgentError("protocol", "signal: 'signal' must be a signal number 1..64")
    command = agent.running(request)
    if command is None:
        agent.reply(rid, False)
        return
    leader = command.leader or command_pid(command.cgroup)
    if leader is None:  # never the launcher: its death would end the command's accounting
        agent.reply(rid, False)
        return
    command.leader = leader
    try:
        os.killpg(leader, number)
    except ProcessLookupError:
        try:  # it left its process group: the command itself still gets it
            os.kill(leader, number)
        except ProcessLookupError:
            agent.reply(rid, False)
            return
    agent.reply(rid, True)


def _op_kill(agent: Agent, rid: int, request: Message) -> None:
    command = agent.running(request)
    if command is None:
        with agent.lock:
            starting = request.get("target") in agent.starting
            if starting:
                agent.kill_pending.add(request["target"])
        agent.reply(rid, starting)  # a command still starting dies as soon as it is placed
        return
    command.killed = True
    command.kill_tree()
    agent.reply(rid, True)


def _op_attach(agent: Agent, rid: int, request: Message) -> None:
    """Give a running command (named by ``tag``) to this request: after a wake from
    hibernation the host's new connection gets its output and its exit from here on, and
    ``started`` again first. Output it wrote meanwhile was none: it was frozen, then saved."""
    tag = request.get("tag")
    if not isinstance(tag, str):
        raise AgentError("protocol", "attach: 'tag' must be the command's tag")
    with agent.lock:
        command = next((c for c in agent.commands.values() if c.tag == tag), None)
        if command is not None and agent.commands.get(rid, command) is not command:
            raise AgentError("protocol", f"attach: id {rid} is another command's")
        if command is not None:
            del agent.commands[command.id]
            agent.commands[rid] = command
    if command is None:
        raise AgentError("not_found", f"no running command is tagged {tag!r} (it ended)")
    with command.lock:
        command.id = rid  # what its output and exit are sent under from now on
        held, command.held = command.held or [], None
        agent.channel.send({"id": rid, "started": {"pid": command.pid}})
        for fields in held:  # what it wrote between the wake and now, in order
            agent.channel.send({"id": rid, **fields})
    if any("exit" in fields for fields in held):
        with agent.lock:
            if agent.commands.get(rid) is command:
                del agent.commands[rid]


def _op_procs(agent: Agent, rid: int, request: Message) -> None:
    with agent.lock:
        known = {c.cgroup: c.id for c in agent.commands.values()}
    orphans = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(agent.cmd_root):
            path = os.path.join(agent.cmd_root, name)
            if os.path.isdir(path) and path not in known:
                orphans += len(cgroup_pids(path))
    agent.reply(rid, {"commands": sorted(known.values()), "orphans": orphans})


def _op_freeze(agent: Agent, rid: int, request: Message) -> None:
    frozen = request.get("frozen")
    if not isinstance(frozen, bool):
        raise AgentError("protocol", "freeze: 'frozen' must be true or false")
    try:
        _freeze_groups(agent, frozen)
    except OSError as exc:
        raise AgentError("io", f"cannot {'freeze' if frozen else 'thaw'} the commands: "
                         f"{exc.strerror}") from None
    agent.reply(rid, True)


def _freeze_groups(agent: Agent, frozen: bool) -> None:
    for name in sorted(os.listdir(agent.cmd_root)):
        path = os.path.join(agent.cmd_root, name, "cgroup.freeze")
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            write_text(path, "1" if frozen else "0")


OPS = {"attach": _op_attach, "stdin": _op_stdin, "stdin_close": _op_stdin_close,
       "resize": _op_resize, "signal": _op_signal, "kill": _op_kill, "procs": _op_procs,
       "freeze": _op_freeze}
