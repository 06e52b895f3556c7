"""The built-in resource tiers. README's table is generated from the same numbers."""

from __future__ import annotations

from ..errors import UsageError
from ..models import ResourceTier

__all__ = ["TIERS", "get_tier"]

MiB = 1024 * 1024
GiB = 1024 * MiB

TIERS: dict[str, ResourceTier] = {
    "small": ResourceTier(
        name="small",
        cpus=1.0,
        memory_bytes=512 * MiB,
        pids=128,
        disk_bytes=1 * GiB,
        tmp_bytes=64 * MiB,
        command_timeout_s=60.0,
        ttl_s=3600.0,
        max_ttl_s=24 * 3600.0,
        output_limit_bytes=1 * MiB,
    ),
    "large": ResourceTier(
        name="large",
        cpus=2.0,
        memory_bytes=4 * GiB,
        pids=1024,
        disk_bytes=10 * GiB,
        tmp_bytes=512 * MiB,
        command_timeout_s=600.0,
        ttl_s=4 * 3600.0,
        max_ttl_s=7 * 24 * 3600.0,
        output_limit_bytes=8 * MiB,
    ),
}


def get_tier(name: str) -> ResourceTier:
    """Return the tier called ``name``.

    Raises:
        UsageError: no such tier; the message lists the known ones.
    """
    try:
        return TIERS[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(TIERS))
        raise UsageError(f"unknown resource tier {name!r}; choose one of: {known}") from None
