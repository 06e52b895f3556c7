"""Helpers for testing code that uses Corral (a minimal package; the integrator completes it)."""

from __future__ import annotations

from .transport import asgi_transport, async_asgi_transport

__all__ = ["asgi_transport", "async_asgi_transport"]
