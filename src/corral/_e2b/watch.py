"""Directory watching on the E2B surface: the streaming ``WatchDir`` (async Python SDK, JS) and
the polling ``CreateWatcher`` / ``GetWatcherEvents`` / ``RemoveWatcher`` (sync Python SDK),
E2B-COMPAT §6.4, over the backend's ``WatchableFS`` capability (inotify on the host tiers).

Both forms wait on the watch's descriptor with the event loop's ``add_reader``, so a watch
holds no thread. Polling watchers are kept per sandbox, bounded in number and in buffered
events, and closed when they go unpolled for ``IDLE_S`` (a gone sandbox is never polled again:
its watchers go with it) or when their sandbox's workspace goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.routing import BaseRoute

from .._control.plane import AuditedFiles
from ..backends import DirWatch, WatchEvent
from ..errors import FileError
from . import filesystem as fs
from .connect import ConnectError, route, server_stream, unary
from .messages import WatchDir, WatcherRequest
from .target import target_of

__all__ = ["IDLE_S", "MAX_BUFFERED", "MAX_PER_SANDBOX", "Watchers", "routes"]

logger = logging.getLogger(__name__)

MAX_PER_SANDBOX = 16
MAX_WATCHERS = 1024
MAX_BUFFERED = 4096
IDLE_S = 600.0
_SWEEP_S = 30.0
_EVENT_TYPES = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE",
                "remove": "EVENT_TYPE_REMOVE", "rename": "EVENT_TYPE_RENAME",
                "chmod": "EVENT_TYPE_CHMOD"}


async def _open(message: dict[str, Any], request: Request
                ) -> tuple[AuditedFiles, str, DirWatch, bool]:
    asked = WatchDir.read(message)
    path, recursive, include = asked.path, asked.recursive, asked.include_entry
    files = await fs.open_files(request)

    def start() -> DirWatch:
        entry = files.stat(path)
        if entry.type != "dir":
            raise FileError(f"{path} is not a directory; only directories can be watched")
        return files.watch(path, recursive=recursive)

    return files, path, await fs.call(start), include


def _event(files: AuditedFiles, root: str, event: WatchEvent, include: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"name": event.name, "type": _EVENT_TYPES[event.op]}
    if include and event.op not in ("remove", "rename"):
        with contextlib.suppress(FileError):
            out["entry"] = fs.described(files, files.stat(f"{root}/{event.name}"))
    return out


async def _readable(fd: int, timeout: float | None) -> None:
    """Until ``fd`` is readable or ``timeout`` passes."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await asyncio.wait_for(ready, timeout)
    except TimeoutError:
        pass
    finally:
        loop.remove_reader(fd)


def _deadline(request: Request) -> float | None:
    raw = request.headers.get("connect-timeout-ms", "")
    if raw.isdigit() and 0 < len(raw) <= 10 and int(raw) > 0:
        return time.monotonic() + int(raw) / 1000
    return None


async def watch_dir(message: dict[str, Any], request: Request) -> AsyncIterator[dict[str, Any]]:
    files, root, handle, include = await _open(message, request)
    deadline = _deadline(request)
    try:
        yield {"start": {}}
        while True:
            for event in handle.read():
                yield {"filesystem": _event(files, root, event, include)}
            if handle.ended:
                return  # the directory is gone: the stream ends cleanly, like envd's
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return  # the SDK's own timeout: it stops waiting then anyway
            await _readable(handle.fileno(), left)
    finally:
        handle.close()


# -- polling watchers ----------------------------------------------------------------------------


@dataclass
class _Watcher:
    id: str
    sandbox_id: str
    root: str
    files: AuditedFiles
    handle: DirWatch
    include: bool
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_BUFFERED))
    dropped: int = 0
    polled: float = field(default_factory=time.monotonic)


class Watchers:
    """The polling watchers of one E2B app, all on its event loop."""

    def __init__(self) -> None:
        self._watchers: dict[str, _Watcher] = {}
        self._sweeper: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._watchers)

    def add(self, sandbox_id: str, root: str, files: AuditedFiles, handle: DirWatch,
            include: bool) -> str:
        self.sweep()
        mine = sum(1 for w in self._watchers.values() if w.sandbox_id == sandbox_id)
        if mine >= MAX_PER_SANDBOX or len(self._watchers) >= MAX_WATCHERS:
            handle.close()
            raise ConnectError("resource_exhausted", f"this sandbox already has {mine} "
                               "watchers; stop one (WatchHandle.stop()) before starting "
                               "another")
        watcher = _Watcher(id=secrets.token_hex(8), sandbox_id=sandbox_id, root=root,
                           files=files, handle=handle, include=include)
        self._watchers[watcher.id] = watcher
        loop = asyncio.get_running_loop()
        loop.add_reader(handle.fileno(), self._drain, watcher)
        if self._sweeper is None:
            self._sweeper = loop.call_later(_SWEEP_S, self._scheduled_sweep)
        return watcher.id

    def _drain(self, watcher: _Watcher) -> None:
        # Read as events come, so a recursive watch follows new directories at once.
        for event in watcher.handle.read():
            if len(watcher.events) == watcher.events.maxlen:
                watcher.dropped += 1  # the oldest goes: a slow poller sees the latest
            watcher.events.append(_event(watcher.files, watcher.root, event, watcher.include))
        if watcher.handle.ended:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(watcher.handle.fileno())

    def take(self, sandbox_id: str, watcher_id: str) -> list[dict[str, Any]]:
        watcher = self._get(sandbox_id, watcher_id)
        self._drain(watcher)
        watcher.polled = time.monotonic()
        events = list(watcher.events)
        watcher.events.clear()
        if watcher.dropped:
            logger.info("watcher %s dropped %d events nobody polled", watcher_id,
                        watcher.dropped)
            watcher.dropped = 0
        return events

    def remove(self, sandbox_id: str, watcher_id: str) -> None:
        self._close(self._get(sandbox_id, watcher_id))

    def _get(self, sandbox_id: str, watcher_id: str) -> _Watcher:
        watcher = self._watchers.get(watcher_id)
        if watcher is None or watcher.sandbox_id != sandbox_id:  # another sandbox's: unknown
            raise ConnectError("not_found", f"watcher {watcher_id[:40]!r} not found (stopped, "
                               f"or unpolled for over {IDLE_S:.0f} s)")
        return watcher

    def _close(self, watcher: _Watcher) -> None:
        self._watchers.pop(watcher.id, None)
        with contextlib.suppress(ValueError, OSError, RuntimeError):
            asyncio.get_running_loop().remove_reader(watcher.handle.fileno())
        watcher.handle.close()

    def sweep(self) -> None:
        now = time.monotonic()
        for watcher in list(self._watchers.values()):
            if now - watcher.polled > IDLE_S:
                self._close(watcher)

    def _scheduled_sweep(self) -> None:
        self._sweeper = None
        self.sweep()
        if self._watchers:
            self._sweeper = asyncio.get_running_loop().call_later(_SWEEP_S,
                                                                  self._scheduled_sweep)

    def close(self) -> None:
        for watcher in list(self._watchers.values()):
            self._close(watcher)
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None


def _watchers(request: Request) -> Watchers:
    state = request.app.state
    found = getattr(state, "e2b_watchers", None)
    if not isinstance(found, Watchers):
        found = Watchers()
        state.e2b_watchers = found
    return found


def _watcher_id(message: dict[str, Any]) -> str:
    return WatcherRequest.read(message).watcher_id


async def create_watcher(message: dict[str, Any], request: Request) -> dict[str, Any]:
    files, root, handle, include = await _open(message, request)
    sandbox_id = target_of(request).sandbox_id
    return {"watcherId": _watchers(request).add(sandbox_id, root, files, handle, include)}


async def get_watcher_events(message: dict[str, Any], request: Request) -> dict[str, Any]:
    events = _watchers(request).take(target_of(request).sandbox_id, _watcher_id(message))
    return {"events": [{"name": e["name"], "type": e["type"],
                        **({"entry": e["entry"]} if "entry" in e else {})} for e in events]}


async def remove_watcher(message: dict[str, Any], request: Request) -> dict[str, Any]:
    _watchers(request).remove(target_of(request).sandbox_id, _watcher_id(message))
    return {}


routes: list[BaseRoute] = [
    route("filesystem.Filesystem/WatchDir", server_stream(watch_dir,
                                                          keepalive={"keepalive": {}})),
    route("filesystem.Filesystem/CreateWatcher", unary(create_watcher)),
    route("filesystem.Filesystem/GetWatcherEvents", unary(get_watcher_events)),
    route("filesystem.Filesystem/RemoveWatcher", unary(remove_watcher)),
]
