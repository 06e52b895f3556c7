"""The lifecycle ops: ``ping``; ``resume`` after a snapshot restore (fresh randomness, clock,
hostname, and the old session's commands, handles and connections let go); ``mount`` and
``unmount`` of the workspace disk; ``sync``; ``fsfreeze`` around a snapshot."""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import fcntl
import os
import socket
import struct
import time
from typing import TYPE_CHECKING

from . import conns
from .config import USER_ID
from .protocol import AgentError, Message
from .system import (
    BLKFLSBUF,
    FIFREEZE,
    FITHAW,
    MS_BIND,
    MS_NODEV,
    MS_NOSUID,
    RNDADDENTROPY,
    RNDRESEEDCRNG,
    mount,
    syncfs,
    umount,
    write_text,
)

if TYPE_CHECKING:
    from .agent import Agent

__all__ = ["INLINE_OPS", "THREADED_OPS"]


def _op_ping(agent: Agent, rid: int, request: Message) -> None:
    agent.reply(rid, True)


def _op_resume(agent: Agent, rid: int, request: Message) -> None:
    seed_text = request.get("seed")
    time_ns = request.get("time_ns")
    hostname = request.get("hostname", "sandbox")
    try:
        seed = base64.b64decode(seed_text if isinstance(seed_text, str) else "!", validate=True)
    except (binascii.Error, ValueError):
        raise AgentError("protocol", "resume: 'seed' must be base64") from None
    if len(seed) != 64:
        raise AgentError("protocol", "resume: 'seed' must be 64 bytes")
    if not isinstance(time_ns, int) or isinstance(time_ns, bool) or time_ns <= 0:
        raise AgentError("protocol", "resume: 'time_ns' must be an integer > 0")
    if not isinstance(hostname, str) or not 0 < len(hostname) <= 64:
        raise AgentError("protocol", "resume: 'hostname' must be 1..64 characters")
    # The restored kernel's pool is the snapshot's, shared by every sibling: mix in fresh bytes.
    # Credited bytes only reach the input pool; the generator that getrandom() reads reseeds
    # from it on its own schedule (seconds to a minute), so siblings would keep drawing the
    # same stream until then. Force the reseed now.
    info = struct.pack("ii", len(seed) * 8, len(seed)) + seed
    try:
        with open("/dev/urandom", "wb", buffering=0) as f:
            fcntl.ioctl(f.fileno(), RNDADDENTROPY, info)
            fcntl.ioctl(f.fileno(), RNDRESEEDCRNG)
    except OSError as exc:
        raise AgentError("io", f"cannot reseed the RNG: {exc.strerror}") from None
    if agent.config.strict:
        time.clock_settime_ns(time.CLOCK_REALTIME, time_ns)
        socket.sethostname(hostname)
        if agent.config.disk is not None and os.path.exists(agent.config.disk):
            fd = os.open(agent.config.disk, os.O_RDONLY | os.O_CLOEXEC)
            try:
                fcntl.ioctl(fd, BLKFLSBUF)
            finally:
                os.close(fd)
    sandbox_id = request.get("sandbox_id")
    # A wake from hibernation keeps its commands for the host to ``attach`` to again; any
    # other restore (a memory snapshot's or fork's) leaves them running as orphans.
    keep = request.get("keep_commands") is True
    with agent.lock:
        agent.session += 1
        commands = [] if keep else list(agent.commands.values())
        if keep:
            for command in agent.commands.values():  # held until the host attaches
                with command.lock:
                    command.held = []
        else:
            agent.commands.clear()
        handles = list(agent.handles.items())
        open_conns = list(agent.conns.values())
    for command in commands:  # they keep running as orphans, reported by no one
        command.detached = True
    for hid, handle in handles:
        agent.drop_handle(hid, handle)
    for conn in open_conns:
        conns.close(agent, conn, notify=False)
    if isinstance(sandbox_id, str):
        with contextlib.suppress(OSError):
            os.makedirs("/run/corral", exist_ok=True)
            write_text("/run/corral/sandbox_id", sandbox_id)
    agent.reply(rid, True)


def _op_mount(agent: Agent, rid: int, request: Message) -> None:
    fresh = request.get("fresh")
    if not isinstance(fresh, bool):
        raise AgentError("protocol", "mount: 'fresh' must be true or false")
    disk = agent.config.disk
    if disk is None:
        raise AgentError("io", "this agent has no workspace disk (test mode)")
    workspace = agent.config.workspace
    try:
        mount(disk, workspace, "ext4", MS_NOSUID | MS_NODEV)
        if fresh:
            os.chown(workspace, USER_ID, USER_ID)
            os.chmod(workspace, 0o755)
        if agent.config.home is not None:
            mount(workspace, agent.config.home, None, MS_BIND)
    except OSError as exc:
        raise AgentError("io", f"cannot mount the workspace: {exc}") from None
    agent.reply(rid, True)


def _op_unmount(agent: Agent, rid: int, request: Message) -> None:
    with agent.lock:
        if agent.commands:
            raise AgentError("busy", "commands are running; the workspace stays mounted")
    try:
        syncfs(agent.config.workspace)
        if agent.config.home is not None:
            umount(agent.config.home)
        umount(agent.config.workspace)
    except OSError as exc:
        kind = "busy" if exc.errno == errno.EBUSY else "io"
        raise AgentError(kind, f"cannot unmount the workspace: {exc}") from None
    agent.reply(rid, True)


def _op_sync(agent: Agent, rid: int, request: Message) -> None:
    try:
        syncfs(agent.config.workspace)
    except OSError as exc:
        raise AgentError("io", f"cannot sync the workspace: {exc.strerror}") from None
    agent.reply(rid, True)


def _op_fsfreeze(agent: Agent, rid: int, request: Message) -> None:
    frozen = request.get("frozen")
    if not isinstance(frozen, bool):
        raise AgentError("protocol", "fsfreeze: 'frozen' must be true or false")
    fd = os.open(agent.config.workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, FIFREEZE if frozen else FITHAW, 0)
    except OSError as exc:
        # Already in the asked state: EBUSY to freeze, EINVAL to thaw.
        if exc.errno != (errno.EBUSY if frozen else errno.EINVAL):
            raise AgentError("io", f"cannot {'freeze' if frozen else 'thaw'} the workspace: "
                             f"{exc.strerror}") from None
    finally:
        os.close(fd)
    agent.reply(rid, True)


INLINE_OPS = {"ping": _op_ping}
THREADED_OPS = {"resume": _op_resume, "mount": _op_mount, "unmount": _op_unmount,
                "sync": _op_sync, "fsfreeze": _op_fsfreeze}
