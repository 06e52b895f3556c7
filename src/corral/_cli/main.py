"""The ``corral`` command line: a thin layer over the SDK.

Results go to stdout, progress and errors to stderr. Every command takes ``--json``. ``run`` and
``exec`` exit with the sandboxed command's own exit code; Corral's own failures use the codes below.
"""

from __future__ import annotations

import logging
import sys
import time
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import click

from .._audit.events import AuditEvent
from .._sdk.sandbox import Sandbox
from .._settings import Settings
from ..models import CommandResult, FileEntry, SandboxInfo
from .admin import keys, secrets, tenants
from .common import (
    EXIT_FAILED,
    EXIT_UNAVAILABLE,
    F,
    emit_json,
    handle_errors,
    home_of,
    json_option,
    parse_pairs,
)
from .drill import drill
from .snapshots import fork, restore, snapshot, snapshots, start_options
from .templates import templates

__all__ = ["main"]

def _command_from(args: Sequence[str]) -> str | list[str]:
    """One argument is a shell string (pipes, globs work); several are an argv run as-is."""
    if not args:
        raise click.UsageError("no command given; put it after --, e.g. `corral run -- echo hi`")
    return args[0] if len(args) == 1 else list(args)


def _run_and_report(
    sb: Sandbox, command: str | list[str], *, timeout: float | None, env: dict[str, str],
    cwd: str | None, forward_stdin: bool, as_json: bool, context: dict[str, str],
) -> NoReturn:
    stdin = sys.stdin.buffer.read() if forward_stdin else None

    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def err(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    result: CommandResult = sb.commands.run(
        command, timeout=timeout, envs=env, cwd=cwd, stdin=stdin,
        on_stdout=None if as_json else out, on_stderr=None if as_json else err,
        context=context or None,
    )
    if as_json:
        emit_json(_result_json(result))
    elif result.timed_out:
        click.secho(f"corral: command timed out after {result.duration_s:.1f} s; its processes "
                    "were killed", err=True, fg="yellow")
    elif result.usage.oom_killed:
        click.secho("corral: the command ran out of memory and was killed (OOM)", err=True,
                    fg="yellow")
    sys.exit(result.exit_code)


def _result_json(result: CommandResult) -> dict[str, Any]:
    return {
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "timed_out": result.timed_out,
        "duration_s": round(result.duration_s, 6),
        "usage": result.usage.to_dict(),
        "stdout_truncated": result.stdout_truncated,
        "stderr_truncated": result.stderr_truncated,
        "command_id": result.command_id,
    }


def _info_json(info: SandboxInfo) -> dict[str, Any]:
    return info.to_dict()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--home", type=click.Path(path_type=Path), default=None,
              help="Data directory (default: $CORRAL_HOME or /var/lib/corral).")
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.version_option(package_name="corral", prog_name="corral")
@click.pass_context
def cli(ctx: click.Context, home: Path | None, debug: bool) -> None:
    """Corral: run untrusted code from AI agents in sandboxes that cannot hurt the host.

    Sandboxes have no network, one writable directory (/workspace), hard CPU, memory, process,
    disk and time limits, and run as their own unprivileged host user.

    \b
    Quick start:
      corral doctor                     check this host
      corral run -- python3 -c 'print(1+1)'
      ID=$(corral create)               a sandbox that persists across commands
      corral exec $ID -- 'echo hi > f.txt'
      corral files read $ID f.txt
      corral rm $ID
    """
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = Settings(home=home) if home is not None else Settings()
    except Exception as exc:  # pydantic's ValidationError names the bad variable
        raise click.UsageError(f"invalid configuration: {exc}") from exc
    ctx.obj = {"settings": settings, "debug": debug, "home_given": home is not None}


def command_options(fn: F) -> F:
    """The options `run` and `exec` share, and the trailing COMMAND."""
    for decorator in reversed([
        click.option("--timeout", "-t", type=float, default=None,
                     help="Command timeout in seconds (default: the tier's)."),
        click.option("--env", "-e", "env", multiple=True, metavar="KEY=VALUE",
                     help="Set a variable."),
        click.option("--cwd", default=None, help="Working directory inside /workspace."),
        click.option("--stdin", "forward_stdin", is_flag=True,
                     help="Send this terminal's stdin."),
        click.option("--context", "-c", "context", multiple=True, metavar="KEY=VALUE",
                     help="Why this command runs (tool-call id, model input): kept in the "
                          "audit trail."),
        json_option,
        click.argument("command", nargs=-1, type=click.UNPROCESSED),
    ]):
        fn = decorator(fn)
    return fn


def network_options(fn: F) -> F:
    """--allow, --deny and --secret, shared by `run` and `create`."""
    for decorator in reversed([
        click.option("--allow", "allow", multiple=True, metavar="HOST",
                     help="Allow egress to HOST (pypi.org, *.github.com, host:port); repeatable."),
        click.option("--deny", "deny", multiple=True, metavar="HOST",
                     help="Deny HOST even if an allow rule matches; repeatable."),
        click.option("--secret", "secret_names", multiple=True, metavar="NAME",
                     help="Expose host secret NAME as a placeholder in env NAME; repeatable."),
    ]):
        fn = decorator(fn)
    return fn


def _network(allow: tuple[str, ...], deny: tuple[str, ...]) -> dict[str, list[str]] | str:
    return {"allow": list(allow), "deny": list(deny)} if allow else "none"


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--resources", "-r", default="small", show_default=True,
              help="Resource tier: small or large.")
@network_options
@start_options
@command_options
@click.pass_context
@handle_errors
def run(ctx: click.Context, resources: str, allow: tuple[str, ...], deny: tuple[str, ...],
        secret_names: tuple[str, ...], template: str | None, isolation: str | None,
        snapshot_ref: str | None, timeout: float | None, env: tuple[str, ...],
        cwd: str | None, forward_stdin: bool, context: tuple[str, ...], as_json: bool,
        command: tuple[str, ...]) -> None:
    """Create a sandbox, run COMMAND in it, destroy it; exit with COMMAND's exit code.

    One argument is run by bash (pipes and globs work); several are run as an argv.
    """
    cmd = _command_from(command)
    variables = parse_pairs(env)
    with Sandbox.create(template, resources=resources, network=_network(allow, deny),
                        secrets=list(secret_names), isolation=isolation,
                        snapshot=snapshot_ref, home=home_of(ctx)) as sb:
        _run_and_report(sb, cmd, timeout=timeout, env=variables, cwd=cwd,
                        forward_stdin=forward_stdin, as_json=as_json,
                        context=parse_pairs(context, "--context"))


@cli.command()
@click.option("--resources", "-r", default="small", show_default=True,
              help="Resource tier: small or large.")
@click.option("--ttl", type=float, default=None,
              help="Lifetime in seconds (default: the tier's); destroyed after that.")
@click.option("--label", "-l", "labels", multiple=True, metavar="KEY=VALUE", help="Add a label.")
@network_options
@start_options
@json_option
@click.pass_context
@handle_errors
def create(ctx: click.Context, resources: str, ttl: float | None, labels: tuple[str, ...],
           allow: tuple[str, ...], deny: tuple[str, ...], secret_names: tuple[str, ...],
           template: str | None, isolation: str | None, snapshot_ref: str | None,
           as_json: bool) -> None:
    """Create a sandbox and print its id."""
    label_map = parse_pairs(labels, "--label")
    sb = Sandbox.create(template, resources=resources, timeout=ttl, labels=label_map,
                        network=_network(allow, deny), secrets=list(secret_names),
                        isolation=isolation, snapshot=snapshot_ref, home=home_of(ctx))
    if as_json:
        emit_json(_info_json(sb.get_info()))
    else:
        click.echo(sb.id)


@cli.command(name="exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@command_options
@click.pass_context
@handle_errors
def exec_(ctx: click.Context, sandbox_id: str, timeout: float | None, env: tuple[str, ...],
          cwd: str | None, forward_stdin: bool, context: tuple[str, ...], as_json: bool,
          command: tuple[str, ...]) -> None:
    """Run COMMAND in an existing sandbox; exit with COMMAND's exit code."""
    cmd = _command_from(command)
    sb = Sandbox.connect(sandbox_id, home=home_of(ctx))
    _run_and_report(sb, cmd, timeout=timeout, env=parse_pairs(env), cwd=cwd,
                    forward_stdin=forward_stdin, as_json=as_json,
                    context=parse_pairs(context, "--context"))


@cli.command(name="ls")
@json_option
@click.pass_context
@handle_errors
def list_(ctx: click.Context, as_json: bool) -> None:
    """List live sandboxes."""
    infos = Sandbox.list(home=home_of(ctx))
    if as_json:
        emit_json([_info_json(i) for i in infos])
        return
    if not infos:
        click.echo("no sandboxes", err=True)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None)
    for column in ("ID", "TEMPLATE", "RESOURCES", "ISOLATION", "AGE", "EXPIRES IN", "LABELS"):
        table.add_column(column)
    now = time.time()
    for info in infos:
        labels = ",".join(f"{k}={v}" for k, v in info.labels.items())
        table.add_row(info.id, info.template, info.resources, info.isolation,
                      _duration(now - info.created_at),
                      _duration(info.expires_at - now), labels)
    Console().print(table)


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


@cli.command(name="info")
@click.argument("sandbox_id")
@json_option
@click.pass_context
@handle_errors
def info_(ctx: click.Context, sandbox_id: str, as_json: bool) -> None:
    """Show one sandbox."""
    info = Sandbox.connect(sandbox_id, home=home_of(ctx)).get_info()
    if as_json:
        emit_json(_info_json(info))
    else:
        for key, value in _info_json(info).items():
            click.echo(f"{key:11} {value}")


@cli.command(name="pause")
@click.argument("sandbox_id")
@json_option
@click.pass_context
@handle_errors
def pause_(ctx: click.Context, sandbox_id: str, as_json: bool) -> None:
    """Freeze every process in a sandbox; its files stay reachable."""
    sb = Sandbox.connect(sandbox_id, home=home_of(ctx))
    sb.pause()
    if as_json:
        emit_json(_info_json(sb.get_info()))


@cli.command(name="resume")
@click.argument("sandbox_id")
@json_option
@click.pass_context
@handle_errors
def resume_(ctx: click.Context, sandbox_id: str, as_json: bool) -> None:
    """Let a paused sandbox's processes run again."""
    sb = Sandbox.connect(sandbox_id, home=home_of(ctx))
    sb.resume()
    if as_json:
        emit_json(_info_json(sb.get_info()))


@cli.command(name="rm")
@click.argument("sandbox_ids", nargs=-1, required=True)
@json_option
@click.pass_context
@handle_errors
def remove(ctx: click.Context, sandbox_ids: tuple[str, ...], as_json: bool) -> None:
    """Destroy sandboxes: kill their processes and delete their workspaces."""
    for sandbox_id in sandbox_ids:
        Sandbox.connect(sandbox_id, home=home_of(ctx)).kill()
        if not as_json:
            click.echo(f"removed {sandbox_id}", err=True)
    if as_json:
        emit_json({"removed": list(sandbox_ids)})


@cli.group()
def files() -> None:
    """Read, write and list files in a sandbox's /workspace."""


@files.command(name="read")
@click.argument("sandbox_id")
@click.argument("path")
@json_option
@click.pass_context
@handle_errors
def files_read(ctx: click.Context, sandbox_id: str, path: str, as_json: bool) -> None:
    """Print a file's content (raw bytes; with --json, as UTF-8 text)."""
    sb = Sandbox.connect(sandbox_id, home=home_of(ctx))
    data = sb.files.read(path, format="bytes")
    if as_json:
        emit_json({"path": path, "size": len(data),
                    "content": data.decode("utf-8", errors="replace")})
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()


@files.command(name="write")
@click.argument("sandbox_id")
@click.argument("path")
@click.option("--from", "source", type=click.File("rb"), default="-",
              help="Read the content from this file instead of stdin.")
@json_option
@click.pass_context
@handle_errors
def files_write(ctx: click.Context, sandbox_id: str, path: str, source: Any,
                as_json: bool) -> None:
    """Write stdin (or --from FILE) to PATH, creating parent directories."""
    sb = Sandbox.connect(sandbox_id, home=home_of(ctx))
    entry = sb.files.write(path, source.read())
    if as_json:
        emit_json(entry.to_dict())
    else:
        click.echo(f"wrote {entry.size} bytes to {entry.path}", err=True)


def _shown(name: str) -> str:
    """``name`` safe for a one-line-per-entry table: control and format characters (newline,
    escape sequences, bidi overrides, line separators) are shown as escapes. Bytes that are not
    UTF-8 already arrive escaped as ``\\xNN``; ``--json`` gives names exactly."""
    return "".join(
        c if unicodedata.category(c) not in ("Cc", "Cf", "Zl", "Zp", "Cs")
        else f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
        for c in name)


@files.command(name="ls")
@click.argument("sandbox_id")
@click.argument("path", default="/workspace")
@json_option
@click.pass_context
@handle_errors
def files_ls(ctx: click.Context, sandbox_id: str, path: str, as_json: bool) -> None:
    """List a directory."""
    entries: list[FileEntry] = Sandbox.connect(sandbox_id, home=home_of(ctx)).files.list(path)
    if as_json:
        emit_json([e.to_dict() for e in entries])
        return
    for e in entries:
        suffix = "/" if e.type == "dir" else ("@" if e.type == "symlink" else "")
        click.echo(f"{e.mode:04o} {e.size:>10} {_shown(e.name)}{suffix}")


@cli.command()
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


@cli.command(name="network")
@click.argument("sandbox_id")
@click.option("--allow", "allow", multiple=True, metavar="HOST", help="Allow HOST; repeatable.")
@click.option("--deny", "deny", multiple=True, metavar="HOST", help="Deny HOST; repeatable.")
@click.option("--none", "block", is_flag=True, help="No network at all.")
@json_option
@click.pass_context
@handle_errors
def network_(ctx: click.Context, sandbox_id: str, allow: tuple[str, ...], deny: tuple[str, ...],
             block: bool, as_json: bool) -> None:
    """Show a sandbox's network policy, or replace it (--allow/--deny/--none).

    A change applies to the next connection, also from commands already running.
    """
    sb = Sandbox.connect(sandbox_id, home=home_of(ctx))
    if block:
        sb.network.block()
    elif allow or deny:
        sb.network.update(allow=allow, deny=deny)
    policy = sb.network.get()
    if as_json:
        emit_json(policy)
    else:
        click.echo(f"mode  {policy.get('mode', 'none')}")
        for rule in policy.get("allow", []):
            click.echo(f"allow {rule}")
        for rule in policy.get("deny", []):
            click.echo(f"deny  {rule}")


@cli.command()
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


@cli.command()
@click.pass_context
@handle_errors
def metrics(ctx: click.Context) -> None:
    """Print Prometheus metrics (text exposition format): sandboxes, commands, reaper."""
    from .._audit.metrics import render
    from .._control.manager import get_manager

    click.echo(render(get_manager(ctx.obj["settings"]).store), nl=False)


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; beyond loopback, API keys are required.")
@click.option("--port", default=8080, show_default=True, type=int)
@click.option("--host-name", "host_names", multiple=True, metavar="NAME",
              help="Another name (host or host:port) the service answers to, besides the "
                   "listen address, localhost, 127.0.0.1 and [::1]; repeatable "
                   "(CORRAL_SERVER_HOST_NAMES, comma-separated). Requests with any other Host "
                   "get 421; browser pages from any other origin get 403.")
@click.option("--allow-keyless", is_flag=True, default=None,
              help="Serve keyless on loopback even though API keys existed and all are now "
                   "revoked. Dangerous: any local process, and any web page that reaches "
                   "loopback, can then run code here; without it the service keeps asking for "
                   "a key (CORRAL_SERVER_ALLOW_KEYLESS).")
@click.pass_context
@handle_errors
def serve(ctx: click.Context, host: str, port: int, host_names: tuple[str, ...],
          allow_keyless: bool | None) -> None:
    """Run the HTTP API (OpenAPI at /docs and /openapi.json, Prometheus at /metrics)."""
    from .._control.manager import get_manager
    from .._server.serve import serve as run_server

    settings: Settings = ctx.obj["settings"]
    names = [*settings.server_host_names.split(","), *host_names]
    run_server(get_manager(settings), host=host, port=port, host_names=names,
               allow_keyless=settings.server_allow_keyless if allow_keyless is None
               else allow_keyless)


@cli.command()
@json_option
@click.pass_context
@handle_errors
def reap(ctx: click.Context, as_json: bool) -> None:
    """Destroy expired sandboxes and clean what crashed processes left behind.

    Every command does this on start; run it from cron or a systemd timer so expired sandboxes
    are removed even when nothing else runs.
    """
    from .._control.manager import get_manager

    removed = get_manager(ctx.obj["settings"]).recover()
    if as_json:
        emit_json({"removed": removed})
    else:
        for item in removed:
            click.echo(f"removed {item}")
        click.echo(f"{len(removed)} item(s) removed", err=True)


@cli.command()
@json_option
@click.pass_context
@handle_errors
def doctor(ctx: click.Context, as_json: bool) -> None:
    """Check which isolation tiers this host can run safely, and say how to fix what is missing.

    Exits 0 when the default tier (``CORRAL_BACKEND``) can run; the other tiers are reported,
    with their reasons, either way. ``--json``: ``{ok, default, checks, tiers: {name:
    {supported, checks}}}``, where ``checks`` are the default tier's.
    """
    from .._backends import BACKENDS, load_backend
    from ..backends import HostCheck
    from ..errors import CorralError

    settings = ctx.obj["settings"]
    tiers: dict[str, list[HostCheck]] = {}
    for tier in BACKENDS:
        try:
            tiers[tier] = load_backend(settings, tier).check_host()
        except CorralError as exc:  # a tier that cannot even load is reported, not fatal
            tiers[tier] = [HostCheck(tier, False, exc.message, "see the message")]
    supported = {name: all(c.ok for c in checks) for name, checks in tiers.items()}
    ok = supported[settings.backend]

    def lines(checks: list[HostCheck]) -> list[dict[str, Any]]:
        return [{"name": c.name, "ok": c.ok, "detail": c.detail, "fix": c.fix} for c in checks]

    if as_json:
        emit_json({"ok": ok, "default": settings.backend, "checks": lines(tiers[settings.backend]),
                   "tiers": {name: {"supported": supported[name], "checks": lines(checks)}
                             for name, checks in tiers.items()}})
    else:
        for name, checks in tiers.items():
            verdict = (click.style("supported", fg="green") if supported[name]
                       else click.style("NOT supported", fg="red"))
            default = " (default)" if name == settings.backend else ""
            click.echo(f"{name} tier{default}: {verdict}")
            for c in checks:
                mark = click.style("ok  ", fg="green") if c.ok else click.style("FAIL", fg="red")
                click.echo(f"  {mark} {c.name:16} {c.detail}")
                if not c.ok:
                    click.echo(f"       {'':16} fix: {c.fix}")
        usable = [name for name, good in supported.items() if good]
        click.echo(f"this host can run Corral sandboxes with isolation: {', '.join(usable)}"
                   if usable else
                   "this host cannot run Corral sandboxes safely; fix the FAIL lines above",
                   err=True)
    sys.exit(0 if ok else EXIT_UNAVAILABLE)


@cli.command()
@json_option
@click.pass_context
@handle_errors
def demo(ctx: click.Context, as_json: bool) -> None:
    """Walk through an agent-like session: write code, run it, try to escape, clean up."""
    import io

    from rich.console import Console

    from .demo import run_demo

    console = Console(file=io.StringIO()) if as_json else Console()
    summary = run_demo(home=home_of(ctx), console=console)
    if as_json:
        emit_json(summary)
    contained = all(step.get("contained", True) for step in summary["steps"])
    sys.exit(0 if contained and summary["destroyed"] else EXIT_FAILED)


@cli.command(name="mcp")
@click.option("--transport", type=click.Choice(["stdio", "http"]), default="stdio",
              show_default=True, help="stdio (one client, spawned by it) or Streamable HTTP.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="HTTP address; the endpoint has no authentication, keep it on loopback.")
@click.option("--port", type=int, default=8765, show_default=True, help="HTTP port.")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="PATTERN",
              help="Let the model allow this host in a sandbox's allowlist (repeatable): "
                   "pypi.org, *.github.com, host:8443. Default: no network at all.")
@click.option("--template", "templates", multiple=True, metavar="NAME",
              help="Let the model use this template besides base (repeatable).")
@click.option("--secret", "secrets", multiple=True, metavar="NAME",
              help="Let the model bind this secret (repeatable). Default: none.")
@click.option("--max-lifetime", type=int, metavar="SECONDS",
              help="The longest lifetime the model may give a sandbox.")
@click.pass_context
@handle_errors
def mcp_(ctx: click.Context, transport: str, host: str, port: int,
         allow_hosts: tuple[str, ...], templates: tuple[str, ...], secrets: tuple[str, ...],
         max_lifetime: int | None) -> None:
    """Serve sandboxes as tools over the Model Context Protocol (MCP).

    Calls without a sandbox_id share one sandbox per MCP session, destroyed when the session
    ends (or at its TTL if the server is killed).

    The model is the caller here, and a prompt injection can write its tool calls, so what it
    may ask for has a ceiling of its own: no network, the base template and no secrets unless
    widened with --allow-host, --template and --secret (these replace CORRAL_CEILING_HOSTS,
    _TEMPLATES and _SECRETS here; the other CORRAL_CEILING_* fields still apply).
    Beyond it a tool call fails with ceiling_exceeded; unknown arguments are refused.
    """
    from .._mcp import mcp_ceiling, serve

    ceiling = mcp_ceiling(hosts=allow_hosts, templates=templates, secrets=secrets,
                          max_lifetime_s=max_lifetime)
    serve(home_of(ctx), "http" if transport == "http" else "stdio", host=host, port=port,
          ceiling=ceiling)


cli.add_command(tenants)
cli.add_command(keys)
cli.add_command(secrets)
cli.add_command(templates)
cli.add_command(drill)
cli.add_command(snapshot)
cli.add_command(fork)
cli.add_command(restore)
cli.add_command(snapshots)


def main() -> None:
    cli(prog_name="corral")
