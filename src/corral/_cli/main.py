"""The ``corral`` command line: a thin layer over the SDK.

Results go to stdout, progress and errors to stderr. Every command takes ``--json``. ``run`` and
``exec`` exit with the sandboxed command's own exit code; Corral's own failures use the codes in
``common``.

Commands are loaded by name when used (click's lazy-group pattern): ``corral run`` imports the
SDK it runs on, not the HTTP service, the MCP server or the template builder. Keep this module
and ``common`` free of module-level imports beyond click and the standard library.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

__all__ = ["cli", "main"]

# name -> "module:attribute"; `corral --help` loads them all to show each help line.
COMMANDS: Mapping[str, str] = {
    "run": "corral._cli.sandboxes:run",
    "create": "corral._cli.sandboxes:create",
    "exec": "corral._cli.sandboxes:exec_",
    "code": "corral._cli.code:code",
    "ls": "corral._cli.sandboxes:list_",
    "info": "corral._cli.sandboxes:info_",
    "pause": "corral._cli.sandboxes:pause_",
    "hibernate": "corral._cli.sandboxes:hibernate_",
    "resume": "corral._cli.sandboxes:resume_",
    "rm": "corral._cli.sandboxes:remove",
    "network": "corral._cli.sandboxes:network_",
    "ports": "corral._cli.ports:ports",
    "files": "corral._cli.files:files",
    "replay": "corral._cli.audit:replay",
    "egress": "corral._cli.audit:egress",
    "audit": "corral._cli.audit:audit",
    "metrics": "corral._cli.host:metrics",
    "reap": "corral._cli.host:reap",
    "doctor": "corral._cli.host:doctor",
    "demo": "corral._cli.host:demo",
    "serve": "corral._cli.host:serve",
    "setup": "corral._cli.setup:setup",
    "mcp": "corral._cli.mcp:mcp_",
    "snapshot": "corral._cli.snapshots:snapshot",
    "fork": "corral._cli.snapshots:fork",
    "restore": "corral._cli.snapshots:restore",
    "snapshots": "corral._cli.snapshots:snapshots",
    "volumes": "corral._cli.volumes:volumes",
    "templates": "corral._cli.templates:templates",
    "tenants": "corral._cli.admin:tenants",
    "keys": "corral._cli.admin:keys",
    "secrets": "corral._cli.admin:secrets",
    "drill": "corral._cli.drill:drill",
}


class LazyGroup(click.Group):
    """A group whose commands are named in a table and imported on first use."""

    def __init__(self, *args: Any, lazy_commands: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(lazy_commands)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy_commands:
            module_name, _, attr = self.lazy_commands[cmd_name].partition(":")
            command = getattr(importlib.import_module(module_name), attr)
            if not isinstance(command, click.Command):  # a wrong table entry, found in tests
                raise TypeError(f"{self.lazy_commands[cmd_name]} is not a click command")
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, lazy_commands=COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"]})
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
    from .._settings import Settings

    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = Settings(home=home) if home is not None else Settings()
    except ValueError as exc:  # pydantic's ValidationError, pydantic-settings' SettingsError
        if debug:
            raise
        from .configerror import describe

        for line in describe(exc):
            click.secho(f"corral: {line}", err=True, fg="red")
        ctx.exit(2)  # a usage error: the configuration given is wrong
    ctx.obj = {"settings": settings, "debug": debug, "home_given": home is not None}


def main() -> None:
    try:
        cli(prog_name="corral")
    except ModuleNotFoundError as exc:
        # A host command (serve, mcp, templates build, ...) on the client install.
        from .._core.install import host_install_needed

        needed = host_install_needed(exc, f"`corral {' '.join(sys.argv[1:2])}`")
        if needed is None:
            raise
        click.secho(f"corral: {needed.message}", err=True, fg="red")
        sys.exit(3)
