"""``corral mcp``: sandboxes as tools over the Model Context Protocol. Imports the MCP server
when it runs."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import click

from .common import handle_errors, home_of

if TYPE_CHECKING:
    from .._mcp.where import Where

__all__ = ["mcp_"]


def _mcp_volumes(ctx: click.Context, param: click.Parameter,
                 values: tuple[str, ...]) -> dict[str, bool]:
    """``--volume NAME[:ro]`` values as volume name -> whether the model may only read it."""
    allowed: dict[str, bool] = {}
    for value in values:
        name, _, mode = value.partition(":")
        if not name or mode not in ("", "ro", "rw"):
            raise click.BadParameter(f"{value!r} is not NAME or NAME:ro (like cache:ro)")
        # Named twice, the tighter wins: a typo must not widen what the model gets.
        allowed[name] = allowed.get(name, False) or mode == "ro"
    return allowed


@click.command(name="mcp")
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
@click.option("--volume", "volumes", multiple=True, metavar="NAME[:ro]",
              callback=_mcp_volumes,
              help="Let the model mount this volume (repeatable); with :ro, read-only only. "
                   "Default: none.")
@click.option("--share-home", is_flag=True,
              help="Start even if another Corral instance (corral serve, corral mcp) uses the "
                   "data directory: both then reap and recover the same sandboxes.")
@click.pass_context
@handle_errors
def mcp_(ctx: click.Context, transport: str, host: str, port: int,
         allow_hosts: tuple[str, ...], templates: tuple[str, ...], secrets: tuple[str, ...],
         max_lifetime: int | None, volumes: dict[str, bool], share_home: bool) -> None:
    """Serve sandboxes as tools over the Model Context Protocol (MCP).

    Calls without a sandbox_id share one sandbox per MCP session, destroyed when the session
    ends (or at its TTL if the server is killed).

    The model is the caller here, and a prompt injection can write its tool calls, so what it
    may ask for has a ceiling of its own: no network, the base template, no secrets and no
    volumes unless widened with --allow-host, --template, --secret and --volume (the first
    three replace CORRAL_CEILING_HOSTS, _TEMPLATES and _SECRETS here; the other
    CORRAL_CEILING_* fields still apply). Beyond it a tool call fails with ceiling_exceeded;
    unknown arguments are refused.

    On start it says which data directory and tier it uses (stderr, and the instructions the
    client sees), and refuses a data directory another Corral instance uses unless
    --share-home. MCP clients pass their server none of your shell's environment: set
    CORRAL_HOME in the client's configuration, or pass --home (docs/mcp.md).
    """
    from .._mcp import mcp_ceiling, serve

    ceiling = mcp_ceiling(hosts=allow_hosts, templates=templates, secrets=secrets,
                          max_lifetime_s=max_lifetime)
    serve(home_of(ctx), "http" if transport == "http" else "stdio", host=host, port=port,
          ceiling=ceiling, volumes=volumes, where=_where(ctx), share_home=share_home)


def _where(ctx: click.Context) -> Where:
    """Where the server's sandboxes live, and what chose it."""
    from .._mcp.where import Where
    from .._settings import Settings

    settings: Settings = ctx.obj["settings"]
    home = home_of(ctx)
    if ctx.obj.get("home_given"):
        source = "--home"
    elif any(name.upper() == "CORRAL_HOME" for name in os.environ):  # read case-blind
        source = "CORRAL_HOME"
    else:
        source = "the default"
    return Where(home=home, source=source, tier=settings.backend, url=settings.url,
                 uids=(settings.uid_start, settings.uid_count))


