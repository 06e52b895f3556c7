"""The few I/O primitives whose sync and async forms differ by more than ``await``; the
generated ``_sync`` code calls the plain ones, the hand-written ``_async`` code the ``a`` ones
(``scripts/unasync`` maps each ``aname`` to ``name``)."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    import anyio

__all__ = ["Pool", "ahttp_pool", "anow", "aread_chunk", "arelease", "ashielded", "asleep",
           "http_pool", "now", "read_chunk", "release", "shielded", "sleep"]

CHUNK = 1 << 20


def read_chunk(stream: BinaryIO) -> bytes:
    return stream.read(CHUNK)


async def aread_chunk(stream: BinaryIO) -> bytes:
    import anyio.to_thread

    # The file object is synchronous (maybe a real file): read it off the event loop.
    return await anyio.to_thread.run_sync(stream.read, CHUNK)


# anyio is imported where the async forms run, so the sync SDK (the CLI) never loads it.
sleep = time.sleep
now = time.monotonic


async def asleep(seconds: float) -> None:
    import anyio

    await anyio.sleep(seconds)


def anow() -> float:
    import anyio

    return anyio.current_time()


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    yield


def ashielded() -> anyio.CancelScope:
    """Leaving because of a cancellation must still finish what is inside (destroying)."""
    import anyio

    return anyio.CancelScope(shield=True)



@dataclass(eq=False)
class Pool:
    """An HTTP client as transports hold it: a transport keeps its pool alive; a pool nobody
    holds is collected and its client closed (``weakref.finalize`` on the pool)."""

    client: Any


_pools: weakref.WeakValueDictionary[tuple[str, str | None, float], Pool] = (
    weakref.WeakValueDictionary())
_pools_lock = threading.Lock()


_MAX_CONNECTIONS = 100  # httpx's default


def _client_args(url: str, api_key: str | None, timeout_s: float) -> dict[str, Any]:
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    # No read timeout: a command may legitimately print nothing for minutes.
    return {"base_url": url.rstrip("/"), "headers": headers,
            "timeout": httpx.Timeout(timeout_s, read=None),
            # Keep-alive for every connection the pool may open: httpcore (1.0.9) closes a
            # "surplus" idle connection outside its lock, and under more threads than
            # connections that races a request just handed the same connection (it fails
            # with EBADF; encode/httpcore#1110). With one origin and no surplus, it never does.
            "limits": httpx.Limits(max_connections=_MAX_CONNECTIONS,
                                   max_keepalive_connections=_MAX_CONNECTIONS)}


def http_pool(url: str, api_key: str | None, timeout_s: float) -> Pool:
    """The connection pool of the sync transports for one service and key: shared while any
    of them lives (scripts make a ``Sandbox`` per call and rarely close it), closed once none
    does; not cached for the life of the process."""
    key = (url, api_key, timeout_s)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            import httpx

            client = httpx.Client(**_client_args(url, api_key, timeout_s))
            pool = _pools[key] = Pool(client)
            weakref.finalize(pool, client.close)
        return pool


def ahttp_pool(url: str, api_key: str | None, timeout_s: float) -> Pool:
    """An async client is bound to the event loop it first runs on: one per transport."""
    import httpx

    return Pool(httpx.AsyncClient(**_client_args(url, api_key, timeout_s)))


def release(pool: Pool) -> None:
    """A sync transport lets go of a shared pool (the last one to go closes it)."""


async def arelease(pool: Pool) -> None:
    await pool.client.aclose()
