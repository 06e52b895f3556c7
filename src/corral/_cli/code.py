"""``corral code SANDBOX CODE``: run a cell in the sandbox's code interpreter. A thin layer
over ``Sandbox.run_code``."""

from __future__ import annotations

import base64
import sys
from typing import TYPE_CHECKING

import click

from .common import connect, emit_json, handle_errors, json_option, parse_pairs

if TYPE_CHECKING:
    from ..models import OutputMessage

__all__ = ["code"]


@click.command(name="code")
@click.argument("sandbox_id")
@click.argument("source")
@click.option("--language", "-l", default=None,
              help="python (default), javascript (js), typescript (ts), r or bash.")
@click.option("--context", "context_id", default=None, help="A context id instead.")
@click.option("--timeout", type=float, default=None, help="Seconds before the cell is "
              "interrupted.")
@click.option("--env", "-e", multiple=True, metavar="KEY=VALUE", help="For this cell only.")
@json_option
@click.pass_context
@handle_errors
def code(ctx: click.Context, sandbox_id: str, source: str, language: str | None,
         context_id: str | None, timeout: float | None, env: tuple[str, ...],
         as_json: bool) -> None:
    """Run a cell of code in a stateful kernel (SOURCE, or - for stdin).

    State lasts as long as the kernel's owner: across calls against a service (CORRAL_URL),
    for this one call when embedded. Prints the output as it comes, then the cell's value;
    exits 1 if the cell raised (its traceback on stderr). Images are not printed: --json
    gives every result's MIME bundle (PNG base64)."""
    text = sys.stdin.read() if source == "-" else source

    def out(message: OutputMessage) -> None:
        sys.stdout.write(message.text)
        sys.stdout.flush()

    def err(message: OutputMessage) -> None:
        sys.stderr.write(message.text)
        sys.stderr.flush()

    live = not as_json
    execution = connect(ctx, sandbox_id).run_code(
        text, language=language, context=context_id, envs=parse_pairs(env),
        timeout=timeout, on_stdout=out if live else None, on_stderr=err if live else None)
    if as_json:
        emit_json(execution.to_dict())
    else:
        for result in execution.results:
            if result.text is not None and result.is_main_result:
                click.echo(result.text)
            elif result.png is not None:
                size = len(base64.b64decode(result.png))
                click.echo(f"[image/png, {size} bytes: --json has it]", err=True)
        if execution.error is not None:
            click.echo(execution.error.traceback or
                       f"{execution.error.name}: {execution.error.value}", err=True)
    if execution.error is not None:
        ctx.exit(1)
