"""Host uids for sandboxes: each sandbox of a host-backed tier runs as its own unprivileged uid
from the operator's range (``CORRAL_UID_START``, ``CORRAL_UID_COUNT``)."""

from __future__ import annotations

from collections.abc import Set

from ...errors import QuotaExceeded

__all__ = ["lowest_free_uid"]


def lowest_free_uid(taken: Set[int], start: int, count: int) -> int:
    """The lowest uid of ``start .. start + count - 1`` not in ``taken``."""
    for uid in range(start, start + count):
        if uid not in taken:
            return uid
    raise QuotaExceeded(
        f"all {count} sandbox uids ({start}..{start + count - 1}) are in use; remove "
        "sandboxes (`corral ls`, `corral rm ID`) or widen CORRAL_UID_COUNT")
