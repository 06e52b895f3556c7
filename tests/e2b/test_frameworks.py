"""Agent frameworks' own E2B integrations against ``corral serve`` (issue 37), each in its own
pinned set like the SDK matrix (tests/e2b/README.md), each with a scripted model (no LLM):

- the OpenAI Agents SDK's ``E2BSandboxClient`` (``openai-agents[e2b]``, set ``agents``): its own
  ``Runner`` runs shell commands and ``apply_patch``, for both of its sandbox types;
- smolagents' ``E2BExecutor`` (``smolagents[e2b]``, set ``smolagents``): a ``CodeAgent``
  imports a package its executor installed with ``!pip install`` from a PEP 503 index on
  loopback, which the operator names and the tenant's ceiling allows;
- the JS SDK's ``runCode`` with ``language: 'javascript'`` (set ``js``).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import json
import os
import shutil
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from .conftest import ClientRun, Served, corral_serve, events_of, run_client

pytestmark = [pytest.mark.e2b, pytest.mark.needs_root, pytest.mark.timeout(600)]

# -- OpenAI Agents SDK ----------------------------------------------------------------------------


# E2BSandboxClientOptions as a user leaves them (on_timeout="pause", auto_resume=True: kept,
# since issue 40), and with on_timeout="kill", for both sandbox types.
AGENTS_RUNS = {"defaults": ("e2b",), "e2b": ("e2b", "kill"),
               "code_interpreter": ("e2b_code_interpreter", "kill")}


@pytest.fixture(scope="module", params=[
    "defaults", "e2b", "code_interpreter"])
def agents_run(served: Served, request: pytest.FixtureRequest) -> ClientRun:
    args = AGENTS_RUNS[str(request.param)]
    return run_client(served, "agents", "openai_agents.py", *args, timeout=300)


def test_openai_agents_runner_shell_and_apply_patch(agents_run: ClientRun) -> None:
    got = agents_run.value("run")
    assert got["final"] == "done: hello.py patched"
    assert got["remaining_steps"] == 0  # every scripted turn was consumed
    out = got["outputs"]
    assert "Process exited with code 0" in out["c1"], out["c1"]
    # 42 from the shell; `bin` is the helper directory apply_patch's session start installed
    # under /tmp/openai-agents in an earlier command (/tmp lives as long as the sandbox).
    printed = out["c1"].split("Output:\n", 1)[-1].split()
    assert "42" in printed and "bin" in printed, out["c1"]
    assert out["c2"] == "Created notes/hello.py"
    assert out["c3"] == "Updated notes/hello.py"
    assert "hello\npatched\n42\n" in out["c4"], out["c4"]


def test_openai_agents_audit_trail(agents_run: ClientRun, served: Served) -> None:
    sid = agents_run.value("run")["sandbox_id"]
    assert sid and sid.startswith("sbx-")
    trail = served.audit(sid)
    assert trail[0]["type"] == "sandbox.created" and trail[-1]["type"] == "sandbox.destroyed"
    assert trail[0]["data"]["labels"] == {"suite": "frameworks"}
    started = {e["command"]: e["data"] for e in trail if e["type"] == "command.started"}
    exits = {e["command"]: e["data"]["exit_code"] for e in trail
             if e["type"] == "command.finished"}

    def ran(predicate: Any) -> list[int]:
        return [exits.get(cid, -999) for cid, data in started.items() if predicate(data)]

    # The session start: `mkdir -p -- /workspace` with cwd "/" (refused before issue 37).
    assert ran(lambda d: d["cwd"] == "/" and d["argv"][-1] == "mkdir -p -- /workspace") == [0]
    # Helpers installed into /tmp by one command and run from there by later ones.
    helpers = ran(lambda d: d["argv"][-1].startswith("/tmp/openai-agents/bin/"))
    assert helpers and set(helpers) == {0}, helpers
    writes = [e["data"]["path"] for e in trail if e["type"] == "file.write"]
    assert writes.count("/workspace/notes/hello.py") == 2  # apply_patch: create, then update


# -- smolagents: pip from the tenant's index ------------------------------------------------------

MIRROR = "mirror.test"  # pinned to 127.0.0.1 by the operator: the gateway never dials IP literals
PACKAGE = "corraltiny"
VALUE = "tiny from the tenant's index"
WHEEL = f"{PACKAGE}-1.0-py3-none-any.whl"


@dataclass
class Index:
    port: int
    requests: list[str]

    @property
    def host(self) -> str:
        return f"{MIRROR}:{self.port}"


def _wheel() -> bytes:
    """A pure-Python wheel built by hand (a zip with its metadata and a RECORD)."""
    info = f"{PACKAGE}-1.0.dist-info"
    files = {
        f"{PACKAGE}/__init__.py": f"VALUE = {VALUE!r}\n".encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 1.0\n".encode(),
        f"{info}/WHEEL": (b"Wheel-Version: 1.0\nGenerator: corral-tests\n"
                          b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return out.getvalue()


@pytest.fixture(scope="module")
def index() -> Iterator[Index]:
    """``/simple/`` (PEP 503) with one project, served from 127.0.0.1 by the standard library."""
    root = Path(tempfile.mkdtemp(prefix="corral-test-index-"))
    wheel = _wheel()
    (root / "files").mkdir()
    (root / "files" / WHEEL).write_bytes(wheel)
    (root / "simple" / PACKAGE).mkdir(parents=True)
    (root / "simple" / "index.html").write_text(f'<a href="{PACKAGE}/">{PACKAGE}</a>\n')
    (root / "simple" / PACKAGE / "index.html").write_text(
        f'<a href="../../files/{WHEEL}#sha256={hashlib.sha256(wheel).hexdigest()}">'
        f"{WHEEL}</a>\n")
    requests: list[str] = []

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            requests.append(self.path)  # what the index served, instead of stderr noise

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Index(port=server.server_address[1], requests=requests)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def indexed(index: Index) -> Iterator[Served]:
    """A ``corral serve`` of its own: the operator's pypi index is the loopback one (its name
    pinned, its address allowed), and the server's default ceiling (every tenant's) allows it.
    The settings reach the server through this process's environment, read as it starts."""
    if os.geteuid() != 0:
        pytest.skip("needs root: corral serve runs real sandboxes")
    settings = {"CORRAL_INDEX_PYPI": f"http://{index.host}/simple",
                "CORRAL_EGRESS_HOSTS": json.dumps({MIRROR: ["127.0.0.1"]}),
                "CORRAL_EGRESS_ALLOW_CIDRS": "127.0.0.1/32",
                "CORRAL_CEILING_HOSTS": index.host}
    patch = pytest.MonkeyPatch()
    try:
        for name, value in settings.items():
            patch.setenv(name, value)
        with corral_serve() as srv:
            patch.undo()  # the server has them; nothing else in this session sees them
            yield srv
    finally:
        patch.undo()


@pytest.fixture(scope="module")
def smol(indexed: Served) -> ClientRun:
    return run_client(indexed, "smolagents", "smolagents_pip.py", PACKAGE, timeout=580)


@pytest.mark.timeout(900)  # its own server, then a client bounded at 580 s (see the script)
def test_smolagents_e2b_executor_pip_installs_from_the_tenants_index(
        smol: ClientRun, index: Index, indexed: Served) -> None:
    assert smol.value("installed") == [PACKAGE]
    assert smol.value("run") == VALUE, (smol.value("error_of_steps"), smol.value("pip_again"))
    assert f"/files/{WHEEL}" in index.requests
    sid = smol.value("sandbox_id")
    decisions = {(e["data"]["host"], e["data"]["verdict"])
                 for e in events_of(indexed, sid, "egress.decision")}
    assert (MIRROR, "allowed") in decisions, decisions
    smol.value("cleanup")
    assert indexed.audit(sid)[-1]["type"] == "sandbox.destroyed"


# -- JS SDK: JavaScript cells ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def js_cells(served: Served) -> ClientRun:
    return run_client(served, "js", "js_cells.cjs", timeout=300)


def test_js_sdk_runs_javascript_cells(js_cells: ClientRun, served: Served) -> None:
    assert js_cells.value("expr")["text"] == "2"
    assert js_cells.value("state_set")["error"] is None
    assert js_cells.value("state_kept")["text"] == "42"  # one kernel: declarations persist
    streams = js_cells.value("stdout")
    assert streams["stdout"] == ["from js\n"] and streams["stderr"] == ["to err\n"]
    error = js_cells.value("error")["error"]
    assert error == {"name": "TypeError", "value": "boom"}
    assert int(js_cells.value("node")["text"].strip("'\"")) >= 18  # node runs the cells
    assert js_cells.value("js_alias")["text"].strip("'\"") == "2,4,6"
    # The Python kernel beside it has its own namespace: `answer` there does not touch JS's.
    assert js_cells.value("python_beside")["text"] == "'py'"
    assert js_cells.value("js_unchanged")["text"] == "41"
    ctx = js_cells.value("context")
    assert ctx["language"] == "javascript" and ctx["text"] == "10"
    assert ctx["default_sees"].strip("'\"") == "undefined"  # contexts are separate kernels
    assert js_cells.value("kill_sandbox") is True
    trail = served.audit(js_cells.value("id"))
    assert trail[-1]["type"] == "sandbox.destroyed"


def test_js_sdk_runs_typescript_cells(js_cells: ClientRun) -> None:
    got = js_cells.value("typescript")
    assert got["error"] is None and got["text"] == "42"
