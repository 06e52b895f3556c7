"""Operator commands: tenants, API keys and host secrets. They act on the local data directory."""

from __future__ import annotations

import sys

import click

from .. import errors
from .common import emit_json, handle_errors, json_option

__all__ = ["keys", "secrets", "tenants"]


@click.group()
def tenants() -> None:
    """Tenants of the HTTP service and their quotas."""


@tenants.command(name="add")
@click.argument("name")
@click.option("--max-sandboxes", default=10, show_default=True, type=int)
@click.option("--tier", "tiers", multiple=True, help="Allowed tier (repeatable; default small).")
@click.option("--commands-per-minute", default=600, show_default=True, type=int)
@json_option
@click.pass_context
@handle_errors
def tenants_add(ctx: click.Context, name: str, max_sandboxes: int, tiers: tuple[str, ...],
                commands_per_minute: int, as_json: bool) -> None:
    """Add (or update) a tenant."""
    from .._control.manager import get_manager
    from .._server.auth import TenantDirectory

    tenant = TenantDirectory(get_manager(ctx.obj["settings"]).store).add_tenant(
        name, max_sandboxes=max_sandboxes, tiers=list(tiers) or None,
        commands_per_minute=commands_per_minute)
    if as_json:
        emit_json({"name": tenant.name, "max_sandboxes": tenant.max_sandboxes,
                    "tiers": list(tenant.tiers),
                    "commands_per_minute": tenant.commands_per_minute})
    else:
        click.echo(f"tenant {tenant.name}: {tenant.max_sandboxes} sandboxes, tiers "
                   f"{','.join(tenant.tiers)}, {tenant.commands_per_minute} commands/min",
                   err=True)


@tenants.command(name="ls")
@json_option
@click.pass_context
@handle_errors
def tenants_ls(ctx: click.Context, as_json: bool) -> None:
    """List tenants."""
    from .._control.manager import get_manager

    rows = get_manager(ctx.obj["settings"]).store.tenants()
    if as_json:
        emit_json(rows)
        return
    for row in rows:
        click.echo(f"{row['name']}\t{row['max_sandboxes']}\t{','.join(row['tiers'])}\t"
                   f"{row['commands_per_minute']}/min")


@tenants.command(name="rm")
@click.argument("name")
@click.pass_context
@handle_errors
def tenants_rm(ctx: click.Context, name: str) -> None:
    """Remove a tenant and revoke its keys."""
    from .._control.manager import get_manager

    if not get_manager(ctx.obj["settings"]).store.remove_tenant(name):
        raise errors.UsageError(f"no tenant named {name!r}")


@click.group()
def keys() -> None:
    """API keys of the HTTP service (stored hashed; shown once)."""


@keys.command(name="create")
@click.argument("tenant")
@json_option
@click.pass_context
@handle_errors
def keys_create(ctx: click.Context, tenant: str, as_json: bool) -> None:
    """Create a key for TENANT and print it (it cannot be shown again)."""
    from .._control.manager import get_manager
    from .._server.auth import TenantDirectory

    key_id, key = TenantDirectory(get_manager(ctx.obj["settings"]).store).create_key(tenant)
    if as_json:
        emit_json({"id": key_id, "tenant": tenant, "key": key})
    else:
        click.echo(key)


@keys.command(name="revoke")
@click.argument("key_id")
@click.pass_context
@handle_errors
def keys_revoke(ctx: click.Context, key_id: str) -> None:
    """Revoke a key by its id (the 12 hex digits after ck_)."""
    from .._control.manager import get_manager

    if not get_manager(ctx.obj["settings"]).store.revoke_key(key_id.removeprefix("ck_")[:12]):
        raise errors.UsageError(f"no live key with id {key_id!r}")


@click.group()
def secrets() -> None:
    """Register secrets on the host. Their values are redacted from every audit record."""


@secrets.command(name="add")
@click.argument("name")
@click.option("--host", "hosts", multiple=True, metavar="HOST",
              help="A host the value may be sent to (repeatable): api.example.com, *.example.com.")
@json_option
@click.pass_context
@handle_errors
def secrets_add(ctx: click.Context, name: str, hosts: tuple[str, ...], as_json: bool) -> None:
    """Register NAME with its value read from stdin (never from the command line)."""
    from .._control.manager import get_manager

    value = sys.stdin.read().rstrip("\n")
    info = get_manager(ctx.obj["settings"]).secrets.add(name, value, list(hosts))
    if as_json:
        emit_json({"name": info.name, "hosts": list(info.hosts)})
    else:
        click.echo(f"registered {info.name}", err=True)


@secrets.command(name="ls")
@json_option
@click.pass_context
@handle_errors
def secrets_ls(ctx: click.Context, as_json: bool) -> None:
    """List secret names and hosts (never values)."""
    from .._control.manager import get_manager

    infos = get_manager(ctx.obj["settings"]).secrets.list()
    if as_json:
        emit_json([{"name": i.name, "hosts": list(i.hosts), "created_at": i.created_at}
                    for i in infos])
        return
    for info in infos:
        click.echo(f"{info.name}\t{','.join(info.hosts) or '-'}")


@secrets.command(name="rm")
@click.argument("name")
@json_option
@click.pass_context
@handle_errors
def secrets_rm(ctx: click.Context, name: str, as_json: bool) -> None:
    """Forget a secret."""
    from .._control.manager import get_manager

    if not get_manager(ctx.obj["settings"]).secrets.remove(name):
        raise errors.UsageError(f"no secret named {name!r}; `corral secrets ls` lists them")
    if as_json:
        emit_json({"removed": name})
