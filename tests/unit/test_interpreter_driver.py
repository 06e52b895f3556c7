"""The in-sandbox driver's JSON-lines protocol, driven directly (no sandbox): the host's
python3 runs it as the sandbox would (``python3 -I -u -c <source> <cwd> <language>``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from corral._kernels import driver_source

PYTHON = "/usr/bin/python3"


class Driver:
    def __init__(self, language: str = "python", *flags: str) -> None:
        self.cwd = tempfile.mkdtemp(prefix="corral-driver-")
        self.proc = subprocess.Popen(
            [PYTHON, "-I", "-u", *flags, "-c", driver_source(), self.cwd, language],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={"PATH": "/usr/bin:/bin", "MPLCONFIGDIR": self.cwd, "IPYTHONDIR": self.cwd})
        self.ready = self.read()
        assert self.ready["ev"] == "ready", self.ready
        self.cell = 0

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = "\n"
        while line == "\n":  # the blank line the driver writes before each message
            line = self.proc.stdout.readline()
        assert line, f"the driver exited: {self.proc.stderr.read() if self.proc.stderr else ''}"
        message: dict[str, Any] = json.loads(line)
        return message

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def run(self, code: str, **extra: Any) -> list[dict[str, Any]]:
        self.cell += 1
        self.send({"op": "exec", "id": self.cell, "code": code, **extra})
        events = []
        while True:
            event = self.read()
            assert event["id"] == self.cell
            events.append(event)
            if event["ev"] == "end":
                return events

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        shutil.rmtree(self.cwd, ignore_errors=True)


def _has_ipython() -> bool:
    return subprocess.run([PYTHON, "-c", "import IPython"], capture_output=True).returncode == 0


needs_ipython = pytest.mark.skipif(not _has_ipython(),
                                   reason="python3-ipython is not installed on this host "
                                          "(scripts/bootstrap --test installs it)")


@pytest.fixture
def ipython() -> Iterator[Driver]:
    driver = Driver()
    yield driver
    driver.close()


def _text(events: list[dict[str, Any]], kind: str) -> str:
    return "".join(e["text"] for e in events if e["ev"] == kind)


@needs_ipython
def test_ipython_cells_keep_state_and_return_results(ipython: Driver) -> None:
    assert ipython.ready["kernel"] == "ipython"
    first = ipython.run("x = 41\nx + 1")
    assert first[0] == {"ev": "count", "n": 1, "id": 1}
    assert {"ev": "result", "main": True, "data": {"text/plain": "42"}, "id": 1} in first
    assert ipython.run("x")[0]["n"] == 2
    shown = ipython.run("from IPython.display import HTML, display\ndisplay(HTML('<b>b</b>'))")
    results = [e for e in shown if e["ev"] == "result"]
    assert results[0]["main"] is False and results[0]["data"]["text/html"] == "<b>b</b>"


@needs_ipython
def test_child_and_fd_level_output_cannot_forge_protocol_lines(ipython: Driver) -> None:
    forged = '{"ev": "end", "id": 2}'
    events = ipython.run(f"import os\nprint('a')\nos.system('echo b')\n"
                         f"os.write(1, b'{forged}\\n')\nprint('c')")
    assert [e["ev"] for e in events].count("end") == 1
    assert _text(events, "stdout") == f"a\nb\n{forged}\nc\n"


@needs_ipython
def test_output_is_coalesced_by_line_in_the_order_written(ipython: Driver) -> None:
    events = ipython.run("import sys, os\nprint('a', 'b')\nsys.stdout.write('part')\n"
                         "print('e', file=sys.stderr)\nos.system('echo c')\nprint('d')")
    streamed = [(e["ev"], e["text"]) for e in events if e["ev"] in ("stdout", "stderr")]
    assert streamed == [("stdout", "a b\n"), ("stdout", "part"), ("stderr", "e\n"),
                        ("stdout", "c\n"), ("stdout", "d\n")]


@needs_ipython
def test_a_partial_line_shows_while_the_cell_waits(ipython: Driver) -> None:
    """A progress bar's text without a newline goes out once it has waited (0.3 s, looked at
    every 0.2 s), before the rest of its line: the split proves it went out while the cell
    slept (the sleep is far above the wait, so a loaded host still sees it)."""
    events = ipython.run("import sys, time\nsys.stdout.write('working')\ntime.sleep(3)\n"
                         "print(' done')")
    streamed = [(e["ev"], e["text"]) for e in events if e["ev"] == "stdout"]
    assert streamed == [("stdout", "working"), ("stdout", " done\n")]


@pytest.fixture
def plain() -> Iterator[Driver]:
    driver = Driver("python", "-S")  # the plain kernel: the same streams, no IPython needed
    yield driver
    driver.close()


# How a cell reaches the driver's own protocol descriptor (a global of the driver's module).
PROTO_FD = 'type(sys.stdout).write.__globals__["_PROTO"].fileno()'


def test_long_output_goes_in_pieces_each_far_under_the_hosts_limit(plain: Driver) -> None:
    piece = 1024 * 1024
    events = plain.run("import sys\nprint('x' * (3 * 1024 * 1024 + 5))\n"
                       "for _ in range(300000): sys.stdout.write('ab')\nprint()")
    texts = [e["text"] for e in events if e["ev"] == "stdout"]
    assert "".join(texts) == "x" * (3 * 1024 * 1024 + 5) + "\n" + "ab" * 300000 + "\n"
    assert max(map(len, texts)) <= piece and len(texts) >= 4


def test_a_result_over_the_limit_is_refused_with_an_error(plain: Driver) -> None:
    # The limit lowered for the test: the host's is 32 MiB.
    plain.run('import sys\ntype(sys.stdout).write.__globals__["_MAX_LINE"] = 4000')
    events = plain.run("'y' * 5000")
    assert [e["ev"] for e in events] == ["count", "error", "end"]
    assert events[1]["name"] == "OutputTooLarge" and "4000" in events[1]["value"]
    assert plain.run("'y' * 50")[1]["data"]["text/plain"] == repr("y" * 50)


def test_bytes_written_to_the_protocol_descriptor_swallow_no_message(plain: Driver) -> None:
    assert plain.proc.stdout is not None
    plain.send({"op": "exec", "id": 1, "code": f"import os, sys\nos.write({PROTO_FD}, "
                "b'garbage without a newline')\nprint('after')"})
    lines: list[str] = []
    while not lines or not lines[-1].startswith('{"ev": "end"'):
        lines.append(plain.proc.stdout.readline().rstrip("\n"))
    messages = [json.loads(line) for line in lines if line.startswith("{")]
    assert "garbage without a newline" in lines
    assert [m["ev"] for m in messages] == ["count", "stdout", "end"]
    assert messages[1]["text"] == "after\n"


def test_the_drivers_limit_is_the_hosts() -> None:
    from corral._control.interpreter import MAX_MESSAGE_CHARS

    found = re.search(r"^_MAX_LINE = (.+?)  #", driver_source(), re.MULTILINE)
    assert found is not None and eval(found.group(1)) == MAX_MESSAGE_CHARS


@needs_ipython
def test_errors_interrupts_and_per_cell_envs(ipython: Driver) -> None:
    error = [e for e in ipython.run("1/0") if e["ev"] == "error"][0]
    assert (error["name"], error["value"]) == ("ZeroDivisionError", "division by zero")
    assert "1/0" in error["traceback"]

    done: list[list[dict[str, Any]]] = []
    worker = threading.Thread(target=lambda: done.append(ipython.run("import time\n"
                                                                     "time.sleep(30)")))
    started = time.monotonic()
    worker.start()
    time.sleep(0.5)
    ipython.send({"op": "interrupt"})
    worker.join(10)
    assert done and time.monotonic() - started < 10
    assert [e["name"] for e in done[0] if e["ev"] == "error"] == ["KeyboardInterrupt"]
    assert ipython.run("'alive'")[1]["data"]["text/plain"] == "'alive'"

    env = ipython.run("import os\nos.environ.get('ONLY_HERE')", envs={"ONLY_HERE": "1"})
    assert env[1]["data"]["text/plain"] == "'1'"
    assert ipython.run("repr(os.environ.get('ONLY_HERE'))")[1]["data"]["text/plain"] == "'None'"


def test_without_ipython_the_plain_kernel_says_so_and_works() -> None:
    driver = Driver("python", "-S")  # no site: IPython's dist-packages are out of reach
    try:
        assert driver.ready["kernel"] == "plain"
        driver.run("y = [1, 2]")
        events = driver.run("print('p')\ny + [3]")
        assert _text(events, "stdout") == "p\n"
        assert {"ev": "result", "main": True, "data": {"text/plain": "[1, 2, 3]"},
                "id": 2} in events
        error = [e for e in driver.run("{}['k']") if e["ev"] == "error"][0]
        assert error["name"] == "KeyError" and "KeyError" in error["traceback"]
        assert driver.run("y")[0]["n"] == 4
    finally:
        driver.close()


def test_bash_keeps_cwd_and_variables_and_reports_status() -> None:
    driver = Driver("bash")
    try:
        assert driver.ready["kernel"] == "bash"
        driver.run("cd /tmp; V=7; f() { echo \"f$1\"; }")
        events = driver.run("pwd; echo $V; f x; echo e >&2")
        assert _text(events, "stdout") == "/tmp\n7\nfx\n"
        assert _text(events, "stderr") == "e\n"
        failed = [e for e in driver.run("(exit 3)") if e["ev"] == "error"]
        assert failed[0]["name"] == "CommandExitError" and "3" in failed[0]["value"]
        # Code that looks like the heredoc's end, or quotes, needs no escaping.
        tricky = driver.run("echo 'EOF'; echo \"$(echo '\"q\"')\"")
        assert _text(tricky, "stdout") == "EOF\n\"q\"\n"
        gone = driver.run("exit 0")
        assert [e["name"] for e in gone if e["ev"] == "error"] == ["KernelExited"]
    finally:
        driver.close()


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed on this host")
def test_javascript_keeps_its_vm_context_and_can_be_interrupted() -> None:
    driver = Driver("javascript")
    try:
        assert driver.ready["kernel"] == "node"
        driver.run("let x = 41; const f = (a) => a * 2")
        events = driver.run("console.log('out'); require('child_process')"
                            ".execSync('echo child', {stdio: 'inherit'}); f(x)")
        assert _text(events, "stdout") == "out\nchild\n"
        assert {"ev": "result", "main": True, "data": {"text/plain": "82"}, "id": 2} in events
        error = [e for e in driver.run("undefinedName") if e["ev"] == "error"][0]
        assert error["name"] == "ReferenceError"
        done: list[list[dict[str, Any]]] = []
        worker = threading.Thread(target=lambda: done.append(driver.run("while (true) {}")))
        worker.start()
        time.sleep(0.5)
        driver.send({"op": "interrupt"})
        worker.join(10)
        assert done and [e["name"] for e in done[0] if e["ev"] == "error"] == ["KeyboardInterrupt"]
        assert driver.run("x")[1]["data"]["text/plain"] == "41"
    finally:
        driver.close()
