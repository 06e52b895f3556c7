"""Fan-out for RL and evaluation runs: N sandboxes started from one snapshot, one command in
each, the results as they finish, with back-pressure.

    >>> from corral import FanOut
    >>> with FanOut("seed", 1000, "pytest -q", concurrency=32, url=...) as rollouts:
    ...     for rollout in rollouts:
    ...         record(rollout.index, rollout.result)

Back-pressure, three ways: at most ``concurrency`` of its sandboxes exist at once; a rollout
whose result the caller has not taken yet keeps its slot (its sandbox is already destroyed),
so a slow consumer slows the starts instead of piling results up; and a create the service
refuses for quota (the tenant's or a full cluster's) waits for a slot to free instead of
failing the rollout, up to ``quota_wait`` seconds. Over ``corral serve --cluster`` the
gateway spreads the sandboxes over the nodes and copies the snapshot's layers once per node.

One async implementation (``AsyncFanOut``, on anyio); ``FanOut`` drives it from a thread of
its own through an anyio blocking portal, so the sync form is the same code, not a copy.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.from_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import CorralError, QuotaExceeded, UsageError
from ..models import CommandResult, SnapshotInfo
from . import _wire
from ._aembedded import aopen_transport
from ._async.sandbox import AsyncSandbox

if TYPE_CHECKING:
    from ._async.transport import AsyncTransport

__all__ = ["AsyncFanOut", "FanOut", "Rollout"]

Command = str | Sequence[str]


@dataclass(frozen=True, slots=True)
class Rollout:
    """One sandbox's part of a fan-out."""

    index: int
    #: the sandbox it ran in (destroyed by now); None when it could not be created
    sandbox_id: str | None
    result: CommandResult | None
    #: why there is no result: the create or the command failed (nothing else is raised)
    error: CorralError | None = None

    @property
    def ok(self) -> bool:
        """Whether the command ran and exited 0."""
        return self.error is None and self.result is not None and self.result.exit_code == 0


class AsyncFanOut:
    """``count`` sandboxes from ``snapshot``, ``command`` run in each, destroyed after.

    Use it as an async context manager and iterate it for the rollouts, in the order they
    finish; leaving the block early cancels what runs and destroys its sandboxes.

    Args:
        snapshot: the snapshot every sandbox starts from (a ``SnapshotInfo``, id or name).
        count: how many sandboxes.
        command: the command for each (a shell string or an argv list), or a function of
            the rollout's index that returns it (a seed per rollout, say).
        concurrency: at most this many of its sandboxes at once (default 16).
        timeout: each command's timeout in seconds (default: the tier's limit).
        envs: extra environment variables for every command.
        quota_wait: how long a create refused for quota waits for a slot to free, in seconds,
            before its rollout fails with ``QuotaExceeded``.
        create: more arguments for each ``Sandbox.create`` (``resources``, ``isolation``,
            ``labels``, ``network``, ...).
        home, url, api_key, transport: where the sandboxes live, as for ``Sandbox.create``.

    Raises:
        UsageError: a count or concurrency below 1, or an unknown ``create`` argument.
    """

    def __init__(self, snapshot: str | SnapshotInfo, count: int,
                 command: Command | Callable[[int], Command], *, concurrency: int = 16,
                 timeout: float | None = None, envs: Mapping[str, str] | None = None,
                 quota_wait: float = 60.0, create: Mapping[str, Any] | None = None,
                 home: str | Path | None = None, url: str | None = None,
                 api_key: str | None = None, transport: AsyncTransport | None = None) -> None:
        for name, value in (("count", count), ("concurrency", concurrency)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be a whole number of at least 1, not {value!r}")
        if not isinstance(quota_wait, int | float) or not math.isfinite(quota_wait) or \
                quota_wait < 0:
            raise UsageError(f"quota_wait must be a number of seconds >= 0, not {quota_wait!r}")
        unknown = set(create or {}) - _CREATE_ARGS
        if unknown:
            raise UsageError(f"unknown create arguments: {', '.join(sorted(unknown))} (known: "
                             f"{', '.join(sorted(_CREATE_ARGS))})")
        self._snapshot = _wire.snapshot_ref(snapshot)
        self._count = count
        self._command = command
        self._concurrency = concurrency
        self._timeout = timeout
        self._envs = dict(envs or {})
        self._quota_wait = float(quota_wait)
        self._create = dict(create or {})
        self._target = (home, url, api_key)
        self._given = transport
        self._transport: AsyncTransport | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._results: MemoryObjectReceiveStream[Rollout] | None = None
        self._freed: anyio.Event | None = None

    async def __aenter__(self) -> AsyncFanOut:
        self._transport = self._given or await aopen_transport(*self._target)
        self._freed = anyio.Event()
        send, self._results = anyio.create_memory_object_stream[Rollout]()
        group = anyio.create_task_group()
        await group.__aenter__()
        self._group = group
        group.start_soon(self._schedule, send)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool | None:
        group, self._group = self._group, None
        try:
            if group is not None:
                group.cancel_scope.cancel()  # early exit: what runs stops, its sandboxes go
                await group.__aexit__(exc_type, exc, tb)
        finally:
            if self._results is not None:
                self._results.close()
            if self._given is None and self._transport is not None:
                with anyio.CancelScope(shield=True):
                    await self._transport.aclose()
        return None

    def __aiter__(self) -> AsyncIterator[Rollout]:
        return self

    async def __anext__(self) -> Rollout:
        if self._results is None:
            raise UsageError("use the fan-out in `async with` before iterating it")
        try:
            return await self._results.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    # -- the work -----------------------------------------------------------------------------

    async def _schedule(self, send: MemoryObjectSendStream[Rollout]) -> None:
        slots = anyio.Semaphore(self._concurrency)
        async with send, anyio.create_task_group() as workers:
            for index in range(self._count):
                await slots.acquire()
                workers.start_soon(self._rollout, index, slots, send.clone())

    async def _rollout(self, index: int, slots: anyio.Semaphore,
                       send: MemoryObjectSendStream[Rollout]) -> None:
        async with send:
            try:
                rollout = await self._run(index)
                await send.send(rollout)  # unbuffered: waits for the consumer to take it
            finally:
                slots.release()
                assert self._freed is not None
                self._freed.set()  # wakes the creates waiting for quota
                self._freed = anyio.Event()

    async def _run(self, index: int) -> Rollout:
        command = self._command(index) if callable(self._command) else self._command
        sandbox = await self._start(index)
        if isinstance(sandbox, Rollout):
            return sandbox
        try:
            result = await sandbox.commands.run(command, timeout=self._timeout,
                                                envs=self._envs or None)
        except CorralError as exc:
            return Rollout(index, sandbox.id, None, exc)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await sandbox.kill()
                except CorralError:
                    pass  # gone already (expired, or its node lost): nothing to destroy
        return Rollout(index, sandbox.id, result)

    async def _start(self, index: int) -> AsyncSandbox | Rollout:
        """The rollout's sandbox; while the service refuses it for quota, the next freed
        slot (or a short wait: the quota may be freed by others) and again."""
        assert self._transport is not None
        deadline = anyio.current_time() + self._quota_wait
        pause = 0.05
        while True:
            try:
                # Shielded: a create cancelled midway could leave a sandbox nobody knows of;
                # this way it finishes, and the cancellation then destroys what it made.
                with anyio.CancelScope(shield=True):
                    return await AsyncSandbox.create(snapshot=self._snapshot,
                                                     transport=self._transport, **self._create)
            except QuotaExceeded as exc:
                left = deadline - anyio.current_time()
                if left <= 0:
                    return Rollout(index, None, None, exc)
                assert self._freed is not None
                with anyio.move_on_after(min(pause, left)):
                    await self._freed.wait()
                pause = min(pause * 2, 1.0)
            except CorralError as exc:
                return Rollout(index, None, None, exc)


_CREATE_ARGS = frozenset({"template", "resources", "timeout", "labels", "network", "secrets",
                          "idle_timeout", "isolation", "volumes", "data_mounts", "lifecycle"})


class FanOut:
    """``AsyncFanOut`` for synchronous code: the same arguments, a context manager to
    iterate. The work runs on an event loop in a thread of its own.

    Example:
        >>> with FanOut("seed", 8, lambda i: f"python3 eval.py --seed {i}") as rollouts:
        ...     scores = {r.index: r.result.stdout for r in rollouts if r.ok}
    """

    def __init__(self, snapshot: str | SnapshotInfo, count: int,
                 command: Command | Callable[[int], Command], **options: Any) -> None:
        if "transport" in options:
            raise UsageError("FanOut opens its own connection: pass home, url and api_key")
        self._fan_out = AsyncFanOut(snapshot, count, command, **options)
        self._portal_context: Any = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._entered: Any = None

    def __enter__(self) -> FanOut:
        self._portal_context = anyio.from_thread.start_blocking_portal()
        portal = self._portal_context.__enter__()
        # Entered and left in one task of the portal (its task group requires that).
        entered = portal.wrap_async_context_manager(self._fan_out)
        try:
            entered.__enter__()
        except BaseException:
            self._portal_context.__exit__(None, None, None)
            raise
        self._portal, self._entered = portal, entered
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._portal is None:
            return
        self._portal = None
        try:
            self._entered.__exit__(exc_type, exc, tb)
        finally:
            self._portal_context.__exit__(None, None, None)

    def __iter__(self) -> Iterator[Rollout]:
        return self

    def __next__(self) -> Rollout:
        if self._portal is None:
            raise UsageError("use the fan-out in `with` before iterating it")
        try:
            return self._portal.call(self._fan_out.__anext__)
        except StopAsyncIteration:
            raise StopIteration from None
