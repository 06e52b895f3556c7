"""Corral installed the Python way: the wheel built from this checkout, installed into fresh
virtualenvs outside it. The client install (no host parts) drives a `corral serve` that runs
from the host install; the host install's `corral setup` and `corral doctor` pass.

Each venv gets exactly the locked dependencies of its extra (requirements/client.txt,
host.txt) with --no-deps, so a module the client needs but does not declare fails here, and
`pip check` fails on a declared one the lock lacks."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from corral._settings import Settings
from tests.conftest import managed, private_settings

from .servers import free_port

# Two venvs and a wheel: minutes on a loaded 2-core host (pip's work, not Corral's).
pytestmark = [pytest.mark.needs_root, pytest.mark.timeout(1800)]

CHECKOUT = Path(__file__).resolve().parents[2]
# pip's own progress and warnings off; the same index configuration as the rest of CI.
PIP = ["-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-input", "--no-compile"]


def _run(argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
         timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: no checkout on the path, no CORRAL_* of the suite."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("CORRAL_", "PYTHON", "VIRTUAL_ENV"))}
    return {**env, **extra}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel and sdist of this checkout, built by its build backend (hatchling)."""
    out = tmp_path_factory.mktemp("dist")
    hatchling = Path(sys.executable).parent / "hatchling"
    _run([str(hatchling), "build", "-d", str(out)], cwd=CHECKOUT)
    wheels = list(out.glob("corral-*.whl"))
    sdists = list(out.glob("corral-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(out.iterdir())
    return wheels[0]


def _venv(where: Path, wheel: Path, lock: str) -> Path:
    """A fresh venv holding the wheel and exactly ``lock``'s pins; its bin directory."""
    _run([sys.executable, "-m", "venv", str(where)])
    python = str(where / "bin" / "python")
    _run([python, *PIP, "--no-deps", "--require-hashes", "-r",
          str(CHECKOUT / "requirements" / lock)], env=_clean_env())
    _run([python, *PIP, "--no-deps", str(wheel)], env=_clean_env())
    _run([python, "-m", "pip", "check"], env=_clean_env())
    return where / "bin"


@pytest.fixture(scope="module")
def venvs(built: Path) -> Iterator[tuple[Path, Path]]:
    root = Path(tempfile.mkdtemp(prefix="corral-test-venvs-"))
    try:
        yield _venv(root / "client", built, "client.txt"), _venv(root / "host", built,
                                                                  "host.txt")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _served(host_bin: Path, settings: Settings) -> Iterator[str]:
    port = free_port()
    env = _clean_env(CORRAL_HOME=str(settings.home), CORRAL_UID_START=str(settings.uid_start),
                     CORRAL_UID_COUNT=str(settings.uid_count))
    proc = subprocess.Popen([str(host_bin / "corral"), "serve", "--port", str(port)], env=env,
                            cwd=settings.home, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        # Up when it answers; the wait ends early if it exits (a broken install).
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        if proc.poll() is not None:
            raise AssertionError(f"corral serve exited: {proc.communicate()[1]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


CLIENT_SCRIPT = """
import sys
from corral import Sandbox
with Sandbox.create() as sb:
    sb.files.write("hello.txt", "from the client install")
    result = sb.commands.run("cat hello.txt && python3 -c 'print(6*7)'")
    print(result.stdout, end="")
    sys.exit(result.exit_code)
"""


def test_client_install_drives_a_service_from_the_host_install(
        venvs: tuple[Path, Path], tmp_path: Path) -> None:
    client, host = venvs
    # No host part reached the client install.
    probe = _run([str(client / "python"), "-c", "import fastapi"], env=_clean_env(),
                 cwd=tmp_path, check=False)
    assert probe.returncode != 0 and "No module named 'fastapi'" in probe.stderr
    with private_settings("corral-test-pkg-") as settings:
        try:
            with _served(host, settings) as url:
                env = _clean_env(CORRAL_URL=url)
                sdk = _run([str(client / "python"), "-c", CLIENT_SCRIPT], env=env,
                           cwd=tmp_path)
                assert sdk.stdout == "from the client install42\n"
                cli = _run([str(client / "corral"), "run", "--", "echo", "hi"], env=env,
                           cwd=tmp_path)
                assert cli.stdout == "hi\n"
                listed = _run([str(client / "corral"), "ls", "--json"], env=env,
                              cwd=tmp_path)
                assert json.loads(listed.stdout) == []
        finally:
            with managed(settings):  # whatever a failure left, after the service stopped
                pass
    # What needs the host says how to get it, on the CLI and in the SDK.
    serve = _run([str(client / "corral"), "serve"], env=_clean_env(), cwd=tmp_path,
                 check=False)
    assert serve.returncode == 3, serve.stderr
    assert "pip install 'corral[host]'" in serve.stderr and "Traceback" not in serve.stderr
    embedded = _run([str(client / "corral"), "--home", str(tmp_path / "h"), "ls"],
                    env=_clean_env(), cwd=tmp_path, check=False)
    assert embedded.returncode == 2, embedded.stderr
    assert "CORRAL_URL" in embedded.stderr and "Traceback" not in embedded.stderr


def test_host_install_sets_up_and_passes_doctor(venvs: tuple[Path, Path],
                                                tmp_path: Path) -> None:
    _, host = venvs
    with private_settings("corral-test-pkg-setup-") as settings:
        _setup_and_doctor(host, settings, tmp_path)


def _setup_and_doctor(host: Path, settings: Settings, tmp_path: Path) -> None:
    home = settings.home
    env = _clean_env(CORRAL_HOME=str(home), CORRAL_UID_START=str(settings.uid_start),
                     CORRAL_UID_COUNT=str(settings.uid_count))
    # Idempotent on a host that has everything (CI's bootstrap ran it): it only checks.
    setup = _run([str(host / "corral"), "setup", "--json", "--service", "--unit-path",
                  str(tmp_path / "corral.service")], env=env, cwd=tmp_path)
    report = json.loads(setup.stdout)
    assert report["ok"], report
    assert all(not group["missing"] and not group["installed"] for group in report["packages"])
    unit = (tmp_path / "corral.service").read_text()
    assert f"ExecStart={host / 'corral'} --home {home} serve" in unit
    if shutil.which("systemd-analyze"):
        _run(["systemd-analyze", "verify", str(tmp_path / "corral.service")], env=env)
    doctor = _run([str(host / "corral"), "doctor", "--json"], env=env, cwd=tmp_path,
                  check=False)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert json.loads(doctor.stdout)["ok"]
    check = _run([str(host / "corral"), "serve", "--check-config", "--port",
                  str(free_port())], env=env, cwd=tmp_path, check=False)
    assert check.returncode == 0, check.stderr
    refused = _run([str(host / "corral"), "serve", "--check-config", "--host", "0.0.0.0",
                    "--port", str(free_port())], env=env, cwd=tmp_path, check=False)
    assert refused.returncode == 2 and "without API keys" in refused.stderr
