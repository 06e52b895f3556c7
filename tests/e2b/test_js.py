"""The official JS SDKs (J-latest: e2b@2.51.0, @e2b/code-interpreter@2.8.0; J-min: e2b@2.7.0, the
oldest honouring E2B_API_URL/E2B_SANDBOX_URL, with @e2b/code-interpreter@2.7.0) against
``corral serve`` in URL mode: lifecycle, commands, files, watchDir and runCode. Skipped, with the
reason, without a usable node (>= 18) or without the installed packages (scripts/e2b-sdks)."""

from __future__ import annotations

import secrets

import pytest

from .conftest import ClientRun, Served, events_of, run_client
from .test_py_core import raised

pytestmark = [pytest.mark.e2b, pytest.mark.needs_root]


@pytest.fixture(scope="module", params=["js", "js-min"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def lifecycle(served: Served, kind: str) -> tuple[ClientRun, str]:
    tag = f"j{secrets.token_hex(4)}"
    return run_client(served, kind, "lifecycle.cjs", tag), tag


@pytest.fixture(scope="module")
def commands(served: Served, kind: str) -> ClientRun:
    return run_client(served, kind, "commands.cjs")


@pytest.fixture(scope="module")
def files(served: Served, kind: str) -> ClientRun:
    return run_client(served, kind, "files.cjs")


@pytest.fixture(scope="module")
def watch_code(served: Served, kind: str) -> ClientRun:
    return run_client(served, kind, "watch_code.cjs", timeout=300)


def killed(kind: str) -> bool | None:
    """What an instance's ``kill()`` resolves to: 2.7.0's is void (only the static
    ``Sandbox.kill`` answers true/false there); the trail shows the destroy either way."""
    return None if kind == "js-min" else True


def test_lifecycle(lifecycle: tuple[ClientRun, str], served: Served, kind: str) -> None:
    run, tag = lifecycle
    sid = run.value("id")
    assert sid.startswith("sbx-")
    assert run.value("sandbox_envs") == "hello from envs\n"
    info = run.value("get_info")
    assert info["sandbox_id"] == sid and info["metadata"] == {"suite": tag, "role": "main"}
    assert info["state"] == "running" and info["started_is_date"] is True
    paged = run.value("list_paged")
    assert [len(p) for p in paged] == [1, 1]
    assert sorted(i for p in paged for i in p) == sorted([sid, run.value("second_id")])
    assert run.value("list_filtered") == [[sid]]
    assert 240 < run.value("set_timeout") <= 301
    assert run.value("connect_running") == "connected\n"
    assert run.value("pause") is True and run.value("paused_state") == "paused"
    assert run.value("connect_paused") == "resumed\n"
    assert run.value("kill") is killed(kind) and run.value("kill_again") is False
    raised(run, "killed_get_info", "SandboxNotFoundError", "NotFoundError")
    raised(run, "killed_rpc", "SandboxNotFoundError", "SandboxError")
    raised(run, "bad_key_create", "AuthenticationError")
    assert run.value("kill_second") is killed(kind)
    kinds = [e["type"] for e in served.audit(sid)]
    assert kinds[0] == "sandbox.created" and kinds[-1] == "sandbox.destroyed"
    assert "sandbox.paused" in kinds and "sandbox.resumed" in kinds


def test_commands(commands: ClientRun, served: Served, kind: str) -> None:
    assert commands.value("echo") == {"stdout": "hello e2b\n", "stderr": "", "exit_code": 0}
    assert commands.value("stderr")["stderr"] == "oops\n"
    err = raised(commands, "exit3", "CommandExitError")
    assert err["attrs"]["exitCode"] == 3
    assert commands.value("home")["stdout"] == "/home/user\n/home/user user\n"
    assert commands.value("cwd")["stdout"] == "/home/user/sub\n"
    assert commands.value("envs")["stdout"] == "foo\n"
    assert commands.value("callbacks") == "a\nb\n"
    timed = commands.value("timeout")
    assert timed["error"] is not None and timed["seconds"] < 5, timed
    bg = commands.value("background")
    assert bg["pid"] in bg["listed"] and bg["kill"] is True and bg["kill_again"] is False
    assert "seen by the new handle" in bg["reconnected"]
    assert "first line" not in bg["reconnected"]  # Connect streams from now on, no replay
    assert commands.value("kill_sandbox") is killed(kind)
    argvs = [e["data"]["argv"] for e in events_of(served, commands.value("id"), "command.started")]
    assert ["/bin/bash", "-l", "-c", "echo hello e2b"] in argvs


def test_files(files: ClientRun, served: Served, kind: str) -> None:
    assert files.value("write_text") == "/home/user/hello.txt"
    assert files.value("write_bytes") == "/home/user/blob.bin"
    assert files.value("write_multi") == ["/home/user/multi/a.txt", "/home/user/multi/b.txt"]
    assert files.value("read_text") == "hello, files\n"
    assert files.value("read_bytes") is True
    raised(files, "read_missing", "FileNotFoundError", "NotFoundError")
    assert {"/home/user/multi", "/home/user/multi/a.txt"} <= set(files.value("list_depth2"))
    assert files.value("exists") == [True, False]
    assert files.value("get_info") == {"size": 2048, "type": "file"}
    assert files.value("make_dir") == [True, False]
    assert files.value("rename") == "/home/user/renamed.txt"
    assert files.value("remove") is False
    assert files.value("kill_sandbox") is killed(kind)
    kinds = {e["type"] for e in served.audit(files.value("id"))}
    assert {"file.mkdir", "file.rename", "file.remove"} <= kinds


def test_watch_dir(watch_code: ClientRun) -> None:
    events = [tuple(e) for e in watch_code.value("watch")]
    assert ("x.txt", "create") in events and ("x.txt", "remove") in events, events


def test_run_code(watch_code: ClientRun) -> None:
    assert watch_code.value("first_cell")["error"] is None
    assert watch_code.value("state_kept")["text"] == "2"
    assert "".join(watch_code.value("stdout")["stdout"]) == "to out\n"
    assert watch_code.value("zero_division")["error"]["name"] == "ZeroDivisionError"
    assert any("png" in f for f in watch_code.value("png")["formats"])
    assert watch_code.value("contexts") == {"text": "5", "listed": True}
    # @e2b/code-interpreter 2.7.0 brings its own e2b (^2.8), whose kill() answers true.
    assert watch_code.value("kill_sandbox") is True
