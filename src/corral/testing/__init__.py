"""Helpers for testing code that uses Corral, without root: an in-memory backend
(``corral.testing.backend``) and in-process transports to the HTTP API (``asgi_transport``).

Nothing here isolates anything; never run untrusted code with it."""

from __future__ import annotations

from .transport import asgi_transport, async_asgi_transport

__all__ = ["asgi_transport", "async_asgi_transport"]
