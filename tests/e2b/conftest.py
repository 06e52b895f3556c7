"""The official E2B SDKs against a real ``corral serve`` (E2B-COMPAT.md §12).

One ``corral serve --port P --e2b-port Q`` subprocess per session, on 127.0.0.1, with its own
data directory and uid range, two tenants (``alpha``, ``beta``) and an E2B key each. Each client
script runs in its pinned environment (``.venv-e2b/<set>/``, installed by ``scripts/e2b-sdks``;
``tests/e2b/js`` for node) under ``env -i`` so a developer's own E2B settings never leak in. A
script runs one scenario group and prints one JSON line per step (``{"step": name, ...}``) and a
last ``{"done": true}``; the tests assert on those steps and on the server's audit trail.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral._settings import Settings

from ..conftest import managed

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = Path(__file__).resolve().parent / "clients"
JS_DIR = Path(__file__).resolve().parent / "js"
# Each JS kind's packages: J-latest and J-min (E2B-COMPAT.md §12), the same client scripts.
JS_DIRS = {"js": JS_DIR, "js-min": Path(__file__).resolve().parent / "js-min"}
VENVS = ROOT / ".venv-e2b"
# The core scenarios (test_py_core.py) per set; agents-pins is e2b 2.31.0, between mid and
# bundled (crewai-pins' e2b is bundled's 2.20.3: its own code interpreter is test_py_pins.py's).
PY_SETS = ("latest", "mid", "bundled", "min", "agents-pins")
# Apart from the other test homes (2_100_... in tests/conftest.py, 2_146_... in the edge tests).
_UID_BASE = 2_120_000_000
# What every client gets; nothing else of this process's environment reaches it.
_BASE_PATH = "/usr/local/bin:/usr/bin:/bin"
# The code interpreter's template is mapped to `base` (the host's /usr, with its IPython stack)
# so the suite needs no template build; the server reads this at start-up.
_TEMPLATES = "code-interpreter-v1=base"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def to_corral_id(e2b_id: str) -> str:
    """``sbx-abc`` -> ``sbx_abc`` (the contract's ids.from_e2b, without importing the server)."""
    assert e2b_id.startswith("sbx-"), f"not an E2B-surface sandbox id: {e2b_id!r}"
    return "sbx_" + e2b_id.removeprefix("sbx-")


@dataclass
class Served:
    """A running ``corral serve`` with its E2B listener and two tenants."""

    home: Path
    port: int
    e2b_port: int
    keys: dict[str, str]  # tenant -> its e2b_... key
    proc: subprocess.Popen[bytes]
    log: Path
    scratch: Path  # HOME for clients; per-run temp files
    host: str = "127.0.0.1"
    domain: str | None = None  # domain mode (TLS on e2b_port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def e2b_url(self) -> str:
        return f"http://{self.host}:{self.e2b_port}"

    def audit(self, sandbox_id: str) -> list[dict[str, Any]]:
        """The sandbox's audit events (``sbx-`` or ``sbx_`` id), oldest first."""
        sid = to_corral_id(sandbox_id) if sandbox_id.startswith("sbx-") else sandbox_id
        path = self.home / "audit" / f"{sid}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"


def _corral(settings_env: dict[str, str], *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "corral", *args], env=settings_env,
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise AssertionError(f"corral {' '.join(args)} failed ({out.returncode}): "
                             f"{out.stderr.strip()[-2000:]}")
    return out.stdout


def _wait_listening(served: Served, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        assert served.proc.poll() is None, (
            f"corral serve exited ({served.proc.returncode}):\n{served.log_tail()}")
        try:
            if httpx.get(f"{served.url}/healthz", timeout=1).status_code == 200:
                with socket.create_connection((served.host, served.e2b_port), timeout=1):
                    return
        except (httpx.HTTPError, OSError):
            pass
        assert time.monotonic() < deadline, f"corral serve did not start:\n{served.log_tail()}"
        time.sleep(0.1)


@contextlib.contextmanager
def corral_serve(*serve_args: str, host: str = "127.0.0.1", e2b_port: int | None = None,
                 domain: str | None = None, scratch: Path | None = None) -> Iterator[Served]:
    """``corral serve --host H --port P --e2b-port Q *serve_args`` in its own home; leaves
    nothing behind.

    The home is 0711 (pytest's tmp_path is 0700), so the sandboxes' uids can pass through it."""
    home = Path(tempfile.mkdtemp(prefix="corral-test-e2b-"))
    home.chmod(0o711)
    scratch = scratch or Path(tempfile.mkdtemp(prefix="corral-test-e2b-client-"))
    settings = Settings(home=home, uid_start=_UID_BASE + secrets.randbelow(900) * 10_000,
                        uid_count=10_000)
    env = {**os.environ, "CORRAL_HOME": str(home), "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count), "CORRAL_E2B_TEMPLATES": _TEMPLATES}
    keys: dict[str, str] = {}
    proc = None
    try:
        for tenant in ("alpha", "beta"):
            _corral(env, "tenants", "add", tenant, "--max-sandboxes", "12",
                    "--commands-per-minute", "100000")
            created = json.loads(_corral(env, "keys", "create", tenant, "--e2b", "--json"))
            keys[tenant] = created["key"]
        port, q = free_port(), e2b_port or free_port()
        log = scratch / "serve.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "corral", "serve", "--host", host, "--port", str(port),
                 "--e2b-port", str(q), *serve_args],
                env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        served = Served(home, port, q, keys, proc, log, scratch, host, domain)
        _wait_listening(served)
        yield served
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Whatever the clients left (a failed script never reaches its kill): destroyed here,
        # with the instance's cgroups, netns pins and mounts; then checked gone.
        with managed(settings):
            pass
        left = leftovers(settings)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    assert not left, f"corral serve left these behind: {left}"


def leftovers(settings: Settings) -> list[str]:
    """Host-wide traces of this home's instance (cgroups, netns pins, mounts)."""
    tag = f"corral-{settings.instance}"
    found = [str(h / tag) for h in Path("/sys/fs/cgroup").iterdir() if (h / tag).exists()]
    if settings.run_dir.exists():
        found += [str(p) for p in settings.run_dir.iterdir() if p.name.startswith(tag)]
    with open("/proc/mounts") as f:
        found += [line.strip() for line in f if str(settings.home) in line]
    return found


@pytest.fixture(scope="session")
def served() -> Iterator[Served]:
    """The session's ``corral serve`` with its E2B listener (URL mode)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: corral serve runs real sandboxes")
    with corral_serve() as srv:
        yield srv


# -- running a client ---------------------------------------------------------------------------


@dataclass
class ClientRun:
    """What a client script reported: its steps by name, and how it ended."""

    script: str
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    done: bool = False
    returncode: int | None = None
    stderr: str = ""
    seconds: float = 0.0
    server_log: str = ""

    def __getitem__(self, name: str) -> dict[str, Any]:
        """The step's record; fails with the script's own story when it never ran."""
        if name not in self.steps:
            pytest.fail(f"{self.script}: step {name!r} did not run (done={self.done}, "
                        f"exit={self.returncode}); stderr:\n{self.stderr[-3000:]}\n"
                        f"server log:\n{self.server_log}")
        return self.steps[name]

    def value(self, name: str) -> Any:
        """The step's value; fails with its exception when the step raised."""
        step = self[name]
        if "error" in step:
            pytest.fail(f"{self.script}: step {name!r} raised {step['error']}: "
                        f"{step.get('message', '')}\n{step.get('trace', '')[-2000:]}\n"
                        f"server log:\n{self.server_log}")
        return step.get("value")

    def error(self, name: str) -> dict[str, Any]:
        """The step's exception record; fails when it did not raise."""
        step = self[name]
        if "error" not in step:
            pytest.fail(f"{self.script}: step {name!r} was expected to raise, returned "
                        f"{step.get('value')!r}")
        return step


def _sdk_env(served: Served, key: str, extra: dict[str, str] | None) -> dict[str, str]:
    env = {"PATH": _BASE_PATH, "HOME": str(served.scratch), "LANG": "C.UTF-8",
           "E2B_API_KEY": key, "E2B_CONNECTION_RETRIES": "0"}
    if served.domain is None:  # URL mode; the domain is a fail-safe that never resolves
        env |= {"E2B_API_URL": served.e2b_url, "E2B_SANDBOX_URL": served.e2b_url,
                "E2B_DOMAIN": "corral.invalid"}
    else:
        env["E2B_DOMAIN"] = served.domain
    return env | (extra or {})


def node_problem() -> str | None:
    """Why the JS clients cannot run here (None when they can)."""
    node = shutil.which("node")
    if node is None:
        return "node is not installed (scripts/e2b-sdks installs Debian's nodejs)"
    version = subprocess.run([node, "-p", "process.versions.node"], capture_output=True,
                             text=True).stdout.strip()
    if int(version.split(".")[0] or 0) < 18:
        return f"node {version} is older than 18, the oldest the E2B JS SDK supports"
    if not all((d / "node_modules" / "e2b").is_dir() for d in JS_DIRS.values()):
        return "the E2B JS SDKs are not installed: run scripts/e2b-sdks"
    return None


def client_argv(kind: str, script: str) -> list[str]:
    """The argv that runs ``clients/<kind>/<script>``; kind is a Python set name or ``js``."""
    if kind in JS_DIRS:
        problem = node_problem()
        if problem:
            pytest.skip(f"E2B JS SDK tests skipped: {problem}")
        return [str(shutil.which("node")), str(CLIENTS / "js" / script)]
    python = VENVS / kind / "bin" / "python"
    if not python.exists():
        pytest.fail(f"the E2B SDK set {kind!r} is not installed ({python} missing): "
                    "run scripts/e2b-sdks (scripts/bootstrap --test does)")
    return [str(python), str(CLIENTS / "py" / script)]


def run_client(served: Served, kind: str, script: str, *args: str, tenant: str = "alpha",
               key: str | None = None, env: dict[str, str] | None = None,
               timeout: float = 240.0, wrap: list[str] | None = None) -> ClientRun:
    """Runs a client script under ``env -i`` and collects the steps it printed.

    A script that overruns ``timeout`` is killed (its whole process group); the steps it had
    printed are kept, the rest fail as "did not run"."""
    client_env = _sdk_env(served, key or served.keys[tenant], env)
    if kind in JS_DIRS:
        # The clients are CommonJS so NODE_PATH finds the SDKs in tests/e2b/js (ESM ignores it).
        client_env["NODE_PATH"] = str(JS_DIRS[kind] / "node_modules")
    argv = [*(wrap or []), "env", "-i", *(f"{k}={v}" for k, v in client_env.items()),
            *client_argv(kind, script), *args]
    run = ClientRun(script=f"{kind}/{script}")
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, cwd=served.scratch)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[killed after {timeout:.0f} s]".encode()
    run.seconds = time.monotonic() - start
    run.returncode = proc.returncode
    run.stderr = err.decode(errors="replace")
    for line in out.decode(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("done"):
            run.done = True
        elif "step" in record:
            run.steps[record.pop("step")] = record
    run.server_log = served.log_tail()
    return run


def events_of(served: Served, sandbox_id: str, kind: str) -> list[dict[str, Any]]:
    """The sandbox's audit events of one type."""
    return [e for e in served.audit(sandbox_id) if e["type"] == kind]
