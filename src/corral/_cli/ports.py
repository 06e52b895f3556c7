"""Port commands: ``corral ports expose|ls|rm`` (``unexpose`` is ``rm``).

A thin layer over ``sandbox.ports``, so each works embedded and against ``--url`` /
``CORRAL_URL`` alike. With ``--json``, a port prints as ``{sandbox_id, port, public, url,
host_url, token, signed_url, signed_expires_at}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from .common import columns, connect, emit_json, handle_errors, json_option, when

if TYPE_CHECKING:
    from ..models import PortInfo

__all__ = ["ports"]

_PORT = click.IntRange(1, 65535)
_TOKEN_HEADER = "X-Corral-Port-Token"
# Embedded, the SDK cannot know where `corral serve` answers; say how to find out.
_NO_URL = ("- (not known here: set CORRAL_PORTS_URL to the address `corral serve` answers at; "
           "it serves the port)")


class _AliasedGroup(click.Group):
    """A group that also answers to a few other names, kept out of its listing."""

    aliases = {"unexpose": "rm"}

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return super().get_command(ctx, self.aliases.get(cmd_name, cmd_name))


def _port_json(info: PortInfo) -> dict[str, Any]:
    return info.to_dict()


def _describe(info: PortInfo) -> list[str]:
    """The aligned lines `ports expose` prints: where, with what, and until when."""
    lines = [("port", f"{info.port} of {info.sandbox_id}"),
             ("access", "public: anyone with the URL" if info.public
              else f"private: send the token as {_TOKEN_HEADER}, or open the signed link"),
             ("url", info.url or _NO_URL)]
    if info.host_url:
        lines.append(("host_url", info.host_url))
    lines.append(("token", info.token or "-"))
    if info.signed_url:
        expires = when(info.signed_expires_at)
        lines += [("signed_url", info.signed_url), ("expires", f"{expires} (the signed link)")]
    width = max(len(key) for key, _ in lines)
    return [f"{key:{width}}  {value}" for key, value in lines]


@click.group(cls=_AliasedGroup)
def ports() -> None:
    """Reach servers in a sandbox through `corral serve`: expose, list and unexpose ports.

    A server in the sandbox (listening on 0.0.0.0 or 127.0.0.1) is served at
    <service>/ports/<sandbox>/<port>/ (and <port>-<sandbox>.<domain> with CORRAL_PORTS_DOMAIN),
    HTTP and WebSockets alike. Ports are private by default: reachable with the port's token
    (header X-Corral-Port-Token, or Authorization: Bearer), your API key, or in a browser by
    opening its signed link; --public lets anyone with the URL in. Unexposing revokes the
    token and the links at once.

    \b
    Example:
      corral exec $ID -- 'python3 -m http.server 8000 &'
      corral ports expose $ID 8000 --json > port.json
      curl -H "X-Corral-Port-Token: $(jq -r .token port.json)" "$(jq -r .url port.json)"
      corral ports rm $ID 8000
    """


@ports.command(name="expose")
@click.argument("sandbox_id")
@click.argument("port", type=_PORT)
@click.option("--public", is_flag=True,
              help="Reachable by anyone with the URL, no token needed (default: private).")
@click.option("--link-ttl", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="SECONDS",
              help="How long the signed link works (default an hour, at most a week).")
@json_option
@click.pass_context
@handle_errors
def ports_expose(ctx: click.Context, sandbox_id: str, port: int, public: bool,
                 link_ttl: float | None, as_json: bool) -> None:
    """Serve PORT of a sandbox through `corral serve`; print its URLs, token and signed link.

    Exposing a port again keeps its token and links, and sets it private or --public as
    asked this time.
    """
    info = connect(ctx, sandbox_id).ports.expose(port, public=public, link_ttl=link_ttl)
    if as_json:
        emit_json(_port_json(info))
    else:
        click.echo("\n".join(_describe(info)))


@ports.command(name="ls")
@click.argument("sandbox_id")
@json_option
@click.pass_context
@handle_errors
def ports_ls(ctx: click.Context, sandbox_id: str, as_json: bool) -> None:
    """List a sandbox's exposed ports (--json: each with its token and a fresh signed link)."""
    found = connect(ctx, sandbox_id).ports.list()
    if as_json:
        emit_json([_port_json(p) for p in found])
        return
    if not found:
        click.echo("no exposed ports", err=True)
        return
    rows = [(str(p.port), "public" if p.public else "private", p.url or "-",
             p.token or "-") for p in found]
    click.echo(columns(("PORT", "ACCESS", "URL", "TOKEN"), rows))


@ports.command(name="rm")
@click.argument("sandbox_id")
@click.argument("port_numbers", nargs=-1, required=True, type=_PORT, metavar="PORT...")
@json_option
@click.pass_context
@handle_errors
def ports_rm(ctx: click.Context, sandbox_id: str, port_numbers: tuple[int, ...],
             as_json: bool) -> None:
    """Stop serving ports of a sandbox (also `corral ports unexpose`); their tokens and
    signed links stop working at once. A port not exposed is no error."""
    sb = connect(ctx, sandbox_id)
    for port in port_numbers:
        sb.ports.unexpose(port)
        if not as_json:
            click.echo(f"unexposed port {port} of {sandbox_id}", err=True)
    if as_json:
        emit_json({"sandbox_id": sandbox_id, "unexposed": list(port_numbers)})
