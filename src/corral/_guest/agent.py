"""The agent's state: the channel, the running commands, open write handles and connections,
and the replies every op sends. The ops live by job in ``exec``, ``commands``, ``fs``,
``tunnel``, ``ports`` and ``lifecycle``; ``dispatch`` routes each line to one."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import TYPE_CHECKING, Any

from .channel import Channel
from .config import Config
from .protocol import AGENT_VERSION, AgentError, Message
from .system import log, write_text
from .workspace import Files, WriteHandle

if TYPE_CHECKING:
    from .commands import Command
    from .conns import Conn

__all__ = ["MAX_INFLIGHT", "Agent"]

MAX_INFLIGHT = 64


class Agent:
    """What every op works on; ``lock`` guards the tables."""

    def __init__(self, config: Config, channel: Channel) -> None:
        self.config = config
        self.channel = channel
        self.files = Files(config.workspace)
        self.lock = threading.Lock()
        self.commands: dict[int, Command] = {}
        self.handles: dict[int, WriteHandle] = {}
        self.conns: dict[int, Conn] = {}
        # Execs between their request and ``started``, and the kills that arrived meanwhile.
        self.starting: set[int] = set()
        self.kill_pending: set[int] = set()
        self.cmd_root = os.path.join(config.cgroup_root, "cmd")
        self.inflight = threading.BoundedSemaphore(MAX_INFLIGHT)
        self._next = 0
        self.session = 0
        # The guest's /tmp is made 64 MiB at boot (init.c); sized to the tier's on first exec.
        self.tmp_lock = threading.Lock()
        self.tmp_size = 64 << 20

    def new_id(self) -> int:
        with self.lock:
            self._next += 1
            return self._next

    # -- setup and replies

    def setup(self) -> None:
        try:
            write_text("/proc/self/oom_score_adj", "-1000")
        except OSError as exc:
            log(f"cannot set oom_score_adj: {exc.strerror}")
        os.makedirs(self.cmd_root, exist_ok=True)
        try:
            write_text(os.path.join(self.cmd_root, "cgroup.subtree_control"), "+pids +memory +cpu")
        except OSError as exc:
            (log if self.config.strict else lambda _t: None)(
                f"cannot enable controllers for commands: {exc.strerror}")

    def ready(self) -> None:
        self.channel.send({"id": 0, "ready": {"release": os.uname().release,
                                              "agent": AGENT_VERSION}})

    def shutdown(self) -> None:
        with self.lock:
            commands = list(self.commands.values())
        for command in commands:
            command.kill_tree()
        for command in commands:
            command.done.wait(10)

    def reply(self, rid: Any, ok: Any) -> None:
        self.channel.send({"id": rid, "ok": ok})

    def fail(self, rid: Any, kind: str, message: str) -> None:
        self.channel.send({"id": rid, "error": {"kind": kind, "message": message}})

    def running(self, request: Message) -> Command | None:
        target, tag = request.get("target"), request.get("tag")
        with self.lock:
            if isinstance(tag, str):
                return next((c for c in self.commands.values() if c.tag == tag), None)
            return self.commands.get(target) if isinstance(target, int) else None

    def handle(self, request: Message) -> tuple[int, WriteHandle]:
        hid = request.get("handle")
        with self.lock:
            handle = self.handles.get(hid) if isinstance(hid, int) else None
        if handle is None or not isinstance(hid, int):
            raise AgentError("protocol", f"no open write handle {hid!r} (it ended, failed or "
                             "was aborted)")
        return hid, handle

    def drop_handle(self, hid: int, handle: WriteHandle) -> None:
        with self.lock:
            self.handles.pop(hid, None)
        Files.write_abort(handle)
        with contextlib.suppress(OSError):
            os.close(handle.dir_fd)
        handle.lane.close()
