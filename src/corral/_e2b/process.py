"""envd's ``process.Process`` Connect service over the control plane's background processes.

Every Start is a declared background process (``ProcessTable``): it outlives the request, is
listed, reconnectable, audited as a command of the sandbox's tenant and counted against its
quotas. The stream follows its output; a client that goes away stops following, never the
process (E2B-COMPAT §6.5). What differs from Corral's own surface is E2B's: ``bash -l -c`` as
sent, ``/home/user`` as home and cwd, uint32 pids, ``connect-timeout-ms`` as the process's
deadline, and a kill reported as Go reports it (``exitCode -1``, ``"signal: killed"``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.routing import BaseRoute

from .._control.plane import BackgroundProcess, Manager
from ..errors import CommandError, CorralError, FileNotFound, PathRefused, SandboxNotFound
from . import paths
from .connect import ConnectError, client_stream, route, server_stream, unary
from .messages import (
    CloseStdin,
    ConnectProcess,
    InputChunk,
    Selector,
    SendInput,
    SendSignal,
    Start,
    StreamInputMessage,
    Update,
)
from .state import E2BState
from .target import SandboxTarget, target_of

__all__ = ["end_event", "requested_user", "routes", "timeout_of"]

Message = dict[str, Any]

KEEPALIVE: Message = {"event": {"keepalive": {}}}
# Who a command on this surface is: the sandbox's one unprivileged user.
_USER = "user"
_CONTEXT = {"surface": "e2b"}  # in the audit trail's command.started events


# -- pure: request parsing and the end event --------------------------------------------------


def requested_user(authorization: str | None) -> str:
    """The user named by ``Authorization: Basic base64("<user>:")`` (the sandbox's ``user``
    when none is named); ``root`` and unknown users are refused."""
    if not authorization:
        return _USER
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        raise ConnectError("unauthenticated", f"the Authorization header names a user with "
                           f"Basic base64('<user>:'), not {scheme!r}")
    try:
        name = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise ConnectError("unauthenticated", "the Authorization header is not valid "
                           "Basic base64('<user>:')") from None
    if name in ("", _USER):
        return _USER
    if name == "root":
        raise ConnectError("permission_denied", "Corral never runs commands as root: a "
                           f"sandbox has one unprivileged user, {_USER!r}; pass user='{_USER}' "
                           "(or none)")
    raise ConnectError("permission_denied", f"no user {name!r} in this sandbox: its only user "
                       f"is {_USER!r}; pass user='{_USER}' (or none)")


def timeout_of(header: str | None) -> float | None:
    """The process deadline in seconds from ``connect-timeout-ms`` (None: no limit)."""
    if header is None or header.strip() == "":
        return None
    raw = header.strip()
    if not raw.isdigit() or len(raw) > 10:
        raise ConnectError("invalid_argument", f"connect-timeout-ms must be 1 to 10 digits, "
                           f"got {raw[:20]!r}")
    millis = int(raw)
    return millis / 1000 if millis > 0 else None


def end_event(process: BackgroundProcess) -> Message:
    """The ``end`` event of an exited process, as envd (Go's ``os.ProcessState``) words it."""
    result = process.result
    if result is None:
        return {"event": {"end": {"exitCode": -1, "exited": False, "status": "error",
                                  "error": process.error or "the process did not run"}}}
    if process.signaled:
        return {"event": {"end": {"exitCode": -1, "exited": False,
                                  "status": "signal: killed"}}}
    code = result.exit_code
    return {"event": {"end": {"exitCode": code, "exited": True,
                              "status": f"exit status {code}"}}}


def _start_event(process: BackgroundProcess) -> Message:
    return {"event": {"start": {"pid": process.pid}}}


def _info(process: BackgroundProcess) -> Message:
    config: Message = {"cmd": process.argv[0], "args": process.argv[1:], "envs": process.envs}
    if process.cwd is not None:
        config["cwd"] = paths.to_e2b(process.cwd)
    info: Message = {"config": config, "pid": process.pid}
    if process.tag is not None:
        info["tag"] = process.tag
    return info


# -- the control plane, off the event loop ----------------------------------------------------


def _manager(request: Request) -> Manager:
    manager: Manager = request.app.state.manager
    return manager


def _cwd(manager: Manager, target: SandboxTarget, cwd: str | None) -> str:
    """The cwd to run in (``/home/user`` by default), refused as envd does when missing."""
    if cwd is None:
        return paths.HOME
    try:
        inside = paths.to_workspace(cwd)
    except PathRefused as exc:
        if not (isinstance(cwd, str) and cwd.startswith("/")):
            raise ConnectError("invalid_argument", f"cwd '{cwd}': {exc.message}") from None
        # Outside the workspace (`/`, `/tmp`): whether it exists and may be entered is the
        # sandbox's own answer, given by the tier's chdir inside it.
        return cwd
    try:
        entry = manager.files(target.sandbox_id).stat(inside)
    except FileNotFound:
        raise ConnectError("invalid_argument", f"cwd '{cwd}' does not exist") from None
    if entry.type != "dir":
        raise ConnectError("invalid_argument", f"cwd '{cwd}' is not a directory")
    return paths.to_e2b(inside)


def _start(manager: Manager, target: SandboxTarget, request: Start,
           timeout: float | None, state: E2BState) -> BackgroundProcess:
    config = request.process
    cwd = config.cwd
    run_in = _cwd(manager, target, cwd)
    # envd's environment: PATH (the sandbox's), HOME and USER of the user, the sandbox's
    # envVars from create, then the request's.
    environment = {"HOME": paths.HOME, "USER": _USER, **state.envs(target.sandbox_id),
                   **config.envs}
    try:
        process = manager.processes.start(
            target.sandbox_id, config.argv, envs=environment, cwd=run_in, context=_CONTEXT,
            caller=target.owner, pty=None if request.pty is None else request.pty.pair,
            timeout=timeout, tag=request.tag,
            lossless_output=True)  # envd's stream carries bytes, sent here byte for byte
    except CorralError as exc:
        # A start that failed in its thread carries the control plane's own error.
        cause = exc.__cause__
        raise (cause if isinstance(cause, CorralError) else exc) from None
    process.envs = dict(config.envs)  # List shows the request's envs, as envd does
    process.cwd = cwd
    if request.stdin is False and request.pty is None:
        process.close_input()
    return process


def _find(manager: Manager, target: SandboxTarget, selector: Selector) -> BackgroundProcess:
    pid, tag = selector.pid, selector.tag
    try:
        return manager.processes.find(target.sandbox_id, pid=pid, tag=tag)
    except CorralError:
        what = f"pid {pid}" if pid is not None else f"tag {tag!r}"
        raise ConnectError("not_found", f"process with {what} not found") from None


def _may_have_been_ended(process: BackgroundProcess) -> bool:
    """Whether the process may have died with its sandbox: it failed, was signalled (a
    destroy's SIGKILL, the lifetime's end) or exited with a signal's status."""
    result = process.result
    return result is None or process.signaled or result.exit_code >= 128


def _gone_check(manager: Manager, target: SandboxTarget) -> None:
    """Raise ``SandboxNotFound`` when the sandbox went away (so the stream ends ``unavailable``
    "...was not found", which the SDKs turn into SandboxNotRunningException)."""
    manager.get(target.sandbox_id)


# -- streams ----------------------------------------------------------------------------------


async def _follow(manager: Manager, target: SandboxTarget, process: BackgroundProcess,
                  position: int) -> AsyncIterator[Message]:
    """``start``, the output from ``position`` on, then the one ``end`` event."""
    yield _start_event(process)
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def notify() -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closing: nobody follows
            loop.call_soon_threadsafe(wake.set)

    unwatch = process.watch(notify)
    output_kind = "pty" if process.pty is not None else None
    try:
        while True:
            wake.clear()
            exited = process.state == "exited"  # before reading: then all output is in
            for at, stream, text in process.output(position, raw=True):
                position = at + len(text)
                if stream == "notice":  # output older than the kept window: nothing to send
                    continue
                data = base64.b64encode(text.encode("utf-8", "surrogateescape")).decode()
                yield {"event": {"data": {output_kind or stream: data}}}
            if exited:
                break
            await wake.wait()
    finally:
        unwatch()
    # A sandbox that ended under the process (kill, TTL) is a gone sandbox to the SDK, not a
    # command that died: the stream ends `unavailable` "...was not found", no end event. Only
    # a process that did not end on its own can have been ended so: one that exited with a
    # status below 128 ended first, and its end is the truth (no store read, no thread).
    if _may_have_been_ended(process):
        try:
            await run_in_threadpool(_gone_check, manager, target)
        except SandboxNotFound:
            raise SandboxNotFound(f"sandbox {target.e2b_id} ended while the process ran") \
                from None
    if process.deadline_passed and process.signaled:
        # envd ends a process killed at its connect-timeout-ms deadline with this error, not
        # an end event; older SDKs tell a timeout only from it.
        raise ConnectError("deadline_exceeded", "the command ran past its timeout and was "
                           "killed (pass timeout=0 for no limit)")
    yield end_event(process)


async def _start_stream(message: Message, request: Request) -> AsyncIterator[Message]:
    target = target_of(request)
    manager = _manager(request)
    requested_user(request.headers.get("authorization"))
    timeout = timeout_of(request.headers.get("connect-timeout-ms"))
    start = Start.read(message)
    try:
        process = await run_in_threadpool(_start, manager, target, start, timeout,
                                          request.app.state.e2b)
    except CommandError as exc:
        raise ConnectError("invalid_argument", exc.message) from None
    async for event in _follow(manager, target, process, 0):
        yield event


async def _connect_stream(message: Message, request: Request) -> AsyncIterator[Message]:
    target = target_of(request)
    manager = _manager(request)
    selected = ConnectProcess.read(message)
    process = await run_in_threadpool(_find, manager, target, selected.process)
    # Output from now on, no replay (envd's Connect); an exited process gets its end.
    async for event in _follow(manager, target, process, process.position):
        yield event


# -- unary ------------------------------------------------------------------------------------


async def _list(message: Message, request: Request) -> Message:
    target = target_of(request)
    processes = _manager(request).processes.list(target.sandbox_id)
    running = sorted((p for p in processes if p.state != "exited"), key=lambda p: p.pid)
    return {"processes": [_info(p) for p in running]}


async def _send_input(message: Message, request: Request) -> Message:
    target = target_of(request)
    sent = SendInput.read(message)
    process = await run_in_threadpool(_find, _manager(request), target, sent.process)
    await _write(process, sent.input)
    return {}


async def _write(process: BackgroundProcess, chunk: InputChunk) -> None:
    if chunk.kind == "pty" and process.pty is None:
        raise ConnectError("failed_precondition", f"process {process.pid} has no terminal; "
                           "send its input as stdin")
    try:
        await run_in_threadpool(process.send, chunk.data)
    except CorralError:
        raise ConnectError("not_found", f"process {process.pid} is not running") from None


async def _stream_input(messages: AsyncIterator[Message], request: Request) -> Message:
    target = target_of(request)
    manager = _manager(request)
    process: BackgroundProcess | None = None
    async for message in messages:
        part = StreamInputMessage.read(message)
        if part.start is not None:
            if process is not None:
                raise ConnectError("invalid_argument", "StreamInput takes one start message, "
                                   "first")
            process = await run_in_threadpool(_find, manager, target, part.start.process)
        elif part.data is not None:
            if process is None:
                raise ConnectError("invalid_argument", "StreamInput must begin with "
                                   '{"start": {"process": {"pid": N}}}')
            await _write(process, part.data)
    if process is None:
        raise ConnectError("invalid_argument", "StreamInput sent no start message")
    return {}


async def _send_signal(message: Message, request: Request) -> Message:
    target = target_of(request)
    manager = _manager(request)
    signalled = SendSignal.read(message)  # SIGKILL or SIGTERM: both handled alike below
    process = await run_in_threadpool(_find, manager, target, signalled.process)
    if process.state == "exited":
        raise ConnectError("not_found", f"process {process.pid} is not running")
    # Both end the whole process tree at once (the cgroup's kill): nothing inside may outlive
    # its command, so a SIGTERM is not left to the process to honour.
    try:
        await run_in_threadpool(manager.processes.kill, target.sandbox_id, process.id)
    except CorralError:
        raise ConnectError("not_found", f"process {process.pid} is not running") from None
    return {}


async def _close_stdin(message: Message, request: Request) -> Message:
    target = target_of(request)
    closing = CloseStdin.read(message)
    process = await run_in_threadpool(_find, _manager(request), target, closing.process)
    if process.pty is not None:
        raise ConnectError("failed_precondition", f"process {process.pid} runs on a terminal, "
                           "which has no stdin to close; send Ctrl-D (0x04) as pty input")
    if process.state == "exited":
        raise ConnectError("not_found", f"process {process.pid} is not running")
    await run_in_threadpool(process.close_input)
    return {}


async def _update(message: Message, request: Request) -> Message:
    target = target_of(request)
    update = Update.read(message)
    process = await run_in_threadpool(_find, _manager(request), target, update.process)
    if update.pty is None:
        return {}  # nothing to change
    try:
        await run_in_threadpool(process.resize, *update.pty.pair)
    except CorralError as exc:
        code = "not_found" if process.state == "exited" else "failed_precondition"
        raise ConnectError(code, exc.message) from None
    return {}


routes: list[BaseRoute] = [
    route("process.Process/Start", server_stream(_start_stream, keepalive=KEEPALIVE)),
    route("process.Process/Connect", server_stream(_connect_stream, keepalive=KEEPALIVE)),
    route("process.Process/List", unary(_list)),
    route("process.Process/SendInput", unary(_send_input)),
    route("process.Process/StreamInput", client_stream(_stream_input)),
    route("process.Process/SendSignal", unary(_send_signal)),
    route("process.Process/CloseStdin", unary(_close_stdin)),
    route("process.Process/Update", unary(_update)),
]
