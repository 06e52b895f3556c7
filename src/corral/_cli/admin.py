"""Operator commands: tenants, API keys and host secrets. They act on the local data directory."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from .. import errors
from .common import emit_json, handle_errors, json_option

if TYPE_CHECKING:  # imported by the commands that run: `corral --help` loads this module
    from .._control.plane import Ceiling, Tenant

__all__ = ["keys", "secrets", "tenants"]


@click.group()
def tenants() -> None:
    """Tenants of the HTTP service: their quotas and their ceilings.

    A ceiling is the most a tenant's callers may ask for (a steered model writes the create
    call as easily as the code): the hosts an allowlist may name, the templates, isolation
    and resource tiers, the secrets and the longest lifetime. Anything beyond is refused
    (403 ceiling_exceeded). Where a tenant sets no bound, the server default applies
    (CORRAL_CEILING_HOSTS, _TEMPLATES, _ISOLATION, _RESOURCES, _SECRETS, _MAX_LIFETIME_S).
    """


def _ceiling_options(fn: Any) -> Any:
    options = [
        click.option("--allow-host", "hosts", multiple=True, metavar="PATTERN",
                     help="Ceiling: an allow rule its sandboxes' allowlists must fall within "
                          "(repeatable): api.example.com, *.example.com, host:8443."),
        click.option("--no-network", is_flag=True,
                     help="Ceiling: its sandboxes may allow no host at all."),
        click.option("--template", "templates", multiple=True, metavar="NAME",
                     help="Ceiling: a template its sandboxes may use (repeatable)."),
        click.option("--isolation", "isolation", multiple=True,
                     type=click.Choice(["namespace", "gvisor"]),
                     help="Ceiling: an isolation tier its sandboxes may use (repeatable)."),
        click.option("--resources", "resources", multiple=True, metavar="TIER",
                     help="Ceiling: a resource tier its sandboxes may use (repeatable)."),
        click.option("--secret", "secrets", multiple=True, metavar="NAME",
                     help="Ceiling: a secret its sandboxes may bind (repeatable)."),
        click.option("--max-lifetime", "max_lifetime", type=int, metavar="SECONDS",
                     help="Ceiling: the longest lifetime (TTL) of its sandboxes."),
        click.option("--max-asleep", "max_asleep", type=int, metavar="SECONDS",
                     help="Ceiling: the longest one of its sandboxes may stay paused or "
                          "hibernated before it is destroyed."),
        click.option("--max-hibernated", "max_hibernated", type=int, metavar="N",
                     help="Ceiling: how many of its sandboxes may be hibernated at once "
                          "(0: none)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _ceiling_fields(hosts: tuple[str, ...], no_network: bool, templates: tuple[str, ...],
                    isolation: tuple[str, ...], resources: tuple[str, ...],
                    secrets: tuple[str, ...], max_lifetime: int | None,
                    max_asleep: int | None, max_hibernated: int | None) -> dict[str, Any]:
    """Only the ceiling fields given on the command line."""
    if no_network and hosts:
        raise errors.UsageError("--no-network and --allow-host contradict each other; give one")
    fields: dict[str, Any] = {}
    if no_network or hosts:
        fields["hosts"] = hosts
    for name, values in (("templates", templates), ("isolation", isolation),
                         ("resources", resources), ("secrets", secrets)):
        if values:
            fields[name] = values
    if max_lifetime is not None:
        fields["max_lifetime_s"] = max_lifetime
    if max_asleep is not None:
        fields["max_asleep_s"] = max_asleep
    if max_hibernated is not None:
        fields["max_hibernated"] = max_hibernated
    return fields


def _audit_options(fn: Any) -> Any:
    options = [
        click.option("--audit-max-bytes", "audit_max", metavar="SIZE",
                     help="Audit budget of all its live sandboxes' trails together (500M, "
                          "4G; 0: none). Default: CORRAL_AUDIT_TENANT_MAX_BYTES."),
        click.option("--audit-sandbox-max-bytes", "audit_sandbox_max", metavar="SIZE",
                     help="Audit budget of each of its sandboxes' trails (64M; 0: none). "
                          "Default: CORRAL_AUDIT_SANDBOX_MAX_BYTES."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _bytes(value: str | None, option: str) -> int | None:
    if value is None:
        return None
    from .._control.plane import parse_size

    try:
        return parse_size(value)
    except errors.UsageError:
        raise errors.UsageError(f"{option} takes a size like 64M or 4G (0: no budget), not "
                                f"{value!r}") from None


def _tenant_json(tenant: Tenant) -> dict[str, Any]:
    return {"name": tenant.name, "max_sandboxes": tenant.max_sandboxes,
            "tiers": list(tenant.tiers), "commands_per_minute": tenant.commands_per_minute,
            "ceiling": tenant.ceiling.to_json(), "audit_max_bytes": tenant.audit_max_bytes,
            "audit_sandbox_max_bytes": tenant.audit_sandbox_max_bytes}


def _audit_text(tenant: Tenant) -> str:
    def shown(value: int | None) -> str:
        return "default" if value is None else ("none" if value == 0 else str(value))

    return (f"audit {shown(tenant.audit_max_bytes)} total, "
            f"{shown(tenant.audit_sandbox_max_bytes)} per sandbox")


def _ceiling_text(ceiling: Ceiling) -> str:
    parts = [f"{name}={','.join(value) if isinstance(value, list) else value}"
             for name, value in ceiling.to_json().items()]
    return " ".join(p if not p.endswith("=") else p + "(none)" for p in parts) or "-"


def _show(tenant: Tenant, as_json: bool) -> None:
    if as_json:
        emit_json(_tenant_json(tenant))
    else:
        click.echo(f"tenant {tenant.name}: {tenant.max_sandboxes} sandboxes, tiers "
                   f"{','.join(tenant.tiers)}, {tenant.commands_per_minute} commands/min, "
                   f"ceiling {_ceiling_text(tenant.ceiling)}, {_audit_text(tenant)}",
                   err=True)


@tenants.command(name="add")
@click.argument("name")
@click.option("--max-sandboxes", default=10, show_default=True, type=int)
@click.option("--tier", "tiers", multiple=True, help="Allowed tier (repeatable; default small).")
@click.option("--commands-per-minute", default=600, show_default=True, type=int,
              help="Starts of code per minute: commands, background processes, terminals.")
@_ceiling_options
@_audit_options
@json_option
@click.pass_context
@handle_errors
def tenants_add(ctx: click.Context, name: str, max_sandboxes: int, tiers: tuple[str, ...],
                commands_per_minute: int, hosts: tuple[str, ...], no_network: bool,
                templates: tuple[str, ...], isolation: tuple[str, ...],
                resources: tuple[str, ...], secrets: tuple[str, ...],
                max_lifetime: int | None, max_asleep: int | None,
                max_hibernated: int | None, audit_max: str | None,
                audit_sandbox_max: str | None, as_json: bool) -> None:
    """Add (or replace) a tenant; ceiling options not given set no bound of its own, audit
    budgets not given follow the server's default."""
    from .._control.plane import get_manager

    fields = _ceiling_fields(hosts, no_network, templates, isolation, resources, secrets,
                             max_lifetime, max_asleep, max_hibernated)
    from .._control.plane import Ceiling, TenantDirectory

    tenant = TenantDirectory(get_manager(ctx.obj["settings"]).store).add_tenant(
        name, max_sandboxes=max_sandboxes, tiers=list(tiers) or None,
        commands_per_minute=commands_per_minute, ceiling=Ceiling.build(**fields),
        audit_max_bytes=_bytes(audit_max, "--audit-max-bytes"),
        audit_sandbox_max_bytes=_bytes(audit_sandbox_max, "--audit-sandbox-max-bytes"))
    _show(tenant, as_json)


@tenants.command(name="set")
@click.argument("name")
@click.option("--max-sandboxes", type=int)
@click.option("--tier", "tiers", multiple=True, help="Allowed tier (repeatable; replaces).")
@click.option("--commands-per-minute", type=int)
@_ceiling_options
@click.option("--clear-ceiling", is_flag=True,
              help="Drop the tenant's own ceiling first (the server default applies).")
@_audit_options
@click.option("--clear-audit-budgets", "clear_audit", is_flag=True,
              help="Drop the tenant's own audit budgets first (the server default applies).")
@json_option
@click.pass_context
@handle_errors
def tenants_set(ctx: click.Context, name: str, max_sandboxes: int | None,
                tiers: tuple[str, ...], commands_per_minute: int | None,
                hosts: tuple[str, ...], no_network: bool, templates: tuple[str, ...],
                isolation: tuple[str, ...], resources: tuple[str, ...],
                secrets: tuple[str, ...], max_lifetime: int | None, max_asleep: int | None,
                max_hibernated: int | None, clear_ceiling: bool, audit_max: str | None,
                audit_sandbox_max: str | None, clear_audit: bool, as_json: bool) -> None:
    """Change a tenant: only what is given changes (each ceiling option replaces that field).

    A sandbox paused at its audit budget may be resumed once the budget is raised here."""
    from .._control.plane import Ceiling, TenantDirectory, get_manager

    directory = TenantDirectory(get_manager(ctx.obj["settings"]).store)
    fields = _ceiling_fields(hosts, no_network, templates, isolation, resources, secrets,
                             max_lifetime, max_asleep, max_hibernated)
    if clear_ceiling:
        old = directory.get(name)
        directory.add_tenant(name, max_sandboxes=old.max_sandboxes, tiers=list(old.tiers),
                             commands_per_minute=old.commands_per_minute,
                             audit_max_bytes=old.audit_max_bytes,
                             audit_sandbox_max_bytes=old.audit_sandbox_max_bytes)
    tenant = directory.set_tenant(name, max_sandboxes=max_sandboxes, tiers=list(tiers) or None,
                                  commands_per_minute=commands_per_minute,
                                  ceiling=Ceiling.build(**fields).to_json(),
                                  audit_max_bytes=_bytes(audit_max, "--audit-max-bytes"),
                                  audit_sandbox_max_bytes=_bytes(
                                      audit_sandbox_max, "--audit-sandbox-max-bytes"),
                                  clear_audit=clear_audit)
    _show(tenant, as_json)


@tenants.command(name="ls")
@json_option
@click.pass_context
@handle_errors
def tenants_ls(ctx: click.Context, as_json: bool) -> None:
    """List tenants: name, sandboxes, tiers, commands/min and ceiling ("-" = none of its own).

    --json: a list of {name, max_sandboxes, tiers, commands_per_minute, ceiling,
    audit_max_bytes, audit_sandbox_max_bytes}, where ceiling holds only the fields it bounds
    (hosts, templates, isolation, resources, secrets: lists; max_lifetime_s: seconds) and an
    audit budget is null where the server default applies (0: none)."""
    from .._control.plane import TenantDirectory, get_manager

    found = TenantDirectory(get_manager(ctx.obj["settings"]).store).tenants()
    if as_json:
        emit_json([_tenant_json(t) for t in found])
        return
    for t in found:
        click.echo(f"{t.name}\t{t.max_sandboxes}\t{','.join(t.tiers)}\t"
                   f"{t.commands_per_minute}/min\t{_ceiling_text(t.ceiling)}\t"
                   f"{_audit_text(t)}")


@tenants.command(name="rm")
@click.argument("name")
@json_option
@click.pass_context
@handle_errors
def tenants_rm(ctx: click.Context, name: str, as_json: bool) -> None:
    """Remove a tenant and revoke its keys."""
    from .._control.plane import get_manager

    if not get_manager(ctx.obj["settings"]).store.remove_tenant(name):
        raise errors.UsageError(f"no tenant named {name!r}; `corral tenants ls` lists them")
    if as_json:
        emit_json({"removed": name})


@click.group()
def keys() -> None:
    """API keys of the HTTP service (stored hashed; shown once)."""


@keys.command(name="create")
@click.argument("tenant", required=False)
@click.option("--e2b", is_flag=True,
              help="A key in the E2B SDKs' format (e2b_<hex>) for `corral serve --e2b-port`: "
                   "set it as E2B_API_KEY. Same tenant, quotas and ceilings as any key.")
@click.option("--operator", is_flag=True,
              help="An operator key instead of a tenant's: every tenant's sandboxes, no "
                   "quotas, the dashboard's tenants page. Guard it like root's password.")
@json_option
@click.pass_context
@handle_errors
def keys_create(ctx: click.Context, tenant: str | None, e2b: bool, operator: bool,
                as_json: bool) -> None:
    """Create a key for TENANT (or, with --operator, the operator's) and print it (it
    cannot be shown again)."""
    from .._control.plane import TenantDirectory, get_manager

    directory = TenantDirectory(get_manager(ctx.obj["settings"]).store)
    if operator:
        if tenant is not None or e2b:
            raise errors.UsageError("--operator takes no TENANT and no --e2b")
        key_id, key = directory.create_operator_key()
        tenant = "local"
    elif tenant is None:
        raise errors.UsageError("name the TENANT the key is for (or pass --operator)")
    else:
        key_id, key = directory.create_key(tenant, e2b=e2b)
    if as_json:
        emit_json({"id": key_id, "tenant": tenant, "key": key})
    else:
        click.echo(key)


@keys.command(name="revoke")
@click.argument("key_id")
@json_option
@click.pass_context
@handle_errors
def keys_revoke(ctx: click.Context, key_id: str, as_json: bool) -> None:
    """Revoke a key by its id (the 12 hex digits after ck_, or e2b_ and the 12 after it).

    \b
    Example:
      corral keys revoke ck_0123456789ab
    """
    from .._control.plane import get_manager

    revoked = (key_id[:16] if key_id.startswith("e2b_")
               else key_id.removeprefix("ck_")[:12])
    if not get_manager(ctx.obj["settings"]).store.revoke_key(revoked):
        raise errors.UsageError(f"no live key with id {key_id!r}")
    if as_json:
        emit_json({"revoked": revoked})


@click.group()
def secrets() -> None:
    """Register secrets on the host. Their values are redacted from every audit record."""


@secrets.command(name="add")
@click.argument("name")
@click.option("--host", "hosts", multiple=True, metavar="HOST[:PORT]",
              help="A host the value may be sent to over HTTPS (repeatable): api.example.com "
                   "(port 443), api.example.com:8443, *.example.com.")
@json_option
@click.pass_context
@handle_errors
def secrets_add(ctx: click.Context, name: str, hosts: tuple[str, ...], as_json: bool) -> None:
    """Register NAME with its value read from stdin (never from the command line).

    Sandboxes given NAME see a placeholder; the egress gateway puts the value in its place only
    in HTTPS requests to these hosts and ports (a host without a port: 443). An upstream that
    echoes requests back (httpbin-style /headers or /anything, error pages quoting the
    request, a debug endpoint) hands the real value to the sandbox: bind secrets only to hosts
    that never reflect what they are sent.
    """
    from .._control.plane import get_manager

    value = sys.stdin.read().rstrip("\n")
    info = get_manager(ctx.obj["settings"]).secrets.add(name, value, list(hosts))
    if as_json:
        emit_json({"name": info.name, "hosts": list(info.hosts)})
        return
    where = ", ".join(info.hosts) or "no host (add --host: until then it is sent nowhere)"
    click.echo(f"registered {info.name}: replaced in HTTPS requests to {where}; another port of "
               "one of these hosts gets the placeholder, not the value (name it as "
               "HOST:PORT)", err=True)
    click.secho(f"warning: an upstream that echoes requests back (a /headers or /anything "
                f"endpoint, an error page that quotes the request) hands {info.name}'s value "
                "to the sandbox", err=True, fg="yellow")


@secrets.command(name="ls")
@json_option
@click.pass_context
@handle_errors
def secrets_ls(ctx: click.Context, as_json: bool) -> None:
    """List secret names and hosts (never values)."""
    from .._control.plane import get_manager

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
    from .._control.plane import get_manager

    if not get_manager(ctx.obj["settings"]).secrets.remove(name):
        raise errors.UsageError(f"no secret named {name!r}; `corral secrets ls` lists them")
    if as_json:
        emit_json({"removed": name})
