# Generated from src/corral/_sdk/_async/volume.py by scripts/unasync: do not edit.
# Change the async source and run scripts/unasync.
"""Persistent named volumes: made, listed and deleted apart from any sandbox, mounted by
``Sandbox.create(volumes=...)``."""

from __future__ import annotations

import builtins
from pathlib import Path

from ...models import VolumeInfo
from .._embedded import using_transport
from .transport import Transport

__all__ = ["Volume"]


class Volume:
    """A filesystem of a fixed size that outlives sandboxes, restarts and crashes, owned by
    your tenant. Full is ``ENOSPC`` inside.

    Example:
        >>> Volume.create("cache", size="1G")
        >>> with Sandbox.create(volumes={"cache": "/mnt/cache"}) as sb:
        ...     sb.commands.run("echo kept > /mnt/cache/note")
    """

    @classmethod
    def create(cls, name: str, *, size: int | str = "1G",
                     home: str | Path | None = None, url: str | None = None,
                     api_key: str | None = None,
                     transport: Transport | None = None) -> VolumeInfo:
        """Make an empty volume of ``size`` (bytes, or ``512M``, ``10G``).

        Raises:
            UsageError: a bad name or size, or a volume of that name exists.
        """
        with using_transport(transport, home, url, api_key) as opened:
            return opened.create_volume(name, size)

    @classmethod
    def get(cls, name: str, *, home: str | Path | None = None, url: str | None = None,
                  api_key: str | None = None,
                  transport: Transport | None = None) -> VolumeInfo:
        """A volume by name or id, with its use and who mounts it. Raises ``VolumeNotFound``."""
        with using_transport(transport, home, url, api_key) as opened:
            return opened.get_volume(name)

    @classmethod
    def list(cls, *, home: str | Path | None = None, url: str | None = None,
                   api_key: str | None = None,
                   transport: Transport | None = None) -> builtins.list[VolumeInfo]:
        """Every volume (of the data directory, or of your tenant on a service)."""
        with using_transport(transport, home, url, api_key) as opened:
            return opened.list_volumes()

    @classmethod
    def delete(cls, name: str, *, home: str | Path | None = None,
                     url: str | None = None, api_key: str | None = None,
                     transport: Transport | None = None) -> None:
        """Delete a volume and its data. Raises ``VolumeInUse`` while a sandbox mounts it."""
        with using_transport(transport, home, url, api_key) as opened:
            opened.delete_volume(name)
