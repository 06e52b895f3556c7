"""The async embedded transport: ``EmbeddedTransport``'s calls, each in a worker thread (the
control plane blocks: SQLite, flock, waiting for a command), so the event loop never does."""

from __future__ import annotations

import functools
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread

from ..backends import OutputCallback
from ..models import (
    CommandResult,
    Execution,
)
from ._embedded import EmbeddedTransport, embedded_target
from ._wire import AsyncCodeCallback, AsyncOutputCallback, CodeItem, adeliver

if TYPE_CHECKING:
    from .._control.plane import Manager, Tenant
    from ._async.transport import AsyncTransport

__all__ = ["AsyncEmbeddedTransport", "aopen_transport", "ausing_transport"]

_P = ParamSpec("_P")
_T = TypeVar("_T")


async def _in_thread(func: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    return await anyio.to_thread.run_sync(functools.partial(func, *args, **kwargs))


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
    """``EmbeddedTransport``'s calls, each in a worker thread.

    One generic wrapper (``__getattr__``) serves every call that only needs its thread; the
    methods written here are the ones that need more: callbacks run on the caller's event
    loop, their own thread limiter, iterators drained a thread hop at a time.
    ``tests/unit/test_sdk_core.py`` checks that every call of ``AsyncTransport`` is served.
    """

    def __init__(self, manager: Manager, *, caller: Tenant | None = None) -> None:
        self.sync = EmbeddedTransport(manager, caller=caller)

    def __getattr__(self, name: str) -> Callable[..., Coroutine[Any, Any, Any]]:
        # Not for "sync" itself (looked up here before __init__ has set it: no recursion).
        call = None if name.startswith("_") or name == "sync" else getattr(self.sync, name)
        if not callable(call):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        @functools.wraps(call)
        async def in_a_worker_thread(*args: Any, **kwargs: Any) -> Any:
            return await _in_thread(call, *args, **kwargs)

        return in_a_worker_thread

    def sibling(self) -> AsyncEmbeddedTransport:
        return self

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

    async def process_output(self, sandbox_id: str, process_id: str, offset: int, *,
                             follow: bool, wait_s: float | None
                             ) -> AsyncIterator[tuple[int, str, str]]:
        events = await _in_thread(self.sync.process_output, sandbox_id, process_id, offset,
                                  follow=follow, wait_s=wait_s)
        async for event in _drain(events):
            yield event

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

    async def download(self, sandbox_id: str, path: str, *, gzip: bool
                       ) -> AsyncIterator[bytes]:
        chunks = await _in_thread(self.sync.download, sandbox_id, path, gzip=gzip)
        async for chunk in _drain(chunks):
            yield chunk

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
