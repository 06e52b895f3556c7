"""The few I/O primitives whose sync and async forms differ by more than ``await``; the
generated ``_sync`` code calls the plain ones, the hand-written ``_async`` code the ``a`` ones
(``scripts/unasync`` maps each ``aname`` to ``name``)."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from typing import BinaryIO

import anyio
import anyio.to_thread
import httpx

__all__ = ["aclose_on_collect", "anow", "aread_chunk", "ashielded", "asleep",
           "close_on_collect", "now", "read_chunk", "shielded", "sleep"]

CHUNK = 1 << 20


def read_chunk(stream: BinaryIO) -> bytes:
    return stream.read(CHUNK)


async def aread_chunk(stream: BinaryIO) -> bytes:
    # The file object is synchronous (maybe a real file): read it off the event loop.
    return await anyio.to_thread.run_sync(stream.read, CHUNK)


sleep = time.sleep
asleep = anyio.sleep
now = time.monotonic
anow = anyio.current_time


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    yield


def ashielded() -> anyio.CancelScope:
    """Leaving because of a cancellation must still finish what is inside (destroying)."""
    return anyio.CancelScope(shield=True)


def close_on_collect(owner: object, client: httpx.Client) -> None:
    """Close ``client`` when ``owner`` is collected: a ``Sandbox`` left to the garbage
    collector (never closed, as scripts do) releases its connections instead of leaking them;
    before, one cached client per URL lived for the whole process."""
    weakref.finalize(owner, client.close)


def aclose_on_collect(owner: object, client: httpx.AsyncClient) -> None:
    """Nothing: an async client cannot be closed from a finalizer (closing awaits, on its own
    loop); ``AsyncSandbox`` is closed by ``async with`` or ``aclose()``."""
