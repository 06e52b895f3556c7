"""Helpers for testing code that uses Corral, without root: an in-memory backend
(``corral.testing.backend``) and in-process transports to the HTTP API (``asgi_transport``).

Nothing here isolates anything; never run untrusted code with it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .backend import MemoryBackend, MemoryFS, MemoryVMBackend
from .transport import asgi_transport, async_asgi_transport

if TYPE_CHECKING:
    from .._control.plane import Manager

__all__ = ["MemoryBackend", "MemoryFS", "MemoryVMBackend", "asgi_transport",
           "async_asgi_transport", "memory_manager"]


def memory_manager(home: str | Path, *, backend: MemoryBackend | None = None,
                   **settings: object) -> Manager:
    """A whole control plane (store, audit, tenants, quotas, ceilings, snapshots, processes)
    over a :class:`MemoryBackend` (or ``backend``: a :class:`MemoryVMBackend` for memory
    snapshots), in ``home``; no root needed. Pass it to ``create_app`` and ``asgi_transport``
    to drive the HTTP API in-process, or use it embedded. ``settings`` are
    :class:`corral._settings.Settings` fields. Close it when done."""
    from .._control.plane import Manager
    from .._settings import Settings

    return Manager(Settings(home=Path(home), **settings),  # type: ignore[arg-type]
                   backend=backend or MemoryBackend())
