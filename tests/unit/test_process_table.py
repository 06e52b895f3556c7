"""The process table runs on the narrow CommandRunner protocol alone, so its behaviour (start,
output with offsets, input, kill, exit) is testable without root, a backend or a Manager."""

from __future__ import annotations

import threading
import time
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


class _Terminal(_Runner):
    """A runner that records what each run was asked for (pty, cwd, envs)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[dict[str, Any]] = []
        self.sizes: list[tuple[int, int]] = []

    def run(self, sandbox_id: str, cmd: str | Sequence[str], **kwargs: Any) -> CommandResult:
        self.asked.append({k: kwargs.get(k) for k in ("pty", "cwd", "envs")})
        kwargs.pop("pty", None)  # the echo runner below predates terminals
        inner = kwargs["on_start"]

        def started(io: ProcessIO) -> None:
            io.resize = lambda rows, cols: self.sizes.append((rows, cols))  # type: ignore
            inner(io)

        kwargs["on_start"] = started
        return super().run(sandbox_id, cmd, **kwargs)


def test_pids_are_small_per_sandbox_and_never_reused() -> None:
    table = ProcessTable(_Runner())
    a = table.start("sbx_000000000001", "cat")
    b = table.start("sbx_000000000001", "cat", tag="web")
    c = table.start("sbx_000000000002", "cat")
    assert (a.pid, b.pid, c.pid) == (1, 2, 1)
    a.close_input()
    a.wait(5)
    d = table.start("sbx_000000000001", "cat")
    assert d.pid == 3  # 1 has exited but is remembered: not given out again
    assert table.find("sbx_000000000001", pid=2) is b
    assert table.find("sbx_000000000001", tag="web") is b
    with pytest.raises(CommandNotFound):
        table.find("sbx_000000000002", pid=2)  # another sandbox's pid
    with pytest.raises(CommandNotFound):
        table.find("sbx_000000000001", tag="nope")
    for process in (b, c, d):
        process.close_input()


def test_a_kill_by_the_table_is_a_signal_death_an_exit_137_is_not() -> None:
    runner = _Runner()
    table = ProcessTable(runner)
    killed = table.start("sbx_000000000001", "sleep 100")
    table.kill("sbx_000000000001", killed.id)
    killed.wait(5)
    assert killed.kill_requested and killed.signaled

    exited = table.start("sbx_000000000001", "cat")
    runner.killed.append(exited.command_id)  # the runner reports 137, no kill was asked
    exited.close_input()
    exited.wait(5)
    assert exited.result is not None and exited.result.exit_code == 137
    assert not exited.signaled


def test_timeout_kills_at_the_deadline() -> None:
    runner = _Runner()
    table = ProcessTable(runner)
    began = time.monotonic()
    process = table.start("sbx_000000000001", "sleep 100", timeout=0.2)
    result = process.wait(5)
    assert result is not None and 0.15 < time.monotonic() - began < 3
    assert runner.killed == [process.command_id] and process.signaled
    with pytest.raises(UsageError):
        table.start("sbx_000000000001", "true", timeout=0)


def test_watchers_hear_output_and_exit_and_can_stop() -> None:
    table = ProcessTable(_Runner())
    process = table.start("sbx_000000000001", "cat")
    heard: list[int] = []
    unwatch = process.watch(lambda: heard.append(process.position))
    process.send(b"abc\n")
    assert heard and heard[-1] == len("ready\nabc\n")
    unwatch()
    count = len(heard)
    process.close_input()
    process.wait(5)
    assert len(heard) == count  # stopped
    # A watcher that raises never stops the output.
    other = table.start("sbx_000000000001", "cat")
    other.watch(lambda: 1 / 0)  # type: ignore[func-returns-value]
    other.send(b"x\n")
    assert [t for _, _, t in other.output(0)] == ["ready\n", "x\n"]
    other.close_input()


def test_a_tap_sees_every_chunk_past_the_window_then_the_exit() -> None:
    table = ProcessTable(_Runner())
    process = table.start("sbx_000000000001", "cat")
    chunks: list[tuple[str, str]] = []
    ended = threading.Event()
    process.tap(lambda stream, text: chunks.append((stream, text)), ended.set)
    assert chunks == [("stdout", "ready\n")]  # what was kept before the tap, first
    block = "y" * (1 << 20)
    for _ in range(6):  # past the 4 MiB window: the window drops, the tap does not
        process.send(block.encode())
    assert [t for _, t in chunks[1:]] == [block] * 6
    assert next(process.output(0))[1] == "notice"
    assert not ended.is_set()
    process.close_input()
    process.wait(5)
    assert ended.is_set()
    late: list[str] = []
    process.tap(lambda stream, text: late.append(stream), lambda: late.append("exit"))
    assert late[0] == "notice" and late[-1] == "exit"  # tapped after the window moved on


def test_pty_goes_to_the_runner_and_resize_to_the_terminal() -> None:
    runner = _Terminal()
    table = ProcessTable(runner)
    plain = table.start("sbx_000000000001", "cat")
    assert runner.asked[-1]["pty"] is None
    with pytest.raises(UsageError):
        plain.resize(30, 100)  # no terminal
    term = table.start("sbx_000000000001", ["/bin/bash", "-i"], pty=(24, 80))
    assert runner.asked[-1]["pty"] == (24, 80)
    term.resize(30, 100)
    assert runner.sizes == [(30, 100)]
    with pytest.raises(UsageError):
        term.resize(0, 100)
    with pytest.raises(UsageError):
        table.start("sbx_000000000001", "bash", pty=(24, 5000))
    for process in (plain, term):
        process.close_input()
