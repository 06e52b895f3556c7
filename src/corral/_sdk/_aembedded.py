"""The async embedded transport: ``EmbeddedTransport``'s calls, each in a worker thread (the
control plane blocks: SQLite, flock, waiting for a command), so the event loop never does."""

from __future__ import annotations

import builtins
import functools
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, ParamSpec, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread

from .._audit.log import AuditTrail
from ..backends import OutputCallback
from ..models import (
    CodeContext,
    CommandResult,
    Execution,
    FileEntry,
    PortInfo,
    SandboxInfo,
    SnapshotInfo,
    VolumeInfo,
)
from ._embedded import EmbeddedTransport, embedded_target
from ._wire import AsyncCodeCallback, AsyncOutputCallback, CodeItem, ProcessInfo, adeliver

if TYPE_CHECKING:
    from .._control.manager import Manager
    from .._control.tenants import Tenant
    from ._async.transport import AsyncTransport

__all__ = ["AsyncEmbeddedTransport", "aopen_transport", "ausing_transport"]

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _forward(callback: AsyncOutputCallback | None,
             abandoned: threading.Event) -> OutputCallback | None:
    """A callback for the worker thread that runs ``callback`` on the event loop (so user code
    never runs in a foreign thread), in order, waiting for it (backpressure)."""
    if callback is None:
        return None

    def forward(text: str) -> None:
        if abandoned.is_set():
            return
        try:
            anyio.from_thread.run(adeliver, callback, text)
        except RuntimeError:
            if not abandoned.is_set():  # else: the caller is gone, maybe its loop too
                raise

    return forward


def _forward_code(callback: AsyncCodeCallback | None,
                  abandoned: threading.Event) -> Callable[[CodeItem], None] | None:
    """``_forward`` for a cell's callback items."""
    if callback is None:
        return None

    def forward(item: CodeItem) -> None:
        if abandoned.is_set():
            return
        try:
            anyio.from_thread.run(adeliver, callback, item)
        except RuntimeError:
            if not abandoned.is_set():
                raise

    return forward


class AsyncEmbeddedTransport:
    """``EmbeddedTransport``'s calls, each in a worker thread."""

    def __init__(self, manager: Manager, *, caller: Tenant | None = None) -> None:
        self.sync = EmbeddedTransport(manager, caller=caller)

    @staticmethod
    async def _call(func: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return await anyio.to_thread.run_sync(functools.partial(func, *args, **kwargs))

    def sibling(self) -> AsyncEmbeddedTransport:
        return self

    async def create(self, **kwargs: Any) -> SandboxInfo:
        return await self._call(self.sync.create, **kwargs)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await self._call(self.sync.get, sandbox_id)

    async def list(self) -> builtins.list[SandboxInfo]:
        return await self._call(self.sync.list)

    async def destroy(self, sandbox_id: str) -> None:
        await self._call(self.sync.destroy, sandbox_id)

    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        return await self._call(self.sync.set_timeout, sandbox_id, timeout)

    async def set_network(self, sandbox_id: str, network: Any) -> SandboxInfo:
        return await self._call(self.sync.set_network, sandbox_id, network)

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        return await self._call(self.sync.pause, sandbox_id)

    async def expose_port(self, sandbox_id: str, port: int, *, public: bool,
                          link_ttl: float | None) -> PortInfo:
        return await self._call(self.sync.expose_port, sandbox_id, port, public=public,
                                link_ttl=link_ttl)

    async def list_ports(self, sandbox_id: str) -> builtins.list[PortInfo]:
        return await self._call(self.sync.list_ports, sandbox_id)

    async def unexpose_port(self, sandbox_id: str, port: int) -> None:
        await self._call(self.sync.unexpose_port, sandbox_id, port)

    async def create_volume(self, name: str, size: int | str) -> VolumeInfo:
        return await self._call(self.sync.create_volume, name, size)

    async def get_volume(self, ref: str) -> VolumeInfo:
        return await self._call(self.sync.get_volume, ref)

    async def list_volumes(self) -> builtins.list[VolumeInfo]:
        return await self._call(self.sync.list_volumes)

    async def delete_volume(self, ref: str) -> None:
        await self._call(self.sync.delete_volume, ref)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return await self._call(self.sync.resume, sandbox_id)

    async def run(self, sandbox_id: str, cmd: str | Sequence[str], *, timeout: float | None,
                  envs: Mapping[str, str] | None, cwd: str | None, stdin: str | bytes | None,
                  on_stdout: AsyncOutputCallback | None, on_stderr: AsyncOutputCallback | None,
                  context: Mapping[str, Any] | None, output: str) -> CommandResult:
        abandoned = threading.Event()
        work = functools.partial(
            self.sync.run, sandbox_id, cmd, timeout=timeout, envs=envs, cwd=cwd, stdin=stdin,
            on_stdout=_forward(on_stdout, abandoned), on_stderr=_forward(on_stderr, abandoned),
            context=context, output=output)
        try:
            # Its own limiter: a command may block its thread for minutes and must not use up
            # the shared default pool (40 threads) that other to_thread calls need. Cancelling
            # the caller stops the waiting, not the command (as on the service, which keeps
            # running it): it ends at its timeout, by commands.kill() or with the sandbox.
            return await anyio.to_thread.run_sync(work, abandon_on_cancel=True,
                                                  limiter=anyio.CapacityLimiter(1))
        except anyio.get_cancelled_exc_class():
            abandoned.set()
            raise

    async def kill_command(self, sandbox_id: str, command_id: str) -> None:
        await self._call(self.sync.kill_command, sandbox_id, command_id)

    async def start_process(self, sandbox_id: str, cmd: str | Sequence[str], *,
                            envs: Mapping[str, str] | None, cwd: str | None,
                            context: Mapping[str, Any] | None) -> ProcessInfo:
        return await self._call(self.sync.start_process, sandbox_id, cmd, envs=envs, cwd=cwd,
                                context=context)

    async def get_process(self, sandbox_id: str, process_id: str) -> ProcessInfo:
        return await self._call(self.sync.get_process, sandbox_id, process_id)

    async def list_processes(self, sandbox_id: str) -> builtins.list[ProcessInfo]:
        return await self._call(self.sync.list_processes, sandbox_id)

    async def process_output(self, sandbox_id: str, process_id: str, offset: int, *,
                             follow: bool, wait_s: float | None
                             ) -> AsyncIterator[tuple[int, str, str]]:
        events = await self._call(self.sync.process_output, sandbox_id, process_id, offset,
                                  follow=follow, wait_s=wait_s)
        async for event in _drain(events):
            yield event

    async def send_process(self, sandbox_id: str, process_id: str, data: bytes) -> None:
        await self._call(self.sync.send_process, sandbox_id, process_id, data)

    async def kill_process(self, sandbox_id: str, process_id: str) -> None:
        await self._call(self.sync.kill_process, sandbox_id, process_id)

    async def run_code(self, sandbox_id: str, code: str, *, context_id: str | None,
                       language: str | None, envs: Mapping[str, str] | None,
                       timeout: float | None, on_event: AsyncCodeCallback | None
                       ) -> Execution:
        abandoned = threading.Event()
        work = functools.partial(
            self.sync.run_code, sandbox_id, code, context_id=context_id, language=language,
            envs=envs, timeout=timeout, on_event=_forward_code(on_event, abandoned))
        try:
            # Its own limiter, as run(): a cell may hold its thread for minutes.
            return await anyio.to_thread.run_sync(work, abandon_on_cancel=True,
                                                  limiter=anyio.CapacityLimiter(1))
        except anyio.get_cancelled_exc_class():
            abandoned.set()
            raise

    async def create_code_context(self, sandbox_id: str, *, language: str | None,
                                  cwd: str | None) -> CodeContext:
        return await self._call(self.sync.create_code_context, sandbox_id, language=language,
                                cwd=cwd)

    async def list_code_contexts(self, sandbox_id: str) -> builtins.list[CodeContext]:
        return await self._call(self.sync.list_code_contexts, sandbox_id)

    async def restart_code_context(self, sandbox_id: str, context_id: str) -> CodeContext:
        return await self._call(self.sync.restart_code_context, sandbox_id, context_id)

    async def remove_code_context(self, sandbox_id: str, context_id: str) -> None:
        await self._call(self.sync.remove_code_context, sandbox_id, context_id)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self._call(self.sync.read_file, sandbox_id, path)

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> FileEntry:
        return await self._call(self.sync.write_file, sandbox_id, path, data)

    async def list_files(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        return await self._call(self.sync.list_files, sandbox_id, path)

    async def stat_file(self, sandbox_id: str, path: str) -> FileEntry:
        return await self._call(self.sync.stat_file, sandbox_id, path)

    async def file_exists(self, sandbox_id: str, path: str) -> bool:
        return await self._call(self.sync.file_exists, sandbox_id, path)

    async def remove_file(self, sandbox_id: str, path: str) -> None:
        await self._call(self.sync.remove_file, sandbox_id, path)

    async def make_dir(self, sandbox_id: str, path: str) -> bool:
        return await self._call(self.sync.make_dir, sandbox_id, path)

    async def rename_file(self, sandbox_id: str, src: str, dst: str) -> FileEntry:
        return await self._call(self.sync.rename_file, sandbox_id, src, dst)

    async def upload(self, sandbox_id: str, path: str, stream: BinaryIO) -> dict[str, int]:
        return await self._call(self.sync.upload, sandbox_id, path, stream)

    async def download(self, sandbox_id: str, path: str, *, gzip: bool
                       ) -> AsyncIterator[bytes]:
        chunks = await self._call(self.sync.download, sandbox_id, path, gzip=gzip)
        async for chunk in _drain(chunks):
            yield chunk

    async def audit_trail(self, sandbox_id: str, *, types: Sequence[str] | None,
                          since: float | None, until: float | None,
                          command: str | None) -> AuditTrail:
        return await self._call(self.sync.audit_trail, sandbox_id, types=types, since=since,
                                until=until, command=command)

    async def snapshot(self, sandbox_id: str, *, name: str | None,
                       memory: bool = False) -> SnapshotInfo:
        return await self._call(self.sync.snapshot, sandbox_id, name=name, memory=memory)

    async def fork(self, sandbox_id: str, count: int, *,
                   memory: bool = False) -> builtins.list[SandboxInfo]:
        return await self._call(self.sync.fork, sandbox_id, count, memory=memory)

    async def restore(self, sandbox_id: str, snapshot: str) -> SandboxInfo:
        return await self._call(self.sync.restore, sandbox_id, snapshot)

    async def get_snapshot(self, ref: str) -> SnapshotInfo:
        return await self._call(self.sync.get_snapshot, ref)

    async def list_snapshots(self) -> builtins.list[SnapshotInfo]:
        return await self._call(self.sync.list_snapshots)

    async def delete_snapshot(self, ref: str) -> None:
        await self._call(self.sync.delete_snapshot, ref)

    async def aclose(self) -> None:
        """Nothing to release: the manager is shared by the process."""


_DONE = object()


async def _drain(items: Iterator[_T]) -> AsyncIterator[_T]:
    """A blocking iterator's items, each fetched in a worker thread; closed at the end (a
    generator's cleanup closes the files it reads)."""
    try:
        while (item := await anyio.to_thread.run_sync(next, items, _DONE)) is not _DONE:
            yield item  # type: ignore[misc]
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()


async def aopen_transport(home: str | Path | None, url: str | None, api_key: str | None
                          ) -> AsyncTransport:
    from ._async.http import AsyncHTTPTransport

    target = await anyio.to_thread.run_sync(embedded_target, home, url, api_key)
    if isinstance(target, tuple):
        return AsyncHTTPTransport(*target)
    return AsyncEmbeddedTransport(target)


@asynccontextmanager
async def ausing_transport(transport: AsyncTransport | None, home: str | Path | None,
                           url: str | None, api_key: str | None
                           ) -> AsyncIterator[AsyncTransport]:
    if transport is not None:
        yield transport
        return
    opened = await aopen_transport(home, url, api_key)
    try:
        yield opened
    finally:
        await opened.aclose()
