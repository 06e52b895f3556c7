"""What a new user met in the CLI's first hour (issue 38): a closed pipe, an invalid setting,
tables cut to 80 columns, and raw epoch numbers in human output."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from corral._audit.events import AuditEvent
from corral._cli.main import cli
from corral.models import SandboxInfo

_ISO_UTC = re.compile(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\b")
_NOW = 1_796_000_000.0  # 2026-11-30T...: a fixed time, so what is printed is known


def _corral(args: list[str], *, home: Path, env: dict[str, str] | None = None,
            stdout: int | None = None) -> subprocess.CompletedProcess[bytes]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    environment.update(CORRAL_HOME=str(home), **(env or {}))
    return subprocess.run([sys.executable, "-m", "corral", *args], env=environment,
                          stdout=stdout if stdout is not None else subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=120, check=False)


@pytest.mark.needs_root
@pytest.mark.parametrize("args", [["ls", "--json"], ["--help"]])
def test_a_closed_pipe_ends_the_command_quietly(args: list[str]) -> None:
    home = Path(tempfile.mkdtemp(prefix="corral-test-cli-"))
    home.chmod(0o711)
    # `corral ls --json | head -c1`, without the race: the reader is gone before the write.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = _corral(args, home=home, stdout=write_end,
                       env={"CORRAL_UID_START": "2060500000", "CORRAL_UID_COUNT": "10"})
    finally:
        os.close(write_end)
        shutil.rmtree(home, ignore_errors=True)
    assert done.stderr.decode() == ""  # no "Broken pipe", no traceback, no "Exception ignored"
    assert done.returncode == 1  # click's own for a closed pipe (as `corral --help` had it)


@pytest.mark.parametrize(("variable", "value", "says"), [
    ("CORRAL_UID_START", "abc", "valid integer"),
    ("CORRAL_UID_START", "5", "greater than or equal to 1000"),
    ("CORRAL_AUDIT", "maybe", "valid boolean"),
    ("CORRAL_EGRESS_HOSTS", "{bad", "not valid JSON"),
])
def test_an_invalid_setting_is_one_line_naming_the_variable(
        tmp_path: Path, variable: str, value: str, says: str) -> None:
    done = _corral(["ls"], home=tmp_path, env={variable: value})
    assert done.returncode == 2
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"corral: invalid {variable}")
    assert says in lines[0] and f"e.g. {variable}=" in lines[0]
    assert "http" not in lines[0] and "pydantic" not in lines[0] and "type=" not in lines[0]
    assert not (tmp_path / "corral.db").exists()  # refused before anything was opened


def test_every_invalid_setting_gets_its_line_and_a_range_error_names_both(
        tmp_path: Path) -> None:
    done = _corral(["ls"], home=tmp_path, env={"CORRAL_UID_START": "abc",
                                               "CORRAL_AUDIT": "maybe"})
    lines = done.stderr.decode().strip().splitlines()
    assert [line.split("=", 1)[0] for line in lines] == [
        "corral: invalid CORRAL_UID_START", "corral: invalid CORRAL_AUDIT"]
    done = _corral(["ls"], home=tmp_path, env={"CORRAL_UID_START": "2147483000"})
    assert done.returncode == 2
    assert "CORRAL_UID_START or CORRAL_UID_COUNT" in done.stderr.decode()


class _Trail:
    def __init__(self, events: list[AuditEvent]) -> None:
        self.events = events


def test_egress_keeps_long_host_names_whole_in_a_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    host = "a-very-long-package-mirror-name.internal.example-corporation.com"
    events = [AuditEvent(seq=1, ts=_NOW, sandbox="sbx_000000000001", command="cmd_0001",
                         type="egress.decision",
                         data={"method": "CONNECT", "host": host, "port": 443,
                               "verdict": "denied", "rule": "not-allowed", "bytes_up": 0,
                               "bytes_down": 0})]
    auditor = SimpleNamespace(trail=lambda *a, **k: _Trail(events))
    monkeypatch.setattr("corral._control.plane.get_manager",
                        lambda settings: SimpleNamespace(auditor=auditor))
    monkeypatch.setenv("COLUMNS", "80")
    result = CliRunner().invoke(cli, ["egress", "sbx_000000000001"])
    assert result.exit_code == 0, result.output
    assert f"{host}:443" in result.output
    assert _ISO_UTC.search(result.output)


def _info() -> SandboxInfo:
    return SandboxInfo(id="sbx_000000000001", template="base", resources="small",
                       state="running", created_at=_NOW, expires_at=_NOW + 3600)


def test_info_shows_times_in_iso_8601_utc_and_json_keeps_numbers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox = SimpleNamespace(get_info=_info)
    monkeypatch.setattr("corral._cli.sandboxes.connect", lambda ctx, sandbox_id: sandbox)
    human = CliRunner().invoke(cli, ["info", "sbx_000000000001"])
    assert human.exit_code == 0, human.output
    expected = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_NOW))
    assert re.search(rf"^created_at\s+{expected}$", human.output, re.M), human.output
    assert str(int(_NOW)) not in human.output
    as_json = CliRunner().invoke(cli, ["info", "sbx_000000000001", "--json"])
    assert f'"created_at": {_NOW}' in as_json.output


def test_snapshots_show_iso_times_and_whole_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = SimpleNamespace(id="snap_" + "x" * 60, name="a-rather-long-snapshot-name",
                               template="base", sandbox="sbx_000000000001", size_bytes=1024,
                               depth=1, memory=False, created_at=_NOW)

    class _Sdk:
        @staticmethod
        def list_snapshots(**kwargs: Any) -> list[Any]:
            return [snapshot]

    monkeypatch.setattr("corral._cli.snapshots.sdk", lambda: _Sdk)
    monkeypatch.setenv("COLUMNS", "80")
    result = CliRunner().invoke(cli, ["snapshots", "ls"])
    assert result.exit_code == 0, result.output
    assert snapshot.id in result.output and snapshot.name in result.output
    assert _ISO_UTC.search(result.output)


def test_help_loads_every_command_but_no_model_drill_or_template_stack() -> None:
    # `corral --help` imports each command's module to list it: those modules import what
    # they run when they run (the drill package, the tenants' store, rich, pydantic's models).
    code = ("import sys, json\nfrom click.testing import CliRunner\n"
            "from corral._cli.main import cli\n"
            "assert CliRunner().invoke(cli, ['--help']).exit_code == 0\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    loaded = set(json.loads(out.stdout))
    heavy = {"pydantic", "corral._drill", "corral._control.tenants", "corral._templates",
             "rich", "corral.models"}
    assert loaded.isdisjoint(heavy), sorted(loaded & heavy)
