"""``corral serve --check-config``: everything starting the service would refuse, found before
it starts (the systemd unit's ``ExecStartPre``), every problem at once."""

from __future__ import annotations

import errno
import os
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import click

from .common import EXIT_USAGE

if TYPE_CHECKING:
    from .._serve.run import E2BListener
    from .._settings import Settings

__all__ = ["check_service"]


def _port_problem(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (f"{host}:{port} is in use by another process (a running corral serve? "
                        "`ss -ltnp` shows which): choose another --port")
            return f"cannot listen on {host}:{port}: {exc.strerror}"
    return None


def _home_problem(settings: Settings) -> str | None:
    home = settings.home
    existing = home
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"the data directory {home} cannot be created or written (check {existing})"
    return None


def check_service(settings: Settings, *, host: str, ports: Sequence[int],
                  host_names: Sequence[str], allow_keyless: bool,
                  e2b: E2BListener | None, share_home: bool) -> None:
    """Print what was checked; exit 2 listing every problem, or return when all pass."""
    from .._control.plane import get_manager
    from .._core.homelock import instances_using
    from .._serve.run import prepare
    from ..errors import CorralError
    from .tiers import tier_checks

    problems: list[str] = []
    home = _home_problem(settings)
    if home:
        problems.append(home)
    else:
        click.echo(f"ok    data directory {settings.home}", err=True)
        others = instances_using(settings.home)
        listed = "; ".join(other.describe() for other in others)
        if others and not share_home:
            problems.append(f"the data directory is in use by another Corral instance: "
                            f"{listed} (stop it, give this service a data directory of its "
                            "own, or pass --share-home)")
        elif others:
            click.echo(f"warn  sharing the data directory with {listed} (--share-home)",
                       err=True)
        try:
            prepared = prepare(get_manager(settings), host=host, host_names=host_names,
                               allow_keyless=allow_keyless, e2b=e2b)
        except CorralError as exc:
            problems.append(exc.message)
        else:
            click.echo(f"ok    listening on {host} (names, keys, E2B and TLS options)", err=True)
            for warning in prepared.warnings:
                click.echo(f"warn  {warning}", err=True)
    checks = tier_checks(settings).get(settings.backend, [])
    failed = [check for check in checks if not check.ok]
    for check in failed:
        problems.append(f"the default tier ({settings.backend}) cannot run: {check.name}: "
                        f"{check.detail} (fix: {check.fix})")
    if not failed:
        click.echo(f"ok    the default tier, {settings.backend}, passes its host checks",
                   err=True)
    for port in ports:
        problem = _port_problem(host, port)
        if problem:
            problems.append(problem)
        else:
            click.echo(f"ok    {host}:{port} is free", err=True)
    for problem in problems:
        click.secho(f"FAIL  {problem}", err=True, fg="red")
    if problems:
        click.echo(f"corral: {len(problems)} problem(s); `corral serve` with these options "
                   "would not start", err=True)
        sys.exit(EXIT_USAGE)
    click.echo("configuration OK: `corral serve` with these options would start", err=True)
