"""Helpers shared by the CLI's command modules: exit codes, error handling, JSON output, and the
command class for commands that take a COMMAND after ``--``.

Light on purpose: every command imports this module, so the SDK and the control plane are
imported inside the helpers that need them, never at module level.
"""

from __future__ import annotations

import errno
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from .. import errors

if TYPE_CHECKING:
    from .._sdk.sandbox import Sandbox
    from .._settings import Settings

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_NOT_FOUND = 4

F = TypeVar("F", bound=Callable[..., Any])


def _exit_code_for(exc: errors.CorralError) -> int:
    if isinstance(exc, errors.SandboxNotFound | errors.FileNotFound | errors.SnapshotNotFound
                  | errors.VolumeNotFound | errors.PortNotExposed):
        return EXIT_NOT_FOUND
    if isinstance(exc, errors.BackendUnavailable):
        return EXIT_UNAVAILABLE
    if isinstance(exc, errors.UsageError | errors.CommandError | errors.PathRefused
                  | errors.ConfigError):
        return EXIT_USAGE
    return EXIT_FAILED


def _fail(message: str, code: str, exit_code: int, as_json: bool) -> NoReturn:
    if as_json:
        click.echo(json.dumps({"code": code, "message": message}), err=True)
    else:
        click.secho(f"corral: {message}", err=True, fg="red")
    sys.exit(exit_code)


def handle_errors(fn: F) -> F:
    """Turn Corral errors into a message and an exit code; tracebacks only with --debug."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        as_json = bool(kwargs.get("as_json", False))
        try:
            return fn(*args, **kwargs)
        except errors.CorralError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            _fail(exc.message, exc.code, _exit_code_for(exc), as_json)
        except OSError as exc:
            # Our stdout's reader went away (`corral ls --json | head -c1`): click's main ends
            # quietly, as `yes | head` does, not with "Broken pipe" as if Corral had failed.
            if exc.errno == errno.EPIPE or (ctx.obj and ctx.obj.get("debug")):
                raise
            _fail(f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""),
                  "os_error", EXIT_FAILED, as_json)

    return wrapper  # type: ignore[return-value]


json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def home_of(ctx: click.Context) -> Path | None:
    """The data directory for SDK calls; None (so the SDK talks to ``CORRAL_URL``) when a
    service is configured and no --home was given."""
    settings: Settings = ctx.obj["settings"]
    if settings.url and not ctx.obj.get("home_given"):
        return None
    return settings.home


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=None, sort_keys=False))


def when(ts: float | None) -> str:
    """A timestamp for a person, the same in every command: ISO 8601 in UTC, to the second
    (``2026-12-07T07:41:05Z``); ``-`` for none. JSON keeps the numbers."""
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def size_text(n: int) -> str:
    """Bytes for a person: ``512 B``, ``1.5 GiB``."""
    if n < 1024:
        return f"{n} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def parse_pairs(pairs: Sequence[str], option: str = "--env") -> dict[str, str]:
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint=option)
        parsed[key] = value
    return parsed


def sdk() -> type[Sandbox]:
    """The SDK's ``Sandbox``, imported when a command first needs it."""
    from .._sdk.sandbox import Sandbox

    return Sandbox


def connect(ctx: click.Context, sandbox_id: str) -> Sandbox:
    """The sandbox ``sandbox_id``, embedded or on the configured service."""
    return sdk().connect(sandbox_id, home=home_of(ctx))


class _OptionBeforeCommand(click.NoSuchOption):
    """click's "No such option" (with its "Did you mean"), then where the command goes."""

    def __init__(self, original: click.NoSuchOption, example: str) -> None:
        super().__init__(original.option_name, possibilities=original.possibilities,
                         ctx=original.ctx)
        self.example = example

    def format_message(self) -> str:
        return (f"{super().format_message()}\nOptions go before --; everything after -- is "
                f"the command, run as given: {self.example}")


class TakesCommand(click.Command):
    """A command whose trailing COMMAND is everything after ``--``.

    Unknown options before ``--`` are refused: passed through, ``corral run --resource large
    -- echo hi`` would run ``--resource`` as the command. After ``--`` nothing is parsed.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            before = [p.human_readable_name for p in self.params
                      if isinstance(p, click.Argument) and p.name != "command"]
            example = " ".join([ctx.command_path, *before, "[OPTIONS] -- ls -la"])
            raise _OptionBeforeCommand(exc, f"`{example}`") from None


def columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain left-aligned table, one line per row (rich's costs ~25 ms of start-up to import,
    more than `corral ls` itself takes). Never cut to the terminal's width: a host name or an
    id cut short identifies nothing, and a pipe's reader has no width at all."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths,
                                                                        strict=True)).rstrip()
                     for line in (header, *rows))
