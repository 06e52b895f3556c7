"""Snapshot, fork and restore commands: ``corral snapshot``, ``corral fork``, ``corral restore``
and ``corral snapshots ls|info|rm``.

A thin layer over ``Sandbox``'s methods, so each works embedded and against ``--url`` /
``CORRAL_URL`` alike. With ``--json``, a snapshot prints as ``{id, name, sandbox, template,
created_at, size_bytes, depth, memory}`` and a sandbox as ``corral info --json`` prints it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from .._backends import BACKENDS
from .common import (
    F,
    columns,
    connect,
    emit_json,
    handle_errors,
    home_of,
    json_option,
    sdk,
    size_text,
    when,
)

if TYPE_CHECKING:
    from ..models import SnapshotInfo

__all__ = ["fork", "restore", "snapshot", "snapshots", "start_options"]


def start_options(fn: F) -> F:
    """--template, --image, --isolation and --snapshot, shared by `run` and `create`."""
    for decorator in reversed([
        click.option("--template", default=None, metavar="NAME",
                     help="Root filesystem: base (default), or one built with "
                          "`corral templates build` (python, node, ...)."),
        click.option("--image", default=None, metavar="REF",
                     help="Root filesystem from an image instead ([host/]path[:tag][@sha256:"
                          "...], oci:/dir, docker-archive:/file.tar); pulled unless it was."),
        click.option("--isolation", type=click.Choice(list(BACKENDS)), default=None,
                     help="Isolation tier (default: the configured one, namespace unless set); "
                          "`corral doctor` says which this host supports."),
        click.option("--snapshot", "snapshot_ref", default=None, metavar="REF",
                     help="Start from this snapshot's workspace and template (id or name)."),
    ]):
        fn = decorator(fn)
    return fn


def _snapshot_json(snap: SnapshotInfo) -> dict[str, Any]:
    return snap.to_dict()


@click.command()
@click.argument("sandbox_id")
@click.option("--name", default=None, metavar="NAME",
              help="Name it (letters, digits, _ . -; unique among your snapshots); refer to "
                   "it by name or id later.")
@click.option("--memory", is_flag=True,
              help="Also save the running sandbox's memory and processes, while commands "
                   "run (microvm tier only); sandboxes started from it resume them.")
@json_option
@click.pass_context
@handle_errors
def snapshot(ctx: click.Context, sandbox_id: str, name: str | None, memory: bool,
             as_json: bool) -> None:
    """Save a sandbox's /workspace as it is now, and print the snapshot's id.

    Instant whatever the workspace's size; the sandbox goes on from there. Nothing may be
    running in it, unless --memory (microvm tier): then its memory and processes are saved
    too, at one instant, running commands included. Start sandboxes from it with
    `corral create --snapshot REF`, roll back with `corral restore ID REF`.

    \b
    Example:
      SNAP=$(corral snapshot $ID --name before-upgrade)
      WARM=$(corral snapshot $ID --memory --name warmed-up)
    """
    snap = connect(ctx, sandbox_id).snapshot(name, memory=memory)
    if as_json:
        emit_json(_snapshot_json(snap))
    else:
        click.echo(snap.id)


@click.command()
@click.argument("sandbox_id")
@click.option("--count", "-n", type=int, default=1, show_default=True,
              help="How many sandboxes to make (1-64).")
@click.option("--memory", is_flag=True,
              help="Each resumes the running sandbox's memory and processes as they are now "
                   "(microvm tier only); commands may be running.")
@json_option
@click.pass_context
@handle_errors
def fork(ctx: click.Context, sandbox_id: str, count: int, memory: bool,
         as_json: bool) -> None:
    """Make new sandboxes that start from this one's /workspace as it is now; print their ids.

    Instant whatever the workspace's size (they share its read-only layers). Each gets the
    original's template, tier, isolation, network policy, secrets and labels, and its own
    lifetime. Nothing may be running in the original, unless --memory.

    \b
    Example:
      for id in $(corral fork $ID -n 3); do corral exec $id -- ./try.sh & done
    """
    children = connect(ctx, sandbox_id).fork(count, memory=memory)
    if as_json:
        emit_json([child.get_info().to_dict() for child in children])
    else:
        for child in children:
            click.echo(child.id)


@click.command()
@click.argument("sandbox_id")
@click.argument("snapshot_ref", metavar="SNAPSHOT")
@json_option
@click.pass_context
@handle_errors
def restore(ctx: click.Context, sandbox_id: str, snapshot_ref: str, as_json: bool) -> None:
    """Put a sandbox's /workspace back exactly as it was in SNAPSHOT (its id or name).

    Changes made since, and not saved in a snapshot, are gone. Nothing may be running in the
    sandbox.
    """
    sb = connect(ctx, sandbox_id)
    sb.restore(snapshot_ref)
    if as_json:
        emit_json(sb.get_info().to_dict())
    else:
        click.echo(f"restored {sandbox_id} to {snapshot_ref}", err=True)


@click.group()
def snapshots() -> None:
    """List, inspect and delete snapshots (made with `corral snapshot`)."""


@snapshots.command(name="ls")
@json_option
@click.pass_context
@handle_errors
def snapshots_ls(ctx: click.Context, as_json: bool) -> None:
    """List snapshots (of the data directory, or of your tenant on a service)."""
    snaps = sdk().list_snapshots(home=home_of(ctx))
    if as_json:
        emit_json([_snapshot_json(s) for s in snaps])
        return
    if not snaps:
        click.echo("no snapshots", err=True)
        return
    # Plain columns: rich's table cut ids and names to the terminal's width.
    rows = [(s.id, s.name or "-", s.template, s.sandbox, size_text(s.size_bytes), str(s.depth),
             "yes" if s.memory else "no", when(s.created_at)) for s in snaps]
    click.echo(columns(("ID", "NAME", "TEMPLATE", "FROM", "SIZE", "DEPTH", "MEMORY",
                        "CREATED"), rows))


@snapshots.command(name="info")
@click.argument("snapshot_ref", metavar="SNAPSHOT")
@json_option
@click.pass_context
@handle_errors
def snapshots_info(ctx: click.Context, snapshot_ref: str, as_json: bool) -> None:
    """Show one snapshot, by id or name."""
    snap = sdk().get_snapshot(snapshot_ref, home=home_of(ctx))
    if as_json:
        emit_json(_snapshot_json(snap))
    else:
        for key, value in _snapshot_json(snap).items():
            click.echo(f"{key:11} {value}")


@snapshots.command(name="rm")
@click.argument("snapshot_refs", nargs=-1, required=True, metavar="SNAPSHOT...")
@json_option
@click.pass_context
@handle_errors
def snapshots_rm(ctx: click.Context, snapshot_refs: tuple[str, ...], as_json: bool) -> None:
    """Delete snapshots, by id or name.

    Refused for a snapshot a live sandbox is built on (started from it, forked from it or
    restored to it): destroy those sandboxes, or restore them to another snapshot, first.
    """
    for ref in snapshot_refs:
        sdk().delete_snapshot(ref, home=home_of(ctx))
        if not as_json:
            click.echo(f"removed {ref}", err=True)
    if as_json:
        emit_json({"removed": list(snapshot_refs)})
