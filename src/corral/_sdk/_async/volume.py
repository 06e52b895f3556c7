"""Persistent named volumes: made, listed and deleted apart from any sandbox, mounted by
``AsyncSandbox.create(volumes=...)``."""

from __future__ import annotations

import builtins
from pathlib import Path

from ...models import VolumeInfo
from .._aembedded import ausing_transport
from .transport import AsyncTransport

__all__ = ["AsyncVolume"]


class AsyncVolume:
    """A filesystem of a fixed size that outlives sandboxes, restarts and crashes, owned by
    your tenant. Full is ``ENOSPC`` inside.

    Example:
        >>> await AsyncVolume.create("cache", size="1G")
        >>> async with await AsyncSandbox.create(volumes={"cache": "/mnt/cache"}) as sb:
        ...     await sb.commands.run("echo kept > /mnt/cache/note")
    """

    @classmethod
    async def create(cls, name: str, *, size: int | str = "1G",
                     home: str | Path | None = None, url: str | None = None,
                     api_key: str | None = None,
                     transport: AsyncTransport | None = None) -> VolumeInfo:
        """Make an empty volume of ``size`` (bytes, or ``512M``, ``10G``).

        Raises:
            UsageError: a bad name or size, or a volume of that name exists.
        """
        async with ausing_transport(transport, home, url, api_key) as opened:
            return await opened.create_volume(name, size)

    @classmethod
    async def get(cls, name: str, *, home: str | Path | None = None, url: str | None = None,
                  api_key: str | None = None,
                  transport: AsyncTransport | None = None) -> VolumeInfo:
        """A volume by name or id, with its use and who mounts it. Raises ``VolumeNotFound``."""
        async with ausing_transport(transport, home, url, api_key) as opened:
            return await opened.get_volume(name)

    @classmethod
    async def list(cls, *, home: str | Path | None = None, url: str | None = None,
                   api_key: str | None = None,
                   transport: AsyncTransport | None = None) -> builtins.list[VolumeInfo]:
        """Every volume (of the data directory, or of your tenant on a service)."""
        async with ausing_transport(transport, home, url, api_key) as opened:
            return await opened.list_volumes()

    @classmethod
    async def delete(cls, name: str, *, home: str | Path | None = None,
                     url: str | None = None, api_key: str | None = None,
                     transport: AsyncTransport | None = None) -> None:
        """Delete a volume and its data. Raises ``VolumeInUse`` while a sandbox mounts it."""
        async with ausing_transport(transport, home, url, api_key) as opened:
            await opened.delete_volume(name)
