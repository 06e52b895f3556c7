"""``corral replay``: a sandbox's audit trail as a readable timeline."""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections.abc import Iterable

import click
from rich.console import Console
from rich.markup import escape

from .._audit.events import EVENT_TYPES, AuditEvent

__all__ = ["parse_time", "render_event", "type_filter"]

_AGO_RE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_MAX_OUTPUT_LINES = 12


def parse_time(value: str | None, option: str) -> float | None:
    """Unix seconds, ISO 8601 (UTC when no zone is given), or a duration ago: 30s, 10m, 2h, 1d."""
    if value is None:
        return None
    text = value.strip()
    match = _AGO_RE.match(text)
    if match:
        return time.time() - float(match.group(1)) * _UNITS[match.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        parsed = dt.datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a time: use Unix seconds, ISO 8601 or a duration ago like 10m",
            param_hint=option,
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return parsed.timestamp()


def type_filter(types: Iterable[str]) -> list[str]:
    """Validate ``--type`` values: exact event types or a family such as ``command.*``."""
    wanted = list(types)
    families = {t.split(".")[0] for t in EVENT_TYPES}
    for t in wanted:
        if t not in EVENT_TYPES and not (t.endswith(".*") and t[:-2] in families):
            raise click.BadParameter(
                f"unknown event type {t!r}; use one of {', '.join(EVENT_TYPES)} or a family "
                f"such as command.*", param_hint="--type")
    return wanted


def _clock(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%H:%M:%S.%f")[:-3]


def _output_lines(text: str) -> list[str]:
    lines = text.rstrip("\n").split("\n")
    if len(lines) > _MAX_OUTPUT_LINES:
        hidden = len(lines) - _MAX_OUTPUT_LINES
        lines = [*lines[:_MAX_OUTPUT_LINES],
                 f"… {hidden} more line(s) in this chunk (--json shows all)"]
    return lines


def render_event(console: Console, event: AuditEvent, started: float) -> None:
    """One event as one or a few coloured lines."""
    d = event.data
    head = f"[dim]{_clock(event.ts)} +{event.ts - started:7.3f}s[/dim]"
    cmd = f" [dim]{event.command}[/dim]" if event.command else ""
    kind = event.type
    if kind == "command.output":
        colour = "red" if d.get("stream") == "stderr" else "white"
        for line in _output_lines(str(d.get("text", ""))):
            console.print(f"{head}   [{colour}]│ {escape(line)}[/{colour}]")
        return
    if kind == "command.started":
        argv = " ".join(json.dumps(a) if " " in a else a for a in d.get("argv", []))
        env = ",".join(d.get("env_names", [])) or "-"
        detail = (f"[bold]$ {escape(argv)}[/bold]  [dim]cwd={d.get('cwd')} env={env} "
                  f"timeout={d.get('timeout_s')}s[/dim]")
        if d.get("context"):
            detail += f"\n{' ' * 26}[blue]why: {escape(json.dumps(d['context'])[:500])}[/blue]"
    elif kind == "command.finished":
        if d.get("exit_code") is None:
            detail = f"[red]failed to run: {escape(str(d.get('error')))}[/red]"
        else:
            ok = d["exit_code"] == 0 and not d.get("timed_out")
            colour = "green" if ok else "red"
            notes = [f"exit {d['exit_code']}", f"{d.get('duration_s', 0) * 1000:.0f} ms",
                     f"cpu {d.get('cpu_s', 0) * 1000:.0f} ms",
                     f"peak {d.get('peak_memory_bytes', 0) / 1048576:.1f} MiB"]
            if d.get("timed_out"):
                notes.append("TIMED OUT")
            if d.get("oom_killed"):
                notes.append("OOM")
            detail = f"[{colour}]{' · '.join(notes)}[/{colour}]"
    elif kind == "code.started":
        lines = str(d.get("code", "")).rstrip("\n").split("\n")
        shown = "\n".join(f"{' ' * 26}[bold]>>> {escape(line)}[/bold]" for line in lines[:20])
        more = f"\n{' ' * 26}[dim]… {len(lines) - 20} more line(s)[/dim]" \
            if len(lines) > 20 else ""
        detail = (f"[dim]{d.get('language')} ({d.get('kernel')}) context={d.get('context')}"
                  f"[/dim]\n{shown}{more}")
    elif kind == "code.finished":
        error = d.get("error") or {}
        ok = d.get("outcome") == "ok"
        colour = "green" if ok else "red"
        notes = [str(d.get("outcome")), f"[{d.get('execution_count')}]",
                 f"{float(d.get('duration_s') or 0) * 1000:.0f} ms"]
        if error:
            notes.append(f"{error.get('name')}: {error.get('value')}")
        results = d.get("results") or []
        if results:
            notes.append("results " + " ".join("+".join(r) for r in results))
        detail = f"[{colour}]{escape(' · '.join(notes))}[/{colour}]"
    elif kind == "command.output_truncated":
        detail = f"[yellow]{d.get('stream')} truncated in the log: {d.get('dropped_bytes')} " \
                 f"bytes not kept[/yellow]"
    elif kind == "egress.decision":
        allowed = d.get("verdict") == "allowed"
        colour = "green" if allowed else "red"
        detail = (f"[{colour}]{d.get('verdict')}[/{colour}] {escape(str(d.get('method')))} "
                  f"{escape(str(d.get('host')))}:{d.get('port')} [dim]{escape(str(d.get('rule')))}"
                  f" {d.get('mode') or ''} up {d.get('bytes_up', 0)} B down "
                  f"{d.get('bytes_down', 0)} B[/dim]")
    elif kind in ("egress.summary", "port.summary"):
        # Repeated events counted in one interval, beyond those written in full.
        key = " ".join(f"{k}={v}" for k, v in (d.get("key") or {}).items())
        seen = "; ".join(f"{name}: {', '.join(str(v) for v in values)}"
                         for name, values in (d.get("distinct") or {}).items())
        span = float(d.get("last_ts") or 0) - float(d.get("first_ts") or 0)
        detail = (f"[yellow]{d.get('count')} more {escape(str(d.get('of')))} {escape(key)} "
                  f"in {span:.1f} s[/yellow] [dim]{escape(seen[:300])}[/dim]")
    elif kind == "audit.budget_exceeded":
        detail = (f"[red]{d.get('scope')} audit budget exceeded: {d.get('used_bytes')} of "
                  f"{d.get('budget_bytes')} bytes; {d.get('action')}[/red]")
    elif kind == "file.refused":
        reason = d.get("reason") or {}
        detail = (f"[red]{escape(str(d.get('op')))} {escape(str(d.get('path')))} refused: "
                  f"{escape(str(reason.get('message', '')))}[/red]")
    elif kind.startswith("file."):
        size = f" {d['size']} B sha256:{str(d.get('sha256', ''))[:12]}" if "size" in d else ""
        detail = f"[magenta]{escape(str(d.get('path')))}{size}[/magenta]"
    elif kind.startswith("sandbox."):
        fields = {k: v for k, v in d.items() if k not in ("limits",)}
        detail = f"[cyan]{escape(json.dumps(fields, sort_keys=True))}[/cyan]"
    else:
        detail = escape(json.dumps(d, sort_keys=True))
    console.print(f"{head} [bold]{kind:<24}[/bold]{cmd} {detail}")
