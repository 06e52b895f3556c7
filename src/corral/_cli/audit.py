"""``corral replay`` and ``corral egress``: what happened in a sandbox, from its audit trail."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click

from .common import handle_errors, json_option

if TYPE_CHECKING:
    from .._audit.events import AuditEvent

__all__ = ["egress", "replay"]


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
    from .._control.manager import get_manager
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
    """Every egress decision of a sandbox: who asked for what, the verdict and the rule."""
    from .._control.manager import get_manager

    trail = get_manager(ctx.obj["settings"]).auditor.trail(sandbox_id, types=["egress.decision"])
    if as_json:
        for event in trail.events:
            click.echo(event.model_dump_json())
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None)
    for column in ("TIME", "COMMAND", "METHOD", "HOST:PORT", "VERDICT", "RULE", "UP", "DOWN"):
        table.add_column(column)
    for event in trail.events:
        d = event.data
        verdict = d.get("verdict", "")
        colour = "green" if verdict == "allowed" else "red"
        table.add_row(time.strftime("%H:%M:%S", time.gmtime(event.ts)), event.command or "-",
                      d.get("method", ""), f"{d.get('host')}:{d.get('port')}",
                      f"[{colour}]{verdict}[/{colour}]", d.get("rule", ""),
                      str(d.get("bytes_up", 0)), str(d.get("bytes_down", 0)))
    Console().print(table)


