"""Helpers shared by the CLI's command modules: exit codes, error handling, JSON output."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from .. import errors
from .._settings import Settings

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_NOT_FOUND = 4

F = TypeVar("F", bound=Callable[..., Any])


def _exit_code_for(exc: errors.CorralError) -> int:
    if isinstance(exc, errors.SandboxNotFound | errors.FileNotFound | errors.SnapshotNotFound):
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
            if ctx.obj and ctx.obj.get("debug"):
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


def parse_pairs(pairs: Sequence[str], option: str = "--env") -> dict[str, str]:
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint=option)
        parsed[key] = value
    return parsed
