"""Behavioural SDK cases; each runs on every transport × tier (see conftest.py)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from corral import (
    CommandError,
    FileNotFound,
    PathRefused,
    Sandbox,
    SandboxNotFound,
    UsageError,
)

pytestmark = pytest.mark.needs_root


def test_create_and_info(sb: Sandbox, isolation: str) -> None:
    info = sb.get_info()
    assert info.id == sb.id and info.isolation == isolation and info.state == "running"


def test_run_exit_code_and_streams(sb: Sandbox) -> None:
    result = sb.commands.run("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not result.ok and result.command_id.startswith("cmd_")


def test_live_output_matches_the_result(sb: Sandbox) -> None:
    seen: list[str] = []
    result = sb.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=seen.append)
    assert "".join(seen) == result.stdout == "1\n2\n3\n"


def test_env_and_cwd(sb: Sandbox) -> None:
    sb.files.make_dir("d")
    result = sb.commands.run("pwd; echo $X", cwd="/workspace/d", envs={"X": "y"})
    assert result.stdout == "/workspace/d\ny\n"


def test_stdin(sb: Sandbox) -> None:
    assert sb.commands.run(["wc", "-c"], stdin="12345").stdout.strip() == "5"


def test_timeout_kills_the_tree(sb: Sandbox) -> None:
    result = sb.commands.run("sleep 10", timeout=0.5)
    assert result.timed_out and result.exit_code == 124


def test_binary_output_is_byte_exact(sb: Sandbox) -> None:
    blob = os.urandom(1000)
    sb.files.write("r.bin", blob)
    assert sb.commands.run("cat r.bin", output="bytes").stdout_bytes == blob


def test_files_round_trip(sb: Sandbox) -> None:
    entry = sb.files.write("a/b.txt", "hello")
    assert entry.path == "/workspace/a/b.txt" and entry.size == 5
    assert sb.files.read("a/b.txt") == "hello"
    assert sb.files.read("a/b.txt", format="bytes") == b"hello"
    assert [e.name for e in sb.files.list("a")] == ["b.txt"]
    assert sb.files.exists("a/b.txt") and not sb.files.exists("a/nope")
    sb.files.rename("a/b.txt", "a/c.txt")
    assert sb.files.stat("a/c.txt").size == 5
    sb.files.remove("a")
    with pytest.raises(FileNotFound):
        sb.files.read("a/c.txt")
    with pytest.raises(PathRefused):
        sb.files.read("/etc/shadow")


def test_background_process(sb: Sandbox) -> None:
    process = sb.processes.start("read line; echo got $line")
    assert [p.id for p in sb.processes.list()] == [process.id]
    process.send("hi\n")
    info = process.wait(timeout=10)
    assert info["state"] == "exited" and info["exit_code"] == 0
    assert "".join(text for _, _, text in process.output()) == "got hi\n"


def test_snapshot_fork_restore(sb: Sandbox) -> None:
    sb.files.write("f", "one")
    snap = sb.snapshot()
    sb.files.write("f", "two")
    (child,) = sb.fork()
    with child:
        assert child.files.read("f") == "two"
    sb.restore(snap)
    assert sb.files.read("f") == "one"


def test_audit_trail(sb: Sandbox) -> None:
    result = sb.commands.run("echo audited")
    events = sb.audit.events(command=result.command_id)
    assert [e.type for e in events][0] == "command.started"
    assert "command.finished" in {e.type for e in sb.audit.events(types=["command.*"])}


def test_errors_are_the_same_classes(sb: Sandbox, target: dict[str, Any]) -> None:
    with pytest.raises(CommandError):
        sb.commands.run("")
    with pytest.raises(UsageError):
        sb.commands.run("true", timeout=100_000)
    with pytest.raises(SandboxNotFound):
        Sandbox.connect("sbx_doesnotexist", **target)


def test_kill_then_use_is_refused(sb: Sandbox) -> None:
    sb.kill()
    with pytest.raises(UsageError):
        sb.commands.run("true")

