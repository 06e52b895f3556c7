"""``corral replay`` and ``corral egress``: what happened in a sandbox, from its audit trail;
``corral audit``: the operator's view of the trails on this host (their sizes against the
budgets, and the retention of destroyed sandboxes' trails)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import click

from .. import errors
from .common import columns, emit_json, handle_errors, json_option, size_text, when

if TYPE_CHECKING:
    from .._audit.events import AuditEvent

__all__ = ["audit", "egress", "replay"]

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


@click.command()
@click.argument("sandbox_id")
@click.option("--type", "-T", "types", multiple=True,
              help="Only these event types (repeatable); a family works too: command.*")
@click.option("--since", default=None, help="From this time: Unix seconds, ISO 8601, or 10m ago.")
@click.option("--until", default=None, help="Up to this time (same forms).")
@click.option("--command", "command_id", default=None, help="Only events of this command id.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events until the sandbox "
              "is destroyed (Ctrl-C stops).")
@json_option
@click.pass_context
@handle_errors
def replay(ctx: click.Context, sandbox_id: str, types: tuple[str, ...], since: str | None,
           until: str | None, command_id: str | None, follow: bool, as_json: bool) -> None:
    """Show what happened in a sandbox, in order: commands, output, files, lifecycle.

    Works for destroyed sandboxes too. With --json: one event per line.
    """
    from rich.console import Console

    from .._audit.log import follow as follow_log
    from .._control.plane import get_manager
    from .replay import parse_time, render_event, type_filter

    wanted = type_filter(types)
    start, end = parse_time(since, "--since"), parse_time(until, "--until")
    auditor = get_manager(ctx.obj["settings"]).auditor
    console = Console(highlight=False)

    def show(event: AuditEvent, first_ts: float) -> None:
        if as_json:
            click.echo(event.model_dump_json())
        else:
            render_event(console, event, first_ts)

    if follow:
        path = auditor.path(sandbox_id)
        first: float | None = None
        try:
            for event in follow_log(path, types=wanted, command=command_id):
                if event is None:
                    continue
                if (start is not None and event.ts < start) or (end is not None and event.ts > end):
                    continue
                first = event.ts if first is None else first
                show(event, first)
        except KeyboardInterrupt:
            pass
        return
    trail = auditor.trail(sandbox_id, types=wanted, since=start, until=end, command=command_id)
    first_ts = trail.events[0].ts if trail.events else 0.0
    for event in trail.events:
        show(event, first_ts)
    if trail.torn_tail:
        click.secho("corral: the log's last line was torn (a crash cut a write short) and was "
                    "skipped", err=True, fg="yellow")
    if trail.skipped:
        click.secho(f"corral: {trail.skipped} unreadable line(s) were skipped", err=True,
                    fg="yellow")


@click.command()
@click.argument("sandbox_id")
@json_option
@click.pass_context
@handle_errors
def egress(ctx: click.Context, sandbox_id: str, as_json: bool) -> None:
    """Every egress decision of a sandbox: who asked for what, the verdict and the rule.

    Refusals beyond the first few of an interval are counted per rule: such a row (an
    egress.summary event) shows the count and one sample request.
    """
    from .._control.plane import get_manager

    trail = get_manager(ctx.obj["settings"]).auditor.trail(
        sandbox_id, types=["egress.decision", "egress.summary"])
    if as_json:
        for event in trail.events:
            click.echo(event.model_dump_json())
        return
    # Plain columns, not rich's table: that cut host names to the terminal's width (80 columns
    # when stdout is a pipe), and the host is what a reader of this table is looking for.
    rows = []
    for event in trail.events:
        d = event.data
        count = ""
        if event.type == "egress.summary":
            count = f" x{d.get('count')}"
            d = d.get("sample") or {}
        rows.append((when(event.ts), event.command or "-", str(d.get("method", "")),
                     f"{d.get('host')}:{d.get('port')}", f"{d.get('verdict', '')}{count}",
                     str(d.get("rule", "")), str(d.get("bytes_up", 0)),
                     str(d.get("bytes_down", 0))))
    click.echo(columns(("TIME", "COMMAND", "METHOD", "HOST:PORT", "VERDICT", "RULE", "UP",
                        "DOWN"), rows))




@click.group()
def audit() -> None:
    """The audit trails on this host: their sizes and the retention of destroyed sandboxes'.

    Each sandbox's trail is bounded by its audit byte budget (CORRAL_AUDIT_SANDBOX_MAX_BYTES,
    and its tenant's CORRAL_AUDIT_TENANT_MAX_BYTES): at it the sandbox is paused with the
    reason in its trail. Trails of destroyed sandboxes stay until retention removes them
    (CORRAL_AUDIT_RETENTION_S and CORRAL_AUDIT_RETENTION_MAX_BYTES), which `corral audit
    prune` and the service's reaper apply. See docs/audit.md.
    """


def _duration(value: str | None, option: str) -> float | None:
    if value is None:
        return None
    found = _DURATION.fullmatch(value.strip())
    if found is None:
        raise errors.UsageError(f"{option} takes a duration like 3600, 90m, 12h or 30d, not "
                                f"{value!r}")
    return float(found.group(1)) * _SECONDS[found.group(2).lower()]


def _size(value: str | None, option: str) -> int | None:
    if value is None:
        return None
    from .._control.plane import parse_size

    try:
        return parse_size(value)
    except errors.UsageError:
        raise errors.UsageError(f"{option} takes a size like 500M or 8G (0: no limit), not "
                                f"{value!r}") from None


@audit.command(name="prune")
@click.option("--older-than", "older_than", metavar="DURATION", default=None,
              help="Remove destroyed sandboxes' trails older than this (3600, 90m, 12h, 30d; "
                   "0: no age limit). Default: CORRAL_AUDIT_RETENTION_S.")
@click.option("--max-total", "max_total", metavar="SIZE", default=None,
              help="Then remove the oldest while they add up to more than this (500M, 8G; "
                   "0: no limit). Default: CORRAL_AUDIT_RETENTION_MAX_BYTES.")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@json_option
@click.pass_context
@handle_errors
def audit_prune(ctx: click.Context, older_than: str | None, max_total: str | None,
                dry_run: bool, as_json: bool) -> None:
    """Remove the trails of destroyed sandboxes past retention; never a live sandbox's.

    Age is the time since a trail's last write (its sandbox's destruction). The service's
    reaper does the same once a minute with the settings' values.

    \b
    --json: {dry_run, max_age_s, max_total_bytes, removed: [{sandbox, bytes, age_s,
    reason: "age"|"size"}], removed_bytes, kept, kept_bytes, live, live_bytes, unsettled}.
    """
    from .._control.plane import get_manager

    settings = ctx.obj["settings"]
    age = _duration(older_than, "--older-than")
    total = _size(max_total, "--max-total")
    age = settings.audit_retention_s if age is None else age
    total = settings.audit_retention_max_bytes if total is None else total
    report = get_manager(settings).recovery.prune_trails(max_age_s=age, max_total_bytes=total,
                                                         dry_run=dry_run)
    if as_json:
        emit_json({**report.to_dict(), "max_age_s": age, "max_total_bytes": total})
        return
    verb = "would remove" if dry_run else "removed"
    for pruned in report.removed:
        click.echo(f"{pruned.sandbox_id}\t{size_text(pruned.bytes)}\t"
                   f"{pruned.age_s / 86400:.1f} d\t{pruned.reason}")
    click.echo(f"corral: {verb} {len(report.removed)} trail(s), "
               f"{size_text(sum(p.bytes for p in report.removed))}; kept {report.kept} of "
               f"destroyed sandboxes ({size_text(report.kept_bytes)}) and {report.live} of "
               f"live ones ({size_text(report.live_bytes)})", err=True)


@audit.command(name="usage")
@json_option
@click.pass_context
@handle_errors
def audit_usage(ctx: click.Context, as_json: bool) -> None:
    """Each live sandbox's trail against its budget, and each tenant's total.

    \b
    --json: {sandboxes: [{sandbox, tenant, state, bytes, budget_bytes}], tenants: [{tenant,
    bytes, budget_bytes}]} (budget 0: none).
    """
    from .._audit.budget import trail_size
    from .._control.plane import get_manager

    manager = get_manager(ctx.obj["settings"])
    rows: list[dict[str, Any]] = []
    tenants: dict[str, dict[str, Any]] = {}
    for info in manager.sandboxes.list():
        budget = manager.audit_budgets.budget(info.id)
        used = trail_size(manager.auditor.path(info.id))
        rows.append({"sandbox": info.id, "tenant": info.tenant, "state": info.state,
                     "bytes": used, "budget_bytes": budget.sandbox_bytes if budget else 0})
        if budget is not None:
            entry = tenants.setdefault(info.tenant, {"tenant": info.tenant, "bytes": 0,
                                                     "budget_bytes": budget.tenant_bytes})
            entry["bytes"] += used
    if as_json:
        emit_json({"sandboxes": rows, "tenants": list(tenants.values())})
        return
    for row in rows:
        bound = size_text(row["budget_bytes"]) if row["budget_bytes"] else "-"
        click.echo(f"{row['sandbox']}\t{row['tenant']}\t{row['state']}\t"
                   f"{size_text(row['bytes'])}\t/ {bound}")
    for entry in tenants.values():
        bound = size_text(entry["budget_bytes"]) if entry["budget_bytes"] else "-"
        click.echo(f"tenant {entry['tenant']}: {size_text(entry['bytes'])} / {bound}",
                   err=True)
