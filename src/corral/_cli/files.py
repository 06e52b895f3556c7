"""``corral files read|write|ls``: a sandbox's /workspace from the host side."""

from __future__ import annotations

import sys
import unicodedata
from typing import TYPE_CHECKING, Any

import click

from .common import connect, emit_json, handle_errors, json_option

if TYPE_CHECKING:
    from ..models import FileEntry

__all__ = ["files"]


@click.group()
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
    sb = connect(ctx, sandbox_id)
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
    """Write stdin (or --from FILE) to PATH, creating parent directories.

    \b
    Examples:
      echo 'print(42)' | corral files write $ID src/app.py
      corral files write $ID data.csv --from ./data.csv
    """
    sb = connect(ctx, sandbox_id)
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
    entries: list[FileEntry] = connect(ctx, sandbox_id).files.list(path)
    if as_json:
        emit_json([e.to_dict() for e in entries])
        return
    for e in entries:
        suffix = "/" if e.type == "dir" else ("@" if e.type == "symlink" else "")
        click.echo(f"{e.mode:04o} {e.size:>10} {_shown(e.name)}{suffix}")


