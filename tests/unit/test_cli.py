"""The CLI's own parsing and start-up, without running a sandbox: options are refused before any
sandbox exists, and the hot paths import only what they use."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from corral._cli.main import COMMANDS, cli

HEAVY = ("fastapi", "uvicorn", "starlette", "mcp", "httpx", "anyio", "rich", "pygments")


@pytest.mark.parametrize("args", [
    ["run", "--resource", "large", "--", "echo", "hi"],
    ["run", "--bogus", "echo", "hi"],
    ["run", "--json", "--resource=large", "--", "echo", "hi"],
    ["exec", "sbx_000000000000", "--resource", "large", "--", "echo", "hi"],
    ["exec", "sbx_000000000000", "--bogus", "--", "true"],
])
def test_unknown_options_before_the_separator_are_refused(tmp_path, args: list[str]) -> None:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(cli, ["--home", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert "No such option" in result.output
    assert "after --" in result.output  # says where the command goes
    assert not (tmp_path / "corral.db").exists()  # refused before anything was opened


def test_the_refusal_suggests_the_option_meant(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(cli, ["--home", str(tmp_path), "run", "--resource", "large",
                                      "--", "echo", "hi"])
    assert "No such option '--resource'" in result.output
    assert "Did you mean '--resources'?" in result.output


def _imported_by(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport json, sys\n"
                          "print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, timeout=60)
    return {name.split(".")[0] for name in json.loads(out.stdout)}


def test_the_cli_entry_point_imports_no_service_or_client_stack() -> None:
    loaded = _imported_by("import corral._cli.main")
    assert loaded.isdisjoint(HEAVY), sorted(loaded & set(HEAVY))


def test_parsing_a_run_command_imports_no_service_or_client_stack() -> None:
    # Resolving `run` and parsing its options loads the command's module, not the SDK stack.
    loaded = _imported_by(
        "from corral._cli.main import cli\n"
        "import click\n"
        "ctx = cli.make_context('corral', ['run', '--', 'true'], resilient_parsing=True)\n"
        "cmd = cli.get_command(ctx, 'run')\n"
        "cmd.make_context('run', ['--json', '--', 'true'], parent=ctx)\n")
    assert loaded.isdisjoint(HEAVY), sorted(loaded & set(HEAVY))


def test_help_lists_every_command_with_its_help_line() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0, result.output
    listing = result.output.split("Commands:", 1)[1]
    names = {line.split()[0] for line in listing.splitlines() if line.strip()}
    expected = set(COMMANDS)
    assert "setup" in expected and "run" in expected
    assert names == expected
    for line in listing.splitlines():
        if line.strip():
            assert len(line.split()) > 1, f"no help line: {line!r}"


def _walk(group: object, path: list[str]):  # type: ignore[no-untyped-def]
    import click

    assert isinstance(group, click.Group)
    ctx = click.Context(group, info_name="corral")
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        if isinstance(command, click.Group):
            yield from _walk(command, [*path, name])
        else:
            yield [*path, name], command


def test_every_command_has_json_and_a_help_text() -> None:
    # serve and mcp run a service in the foreground until stopped: they print nothing to parse.
    foreground = {("serve",), ("mcp",)}
    missing_json, missing_help = [], []
    for path, command in _walk(cli, []):
        if tuple(path) not in foreground and not any(
                "--json" in p.opts for p in command.params):
            missing_json.append(" ".join(path))
        if not (command.help or "").strip():
            missing_help.append(" ".join(path))
    assert missing_json == [] and missing_help == []
