"""Sandbox ids as the E2B SDKs and port host names see them.

Corral's ids (``sbx_<12 base36>``) hold an underscore, which is not valid in a DNS label, and
domain mode puts the id in a host name (``49983-<id>.<domain>``). The E2B surface shows the same
id with ``-`` for ``_``: a bijection, since a Corral id has exactly one underscore after its
prefix, so nothing is stored.
"""

from __future__ import annotations

import re

__all__ = ["E2B_ID", "from_e2b", "to_e2b"]

# What the SDKs accept in a host name label, with room for the "49983-" port prefix.
E2B_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,56}")
_CORRAL_ID = re.compile(r"(sbx|snap)_([a-z0-9]{1,50})")


def to_e2b(corral_id: str) -> str:
    return corral_id.replace("_", "-", 1)


def from_e2b(e2b_id: str) -> str | None:
    """The Corral id, or None when ``e2b_id`` cannot be one of ours."""
    if not E2B_ID.fullmatch(e2b_id):
        return None
    prefix, dash, rest = e2b_id.partition("-")
    candidate = f"{prefix}_{rest}" if dash else e2b_id
    return candidate if _CORRAL_ID.fullmatch(candidate) else None
