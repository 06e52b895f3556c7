"""Memory images (memory snapshots): which tier can make and resume them, and what a sandbox
resuming one must match (the image is a running machine: its tier, root image and RAM)."""

from __future__ import annotations

from typing import Any

from ..backends import IsolationBackend, MemorySnapshots
from ..errors import UsageError

__all__ = ["capable", "check_resumable"]


def capable(backend: IsolationBackend, doing: str) -> MemorySnapshots:
    """``backend`` as a ``MemorySnapshots``; ``UsageError`` naming the tier that has it."""
    if not isinstance(backend, MemorySnapshots):
        raise UsageError(
            f"{doing} needs memory snapshots, which need the microvm tier (this sandbox runs "
            f"on the {backend.name} tier, which can snapshot only its workspace); create the "
            "sandbox with isolation='microvm', or take a disk snapshot (memory=False)")
    return backend


def check_resumable(image: dict[str, Any], *, snapshot: str, template: str, resources: str,
                    isolation: str) -> None:
    """Refuse a sandbox that could not resume ``image`` (recorded by ``Store``)."""
    for what, wanted, given in (("isolation", image["isolation"], isolation),
                                ("template", image["template"], template),
                                ("resources", image["resources"], resources)):
        if wanted != given:
            raise UsageError(
                f"snapshot {snapshot} holds a running sandbox's memory, taken with "
                f"{what}={wanted!r}, so a sandbox resuming it must have {what}={wanted!r} (not "
                f"{given!r}); pass {what}={wanted!r}")
