"""Volume commands: ``corral volumes create|ls|info|rm``, and the ``--volume`` / ``--data``
options ``run`` and ``create`` take to mount them.

A thin layer over ``Volume``, so each works embedded and against ``--url`` / ``CORRAL_URL``
alike. With ``--json``, a volume prints as ``{id, name, size_bytes, used_bytes, created_at,
mounted_by, writer}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from .common import (
    F,
    columns,
    emit_json,
    handle_errors,
    home_of,
    json_option,
    size_text,
    when,
)

if TYPE_CHECKING:
    from .._sdk.sandbox import Volume
    from ..models import VolumeInfo

__all__ = ["mount_options", "parse_data_mounts", "parse_volumes", "volumes"]

_VOLUME_SYNTAX = "NAME:/mnt/PATH[:ro]"
_DATA_SYNTAX = "NAME:/mnt/PATH"


def _volume_sdk() -> type[Volume]:
    from .._sdk.sandbox import Volume

    return Volume


def _split(value: str, syntax: str, example: str) -> tuple[str, str, str | None]:
    """NAME, PATH and the optional mode of one ``NAME:PATH[:MODE]``. Neither a volume's name
    nor a mount point can hold a colon, so splitting on it is unambiguous."""
    parts = value.split(":")
    if len(parts) not in (2, 3):
        raise click.BadParameter(
            f"{value!r} is not {syntax} (like {example})" if len(parts) < 2 else
            f"{value!r} has too many ':'; the form is {syntax} (like {example})")
    name, path = parts[0], parts[1]
    if not name:
        raise click.BadParameter(f"{value!r} names no volume before the ':'; the form is "
                                 f"{syntax} (like {example})")
    if not path.startswith("/"):
        raise click.BadParameter(f"{value!r}: the mount point {path!r} must be an absolute "
                                 f"path under /mnt/ or /workspace/ (like {example})")
    return name, path, parts[2] if len(parts) == 3 else None


def parse_volumes(values: Sequence[str]) -> dict[str, str | dict[str, Any]]:
    """``--volume`` values as ``Sandbox.create(volumes=...)`` takes them."""
    parsed: dict[str, str | dict[str, Any]] = {}
    for value in values:
        name, path, mode = _split(value, _VOLUME_SYNTAX, "cache:/mnt/cache:ro")
        if mode not in (None, "ro", "rw"):
            raise click.BadParameter(f"{value!r}: after the mount point comes ro (read-only) "
                                     f"or rw (the default), not {mode!r}")
        if name in parsed:
            # The SDK maps each volume to one mount point: a second would silently win.
            raise click.BadParameter(f"volume {name!r} is given twice; mount each volume once")
        parsed[name] = {"path": path, "read_only": True} if mode == "ro" else path
    return parsed


def parse_data_mounts(values: Sequence[str]) -> dict[str, str]:
    """``--data`` values as ``Sandbox.create(data_mounts=...)`` takes them."""
    parsed: dict[str, str] = {}
    for value in values:
        name, path, mode = _split(value, _DATA_SYNTAX, "refs:/mnt/refs")
        if mode == "rw":
            raise click.BadParameter(f"{value!r}: data mounts are always read-only")
        if mode not in (None, "ro"):
            raise click.BadParameter(f"{value!r}: the form is {_DATA_SYNTAX} (data mounts are "
                                     f"read-only), not {mode!r} after the mount point")
        if name in parsed:
            raise click.BadParameter(f"data mount {name!r} is given twice; mount each once")
        parsed[name] = path
    return parsed


def _volumes_option(ctx: click.Context, param: click.Parameter,
                    values: tuple[str, ...]) -> dict[str, str | dict[str, Any]] | None:
    return parse_volumes(values) or None


def _data_option(ctx: click.Context, param: click.Parameter,
                 values: tuple[str, ...]) -> dict[str, str] | None:
    return parse_data_mounts(values) or None


def mount_options(fn: F) -> F:
    """--volume and --data, shared by `run` and `create`; parsed while the options are, so a
    typo is refused before any sandbox exists."""
    for decorator in reversed([
        click.option("--volume", "volumes", multiple=True, metavar=_VOLUME_SYNTAX,
                     callback=_volumes_option,
                     help="Mount your volume NAME (`corral volumes create`) at PATH, under "
                          "/mnt/ or /workspace/; :ro mounts it read-only. A volume has one "
                          "writer or any number of readers at a time; repeatable."),
        click.option("--data", "data_mounts", multiple=True, metavar=_DATA_SYNTAX,
                     callback=_data_option,
                     help="Mount the operator's data directory NAME (CORRAL_DATA_MOUNTS) "
                          "read-only at PATH; repeatable."),
    ]):
        fn = decorator(fn)
    return fn


def _volume_json(volume: VolumeInfo) -> dict[str, Any]:
    return volume.to_dict()


@click.group()
def volumes() -> None:
    """Make, list, inspect and delete persistent volumes.

    A volume is a filesystem of a fixed size that outlives sandboxes (full is ENOSPC inside).
    Mount it with `corral create --volume NAME:/mnt/PATH` (append :ro for read-only): at any
    time it has one writer or any number of readers, never both.

    \b
    Example:
      corral volumes create cache --size 2G
      ID=$(corral create --volume cache:/mnt/cache)
      corral run --volume cache:/mnt/cache:ro -- ls /mnt/cache
    """


@volumes.command(name="create")
@click.argument("name")
@click.option("--size", default="1G", show_default=True, metavar="SIZE",
              help="Its quota: bytes, or with a unit (512M, 10G).")
@json_option
@click.pass_context
@handle_errors
def volumes_create(ctx: click.Context, name: str, size: str, as_json: bool) -> None:
    """Make an empty volume NAME and print its id.

    NAME: 1-63 of a-z, 0-9, _ . - (starting with a letter or digit), unique among your
    volumes; refer to it by name or id later.
    """
    volume = _volume_sdk().create(name, size=size, home=home_of(ctx))
    if as_json:
        emit_json(_volume_json(volume))
    else:
        click.echo(volume.id)


@volumes.command(name="ls")
@json_option
@click.pass_context
@handle_errors
def volumes_ls(ctx: click.Context, as_json: bool) -> None:
    """List volumes (of the data directory, or of your tenant on a service)."""
    found = _volume_sdk().list(home=home_of(ctx))
    if as_json:
        emit_json([_volume_json(v) for v in found])
        return
    if not found:
        click.echo("no volumes", err=True)
        return
    rows = [(v.name, v.id, size_text(v.size_bytes),
             "-" if v.used_bytes is None else size_text(v.used_bytes),
             _holders(v), when(v.created_at))
            for v in found]
    click.echo(columns(("NAME", "ID", "SIZE", "USED", "MOUNTED BY", "CREATED"), rows))


def _holders(volume: VolumeInfo) -> str:
    """Who mounts it, the writer marked, or ``-``."""
    return ",".join(f"{sid} (rw)" if sid == volume.writer else sid
                    for sid in volume.mounted_by) or "-"


@volumes.command(name="info")
@click.argument("ref", metavar="NAME")
@json_option
@click.pass_context
@handle_errors
def volumes_info(ctx: click.Context, ref: str, as_json: bool) -> None:
    """Show one volume, by name or id: its size, use and the sandboxes that mount it."""
    volume = _volume_sdk().get(ref, home=home_of(ctx))
    if as_json:
        emit_json(_volume_json(volume))
        return
    lines = {
        "name": volume.name, "id": volume.id, "size": size_text(volume.size_bytes),
        "used": "-" if volume.used_bytes is None else size_text(volume.used_bytes),
        "created": when(volume.created_at),
        "mounted by": ", ".join(volume.mounted_by) or "-",
        "writer": volume.writer or "-",
    }
    for key, value in lines.items():
        click.echo(f"{key:11} {value}")


@volumes.command(name="rm")
@click.argument("refs", nargs=-1, required=True, metavar="NAME...")
@json_option
@click.pass_context
@handle_errors
def volumes_rm(ctx: click.Context, refs: tuple[str, ...], as_json: bool) -> None:
    """Delete volumes and their data, by name or id.

    Refused while a sandbox mounts one: destroy those sandboxes first (`corral volumes info
    NAME` lists them).
    """
    for ref in refs:
        _volume_sdk().delete(ref, home=home_of(ctx))
        if not as_json:
            click.echo(f"removed {ref}", err=True)
    if as_json:
        emit_json({"removed": list(refs)})
