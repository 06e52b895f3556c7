"""``corral templates build|ls|rm``: workspace root filesystems built from Debian packages."""

from __future__ import annotations

import click


@click.group()
def templates() -> None:
    """Build, list and remove sandbox templates."""
