"""The process table runs on the narrow CommandRunner protocol alone, so its behaviour (start,
output with offsets, input, kill, exit) is testable without root, a backend or a Manager."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from corral import CommandNotFound, UsageError
from corral._control.processes import ProcessTable
from corral.backends import OutputCallback, ProcessIO
from corral.models import CommandResult, Usage


class _Echo:
    """A command that echoes its stdin until closed or killed (one per run)."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.done = threading.Event()

    def write(self, data: bytes) -> None:
        self.lines.append(data)
        self.on_stdout(data.decode())

    def close_stdin(self) -> None:
        self.done.set()

    def resize(self, rows: int, cols: int) -> None:
        pass

    on_stdout: OutputCallback = staticmethod(lambda text: None)  # type: ignore[assignment]


class _Runner:
    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.admitted: list[str] = []
        self.killed: list[str] = []
        self.io: dict[str, _Echo] = {}

    def admit_background(self, sandbox_id: str, caller: Any) -> str:
        if self.refuse:
            raise UsageError("no such sandbox")
        self.admitted.append(sandbox_id)
        return sandbox_id

    def run(self, sandbox_id: str, cmd: str | Sequence[str], *,
            envs: Mapping[str, str] | None, cwd: str | None,
            context: Mapping[str, Any] | None, interactive: bool,
            on_start: Callable[[ProcessIO], None] | None, lifetime: bool,
            command_id: str | None, on_stdout: OutputCallback | None,
            on_stderr: OutputCallback | None) -> CommandResult:
        assert interactive and lifetime and command_id and on_start and on_stdout
        echo = self.io[command_id] = _Echo()
        echo.on_stdout = on_stdout  # type: ignore[method-assign]
        on_stdout("ready\n")
        on_start(echo)
        echo.done.wait(10)
        code = 137 if command_id in self.killed else 0
        return CommandResult(exit_code=code, stdout="", stderr="", timed_out=False,
                             duration_s=0.0, usage=Usage(0.0, 0.0, 0, False),
                             command_id=command_id)

    def kill(self, sandbox_id: str, command_id: str) -> None:
        self.killed.append(command_id)
        self.io[command_id].done.set()


def test_start_read_send_and_exit_through_the_runner_alone() -> None:
    runner = _Runner()
    table = ProcessTable(runner)
    process = table.start("sbx_000000000001", ["cat"])
    assert process.state == "running" and runner.admitted == ["sbx_000000000001"]
    process.send(b"hello\n")
    assert [text for _, _, text in process.output(0)] == ["ready\n", "hello\n"]
    assert [(at, text) for at, _, text in process.output(6)] == [(6, "hello\n")]
    assert table.any_live("sbx_000000000001")
    process.close_input()
    result = process.wait(5)
    assert result is not None and result.exit_code == 0
    assert not table.any_live("sbx_000000000001")


def test_kill_goes_to_the_runner_and_unknown_processes_are_not_found() -> None:
    runner = _Runner()
    table = ProcessTable(runner)
    process = table.start("sbx_000000000001", "sleep 100")
    table.kill("sbx_000000000001", process.id)
    result = process.wait(5)
    assert runner.killed == [process.command_id] and result is not None
    assert result.exit_code == 137
    with pytest.raises(CommandNotFound):
        table.get("sbx_000000000002", process.id)  # another sandbox's id


def test_a_refused_start_starts_nothing() -> None:
    table = ProcessTable(_Runner(refuse=True))
    with pytest.raises(UsageError):
        table.start("sbx_000000000001", "true")
    assert table.list("sbx_000000000001") == []
