"""Text read from a sandbox's output."""

from __future__ import annotations

__all__ = ["readable"]


def readable(text: str) -> str:
    """``text`` read with ``surrogateescape`` (bytes that are not UTF-8 as lone surrogates, so it
    re-encodes to the very bytes) as text any encoder takes: each such byte becomes U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
