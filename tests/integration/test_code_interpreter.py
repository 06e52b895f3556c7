"""The code interpreter on Corral's own SDK, embedded and remote: stateful kernels in a real
sandbox (the base template: the host's /usr, where ``scripts/bootstrap --test`` installs
IPython, numpy, pandas, matplotlib, node with TypeScript and R), rich results, errors,
timeouts, dead kernels, contexts, tenants and the audit trail."""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from corral import (
    AsyncSandbox,
    ContextNotFound,
    InterpreterUnavailable,
    OutputMessage,
    Result,
    Sandbox,
    SandboxNotFound,
    UsageError,
)
from corral._control.interpreter import MAX_CELL_OUTPUT_CHARS, MAX_MESSAGE_CHARS
from corral._control.tenants import TenantDirectory
from corral._settings import Settings

from ..conftest import managed
from .servers import Server
from .test_presets import MIRROR, WHEEL, Index, _index_tree, _wheel

pytestmark = pytest.mark.needs_root


def test_state_output_order_results_and_counts(where: dict[str, str]) -> None:
    with Sandbox.create(**where) as sb:
        first = sb.run_code("x = 41\nx + 1")
        assert first.error is None and first.text == "42"
        assert first.results[0].is_main_result
        assert sb.run_code("x").text == "41"  # state kept across cells
        assert sb.run_code("x").execution_count == first.execution_count + 2  # type: ignore[operator]

        seen: list[tuple[str, str]] = []
        stamps: list[float] = []

        def out(m: OutputMessage) -> None:
            seen.append(("out", m.text))
            stamps.append(m.timestamp)

        def err(m: OutputMessage) -> None:
            seen.append(("err", m.text))

        run = sb.run_code(
            "import sys, os\nprint('a')\nprint('b', file=sys.stderr)\nos.system('echo c')\n"
            "print('d')", on_stdout=out, on_stderr=err)
        # Python prints (a line each, as Jupyter sends them) and a child process's output,
        # in the order they happened.
        assert seen == [("out", "a\n"), ("err", "b\n"), ("out", "c\n"), ("out", "d\n")]
        assert "".join(run.logs.stdout) == "a\nc\nd\n" and "".join(run.logs.stderr) == "b\n"
        assert all(abs(s - time.time()) < 60 for s in stamps)


def test_rich_results_png_dataframe_and_errors(where: dict[str, str]) -> None:
    with Sandbox.create(**where) as sb:
        got: list[Result] = []
        chart = sb.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()",
                            on_result=got.append)
        assert chart.error is None, chart.error
        pngs = [r.png for r in chart.results if r.png]
        assert len(pngs) == 1 and got and got[0].png == pngs[0]
        assert base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")
        # A figure left open at the end of a cell is returned too (inline backend).
        assert any(r.png for r in sb.run_code("plt.figure(); plt.bar([1], [2])").results)

        frame = sb.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
        assert frame.results[0].html is not None and "<table" in frame.results[0].html
        assert "text" in frame.results[0].formats() and "html" in frame.results[0].formats()

        md = sb.run_code("from IPython.display import Markdown, display\n"
                         "display(Markdown('**hi**'))")
        assert md.results[0].markdown == "**hi**" and not md.results[0].is_main_result

        errors = []
        failed = sb.run_code("1/0", on_error=errors.append)
        assert failed.error is not None and failed.error.name == "ZeroDivisionError"
        assert failed.error.value == "division by zero"
        assert "ZeroDivisionError" in failed.error.traceback and "1/0" in failed.error.traceback
        assert errors == [failed.error]
        assert sb.run_code("1 +").error.name == "SyntaxError"  # type: ignore[union-attr]


def test_a_figure_as_the_last_expression_is_the_main_result(where: dict[str, str]) -> None:
    # As Jupyter's inline backend: the execute_result carries the PNG (and the text), and the
    # figure is not shown a second time at the cell's end.
    with Sandbox.create(**where) as sb:
        run = sb.run_code("import matplotlib.pyplot as plt\n"
                          "fig, ax = plt.subplots()\nax.plot([1, 3, 2])\nfig")
        assert run.error is None, run.error
        assert len(run.results) == 1 and run.results[0].is_main_result
        main = run.results[0]
        assert main.text == "<Figure size 640x480 with 1 Axes>"
        assert main.png is not None
        assert base64.b64decode(main.png).startswith(b"\x89PNG\r\n\x1a\n")
        # plt.gcf() too; a figure drawn beside another value still comes as a display.
        assert [(r.is_main_result, bool(r.png)) for r in
                sb.run_code("plt.plot([1, 2]); plt.gcf()").results] == [(True, True)]
        both = sb.run_code("plt.plot([2, 1])\n'done'").results
        assert [(r.is_main_result, bool(r.png)) for r in both] == [(True, False),
                                                                   (False, True)]
        # Shown once as a result, closed at the cell's end as the inline backend does; the
        # object itself still renders when asked for again.
        again = sb.run_code("fig").results
        assert len(again) == 1 and again[0].png is not None


def test_pip_install_in_a_cell_is_imported_by_the_next(where: dict[str, str]) -> None:
    # `!pip install` as generated code runs it: Debian's pip refuses installs into its python3
    # (PEP 668) and the root is read-only; the package lands in the user's site in the
    # workspace, which the kernel (python3 -I) imports from, without a restart. No network
    # here: the wheel comes from a directory in the workspace.
    with Sandbox.create(**where) as sb:
        assert sb.run_code("import tinypkg").error.name == "ModuleNotFoundError"  # type: ignore[union-attr]
        sb.files.write(f"wheels/{WHEEL}", _wheel())
        pip = sb.run_code("!pip install --no-index --find-links /workspace/wheels tinypkg")
        assert "Successfully installed tinypkg-1.0" in "".join(pip.logs.stdout), pip.logs
        got = sb.run_code("import tinypkg\nprint(tinypkg.__file__)\ntinypkg.VALUE")
        assert got.error is None and got.text == "'tiny from the mirror'", got.error
        assert "".join(got.logs.stdout).startswith("/workspace/.local/lib/python3")


def test_javascript_and_typescript_cells_as_e2b(where: dict[str, str]) -> None:
    with Sandbox.create(**where) as sb:
        js = sb.create_code_context(language="js")
        assert js.language == "javascript"
        sb.run_code("const base = 40; function add(a, b) { return a + b }", context=js)
        assert sb.run_code("add(base, 2)", context=js).text == "42"
        # Top-level await, its value as the result; a cell run again may declare again.
        waited = sb.run_code("const v = await new Promise((r) => setTimeout(() => r(7), 50))"
                             "\nv * 6", context=js)
        assert waited.error is None and waited.text == "42", waited.error
        assert sb.run_code("const base = 1; base", context=js).text == "1"
        printed = sb.run_code("console.log('out'); console.error('err'); ({a: [1, 2]})",
                              context=js)
        assert printed.logs.stdout == ["out\n"] and printed.logs.stderr == ["err\n"]
        assert printed.text == "{ a: [ 1, 2 ] }"
        fs = sb.run_code("import { readFileSync } from 'fs'\ntypeof readFileSync", context=js)
        assert fs.text == "'function'", fs.error
        # An awaiting cell past its timeout is interrupted; the context keeps its state.
        slow = sb.run_code("await new Promise((r) => setTimeout(r, 60000))", context=js,
                           timeout=1)
        assert slow.error is not None and slow.error.name == "TimeoutError"
        assert sb.run_code("base + 1", context=js).text == "2"

        ts = sb.create_code_context(language="typescript")
        assert ts.language == "typescript" and ts.kernel is None
        typed = sb.run_code("interface P { x: number }\nconst sq = (p: P): number => p.x ** 2"
                            "\nsq({ x: 6 }) + 6", context=ts)
        assert typed.error is None and typed.text == "42", typed.error
        assert sb.run_code("enum Color { Red, Green }\nColor.Green", context=ts).text == "1"
        bad = sb.run_code("let q: = 1", context=ts)
        assert bad.error is not None and bad.error.name == "SyntaxError"
        assert "line 1" in bad.error.value
        assert sb.list_code_contexts()[-1].kernel == "node"


def test_r_cells(where: dict[str, str]) -> None:
    with Sandbox.create(**where) as sb:
        r = sb.create_code_context(language="r")
        first = sb.run_code("x <- 41\nprint('hi')\nx + 1", context=r)
        assert first.error is None and first.text == "[1] 42", first.error
        assert "".join(first.logs.stdout) == '[1] "hi"\n'
        assert sb.run_code("x", context=r).text == "[1] 41"  # state kept
        frame = sb.run_code("data.frame(a = 1:2, b = c('x', 'y'))", context=r)
        assert frame.text == "  a b\n1 1 x\n2 2 y"
        failed = sb.run_code("stop('boom')", context=r)
        assert failed.error is not None
        assert (failed.error.name, failed.error.value) == ("Error", "boom")
        assert sb.run_code("1 +", context=r).error.name == "SyntaxError"  # type: ignore[union-attr]
        warned = sb.run_code("warning('careful'); 5", context=r)
        assert warned.text == "[1] 5" and "careful" in "".join(warned.logs.stderr)
        # A plot is a PNG display (R's cairo png device; no X11).
        plot = sb.run_code("plot(1:10)\nhist(rnorm(50))", context=r)
        pngs = [r.png for r in plot.results if r.png]
        assert plot.error is None and len(pngs) == 2, plot.error
        assert base64.b64decode(pngs[0]).startswith(b"\x89PNG")
        slow = sb.run_code("Sys.sleep(60)", context=r, timeout=1)
        assert slow.error is not None and slow.error.name == "TimeoutError"
        assert sb.run_code("x", context=r).text == "[1] 41"  # interrupted, not restarted
        assert sb.list_code_contexts()[-1].kernel == "r"
        assert sb.run_code("R.version$major", language="r").text == '[1] "4"'


def test_contexts_bash_and_refusals(where: dict[str, str]) -> None:
    with Sandbox.create(**where) as sb:
        sb.files.make_dir("sub")
        ctx = sb.create_code_context(cwd="/workspace/sub")
        assert ctx.language == "python" and ctx.cwd == "/workspace/sub"
        assert sb.run_code("import os; os.getcwd()", context=ctx).text == "'/workspace/sub'"
        sb.run_code("y = 5", context=ctx)
        assert sb.run_code("y", context=ctx).text == "5"
        assert sb.run_code("'y' in dir()").text == "False"  # the default context is another
        listed = {c.id: c for c in sb.list_code_contexts()}
        assert ctx.id in listed and listed[ctx.id].kernel == "ipython"

        sb.restart_code_context(ctx)
        assert sb.run_code("y", context=ctx).error.name == "NameError"  # type: ignore[union-attr]
        sb.remove_code_context(ctx)
        assert ctx.id not in {c.id for c in sb.list_code_contexts()}
        with pytest.raises(ContextNotFound):
            sb.run_code("1", context=ctx.id)
        with pytest.raises(ContextNotFound):
            sb.restart_code_context("ctx_000000000000")

        shell = sb.create_code_context(language="bash")
        sb.run_code("cd /tmp && export GREETING=hello", context=shell)
        kept = sb.run_code("pwd; echo $GREETING", context=shell)
        assert "".join(kept.logs.stdout) == "/tmp\nhello\n"
        assert sb.run_code("false", context=shell).error.name == "CommandExitError"  # type: ignore[union-attr]
        assert "".join(sb.run_code("echo $((6*7))", language="bash").logs.stdout) == "42\n"

        js = sb.create_code_context(language="javascript")
        sb.run_code("let n = 41; console.log('hi')", context=js)
        counted = sb.run_code("n + 1", context=js)
        assert counted.text == "42" and sb.list_code_contexts()[-1].kernel == "node"
        assert sb.run_code("null.x", context=js).error.name == "TypeError"  # type: ignore[union-attr]
        assert sb.run_code("Promise.resolve(7)", language="js").text == "7"
        assert sb.run_code("const t: number = 6; t * 7", language="ts").text == "42"
        for name in ("java", "deno"):  # E2B's template has these; Corral says what it has
            with pytest.raises(InterpreterUnavailable, match=f"no {name} kernel.*typescript"):
                sb.run_code("1", language=name)
        with pytest.raises(UsageError, match="unknown language"):
            sb.run_code("1", language="cobol")
        with pytest.raises(UsageError, match="either context or language"):
            sb.run_code("1", context=shell, language="python")


def test_timeout_interrupts_and_a_dead_kernel_is_reported(where: dict[str, str]) -> None:
    with Sandbox.create(**where) as sb:
        sb.run_code("kept = 1")
        started = time.monotonic()
        slow = sb.run_code("import time\ntime.sleep(30)", timeout=1)
        assert time.monotonic() - started < 10
        assert slow.error is not None and slow.error.name == "TimeoutError"
        assert sb.run_code("kept").text == "1"  # interrupted, not killed: state kept

        # A cell that ignores the interrupt costs its kernel, not a hang.
        stuck = sb.run_code("import signal, time\nsignal.signal(signal.SIGINT, lambda *a: None)"
                            "\nwhile True: time.sleep(0.1)", timeout=1)
        assert stuck.error is not None and stuck.error.name == "TimeoutError"
        assert "restarted" in stuck.error.value
        assert sb.run_code("1 + 1").text == "2"

        died = sb.run_code("import os\nos._exit(3)")
        assert died.error is not None and died.error.name == "KernelDied"
        assert "exit code 3" in died.error.value
        assert sb.run_code("'fresh'").text == "'fresh'"


def test_out_of_memory_is_reported_and_the_next_cell_works(home: str) -> None:
    with Sandbox.create(home=home) as sb:  # small: 512 MiB for the whole sandbox
        oom = sb.run_code("blocks = []\nwhile True: blocks.append(bytearray(64 << 20))",
                          timeout=60)
        assert oom.error is not None
        assert oom.error.name in ("KernelOutOfMemory", "MemoryError"), oom.error
        assert sb.run_code("2 * 21").text == "42"


def test_a_kernel_outlives_the_tiers_output_limit(home: str) -> None:
    # The small tier keeps 1 MiB per stream of a command; a kernel's protocol is its stdout
    # for its whole life, so 3 MiB of output over some cells must not silence it.
    with Sandbox.create(home=home) as sb:
        for _ in range(3):
            run = sb.run_code("print('x' * (1 << 20))")
            assert run.error is None and len("".join(run.logs.stdout)) == (1 << 20) + 1
        assert sb.run_code("'alive'").text == "'alive'"


# Code in the kernel can write to the driver's own protocol descriptor (a global of its module).
LONG_LINE_CELL = """
import os, sys
fd = type(sys.stdout).write.__globals__["_PROTO"].fileno()
block = b"x" * (1 << 20)
for _ in range(256):
    view = memoryview(block)
    while view:
        view = view[os.write(fd, view):]
print("written")
"""


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_a_long_line_on_the_protocol_stream_is_dropped_with_an_error(home: str) -> None:
    # 256 MiB without a newline, straight to the protocol descriptor: the service (this
    # process, embedded) holds at most the limit of it, the cell says what happened, its own
    # output after it is not lost, and the next cell works.
    with Sandbox.create(home=home) as sb:
        # The largest message worth sending still comes whole: a 24 MiB figure.
        big = sb.run_code("from IPython.display import display\n"
                          "display({'image/png': 'A' * (24 << 20)}, raw=True)")
        assert big.error is None, big.error
        assert [len(r.png or "") for r in big.results] == [24 << 20]
        del big
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak RSS starts again from here
        before = _status_kib("VmRSS")
        run = sb.run_code(LONG_LINE_CELL, timeout=60)
        grown_mib = (_status_kib("VmHWM") - before) / 1024
        assert run.error is not None and run.error.name == "OutputTooLarge", run.error
        assert "".join(run.logs.stdout) == "written\n"
        assert grown_mib < MAX_MESSAGE_CHARS / 2**20 + 64, grown_mib
        assert sb.run_code("6 * 7").text == "42"


# 200 MiB in lines of 1 MiB from Python; 256 MiB without a newline to fd 1 (forwarded).
FLOODS = {
    "print": "import sys\nfor _ in range(200): sys.stdout.write('x' * (1 << 20) + '\\n')",
    "fd1": LONG_LINE_CELL.replace('type(sys.stdout).write.__globals__["_PROTO"].fileno()', "1"),
}


@pytest.mark.parametrize("flood", sorted(FLOODS))
def test_a_cells_output_past_its_budget_is_dropped_with_an_error(home: str,
                                                                 flood: str) -> None:
    # The service keeps at most the cell's budget of it (it kept all, growing as fast as the
    # cell printed), says where it cut, and the next cell works.
    with Sandbox.create(home=home) as sb:
        assert sb.run_code("1").text == "1"
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS")
        run = sb.run_code(FLOODS[flood] + "\ndone = True", timeout=60)
        grown_mib = (_status_kib("VmHWM") - before) / 1024
        assert run.error is not None and run.error.name == "OutputTooLarge", run.error
        kept = sum(map(len, run.logs.stdout))
        assert MAX_CELL_OUTPUT_CHARS // 2 < kept <= MAX_CELL_OUTPUT_CHARS, kept
        assert "the rest was dropped" in "".join(run.logs.stderr)
        assert grown_mib < 2 * MAX_CELL_OUTPUT_CHARS / 2**20 + 64, grown_mib
        del run
        assert sb.run_code("print(done)").logs.stdout == ["True\n"]  # it ran to its end


@pytest.fixture(scope="module")
def keyed() -> Iterator[tuple[Server, dict[str, str]]]:
    """A service of its own with two tenants (keys switch authentication on for a home)."""
    home = Path(tempfile.mkdtemp(prefix="corral-test-interp-"))
    settings = Settings(home=home, uid_start=2_140_000_000 + secrets.randbelow(100) * 1000,
                        uid_count=1000)
    with managed(settings) as mgr:
        directory = TenantDirectory(mgr.store)
        keys = {}
        for name in ("interp-a", "interp-b"):
            directory.add_tenant(name, max_sandboxes=5, tiers=["small"],
                                 commands_per_minute=600)
            keys[name] = directory.create_key(name)[1]
        with Server(mgr) as srv:
            yield srv, keys
    shutil.rmtree(home, ignore_errors=True)


def test_another_tenant_cannot_use_the_contexts(keyed: tuple[Server, dict[str, str]]) -> None:
    server, keys = keyed
    with Sandbox.create(url=server.url, api_key=keys["interp-a"]) as mine:
        ctx = mine.create_code_context()
        mine.run_code("secret = 'a'", context=ctx)
        with Sandbox.create(url=server.url, api_key=keys["interp-b"]) as theirs:
            with pytest.raises(SandboxNotFound):
                Sandbox.connect(mine.id, url=server.url,
                                api_key=keys["interp-b"]).run_code("secret")
            # Its own sandbox does not reach another sandbox's context either.
            with pytest.raises(ContextNotFound):
                theirs.run_code("secret", context=ctx.id)
        assert mine.run_code("secret", context=ctx).text == "'a'"


def test_cells_are_audited_and_the_kernel_is_a_background_process(home: str) -> None:
    with Sandbox.create(home=home) as sb:
        sb.run_code("print('hi')")
        sb.run_code("1/0")
        kernels = sb.processes.list()
        assert len(kernels) == 1 and kernels[0].info()["state"] == "running"
        events = sb.audit.events(types=["code.*"])
        assert [e.type for e in events] == ["code.started", "code.finished"] * 2
        assert events[0].data["code"] == "print('hi')" and events[1].data["outcome"] == "ok"
        assert events[3].data["outcome"] == "error"
        assert events[3].data["error"]["name"] == "ZeroDivisionError"
        assert events[0].command == kernels[0].info()["command_id"]


def test_async_sdk(where: dict[str, str]) -> None:
    async def scenario() -> None:
        async with await AsyncSandbox.create(**where) as sb:
            seen: list[str] = []

            async def on_stdout(m: OutputMessage) -> None:
                await asyncio.sleep(0)
                seen.append(m.text)

            run = await sb.run_code("for i in range(3): print(i)", on_stdout=on_stdout)
            assert "".join(seen) == "0\n1\n2\n" and run.error is None
            ctx = await sb.create_code_context(language="bash")
            assert [c.id for c in await sb.list_code_contexts() if c.id == ctx.id]
            await sb.remove_code_context(ctx)

    asyncio.run(scenario())


def test_create_to_first_result_is_quick(where: dict[str, str]) -> None:
    with Sandbox.create(**where) as sb:
        started = time.monotonic()
        assert sb.run_code("1 + 1").text == "2"
        first = time.monotonic() - started
        warm = []
        for _ in range(5):
            t = time.monotonic()
            sb.run_code("1 + 1")
            warm.append(time.monotonic() - t)
    # Loose bounds for a shared CI machine; bench/bench_code_interpreter.py measures properly.
    assert first < 5 and sorted(warm)[2] < 0.5


# What generated code imports (issue 37): the template has all of it, from Debian.
TEMPLATE_IMPORTS = ("numpy", "pandas", "matplotlib", "seaborn", "sklearn", "scipy", "requests",
                    "openpyxl", "bs4", "plotly", "IPython")


@pytest.fixture(scope="module")
def mirror() -> Iterator[Index]:
    """test_presets' PEP 503 index of one wheel (tinypkg), served on loopback."""
    root = Path(tempfile.mkdtemp(prefix="corral-test-ci-index-"))
    requests: list[str] = []

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            requests.append(self.path)

    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 functools.partial(Handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield Index(port=server.server_address[1], sha256=_index_tree(root),
                    requests=requests)
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_code_interpreter_template_builds_and_runs_every_kernel(settings: Settings,
                                                                    mirror: Index) -> None:
    # The real template, from Debian packages with mmdebstrap (minutes, cached after), in a
    # home whose pypi preset is a PEP 503 index on loopback: pip in a cell installs from it.
    home = Path(tempfile.mkdtemp(prefix="corral-test-ci-template-"))
    home.chmod(0o711)
    own = Settings(home=home, uid_start=settings.uid_start + 8000, uid_count=500,
                   egress_allow_cidrs="127.0.0.1/32", egress_hosts={MIRROR: ["127.0.0.1"]},
                   index_pypi=f"http://{mirror.host}/simple")
    env = {**os.environ, "CORRAL_HOME": str(home), "CORRAL_UID_START": str(own.uid_start),
           "CORRAL_UID_COUNT": str(own.uid_count)}
    try:
        started = time.monotonic()
        built = subprocess.run([sys.executable, "-m", "corral", "templates", "build",
                                "code-interpreter", "--json"], env=env, capture_output=True,
                               text=True, timeout=1400)
        assert built.returncode == 0, built.stderr[-3000:]
        seconds = time.monotonic() - started
        with managed(own), Sandbox.create(home=str(home), template="code-interpreter",
                                          network={"presets": ["pypi"]}) as sb:
            imported = sb.run_code(f"import {', '.join(TEMPLATE_IMPORTS)}\n"
                                   "import matplotlib.pyplot as plt\n"
                                   "fig = plt.figure(); plt.plot([1, 2]); fig")
            assert imported.error is None, imported.error
            assert [(r.is_main_result, bool(r.png)) for r in imported.results] == [(True, True)]
            # pip as generated code runs it: a system install (Debian's pip refuses those,
            # PEP 668) lands in the user's site in the workspace, seen by the next cell.
            pip = sb.run_code("!pip install --no-cache-dir --retries 0 tinypkg")
            assert "Successfully installed tinypkg" in "".join(pip.logs.stdout), pip.logs
            assert sb.run_code("import tinypkg; tinypkg.VALUE").text == "'tiny from the mirror'"
            assert f"/files/{WHEEL}" in mirror.requests
            tools = sb.commands.run("git --version && curl --version && npm --version && "
                                    "tsc --version && Rscript --version")
            assert tools.exit_code == 0, tools.stderr
            for language, code, text in (("js", "await Promise.resolve(41) + 1", "42"),
                                         ("ts", "const n: number = 41; n + 1", "42"),
                                         ("r", "41 + 1", "[1] 42"),
                                         ("bash", "echo $((41 + 1))", None)):
                run = sb.run_code(code, language=language)
                assert run.error is None and run.text == text, (language, run)
            plot = sb.run_code("plot(1:3)", language="r")
            assert [bool(r.png) for r in plot.results] == [True]
            kernels = {c.language: c.kernel for c in sb.list_code_contexts()}
            assert kernels == {"python": "ipython", "javascript": "node",
                               "typescript": "node", "r": "r", "bash": "bash"}
    finally:
        shutil.rmtree(home, ignore_errors=True)
    size = json.loads(built.stdout).get("size_bytes", 0)
    print(f"\ncode-interpreter template: build {seconds:.0f} s, {size / 2**20:.0f} MiB")


def test_mcp_run_code_tool(settings: Settings, home: str) -> None:
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    env = {**os.environ, "CORRAL_HOME": str(settings.home),
           "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    params = StdioServerParameters(command=sys.executable, args=["-m", "corral", "mcp"],
                                   env=env)

    async def main() -> list[dict[str, object]]:
        outcomes = []
        with tempfile.TemporaryFile("w+") as errlog:
            async with stdio_client(params, errlog=errlog) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    tools = {t.name for t in (await session.list_tools()).tools}
                    assert "run_code" in tools
                    for code in ("n = 6 * 7\nprint('hi')\nn",
                                 "import matplotlib.pyplot as plt\nplt.plot([1]); plt.show()",
                                 "1/0"):
                        called = await session.call_tool("run_code", {"code": code})
                        assert not called.is_error, called.content
                        assert called.structured_content is not None
                        outcomes.append(dict(called.structured_content))
        return outcomes

    value, chart, failed = asyncio.run(asyncio.wait_for(main(), 90))
    assert value["text"] == "42" and value["stdout"] == "hi\n" and value["error"] is None
    pngs = [r["data"]["image/png"] for r in chart["results"]]  # type: ignore[index, union-attr]
    assert base64.b64decode(pngs[0]).startswith(b"\x89PNG")
    assert failed["error"]["name"] == "ZeroDivisionError"  # type: ignore[index]


def test_cli_code_and_replay(settings: Settings, home: str) -> None:
    env = {**os.environ, "CORRAL_HOME": str(settings.home),
           "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    with Sandbox.create(home=home) as sb:
        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "corral", *args], env=env,
                                  capture_output=True, text=True, timeout=120)

        ran = cli("code", sb.id, "print('hi')\n6 * 7")
        assert (ran.returncode, ran.stdout) == (0, "hi\n42\n"), ran.stderr
        failed = cli("code", sb.id, "1/0")
        assert failed.returncode == 1 and "ZeroDivisionError" in failed.stderr
        as_json = json.loads(cli("code", sb.id, "echo $((1+1))", "--language", "bash",
                                 "--json").stdout)
        assert as_json["logs"]["stdout"] == ["2\n"]
        replay = cli("replay", sb.id)
        assert replay.returncode == 0, replay.stderr
        assert ">>> 6 * 7" in replay.stdout and "ZeroDivisionError" in replay.stdout


def test_a_cell_on_each_tier(isolation: str, home: str) -> None:
    with Sandbox.create(home=home, isolation=isolation) as sb:
        run = sb.run_code("import os\nprint(os.getcwd())\n6 * 7")
        assert run.error is None, run.error
        assert run.text == "42" and "".join(run.logs.stdout) == "/workspace\n"
        assert "".join(sb.run_code("echo $((2 + 2))", language="bash").logs.stdout) == "4\n"
        # A kernel that stops itself costs its cell's timeout and its state, never a hang.
        stopped = sb.run_code("import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)",
                              timeout=2)
        assert stopped.error is not None and stopped.error.name == "TimeoutError", stopped
        assert sb.run_code("6 * 7").text == "42"
        # node (JavaScript, TypeScript) and R under the tier too; R's plot through its pipe.
        assert sb.run_code("await Promise.resolve(41) + 1", language="js").text == "42"
        assert sb.run_code("const n: number = 42; n", language="ts").text == "42"
        plot = sb.run_code("plot(1:2); 41 + 1", language="r")
        assert plot.text == "[1] 42" and [bool(r.png) for r in plot.results] == [False, True]


def test_a_runtime_the_template_lacks_names_the_template_that_has_it(
        home: str, microvm_problems: list[str]) -> None:
    # The microVM tier's base is a small Debian root of its own (microvm-base: python3, no node
    # or R): a kernel of theirs is refused with what to use, not a bare failure.
    if microvm_problems:
        pytest.skip("the microVM tier cannot run on this host: " + "; ".join(microvm_problems))
    with Sandbox.create(home=home, isolation="microvm") as sb:
        assert sb.run_code("6 * 7").text == "42"
        for language, runtime in (("r", "R"), ("javascript", "node"), ("typescript", "node")):
            with pytest.raises(InterpreterUnavailable,
                               match=f"the {language} kernel could not start: {runtime} is not "
                                     "installed in this sandbox's template; the "
                                     "code-interpreter template has it"):
                sb.run_code("1", language=language)
