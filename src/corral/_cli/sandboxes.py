"""Sandbox commands: ``run``, ``create``, ``exec``, ``ls``, ``info``, ``pause``,
``hibernate``, ``resume``, ``rm`` and ``network``. A thin layer over ``Sandbox``, so each
works embedded and against a service (``CORRAL_URL``) alike.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import click

from .common import (
    F,
    TakesCommand,
    columns,
    connect,
    emit_json,
    handle_errors,
    home_of,
    json_option,
    parse_pairs,
    sdk,
    when,
)
from .snapshots import start_options
from .volumes import mount_options

if TYPE_CHECKING:
    from .._sdk.sandbox import Sandbox
    from ..models import CommandResult, SandboxInfo

__all__ = ["create", "exec_", "hibernate_", "info_", "list_", "network_", "pause_", "remove",
           "resume_", "run"]


def _command_from(args: Sequence[str]) -> str | list[str]:
    """One argument is a shell string (pipes, globs work); several are an argv run as-is."""
    if not args:
        raise click.UsageError("no command given; put it after --, e.g. `corral run -- echo hi`")
    return args[0] if len(args) == 1 else list(args)


def _image_command(ctx: click.Context, sb: Sandbox) -> list[str]:
    """The image's Entrypoint + Cmd, for `corral run --image REF` without a command."""
    from .._control.plane import image_config

    config = image_config(ctx.obj["settings"].home / "templates", sb.get_info().template)
    if config is None or not config.argv:
        raise click.UsageError("the image names no Entrypoint or Cmd; put a command after --")
    return config.argv


def _run_and_report(
    sb: Sandbox, command: str | list[str], *, timeout: float | None, env: dict[str, str],
    cwd: str | None, forward_stdin: bool, as_json: bool, context: dict[str, str],
    binary: bool = False,
) -> NoReturn:
    stdin = sys.stdin.buffer.read() if forward_stdin else None
    live = not (as_json or binary)

    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def err(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    result: CommandResult = sb.commands.run(
        command, timeout=timeout, envs=env, cwd=cwd, stdin=stdin,
        on_stdout=out if live else None, on_stderr=err if live else None,
        context=context or None, output="bytes" if binary else "text",
    )
    if as_json:
        emit_json(result.to_dict(exact_bytes=binary))  # the API's own result form
    elif binary:
        # Byte-exact, once the command has ended (text output is decoded as it streams).
        sys.stdout.buffer.write(result.stdout_bytes or b"")
        sys.stdout.buffer.flush()
        sys.stderr.buffer.write(result.stderr_bytes or b"")
        sys.stderr.buffer.flush()
    if not as_json and result.timed_out:
        click.secho(f"corral: command timed out after {result.duration_s:.1f} s; its processes "
                    "were killed", err=True, fg="yellow")
    elif result.usage.oom_killed:
        click.secho("corral: the command ran out of memory and was killed (OOM)", err=True,
                    fg="yellow")
    sys.exit(result.exit_code)


def _info_json(info: SandboxInfo) -> dict[str, Any]:
    return info.to_dict()


def command_options(fn: F) -> F:
    """The options `run` and `exec` share, and the trailing COMMAND."""
    for decorator in reversed([
        click.option("--timeout", "-t", type=float, default=None,
                     help="Command timeout in seconds (default: the tier's)."),
        click.option("--env", "-e", "env", multiple=True, metavar="KEY=VALUE",
                     help="Set a variable."),
        click.option("--cwd", default=None, metavar="DIR",
                     help="Working directory inside /workspace."),
        click.option("--stdin", "forward_stdin", is_flag=True,
                     help="Send this terminal's stdin."),
        click.option("--binary", is_flag=True,
                     help="Write the output byte-exact when the command ends, instead of "
                          "streaming it as text (for binary data); with --json adds "
                          "stdout_b64/stderr_b64."),
        click.option("--context", "-c", "context", multiple=True, metavar="KEY=VALUE",
                     help="Why this command runs (tool-call id, model input): kept in the "
                          "audit trail."),
        json_option,
        click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- COMMAND..."),
    ]):
        fn = decorator(fn)
    return fn


def network_options(fn: F) -> F:
    """--allow, --deny, --index, --require-lock and --secret, shared by `run` and `create`."""
    for decorator in reversed([
        click.option("--allow", "allow", multiple=True, metavar="HOST",
                     help="Allow egress to HOST (pypi.org, *.github.com, host:port); repeatable."),
        click.option("--deny", "deny", multiple=True, metavar="HOST",
                     help="Deny HOST even if an allow rule matches; repeatable."),
        # Not --preset: click would offer it beside --resources for a mistyped --resource.
        click.option("--index", "presets", multiple=True, metavar="NAME",
                     help="Package index preset (pypi, npm, debian): allow the operator's "
                          "index and point the client at it; repeatable."),
        click.option("--require-lock", "require_lock", is_flag=True,
                     help="With --index pypi: pip installs only hashed requirements "
                          "(pip install --require-hashes -r FILE)."),
        click.option("--secret", "secret_names", multiple=True, metavar="NAME",
                     help="Expose host secret NAME as a placeholder in env NAME; repeatable."),
    ]):
        fn = decorator(fn)
    return fn


def _network(allow: tuple[str, ...], deny: tuple[str, ...], presets: tuple[str, ...] = (),
             require_lock: bool = False) -> dict[str, Any] | str:
    if not allow and not presets and not require_lock:
        return "none"
    network: dict[str, Any] = {"allow": list(allow), "deny": list(deny)}
    if presets or require_lock:
        network.update(presets=list(presets), require_lock=require_lock)
    return network


@click.command(cls=TakesCommand)
@click.option("--resources", "-r", default="small", show_default=True, metavar="TIER",
              help="Resource tier: small or large.")
@network_options
@start_options
@mount_options
@command_options
@click.pass_context
@handle_errors
def run(ctx: click.Context, resources: str, allow: tuple[str, ...], deny: tuple[str, ...],
        presets: tuple[str, ...], require_lock: bool, secret_names: tuple[str, ...],
        template: str | None, image: str | None, isolation: str | None,
        snapshot_ref: str | None, volumes: dict[str, str | dict[str, Any]] | None,
        data_mounts: dict[str, str] | None, timeout: float | None, env: tuple[str, ...],
        cwd: str | None, forward_stdin: bool, binary: bool, context: tuple[str, ...],
        as_json: bool, command: tuple[str, ...]) -> None:
    """Create a sandbox, run COMMAND in it, destroy it; exit with COMMAND's exit code.

    Options go before --, the command after it. One argument is run by bash (pipes and globs
    work); several are run as an argv, exactly as given.

    \b
    Examples:
      corral run -- python3 -c 'print(1+1)'
      corral run -r large --timeout 60 -- 'make -j2 && ./test.sh'
      corral run --allow pypi.org -- pip download requests
      corral run --index pypi -- pip install --target deps requests
      corral run --stdin -- python3 - < script.py
      corral run --json -- ls -la      {exit_code, stdout, stderr, timed_out, usage, ...}
      corral run --image 127.0.0.1:5000/tools:1      the image's entrypoint and command
      corral run --volume cache:/mnt/cache -- 'cp -r out /mnt/cache/'
    """
    cmd = _command_from(command) if command or image is None else None
    variables = parse_pairs(env)
    network = _network(allow, deny, presets, require_lock)
    with sdk().create(template, resources=resources, network=network,
                        secrets=list(secret_names), isolation=isolation,
                        snapshot=snapshot_ref, image=image, volumes=volumes,
                        data_mounts=data_mounts, home=home_of(ctx)) as sb:
        if cmd is None:
            cmd = _image_command(ctx, sb)
        _run_and_report(sb, cmd, timeout=timeout, env=variables, cwd=cwd,
                        forward_stdin=forward_stdin, as_json=as_json,
                        context=parse_pairs(context, "--context"), binary=binary)


@click.command()
@click.option("--resources", "-r", default="small", show_default=True, metavar="TIER",
              help="Resource tier: small or large.")
@click.option("--ttl", type=float, default=None,
              help="Lifetime in seconds (default: the tier's); destroyed after that.")
@click.option("--on-timeout", type=click.Choice(["kill", "pause"]), default="kill",
              show_default=True,
              help="At the end of its lifetime: kill destroys it; pause freezes it and keeps it "
                   "(files, memory) for the operator's CORRAL_PAUSED_KEEP_S, until `corral "
                   "resume ID`, which starts its lifetime again.")
@click.option("--auto-resume", is_flag=True,
              help="A command, file, code or port call resumes it when paused or hibernated, "
                   "instead of being refused.")
@click.option("--idle-timeout", type=float, default=None, metavar="SECONDS",
              help="After this long without a command or file use (and nothing running), "
                   "destroy it (or, with --on-idle pause, pause it).")
@click.option("--on-idle", type=click.Choice(["destroy", "pause"]), default="destroy",
              show_default=True, help="What its --idle-timeout does.")
@click.option("--hibernate-after", type=float, default=None, metavar="SECONDS",
              help="Once paused this long, hibernate it: nothing of it left in the kernel, "
                   "its files and /tmp on disk (only with no process running). Default: the "
                   "operator's CORRAL_HIBERNATE_AFTER_S.")
@click.option("--label", "-l", "labels", multiple=True, metavar="KEY=VALUE", help="Add a label.")
@network_options
@start_options
@mount_options
@json_option
@click.pass_context
@handle_errors
def create(ctx: click.Context, resources: str, ttl: float | None, on_timeout: str,
           auto_resume: bool, idle_timeout: float | None, on_idle: str,
           hibernate_after: float | None, labels: tuple[str, ...],
           allow: tuple[str, ...], deny: tuple[str, ...], presets: tuple[str, ...],
           require_lock: bool, secret_names: tuple[str, ...], template: str | None,
           image: str | None, isolation: str | None, snapshot_ref: str | None,
           volumes: dict[str, str | dict[str, Any]] | None, data_mounts: dict[str, str] | None,
           as_json: bool) -> None:
    """Create a sandbox and print its id (--json: the sandbox, as `corral info --json`).

    It lives until `corral rm ID` or its lifetime (--ttl) ends (then it is destroyed, or with
    --on-timeout pause, paused). Volumes it mounts (--volume) outlive it; while it mounts one
    read-write, no other sandbox can mount it.

    \b
    Examples:
      ID=$(corral create --template python --label task=42)
      ID=$(corral create --volume cache:/mnt/cache --data refs:/mnt/refs)
      ID=$(corral create --ttl 600 --on-timeout pause --auto-resume)
      ID=$(corral create --idle-timeout 60 --on-idle pause --hibernate-after 300 --auto-resume)
    """
    label_map = parse_pairs(labels, "--label")
    # Sent only when asked for, so a plain create still works against an older service.
    from ..models import Lifecycle

    # Not validated here: the service judges it (and says what is wrong) like any request.
    lifecycle = Lifecycle.model_construct(
        on_timeout=on_timeout, auto_resume=auto_resume, on_idle=on_idle,
        hibernate_after=hibernate_after).model_dump(exclude_defaults=True) or None
    sb = sdk().create(template, resources=resources, timeout=ttl, labels=label_map,
                        idle_timeout=idle_timeout,
                        network=_network(allow, deny, presets, require_lock),
                        secrets=list(secret_names),
                        isolation=isolation, snapshot=snapshot_ref, image=image,
                        volumes=volumes, data_mounts=data_mounts, lifecycle=lifecycle,
                        home=home_of(ctx))
    if as_json:
        emit_json(_info_json(sb.get_info()))
    else:
        click.echo(sb.id)


@click.command(name="exec", cls=TakesCommand)
@click.argument("sandbox_id")
@command_options
@click.pass_context
@handle_errors
def exec_(ctx: click.Context, sandbox_id: str, timeout: float | None, env: tuple[str, ...],
          cwd: str | None, forward_stdin: bool, binary: bool, context: tuple[str, ...],
          as_json: bool, command: tuple[str, ...]) -> None:
    """Run COMMAND in an existing sandbox; exit with COMMAND's exit code.

    Options go before --, the command after it. One argument is run by bash (pipes and globs
    work); several are run as an argv, exactly as given. /workspace persists between commands.

    \b
    Examples:
      corral exec $ID -- 'echo hi > f.txt && cat f.txt'
      corral exec $ID --cwd src -e DEBUG=1 -- python3 app.py
      corral exec $ID -c tool_call_id=call_7 --json -- pytest -q
      corral exec $ID --binary -- cat image.png > image.png
    """
    cmd = _command_from(command)
    sb = connect(ctx, sandbox_id)
    _run_and_report(sb, cmd, timeout=timeout, env=parse_pairs(env), cwd=cwd,
                    forward_stdin=forward_stdin, as_json=as_json,
                    context=parse_pairs(context, "--context"), binary=binary)


@click.command(name="ls")
@json_option
@click.pass_context
@handle_errors
def list_(ctx: click.Context, as_json: bool) -> None:
    """List live sandboxes (--json: a list, each as `corral info --json` prints it)."""
    infos = sdk().list(home=home_of(ctx))
    if as_json:
        emit_json([_info_json(i) for i in infos])
        return
    if not infos:
        click.echo("no sandboxes", err=True)
        return
    now = time.time()
    rows = [(info.id, info.state, info.template, info.resources, info.isolation,
             _duration(now - info.created_at), _duration(info.expires_at - now),
             "-" if info.sleeping_since is None else _duration(now - info.sleeping_since),
             ",".join(f"{k}={v}" for k, v in info.labels.items())) for info in infos]
    # For a sandbox paused at its timeout, EXPIRES IN is how long it is kept paused.
    click.echo(columns(("ID", "STATE", "TEMPLATE", "RESOURCES", "ISOLATION", "AGE",
                        "EXPIRES IN", "ASLEEP", "LABELS"), rows))


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


@click.command(name="info")
@click.argument("sandbox_id")
@json_option
@click.pass_context
@handle_errors
def info_(ctx: click.Context, sandbox_id: str, as_json: bool) -> None:
    """Show one sandbox."""
    info = connect(ctx, sandbox_id).get_info()
    if as_json:
        emit_json(_info_json(info))
    else:
        for key, value in _info_json(info).items():
            # Times as every command shows them (JSON keeps the numbers).
            if key.endswith("_at") and isinstance(value, int | float):
                value = when(value)
            click.echo(f"{key:16} {value}")


@click.command(name="pause")
@click.argument("sandbox_id")
@json_option
@click.pass_context
@handle_errors
def pause_(ctx: click.Context, sandbox_id: str, as_json: bool) -> None:
    """Freeze every process in a sandbox; its files stay reachable."""
    sb = connect(ctx, sandbox_id)
    sb.pause()
    if as_json:
        emit_json(_info_json(sb.get_info()))


@click.command(name="hibernate")
@click.argument("sandbox_id")
@json_option
@click.pass_context
@handle_errors
def hibernate_(ctx: click.Context, sandbox_id: str, as_json: bool) -> None:
    """Hibernate a sandbox: nothing of it is left in the kernel (no process, mount, loop
    device, cgroup or network namespace), its files and /tmp stay on disk; `corral resume ID`
    (or, created with --auto-resume, its next use) wakes it. Refused while a process of it
    runs (stop it, or `corral pause ID` to freeze it in place instead)."""
    sb = connect(ctx, sandbox_id)
    sb.hibernate()
    if as_json:
        emit_json(_info_json(sb.get_info()))


@click.command(name="resume")
@click.argument("sandbox_id")
@json_option
@click.pass_context
@handle_errors
def resume_(ctx: click.Context, sandbox_id: str, as_json: bool) -> None:
    """Let a paused sandbox's processes run again, or wake a hibernated one; one paused at
    its timeout (--on-timeout pause) starts its lifetime again."""
    sb = connect(ctx, sandbox_id)
    sb.resume()
    if as_json:
        emit_json(_info_json(sb.get_info()))


@click.command(name="rm")
@click.argument("sandbox_ids", nargs=-1, required=True)
@json_option
@click.pass_context
@handle_errors
def remove(ctx: click.Context, sandbox_ids: tuple[str, ...], as_json: bool) -> None:
    """Destroy sandboxes: kill their processes and delete their workspaces."""
    for sandbox_id in sandbox_ids:
        connect(ctx, sandbox_id).kill()
        if not as_json:
            click.echo(f"removed {sandbox_id}", err=True)
    if as_json:
        emit_json({"removed": list(sandbox_ids)})


@click.command(name="network")
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

    \b
    Examples:
      corral network $ID --allow pypi.org --allow '*.pythonhosted.org'
      corral network $ID --none
    """
    sb = connect(ctx, sandbox_id)
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


