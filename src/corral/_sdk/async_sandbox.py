"""The async SDK: ``AsyncSandbox``, the same API as ``Sandbox`` with ``async`` methods.

One pattern, as in E2B: ``await AsyncSandbox.create()`` returns the sandbox, which is an async
context manager::

    async with await AsyncSandbox.create() as sb:
        result = await sb.commands.run("echo hi")

Two transports behind one small protocol (STYLE 2.7): remote (``url=`` or ``CORRAL_URL``) is
``AsyncRemoteManager`` on ``httpx.AsyncClient``, native async I/O; embedded runs the synchronous
control plane's calls in worker threads (``anyio.to_thread``), so the event loop never blocks and
it works inside loops that are already running. Nothing here calls ``asyncio.run()``.
"""

from __future__ import annotations

import builtins
import enum
import functools
import io
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Literal, Protocol, TypeVar, overload

import anyio
import anyio.from_thread
import anyio.to_thread

from .._audit.events import AuditEvent
from .._audit.log import AuditTrail
from .._control.files import AuditedFiles
from .._control.manager import Manager, get_manager
from .._settings import Settings
from ..backends import OutputCallback
from ..errors import SandboxNotFound, UsageError
from ..models import CommandResult, FileEntry, SandboxInfo, SnapshotInfo
from .async_remote import AsyncOutputCallback, AsyncRemoteManager, deliver
from .sandbox import _snapshot_ref

__all__ = ["AsyncAudit", "AsyncCommands", "AsyncFiles", "AsyncNetwork", "AsyncSandbox"]

_T = TypeVar("_T")


# -- the transport protocol and its embedded implementation -------------------------------------


class _Files(Protocol):
    async def read(self, path: str) -> bytes: ...
    async def write(self, path: str, data: bytes) -> FileEntry: ...
    async def list(self, path: str = "/workspace") -> list[FileEntry]: ...
    async def stat(self, path: str) -> FileEntry: ...
    async def exists(self, path: str) -> bool: ...
    async def remove(self, path: str) -> None: ...
    async def make_dir(self, path: str) -> bool: ...
    async def rename(self, src: str, dst: str) -> FileEntry: ...


class _Transport(Protocol):
    """What ``AsyncSandbox`` needs. Errors are Corral's own classes in both implementations;
    ``aclose()`` releases the transport's resources, never a sandbox."""

    async def create(self, *, template: str | None, resources: str, timeout: float | None,
                     labels: Mapping[str, str] | None, network: Any,
                     secrets: Sequence[str] | None, idle_timeout: float | None,
                     isolation: str | None, snapshot: str | None) -> SandboxInfo: ...
    def sibling(self) -> _Transport:
        """The same target over a connection of its own (each sandbox closes its own)."""
        ...
    async def get(self, sandbox_id: str) -> SandboxInfo: ...
    async def list(self) -> list[SandboxInfo]: ...
    async def destroy(self, sandbox_id: str) -> None: ...
    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo: ...
    async def set_network(self, sandbox_id: str, network: Any) -> SandboxInfo: ...
    async def pause(self, sandbox_id: str) -> SandboxInfo: ...
    async def resume(self, sandbox_id: str) -> SandboxInfo: ...
    async def kill_command(self, sandbox_id: str, command_id: str) -> None: ...
    async def snapshot(self, sandbox_id: str, *, name: str | None = None) -> SnapshotInfo: ...
    async def fork(self, sandbox_id: str, count: int = 1) -> builtins.list[SandboxInfo]: ...
    async def restore(self, sandbox_id: str, snapshot: str) -> SandboxInfo: ...
    async def get_snapshot(self, ref: str) -> SnapshotInfo: ...
    async def list_snapshots(self) -> builtins.list[SnapshotInfo]: ...
    async def delete_snapshot(self, ref: str) -> None: ...
    def files(self, sandbox_id: str) -> _Files: ...
    async def upload(self, sandbox_id: str, path: str, stream: BinaryIO) -> dict[str, int]: ...
    def download(self, sandbox_id: str, path: str, *, gzip: bool = False
                 ) -> AsyncIterator[bytes]: ...
    async def audit_trail(self, sandbox_id: str, *, types: Sequence[str] | None = None,
                          since: float | None = None, until: float | None = None,
                          command: str | None = None) -> AuditTrail: ...
    async def run(self, sandbox_id: str, cmd: str | Sequence[str], *,
                  timeout: float | None = None, envs: Mapping[str, str] | None = None,
                  cwd: str | None = None, stdin: str | bytes | None = None,
                  on_stdout: AsyncOutputCallback | None = None,
                  on_stderr: AsyncOutputCallback | None = None,
                  context: Mapping[str, Any] | None = None) -> CommandResult: ...
    async def aclose(self) -> None: ...


async def _in_thread(func: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    return await anyio.to_thread.run_sync(functools.partial(func, *args, **kwargs))


class _ThreadedFiles:
    def __init__(self, manager: Manager, sandbox_id: str) -> None:
        self._m = manager
        self._id = sandbox_id

    def _fs(self) -> AuditedFiles:
        return self._m.files(self._id)

    async def read(self, path: str) -> bytes:
        return await _in_thread(lambda: self._fs().read(path))

    async def write(self, path: str, data: bytes) -> FileEntry:
        return await _in_thread(lambda: self._fs().write(path, data))

    async def list(self, path: str = "/workspace") -> list[FileEntry]:
        return await _in_thread(lambda: self._fs().list(path))

    async def stat(self, path: str) -> FileEntry:
        return await _in_thread(lambda: self._fs().stat(path))

    async def exists(self, path: str) -> bool:
        return await _in_thread(lambda: self._fs().exists(path))

    async def remove(self, path: str) -> None:
        await _in_thread(lambda: self._fs().remove(path))

    async def make_dir(self, path: str) -> bool:
        return await _in_thread(lambda: self._fs().make_dir(path))

    async def rename(self, src: str, dst: str) -> FileEntry:
        return await _in_thread(lambda: self._fs().rename(src, dst))


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
            anyio.from_thread.run(deliver, callback, text)
        except RuntimeError:
            if not abandoned.is_set():  # else: the caller is gone, maybe its loop too
                raise

    return forward


class _EmbeddedTransport:
    """The in-process control plane, each blocking call in a worker thread."""

    def __init__(self, manager: Manager) -> None:
        self._m = manager

    async def create(self, *, template: str | None, resources: str, timeout: float | None,
                     labels: Mapping[str, str] | None, network: Any,
                     secrets: Sequence[str] | None, idle_timeout: float | None,
                     isolation: str | None, snapshot: str | None) -> SandboxInfo:
        return await _in_thread(self._m.create, template=template, resources=resources,
                                timeout=timeout, labels=labels, network=network,
                                secrets=secrets, idle_timeout=idle_timeout,
                                isolation=isolation, snapshot=snapshot)

    def sibling(self) -> _EmbeddedTransport:
        return _EmbeddedTransport(self._m)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await _in_thread(self._m.get, sandbox_id)

    async def list(self) -> list[SandboxInfo]:
        return await _in_thread(self._m.list)

    async def destroy(self, sandbox_id: str) -> None:
        await _in_thread(self._m.destroy, sandbox_id)

    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        return await _in_thread(self._m.set_timeout, sandbox_id, timeout)

    async def set_network(self, sandbox_id: str, network: Any) -> SandboxInfo:
        return await _in_thread(self._m.set_network, sandbox_id, network)

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        return await _in_thread(self._m.pause, sandbox_id)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return await _in_thread(self._m.resume, sandbox_id)

    async def kill_command(self, sandbox_id: str, command_id: str) -> None:
        await _in_thread(self._m.kill_command, sandbox_id, command_id)

    async def snapshot(self, sandbox_id: str, *, name: str | None = None) -> SnapshotInfo:
        return await _in_thread(self._m.snapshot, sandbox_id, name=name)

    async def fork(self, sandbox_id: str, count: int = 1) -> builtins.list[SandboxInfo]:
        return await _in_thread(self._m.fork, sandbox_id, count)

    async def restore(self, sandbox_id: str, snapshot: str) -> SandboxInfo:
        return await _in_thread(self._m.restore, sandbox_id, snapshot)

    async def get_snapshot(self, ref: str) -> SnapshotInfo:
        return await _in_thread(self._m.get_snapshot, ref)

    async def list_snapshots(self) -> builtins.list[SnapshotInfo]:
        return await _in_thread(self._m.list_snapshots)

    async def delete_snapshot(self, ref: str) -> None:
        await _in_thread(self._m.delete_snapshot, ref)

    def files(self, sandbox_id: str) -> _ThreadedFiles:
        return _ThreadedFiles(self._m, sandbox_id)

    async def upload(self, sandbox_id: str, path: str, stream: BinaryIO) -> dict[str, int]:
        return await _in_thread(self._m.upload, sandbox_id, path, stream)

    async def download(self, sandbox_id: str, path: str, *, gzip: bool = False
                       ) -> AsyncIterator[bytes]:
        chunks: Iterator[bytes] = await _in_thread(self._m.download, sandbox_id, path,
                                                   gzip=gzip)
        try:
            while (chunk := await _in_thread(next, chunks, b"")):
                yield chunk
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()  # a generator: runs its cleanup (closes the files it reads)

    async def audit_trail(self, sandbox_id: str, *, types: Sequence[str] | None = None,
                          since: float | None = None, until: float | None = None,
                          command: str | None = None) -> AuditTrail:
        return await _in_thread(self._m.auditor.trail, sandbox_id, types=types, since=since,
                                until=until, command=command)

    async def run(self, sandbox_id: str, cmd: str | Sequence[str], *,
                  timeout: float | None = None, envs: Mapping[str, str] | None = None,
                  cwd: str | None = None, stdin: str | bytes | None = None,
                  on_stdout: AsyncOutputCallback | None = None,
                  on_stderr: AsyncOutputCallback | None = None,
                  context: Mapping[str, Any] | None = None) -> CommandResult:
        abandoned = threading.Event()
        work = functools.partial(
            self._m.run, sandbox_id, cmd, timeout=timeout, envs=envs, cwd=cwd, stdin=stdin,
            on_stdout=_forward(on_stdout, abandoned), on_stderr=_forward(on_stderr, abandoned),
            context=context)
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

    async def aclose(self) -> None:
        """Nothing to release: the manager is shared by the process."""


async def _open(home: str | Path | None, url: str | None, api_key: str | None) -> _Transport:
    """Embedded unless a service URL is given or set in ``CORRAL_URL`` (as ``Sandbox``)."""

    def resolve() -> tuple[str, str | None] | Manager:
        settings = Settings(home=Path(home)) if home is not None else Settings()
        target = url or settings.url
        if target and home is None:
            key = api_key or (settings.api_key.get_secret_value() if settings.api_key else None)
            return target, key
        return get_manager(settings)

    resolved = await _in_thread(resolve)
    if isinstance(resolved, Manager):
        return _EmbeddedTransport(resolved)
    return AsyncRemoteManager(*resolved)


# -- the public API ----------------------------------------------------------------------------


class AsyncCommands:
    """Run commands in one sandbox. Reached as ``sandbox.commands``."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def run(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        envs: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: str | bytes | None = None,
        on_stdout: AsyncOutputCallback | None = None,
        on_stderr: AsyncOutputCallback | None = None,
        context: Mapping[str, Any] | None = None,
    ) -> CommandResult:
        """Run ``cmd`` and wait for it; as ``Sandbox.commands.run``.

        ``on_stdout``/``on_stderr`` may be plain functions or ``async def`` (awaited); either
        way they run on the event loop, one piece at a time, in order. Cancelling the awaiting
        task stops waiting but not the command: it ends at its timeout, by ``kill()`` with
        ``result.command_id`` from the audit trail, or with the sandbox.

        Raises:
            CommandError: empty or malformed command, bad env, cwd outside ``/workspace``.
            SandboxNotFound: the sandbox is gone (or expired).

        Example:
            >>> (await sb.commands.run("python3 -c 'print(6 * 7)'")).stdout
            '42\\n'
        """
        sb = self._sandbox
        return await sb._transport().run(
            sb._live_id(), cmd, timeout=timeout, envs=envs, cwd=cwd, stdin=stdin,
            on_stdout=on_stdout, on_stderr=on_stderr, context=context)

    async def kill(self, command_id: str) -> None:
        """Kill a running command by its id; its ``run()`` returns with exit code 137."""
        await self._sandbox._transport().kill_command(self._sandbox._live_id(), command_id)


class AsyncFiles:
    """Files in the sandbox's ``/workspace``; as ``Sandbox.files``. Paths that leave it raise
    ``PathRefused``."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    def _fs(self) -> _Files:
        return self._sandbox._transport().files(self._sandbox._live_id())

    @overload
    async def read(self, path: str, *, format: Literal["text"] = "text") -> str: ...
    @overload
    async def read(self, path: str, *, format: Literal["bytes"]) -> bytes: ...

    async def read(self, path: str, *,
                   format: Literal["text", "bytes"] = "text") -> str | bytes:
        """Read a whole file, as text (UTF-8, invalid bytes replaced) or bytes."""
        if format not in ("text", "bytes"):
            raise UsageError(f"format must be 'text' or 'bytes', not {format!r}")
        data = await self._fs().read(path)
        return data if format == "bytes" else data.decode("utf-8", errors="replace")

    async def write(self, path: str, data: str | bytes) -> FileEntry:
        """Write a whole file atomically, creating parent directories."""
        if isinstance(data, str):
            data = data.encode()
        elif not isinstance(data, bytes | bytearray | memoryview):
            raise UsageError(f"data must be str or bytes, not {type(data).__name__}")
        return await self._fs().write(path, bytes(data))

    async def list(self, path: str = "/workspace") -> list[FileEntry]:
        """The entries of a directory, sorted by name."""
        return await self._fs().list(path)

    async def stat(self, path: str) -> FileEntry:
        return await self._fs().stat(path)

    async def exists(self, path: str) -> bool:
        return await self._fs().exists(path)

    async def remove(self, path: str) -> None:
        """Remove a file or a whole directory tree."""
        await self._fs().remove(path)

    async def make_dir(self, path: str) -> bool:
        """Create a directory and its parents; False if it already existed."""
        return await self._fs().make_dir(path)

    async def rename(self, src: str, dst: str) -> FileEntry:
        """Move a file, directory or symlink inside the workspace."""
        return await self._fs().rename(src, dst)

    async def upload(self, archive: bytes | BinaryIO, path: str = "/workspace"
                     ) -> dict[str, int]:
        """Extract a tar or tar.gz (bytes, or a binary file object read in chunks off the
        event loop) under ``path``; as ``Sandbox.files.upload``. Returns the counts."""
        stream = io.BytesIO(archive) if isinstance(archive, bytes | bytearray) else archive
        sb = self._sandbox
        return dict(await sb._transport().upload(sb._live_id(), path, stream))

    def download(self, path: str = "/workspace", *, gzip: bool = False
                 ) -> AsyncIterator[bytes]:
        """The tree under ``path`` as a tar stream: ``async for chunk in sb.files.download()``."""
        return self._sandbox._transport().download(self._sandbox._live_id(), path, gzip=gzip)


class AsyncNetwork:
    """The sandbox's network policy; as ``Sandbox.network``."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def get(self) -> dict[str, Any]:
        """``{"mode": "none"|"allowlist", "allow": [...], "deny": [...]}``."""
        return dict((await self._sandbox.get_info()).network)

    async def update(self, *, allow: Sequence[str] | None = None,
                     deny: Sequence[str] | None = None) -> dict[str, Any]:
        """Replace the policy (deny wins; no allow rules means no network)."""
        sb = self._sandbox
        sb._info = await sb._transport().set_network(
            sb._live_id(), {"allow": list(allow or []), "deny": list(deny or [])})
        return dict(sb._info.network)

    async def block(self) -> None:
        """Back to no network at all."""
        sb = self._sandbox
        sb._info = await sb._transport().set_network(sb._live_id(), "none")


class AsyncAudit:
    """The sandbox's audit trail; as ``Sandbox.audit``. Readable after ``kill()`` too."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def events(self, *, types: Sequence[str] | None = None, since: float | None = None,
                     until: float | None = None, command: str | None = None
                     ) -> list[AuditEvent]:
        """Events in log order, filtered by type (``command.*``), Unix time and command id."""
        trail = await self.trail(types=types, since=since, until=until, command=command)
        return trail.events

    async def trail(self, *, types: Sequence[str] | None = None, since: float | None = None,
                    until: float | None = None, command: str | None = None) -> AuditTrail:
        """Like ``events`` but also says whether a torn last line was skipped."""
        return await self._sandbox._transport().audit_trail(
            self._sandbox.id, types=types, since=since, until=until, command=command)


class _State(enum.Enum):
    """The connection's state; whether the sandbox was killed is ``_killed`` (a killed
    sandbox's connection stays open so its audit trail stays readable)."""

    OPEN = "open"
    CLOSED = "closed"


class AsyncSandbox:
    """A sandbox, with ``async`` methods; the same API as ``Sandbox``.

    ``await AsyncSandbox.create()`` returns it; use it as an async context manager, which
    kills the sandbox and then closes the connection on exit. Without ``async with``, call
    ``await sb.kill()`` to destroy it and ``await sb.aclose()`` to release the connection
    (``aclose()`` alone detaches and leaves the sandbox running, for ``connect()`` later).

    Example:
        >>> from corral import AsyncSandbox
        >>> async with await AsyncSandbox.create() as sb:
        ...     await sb.files.write("hello.py", "print('hi')")
        ...     print((await sb.commands.run("python3 hello.py")).stdout)
        hi
    """

    def __init__(self, info: SandboxInfo, transport: _Transport) -> None:
        self._info = info
        self._mgr = transport
        self._state = _State.OPEN
        self._killed = False
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.audit = AsyncAudit(self)
        self.network = AsyncNetwork(self)

    @classmethod
    async def create(
        cls,
        template: str | None = None,
        *,
        resources: str = "small",
        timeout: float | None = None,
        labels: Mapping[str, str] | None = None,
        network: str | Mapping[str, Sequence[str]] | None = None,
        secrets: Sequence[str] | None = None,
        idle_timeout: float | None = None,
        isolation: str | None = None,
        snapshot: str | SnapshotInfo | None = None,
        home: str | Path | None = None,
        url: str | None = None,
        api_key: str | None = None,
    ) -> AsyncSandbox:
        """Create a sandbox; the arguments are ``Sandbox.create``'s.

        ``isolation`` is the tier, ``"namespace"`` (default) or ``"gvisor"``; ``snapshot`` (a
        ``SnapshotInfo``, id or name) starts it from that snapshot's workspace, and then
        ``template`` defaults to the snapshot's.

        Raises:
            UsageError: unknown template, tier or isolation tier, bad timeout or labels.
            SnapshotNotFound: no such snapshot (or not yours, on a service).
            BackendUnavailable: the host lacks something the sandbox needs.
            TransportError: the service at ``url`` cannot be reached.
        """
        transport = await _open(home, url, api_key)
        try:
            info = await transport.create(template=template, resources=resources,
                                          timeout=timeout, labels=labels, network=network,
                                          secrets=secrets, idle_timeout=idle_timeout,
                                          isolation=isolation,
                                          snapshot=_snapshot_ref(snapshot))
        except BaseException:
            await transport.aclose()
            raise
        return cls(info, transport)

    @classmethod
    async def list_snapshots(cls, *, home: str | Path | None = None, url: str | None = None,
                             api_key: str | None = None) -> builtins.list[SnapshotInfo]:
        """Every snapshot (of the data directory, or of your tenant on a service)."""
        transport = await _open(home, url, api_key)
        try:
            return await transport.list_snapshots()
        finally:
            await transport.aclose()

    @classmethod
    async def get_snapshot(cls, snapshot: str, *, home: str | Path | None = None,
                           url: str | None = None, api_key: str | None = None) -> SnapshotInfo:
        """A snapshot by id or name. Raises ``SnapshotNotFound``."""
        transport = await _open(home, url, api_key)
        try:
            return await transport.get_snapshot(snapshot)
        finally:
            await transport.aclose()

    @classmethod
    async def delete_snapshot(cls, snapshot: str | SnapshotInfo, *,
                              home: str | Path | None = None, url: str | None = None,
                              api_key: str | None = None) -> None:
        """Delete a snapshot. Raises ``SnapshotInUse`` while a sandbox is built on it."""
        transport = await _open(home, url, api_key)
        try:
            await transport.delete_snapshot(_snapshot_ref(snapshot))
        finally:
            await transport.aclose()

    async def snapshot(self, name: str | None = None) -> SnapshotInfo:
        """Seal the workspace's current state as a snapshot, in O(1) of its size; the sandbox
        goes on from there. Nothing may be running in it (``SandboxBusy`` otherwise)."""
        return await self._transport().snapshot(self._live_id(), name=name)

    async def fork(self, n: int = 1) -> builtins.list[AsyncSandbox]:
        """``n`` new sandboxes starting from this one's workspace as it is now (sharing its
        read-only layers), with its template, tier, isolation, network policy and secrets.

        Each has a connection of its own: ``async with`` it, or ``kill()`` and ``aclose()``
        each, as for a sandbox from ``create()``."""
        transport = self._transport()
        infos = await transport.fork(self._live_id(), n)
        return [AsyncSandbox(info, transport.sibling()) for info in infos]

    async def restore(self, snapshot: str | SnapshotInfo) -> None:
        """Put the workspace back exactly as it was in ``snapshot``; changes made since (and
        not in a snapshot) are gone. Nothing may be running in it."""
        self._info = await self._transport().restore(self._live_id(), _snapshot_ref(snapshot))

    @classmethod
    async def connect(cls, sandbox_id: str, *, home: str | Path | None = None,
                      url: str | None = None, api_key: str | None = None) -> AsyncSandbox:
        """Attach to an existing sandbox (also one created by another process)."""
        transport = await _open(home, url, api_key)
        try:
            info = await transport.get(sandbox_id)
        except BaseException:
            await transport.aclose()
            raise
        return cls(info, transport)

    @classmethod
    async def list(cls, *, home: str | Path | None = None, url: str | None = None,
                   api_key: str | None = None) -> list[SandboxInfo]:
        """Every live sandbox (of the data directory, or of your tenant on a service)."""
        transport = await _open(home, url, api_key)
        try:
            return await transport.list()
        finally:
            await transport.aclose()

    @property
    def id(self) -> str:
        return self._info.id

    async def get_info(self) -> SandboxInfo:
        """Fresh metadata from the store."""
        self._info = await self._transport().get(self._live_id())
        return self._info

    async def pause(self) -> None:
        """Freeze every process in the sandbox; ``resume()`` goes on."""
        self._info = await self._transport().pause(self._live_id())

    async def resume(self) -> None:
        self._info = await self._transport().resume(self._live_id())

    async def set_timeout(self, timeout: float) -> None:
        """Set the remaining lifetime to ``timeout`` seconds from now."""
        self._info = await self._transport().set_timeout(self._live_id(), timeout)

    async def kill(self) -> None:
        """Destroy the sandbox: kill its processes, delete its workspace. Idempotent."""
        if not self._killed:
            self._transport()  # closed: refuse rather than silently not destroy
            self._killed = True
            try:
                await self._mgr.destroy(self._info.id)
            except SandboxNotFound:
                pass

    async def aclose(self) -> None:
        """Release the connection (the sandbox itself stays unless killed). Idempotent."""
        if self._state is not _State.CLOSED:
            self._state = _State.CLOSED
            await self._mgr.aclose()

    def _transport(self) -> _Transport:
        if self._state is _State.CLOSED:
            raise UsageError(f"this AsyncSandbox for {self._info.id} was closed; "
                             "AsyncSandbox.connect() attaches again")
        return self._mgr

    def _live_id(self) -> str:
        if self._killed:
            raise UsageError(f"sandbox {self._info.id} was killed; create a new one")
        return self._info.id

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Shielded: leaving because of a cancellation must still destroy the sandbox.
        with anyio.CancelScope(shield=True):
            try:
                if self._state is _State.OPEN:
                    await self.kill()
            finally:
                await self.aclose()

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self._info.id} {self._info.resources}>"
