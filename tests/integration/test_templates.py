"""Templates built from Debian packages: real mmdebstrap builds, once per session.

``python`` and ``node`` are each built once (session fixtures) through the CLI, with an
``mmdebstrap`` wrapper first on PATH that logs every call before running the real one, so a
test can tell a real build from a cache hit by counting calls.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from corral import Sandbox
from corral._backends._linux.template import load_template
from corral._settings import Settings
from corral._templates.roots import require_template
from corral.errors import UsageError

pytestmark = [pytest.mark.needs_root, pytest.mark.timeout(900)]

Cli = Callable[..., subprocess.CompletedProcess[str]]


@dataclass(frozen=True)
class Shim:
    path: Path  # directory to put first on PATH
    log: Path  # one line per mmdebstrap run: its arguments
    paused: Path  # builds of a template named "paused*" stop here, mid-build (see below)

    def calls(self, key: str) -> int:
        """Runs whose target was a build directory of ``key`` (a template name)."""
        if not self.log.exists():
            return 0
        return sum(f"/.build-{key}-" in line for line in self.log.read_text().splitlines())


@pytest.fixture(scope="session")
def shim() -> Iterator[Shim]:
    real = shutil.which("mmdebstrap")
    assert real is not None, "mmdebstrap is missing: run scripts/bootstrap"
    directory = Path(tempfile.mkdtemp(prefix="corral-test-shim-"))
    log = directory / "calls.log"
    script = directory / "mmdebstrap"
    paused = directory / "paused"
    # A build of a template named paused* is held inside mmdebstrap, after the essential
    # packages are installed and the chroot's mounts are up, until its pause file is removed
    # (at most 120 s): a test can interrupt it at a known point, never before or after.
    hook = (f'echo "$1" > {paused}; for i in $(seq 1200); do [ -e {paused} ] || exit 0; '
            'sleep 0.1; done')
    script.write_text(
        f'#!/bin/sh\necho "$*" >> {log}\n'
        f'case "$*" in *"/.build-paused"*) exec {real} --essential-hook=\'{hook}\' "$@";; esac\n'
        f'exec {real} "$@"\n')
    script.chmod(0o755)
    yield Shim(path=directory, log=log, paused=paused)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def cli_env(settings: Settings, shim: Shim) -> dict[str, str]:
    return {**os.environ, "CORRAL_HOME": str(settings.home),
            "CORRAL_UID_START": str(settings.uid_start),
            "CORRAL_UID_COUNT": str(settings.uid_count),
            "PATH": f"{shim.path}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


@pytest.fixture(scope="session")
def cli(cli_env: dict[str, str]) -> Cli:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "corral", *args], env=cli_env,
                              capture_output=True, text=True, timeout=900)

    return run


@dataclass(frozen=True)
class Build:
    done: subprocess.CompletedProcess[str]
    seconds: float


def _build(cli: Cli, *args: str) -> Build:
    started = time.monotonic()
    done = cli("templates", "build", *args)
    build = Build(done=done, seconds=time.monotonic() - started)
    assert done.returncode == 0, done.stderr[-3000:]
    return build


@pytest.fixture(scope="session")
def python_build(cli: Cli) -> Build:
    """``python`` built from clean, plain output (progress on stderr)."""
    return _build(cli, "python")


@pytest.fixture(scope="session")
def node_build(cli: Cli) -> Build:
    """``node`` built from clean, with --json."""
    return _build(cli, "node", "--json")


@pytest.fixture
def spec_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="corral-test-spec-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _templates(settings: Settings) -> Path:
    return settings.home / "templates"


def _current_root(settings: Settings, name: str) -> Path:
    return _templates(settings) / os.readlink(_templates(settings) / f"{name}.current") / "root"


# -- building and caching -----------------------------------------------------------------------


def test_python_builds_from_clean_with_progress(python_build: Build, shim: Shim,
                                                 cli: Cli, settings: Settings) -> None:
    assert shim.calls("python") == 1
    # mmdebstrap's phase lines stream to stderr while it works.
    assert "I: running apt-get update..." in python_build.done.stderr
    assert "I: installing remaining packages inside the chroot..." in python_build.done.stderr
    assert "python: built python-" in python_build.done.stdout
    listed = json.loads(cli("templates", "ls", "--json").stdout)
    (row,) = [r for r in listed if r["name"] == "python"]
    assert row["current"] is True and row["kind"] == "built"
    assert {"python3", "python3-venv", "build-essential"} <= set(row["packages"])
    assert row["size_bytes"] > 100 * 2**20 and row["installed_packages"] > 50
    assert [r["name"] for r in listed][0] == "base"
    print(f"\npython template: clean build {python_build.seconds:.1f} s, "
          f"{row['size_bytes'] / 2**20:.0f} MiB")


def test_rebuild_is_a_cache_hit(python_build: Build, shim: Shim, cli: Cli,
                                settings: Settings) -> None:
    root = _current_root(settings, "python")
    inode = root.stat().st_ino
    started = time.monotonic()
    done = cli("templates", "build", "python", "--json")
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["cached"] is True and result["current"] is True
    assert shim.calls("python") == 1  # mmdebstrap did not run again
    assert elapsed < 10 < python_build.seconds
    assert _current_root(settings, "python").stat().st_ino == inode
    print(f"\npython template: cached rebuild {elapsed:.2f} s (CLI process included), "
          f"{result['duration_s']:.3f} s in the builder")


def test_built_root_holds_nothing_of_the_host(python_build: Build,
                                              settings: Settings) -> None:
    root = _current_root(settings, "python")
    for rel in ("etc/resolv.conf", "etc/hostname", "var/lib/dbus/machine-id"):
        assert not os.path.lexists(root / rel), rel
    assert not list((root / "etc" / "ssh").glob("ssh_host_*"))
    assert not list((root / "etc" / "ssl" / "private").iterdir())
    assert not list((root / "var" / "lib" / "apt" / "lists").iterdir())
    assert not [p for p in (root / "dev").rglob("*")
                if stat.S_ISCHR(p.lstat().st_mode) or stat.S_ISBLK(p.lstat().st_mode)]
    host_marks = [line.split()[1].encode() for line in Path("/etc/resolv.conf").read_text()
                  .splitlines() if line.startswith("nameserver")]
    if len(socket.gethostname()) >= 6:  # a short name ("vm") matches ordinary words
        host_marks.append(socket.gethostname().encode())
    for path in (root / "etc").rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            assert not [m for m in host_marks if m in data], path
    assert stat.S_IMODE(root.stat().st_mode) == 0o755
    assert stat.S_IMODE(root.parent.stat().st_mode) == 0o755


def test_sandbox_etc_of_a_built_template(python_build: Build, settings: Settings) -> None:
    ca = b"-----BEGIN CERTIFICATE-----\nY29ycmFsLXRlc3QtY2E=\n-----END CERTIFICATE-----\n"
    template = load_template("python", _templates(settings), extra_ca=ca)
    root = _current_root(settings, "python")
    assert template.root == root
    assert ("bind", str(root / "usr"), "/usr") in template.system
    assert ("symlink", "usr/bin", "/bin") in template.system
    etc = template.etc
    assert (etc / "ssl" / "certs" / "ca-certificates.crt").read_bytes().endswith(ca)
    assert not (root / "etc" / "ssl" / "certs" / "ca-certificates.crt").read_bytes().endswith(ca)
    assert "user:x:1000:1000" in (etc / "passwd").read_text()
    assert (etc / "hostname").read_text() == "sandbox\n"
    for secret in ("shadow", "gshadow", "subuid"):
        assert not os.path.lexists(etc / secret)
    assert (etc / "python3.11").is_dir()  # the build's own /etc, not the host's allowlist
    # Loading again (another process, same CA) reuses the same curated copy.
    assert load_template("python", _templates(settings), extra_ca=ca).etc == etc
    assert load_template("base", _templates(settings)).root is None


# -- using the templates -------------------------------------------------------------------------


def _wheel(name: str, version: str, module: str, source: str) -> tuple[str, bytes]:
    """A real, installable pure-Python wheel, written by hand (no build tools, no network)."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": source.encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: corral-tests\nRoot-Is-Purelib: true\n"
                         b"Tag: py3-none-any\n",
    }
    record = [
        f"{path},sha256="
        f"{base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
        f"{len(data)}"
        for path, data in files.items()
    ]
    files[f"{dist}/RECORD"] = ("\n".join([*record, f"{dist}/RECORD,,"]) + "\n").encode()
    with tempfile.SpooledTemporaryFile() as buf:
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for path, data in files.items():
                zf.writestr(path, data)
        buf.seek(0)
        return f"{name}-{version}-py3-none-any.whl", buf.read()


def test_python_venv_and_pip_install_of_a_local_wheel_offline(python_build: Build,
                                                               home: str) -> None:
    wheel_name, wheel = _wheel("corral_hello", "1.0", "corral_hello",
                               'GREETING = "hello from a local wheel"\n')
    with Sandbox.create(home=home, template="python") as sb:
        assert sb.get_info().template == "python"
        sb.files.write(f"/workspace/{wheel_name}", wheel)
        result = sb.commands.run(
            "set -e; python3 -m venv /workspace/v; "
            "/workspace/v/bin/pip install --no-index --disable-pip-version-check "
            f"/workspace/{wheel_name}; "
            "/workspace/v/bin/python -c 'import corral_hello; print(corral_hello.GREETING)'",
            timeout=60)
        assert result.exit_code == 0, result.stdout + result.stderr
        assert "Successfully installed corral-hello-1.0" in result.stdout
        assert result.stdout.endswith("hello from a local wheel\n")
        # The toolchain is the template's, and the network is still off.
        tools = sb.commands.run("gcc --version && git --version && "
                                "dpkg-query -W python3-venv build-essential")
        assert tools.exit_code == 0, tools.stderr
        offline = sb.commands.run("curl -sS -m 5 https://pypi.org/simple/ >/dev/null")
        assert offline.exit_code != 0
        assert sb.commands.run("touch /usr/x /var/x").exit_code != 0  # read-only root


def test_node_runs_in_the_node_template(node_build: Build, shim: Shim, home: str) -> None:
    result = json.loads(node_build.done.stdout)
    assert result["cached"] is False and result["name"] == "node"
    assert shim.calls("node") == 1
    with Sandbox.create(home=home, template="node") as sb:
        ran = sb.commands.run("node -e 'console.log(1+1)'")
        assert (ran.exit_code, ran.stdout) == (0, "2\n"), ran.stderr
        assert sb.commands.run("npm --version").exit_code == 0
    print(f"\nnode template: clean build {node_build.seconds:.1f} s, "
          f"{result['size_bytes'] / 2**20:.0f} MiB")


def test_go_compiles_and_runs_a_program_offline(cli: Cli, home: str) -> None:
    go_build = _build(cli, "go", "--json")
    result = json.loads(go_build.done.stdout)
    assert result["name"] == "go"
    with Sandbox.create(home=home, template="go") as sb:
        sb.files.write("/workspace/hello/go.mod", "module hello\n\ngo 1.19\n")
        sb.files.write("/workspace/hello/main.go",
                       'package main\n\nimport "fmt"\n\nfunc main() { fmt.Println(6 * 7) }\n')
        # No network: the module has no dependencies, so nothing is downloaded.
        ran = sb.commands.run("cd hello && go build -o hello . && ./hello", timeout=60)
        assert (ran.exit_code, ran.stdout) == (0, "42\n"), ran.stderr
    print(f"\ngo template: clean build {go_build.seconds:.1f} s, "
          f"{result['size_bytes'] / 2**20:.0f} MiB")


# -- refusals ------------------------------------------------------------------------------------


def test_bad_specs_are_refused_clearly(cli: Cli, spec_dir: Path, settings: Settings) -> None:
    typo = spec_dir / "typo.toml"
    typo.write_text('name = "tools"\npakages = ["jq"]\n')
    done = cli("templates", "build", "--file", str(typo))
    assert done.returncode == 2
    assert "unknown key 'pakages'; did you mean 'packages'?" in done.stderr
    bad_path = spec_dir / "path.json"
    bad_path.write_text(json.dumps({"name": "tools", "packages": ["jq"],
                                    "files": [{"path": "/etc/../root/x", "content": ""}]}))
    done = cli("templates", "build", "--file", str(bad_path), "--json")
    assert done.returncode == 2
    error = json.loads(done.stderr)
    assert error["code"] == "usage_error" and "files[0]" in error["message"]
    done = cli("templates", "build", "ruby")
    assert done.returncode == 2 and "no built-in template 'ruby'" in done.stderr
    done = cli("templates", "build", "Base!")
    assert done.returncode == 2 and "invalid template name" in done.stderr
    assert not list(_templates(settings).glob("tools-*"))


def test_a_failed_build_reports_apt_and_keeps_nothing(cli: Cli, spec_dir: Path,
                                                      settings: Settings) -> None:
    spec = spec_dir / "missing.toml"
    spec.write_text('name = "missing"\npackages = ["corral-no-such-package"]\n')
    done = cli("templates", "build", "--file", str(spec))
    assert done.returncode == 1
    assert "Unable to locate package corral-no-such-package" in done.stderr
    assert not [p for p in _templates(settings).iterdir() if "missing" in p.name]


def test_unknown_or_unbuilt_templates_are_refused_at_create(home: str, spec_dir: Path) -> None:
    with pytest.raises(UsageError, match=r"unknown template 'nope'.*corral templates build"):
        Sandbox.create(home=home, template="nope")
    with pytest.raises(UsageError, match="unknown template"):
        Sandbox.create(home=home, template="../python")
    # A built-in template that has not been built yet names the command that builds it.
    with pytest.raises(UsageError, match="`corral templates build python`"):
        require_template("python", spec_dir)
    require_template("base", spec_dir)


def test_base_cannot_be_removed(cli: Cli) -> None:
    done = cli("templates", "rm", "base")
    assert done.returncode == 2 and "cannot be removed" in done.stderr


# -- a spec of one's own: files, setup, concurrent builds, removal ----------------------------


def test_custom_spec_concurrent_builds_then_use_and_remove(
        cli: Cli, cli_env: dict[str, str], shim: Shim, spec_dir: Path, home: str,
        settings: Settings) -> None:
    spec = spec_dir / "hello.toml"
    spec.write_text(
        'name = "hello"\npackages = ["hello"]\nsetup = ["hello > /opt/hello.txt"]\n'
        '[[files]]\npath = "/etc/corral-test/greeting.txt"\ncontent = "hi from a spec\\n"\n')
    argv = [sys.executable, "-m", "corral", "templates", "build", "--file", str(spec), "--json"]
    builders = [subprocess.Popen(argv, env=cli_env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=600) for p in builders]
    assert [p.returncode for p in builders] == [0, 0], [err for _, err in outputs]
    results = [json.loads(out) for out, _ in outputs]
    assert sorted(r["cached"] for r in results) == [False, True]
    assert results[0]["hash"] == results[1]["hash"]
    assert shim.calls("hello") == 1  # the second builder waited and reused the first's work
    with Sandbox.create(home=home, template="hello") as sb:
        ran = sb.commands.run("cat /etc/corral-test/greeting.txt /opt/hello.txt")
        assert ran.stdout == "hi from a spec\nHello, world!\n", ran.stderr
        refused = cli("templates", "rm", "hello")
        assert refused.returncode == 2 and "used by 1 sandbox" in refused.stderr
    removed = cli("templates", "rm", "hello", "--json")
    assert removed.returncode == 0, removed.stderr
    assert [b["hash"] for b in json.loads(removed.stdout)["removed"]] == [results[0]["hash"]]
    assert "hello" not in {r["name"] for r in json.loads(cli("templates", "ls", "--json").stdout)}
    assert not [p for p in _templates(settings).iterdir() if "hello" in p.name]
    with pytest.raises(UsageError, match="unknown template 'hello'"):
        Sandbox.create(home=home, template="hello")
    again = cli("templates", "rm", "hello")
    assert again.returncode == 2 and "not built" in again.stderr


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_build_leaves_nothing(sig: signal.Signals, cli_env: dict[str, str],
                                             shim: Shim, spec_dir: Path,
                                             settings: Settings) -> None:
    name = f"paused{sig.name.lower()}"
    spec = spec_dir / "stopped.toml"
    spec.write_text(f'name = "{name}"\npackages = ["hello"]\n')
    shim.paused.unlink(missing_ok=True)
    # SIGINT as a terminal delivers it: a run started in the background (`cmd &` in a
    # script) inherits it ignored, and Python then never turns it into KeyboardInterrupt.
    builder = subprocess.Popen(
        [sys.executable, "-m", "corral", "templates", "build", "--file", str(spec)],
        env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    try:
        # Signal at a known point: mmdebstrap holds the build in its hook (see `shim`), so
        # the build has certainly begun and cannot finish before the signal lands.
        deadline = time.monotonic() + 600
        while not shim.paused.exists() and builder.poll() is None:
            assert time.monotonic() < deadline, "the build never reached the pause"
            time.sleep(0.2)
        assert builder.poll() is None, builder.communicate()[1]
        assert shim.calls(name) == 1
        builder.send_signal(sig)
        _, err = builder.communicate(timeout=120)
    finally:
        shim.paused.unlink(missing_ok=True)  # releases a hook the interrupt left behind
        if builder.poll() is None:
            builder.kill()
        builder.communicate()  # reaped and its pipes closed, also when the test failed
    assert builder.returncode == 130, err
    assert "interrupted; nothing was kept" in err
    templates = _templates(settings)
    assert not [p for p in templates.iterdir() if name in p.name and p.suffix != ".lock"]
    assert not _processes_mentioning(str(templates / f".build-{name}-"))
    assert str(templates) not in Path("/proc/self/mountinfo").read_text()
