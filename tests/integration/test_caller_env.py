"""The caller is untrusted too: its environment reaches only the sandbox, never a privileged
helper on the host (issue 11).

The attack: a shared object whose constructor creates a canary file on the host, placed in the
workspace and named by its *host* path in ``LD_PRELOAD`` / ``LD_AUDIT``. If any process Corral
starts on the host (setpriv, setsid, bwrap, runsc) honoured the variable, the canary appears;
inside the sandbox the host path does not exist (and the canary's directory does not either),
so the library cannot do anything there. The test uses the real host path, as known to the
host, which is the strongest form of the attack (no need to find it through ``mountinfo``).

Bounded by construction: the library creates one empty file in a fresh temporary directory
and nothing else; every sandbox is killed at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from corral import CommandError, CorralError, Sandbox
from corral._control.manager import Manager
from corral._settings import Settings

from .servers import Server

pytestmark = pytest.mark.needs_root

_LIBRARY = r"""
#include <fcntl.h>
#include <unistd.h>

/* LD_AUDIT loads only a library that answers la_version. */
unsigned int la_version(unsigned int version) { return version; }

__attribute__((constructor)) static void canary(void) {
    int fd = open(CANARY, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd >= 0) close(fd);
}
"""


@pytest.fixture(scope="module")
def canary_dir() -> Iterator[Path]:
    """A fresh host directory outside every workspace; it does not exist inside a sandbox."""
    path = Path(tempfile.mkdtemp(prefix="corral-canary-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def library(canary_dir: Path) -> bytes:
    """The shared object, built on the host by its own compiler."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler on the host to build the test library")
    src = canary_dir / "m.c"
    out = canary_dir / "m.so"
    src.write_text(_LIBRARY)
    subprocess.run([cc, "-shared", "-fPIC", f'-DCANARY="{canary_dir / "pwned"}"',
                    "-o", str(out), str(src)], check=True, capture_output=True, timeout=60)
    data = out.read_bytes()
    # Only the built bytes travel on: the library on the host must be the workspace's copy.
    out.unlink()
    src.unlink()
    return data


def _planted(sb: Sandbox, manager: Manager, isolation: str, library: bytes) -> str:
    """Put the library in the workspace; its host path (what an attacker would read from
    ``/proc/self/mountinfo``)."""
    sb.files.write("m.so", library)
    host = manager.backend_for(isolation).workspace_root(manager._spec(manager.get(sb.id)))
    path = host / "m.so"
    assert path.is_file(), f"the library is not at its host path {path}"
    return str(path)


def _assert_no_canary(canary_dir: Path, how: str) -> None:
    canary = canary_dir / "pwned"
    if canary.exists():
        owner = canary.stat().st_uid
        canary.unlink()
        pytest.fail(f"{how}: the library ran on the host, outside the sandbox, as uid {owner}")


@pytest.fixture
def sandbox(where: dict[str, str], isolation: str) -> Iterator[Sandbox]:
    sb = Sandbox.create(isolation=isolation, **where)
    yield sb
    sb.kill()


@pytest.mark.parametrize("variable", ["LD_PRELOAD", "LD_AUDIT"])
def test_loader_variables_never_reach_a_privileged_process(
    sandbox: Sandbox, manager: Manager, isolation: str, library: bytes, canary_dir: Path,
    variable: str,
) -> None:
    target = _planted(sandbox, manager, isolation, library)
    env = {variable: target}

    result = sandbox.commands.run("env", envs=env, timeout=30)
    _assert_no_canary(canary_dir, f"a command with {variable}")
    # The command's own environment still holds exactly what the caller passed.
    assert f"{variable}={target}" in result.stdout.splitlines(), result.stdout

    process = sandbox.processes.start(["env"], envs=env)
    info = process.wait(timeout=30)
    _assert_no_canary(canary_dir, f"a background process with {variable}")
    assert info["state"] == "exited"
    output = "".join(text for _, stream, text in process.output() if stream == "stdout")
    assert f"{variable}={target}" in output.splitlines(), output


@pytest.mark.parametrize("variable", ["LD_PRELOAD", "LD_AUDIT"])
def test_loader_variables_never_reach_a_terminal_launcher(
    manager: Manager, home: str, isolation: str, library: bytes, canary_dir: Path,
    variable: str,
) -> None:
    """Terminals start through ``setsid --ctty`` first; the same holds there."""
    sb = Sandbox.create(home=home, isolation=isolation)
    try:
        target = _planted(sb, manager, isolation, library)
        result = manager.run(sb.id, ["/bin/sh", "-c", f'printf "%s\\n" "${variable}"'],
                             envs={variable: target}, pty=(24, 80), timeout=30)
        _assert_no_canary(canary_dir, f"a terminal with {variable}")
        assert target in result.stdout, result.stdout
    finally:
        sb.kill()


def test_pid1_shows_no_host_data_directory(sandbox: Sandbox, settings: Settings,
                                           isolation: str) -> None:
    """``/proc/1`` inside is the command's init (the resident zygote's in the namespace tier,
    or bwrap's; the zygote's hides its environment: it is not dumpable): neither its
    command line nor its environment carries the host's data directory, template or
    workspace paths; nor does the workspace's line in ``mountinfo`` (overlayfs options)."""
    probe = textwrap.dedent("""
        import sys
        for name in ("cmdline", "environ"):
            try:
                with open(f"/proc/1/{name}", "rb") as f:
                    text = f.read().replace(b"\\0", b" ").decode()
            except PermissionError:  # the namespace tier's init is not dumpable
                text = "<unreadable>"
            sys.stdout.write(f"{name}=" + text + "\\n")
        for line in open("/proc/self/mountinfo"):
            if line.split()[4] == "/workspace":
                sys.stdout.write("workspace=" + line)
    """)
    result = sandbox.commands.run(["python3", "-c", probe], envs={"CALLER_VALUE": "kept"},
                                  timeout=30)
    assert result.exit_code == 0, result.stderr
    assert "workspace=" in result.stdout, result.stdout
    home = str(settings.home)
    assert home not in result.stdout, result.stdout
    assert "/sandboxes/" not in result.stdout and "/templates/" not in result.stdout
    # A caller's value reaches the command, not the init's own environment.
    environ = next(line for line in result.stdout.splitlines() if line.startswith("environ="))
    assert "CALLER_VALUE" not in environ or isolation == "gvisor"


@pytest.mark.parametrize(("envs", "named"), [
    ({"": "x"}, "''"),
    ({"A=B": "x"}, "A=B"),
    ({"A\x00B": "x"}, "A\\x00B"),
    ({"GOOD": "x\x00y"}, "GOOD"),
])
def test_impossible_environment_entries_are_refused(
    where: dict[str, str], envs: dict[str, str], named: str,
) -> None:
    sb = Sandbox.create(**where)
    try:
        with pytest.raises(CommandError) as caught:
            sb.commands.run("true", envs=envs)
        assert named in str(caught.value), str(caught.value)
        # A background process is refused the same way (the process table wraps the error).
        with pytest.raises(CorralError) as caught_process:
            sb.processes.start("true", envs=envs)
        assert named in str(caught_process.value), str(caught_process.value)
    finally:
        sb.kill()


def test_text_that_cannot_be_encoded_is_refused(home: str, server: Server) -> None:
    """A lone surrogate (valid in JSON as an escape, impossible in UTF-8) in argv or env is a
    precise CommandError, embedded and over raw HTTP (the SDK cannot even send it)."""
    sb = Sandbox.create(home=home)
    try:
        with pytest.raises(CommandError, match="not valid Unicode"):
            sb.commands.run(["echo", "\ud800"])
        with pytest.raises(CommandError, match="TEXT is not valid Unicode"):
            sb.commands.run("true", envs={"TEXT": "\ud800"})
        url = f"{server.url}/v1/sandboxes/{sb.id}/commands"
        for body in ('{"cmd": ["echo", "\\ud800"]}',
                     '{"cmd": "true", "envs": {"TEXT": "\\ud800"}}'):
            response = httpx.post(url, content=body,
                                  headers={"content-type": "application/json"}, timeout=30)
            assert response.status_code == 400, response.text
            assert response.json()["error"] == "command_error", response.text
    finally:
        sb.kill()


def test_one_argument_over_128_kib_names_that_limit(where: dict[str, str]) -> None:
    sb = Sandbox.create(**where)
    try:
        with pytest.raises(CommandError) as caught:
            sb.commands.run(["echo", "x" * (200 * 1024)])
        message = str(caught.value)
        assert "128 KiB" in message and "one argument" in message, message
        assert "bwrap" not in message
        with pytest.raises(CommandError) as caught:
            sb.commands.run("true", envs={"BIG": "y" * (200 * 1024)})
        message = str(caught.value)
        assert "128 KiB" in message and "BIG" in message, message
    finally:
        sb.kill()


def test_bwraps_own_e2big_inside_is_still_the_clear_error(
    home: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the check up front, the kernel's refusal comes from bwrap's execvp inside the
    sandbox (the environment is applied there); it must still be a CommandError naming the
    limits, not bwrap's message as the command's result."""
    from corral._backends.namespace import runner

    monkeypatch.setattr(runner, "check_exec_size", lambda *_a, **_k: None)
    sb = Sandbox.create(home=home)
    try:
        with pytest.raises(CommandError) as caught:
            sb.commands.run("true", envs={"BIG": "y" * (200 * 1024)})
        message = str(caught.value)
        assert "MAX_ARG_STRLEN" in message and "bwrap" not in message, message
    finally:
        sb.kill()


def test_argv_and_environment_over_arg_max_names_that_limit(where: dict[str, str]) -> None:
    """Many short arguments: under every per-string limit, over ARG_MAX once the kernel counts
    one pointer for each (a quarter of the stack limit, 2 MiB by default)."""
    sb = Sandbox.create(**where)
    try:
        with pytest.raises(CommandError) as caught:
            sb.commands.run(["true", *(["x"] * 300_000)])
        message = str(caught.value)
        assert "ARG_MAX" in message and "128 KiB" not in message, message
        assert "bwrap" not in message
        # Just under the limit still runs.
        assert sb.commands.run(["true", *(["x"] * 1000)]).exit_code == 0
    finally:
        sb.kill()


def test_host_helpers_get_the_fixed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The service's own environment (which an operator may have set up with anything) is not
    what privileged helpers see either: they get Corral's fixed one."""
    from corral._core.privileged import PRIVILEGED_ENV, privileged_env

    monkeypatch.setenv("LD_PRELOAD", "/nonexistent/m.so")
    env = privileged_env()
    assert env == dict(PRIVILEGED_ENV)
    assert set(env) <= {"PATH", "LC_ALL"}
    assert os.environ["LD_PRELOAD"] == "/nonexistent/m.so"


def test_every_host_process_corral_starts_gets_the_fixed_environment() -> None:
    """The class, not the instance: every ``subprocess`` call and ``os.exec*``/``os.spawn*``
    under ``src/corral`` passes ``env=privileged_env()`` (or a name bound to it), so no new
    helper can inherit the service's environment or be handed a caller's."""
    import ast

    import corral

    root = Path(corral.__file__).parent
    # Source that runs inside a sandbox, never on the host: the code interpreter's kernel
    # driver (it starts bash and node there, as the user's code could), the microVM's guest
    # agent (its process starts are in _guest/exec.py) and the gVisor resident's helper (they
    # start the user's commands, with the environment the host sent).
    in_sandbox = {root / "_kernels" / "python_driver.py",
                  root / "_guest" / "exec.py",
                  root / "_backends" / "gvisor" / "inside.py"}
    assert all(path.is_file() for path in in_sandbox)
    offenders: list[str] = []
    for path in sorted(set(root.rglob("*.py")) - in_sandbox):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value
            owner_name = owner.id if isinstance(owner, ast.Name) else ""
            name = node.func.attr
            where = f"{path.relative_to(root)}:{node.lineno}"
            if owner_name == "os" and (name.startswith(("exec", "spawn", "posix_spawn"))
                                       or name in ("system", "popen")):
                offenders.append(f"{where} os.{name}")
            elif owner_name == "subprocess" and name in ("run", "Popen", "call",
                                                         "check_call", "check_output"):
                env = next((k.value for k in node.keywords if k.arg == "env"), None)
                fixed = (isinstance(env, ast.Call) and isinstance(env.func, ast.Name)
                         and env.func.id == "privileged_env")
                if not fixed and not isinstance(env, ast.Name | ast.Dict):
                    offenders.append(f"{where} subprocess.{name} without env=privileged_env()")
                if isinstance(env, ast.Dict):
                    offenders.append(f"{where} subprocess.{name} with an env of its own")
    assert not offenders, "host processes without Corral's fixed environment:\n" + "\n".join(
        offenders)
