"""Lifecycle, commands and files through every pinned Python SDK set (E2B-COMPAT.md §12
scenarios 1-3, URL mode), asserted on the SDK's results and on Corral's audit trail."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

import pytest

from .conftest import PY_SETS, ClientRun, Served, events_of, run_client

pytestmark = [pytest.mark.e2b, pytest.mark.needs_root]

BLOB = bytes(range(256)) * 8


def raised(run: ClientRun, step: str, *names: str) -> dict[str, Any]:
    """The step raised one of ``names`` (the class or one of its bases)."""
    record = run.error(step)
    seen = [record["error"], *record.get("bases", [])]
    assert set(names) & set(seen), (
        f"{run.script}: {step} raised {record['error']} ({record.get('message')}), "
        f"expected one of {names}")
    return record


@pytest.fixture(scope="module", params=PY_SETS)
def sdk(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def lifecycle(served: Served, sdk: str) -> tuple[ClientRun, str]:
    tag = f"t{secrets.token_hex(4)}"
    return run_client(served, sdk, "lifecycle.py", tag), tag


@pytest.fixture(scope="module")
def commands(served: Served, sdk: str) -> ClientRun:
    return run_client(served, sdk, "commands.py")


@pytest.fixture(scope="module")
def files(served: Served, sdk: str) -> ClientRun:
    return run_client(served, sdk, "files.py")


# -- 1. lifecycle --------------------------------------------------------------------------------


def test_create_with_metadata_and_envs(lifecycle: tuple[ClientRun, str], served: Served) -> None:
    run, tag = lifecycle
    sid = run.value("id")
    assert sid.startswith("sbx-") and "_" not in sid  # a DNS label (domain mode needs it)
    assert run.value("sandbox_envs") == "hello from envs\n"
    created = events_of(served, sid, "sandbox.created")
    assert len(created) == 1 and created[0]["data"]["tenant"] == "alpha"
    assert tag in repr(created[0]["data"])  # the metadata landed with the sandbox
    started = [e for e in events_of(served, sid, "command.started")
               if "GREETING" in " ".join(e["data"]["argv"])]
    assert started and started[0]["data"]["argv"][:2] == ["/bin/bash", "-l"]
    assert "GREETING" in started[0]["data"]["env_names"]


def test_get_info_types(lifecycle: tuple[ClientRun, str]) -> None:
    run, tag = lifecycle
    info = run.value("get_info")
    assert info["types"] == {"sandbox_id": "str", "template_id": "str", "metadata": "dict",
                             "started_at": "datetime", "end_at": "datetime",
                             "cpu_count": "int", "memory_mb": "int", "envd_version": "str"}
    assert info["sandbox_id"] == run.value("id")
    assert info["metadata"] == {"suite": tag, "role": "main"}
    assert info["state"] == "running"
    assert info["cpu_count"] >= 1 and info["memory_mb"] >= 128
    assert 60 < info["ttl_s"] <= 121  # created with timeout=120


def test_list_pages_and_filters(lifecycle: tuple[ClientRun, str]) -> None:
    run, _ = lifecycle
    main, other = run.value("id"), run.value("second_id")
    paged = run.value("list_paged")
    # limit=1 over two sandboxes: two pages of one, each sandbox once, then no next token.
    assert [len(p) for p in paged] == [1, 1], paged
    assert sorted(i for p in paged for i in p) == sorted([main, other])
    assert run.value("list_filtered") == [[main]]
    assert run.value("list_nothing") in ([], [[]])


def test_set_timeout_connect_pause_resume(lifecycle: tuple[ClientRun, str],
                                          served: Served) -> None:
    run, _ = lifecycle
    assert 240 < run.value("set_timeout") <= 301
    assert run.value("connect_running") == "connected\n"
    assert run.value("pause") in (True, None)
    assert run.value("paused_state") == "paused"
    assert run.value("connect_paused") == "resumed\n"
    assert run.value("resumed_state") == "running"
    kinds = [e["type"] for e in served.audit(run.value("id"))]
    for kind in ("sandbox.timeout_changed", "sandbox.paused", "sandbox.resumed"):
        assert kind in kinds


def test_kill_then_killed(lifecycle: tuple[ClientRun, str], served: Served, sdk: str) -> None:
    run, _ = lifecycle
    assert run.value("kill") is True
    assert run.value("kill_again") is False
    raised(run, "killed_connect", "SandboxNotFoundException", "NotFoundException")
    raised(run, "killed_get_info", "SandboxNotFoundException", "NotFoundException")
    if sdk == "latest":
        raised(run, "killed_rpc", "SandboxNotRunningException")
    else:  # older SDKs name a gone sandbox differently (E2B-COMPAT.md §7.5)
        raised(run, "killed_rpc", "SandboxException", "TimeoutException")
    assert run.value("killed_is_running") is False
    assert [e["type"] for e in served.audit(run.value("id"))][-1] == "sandbox.destroyed"


def test_bad_key(lifecycle: tuple[ClientRun, str]) -> None:
    run, _ = lifecycle
    raised(run, "bad_key_create", "AuthenticationException")
    raised(run, "bad_key_list", "AuthenticationException")
    assert run.value("kill_second") is True


# -- 2. commands ---------------------------------------------------------------------------------


def _finished(served: Served, sid: str, needle: str) -> dict[str, Any]:
    events = served.audit(sid)
    started = [e for e in events if e["type"] == "command.started"
               and needle in e["data"]["argv"][-1]]
    assert started, f"no command.started for {needle!r}"
    cid = started[-1]["command"]
    done = [e for e in events if e["type"] == "command.finished" and e["command"] == cid]
    assert done, f"no command.finished for {needle!r}"
    return dict(done[0]["data"])


def test_stdout_stderr_exit(commands: ClientRun, served: Served) -> None:
    assert commands.value("echo") == {"stdout": "hello e2b\n", "stderr": "", "exit_code": 0}
    assert commands.value("stderr") == {"stdout": "", "stderr": "oops\n", "exit_code": 0}
    err = raised(commands, "exit3", "CommandExitException")
    assert err["attrs"]["exit_code"] == 3 and err["attrs"]["stdout"] == "partial\n"
    sid = commands.value("id")
    assert _finished(served, sid, "exit 3")["exit_code"] == 3
    assert _finished(served, sid, "hello e2b")["exit_code"] == 0


def test_home_cwd_envs(commands: ClientRun) -> None:
    assert commands.value("home")["stdout"] == "/home/user\n/home/user user\n"
    assert commands.value("cwd")["stdout"] == "/home/user/sub\nhere\n"
    assert commands.value("envs")["stdout"] == "foo-bar baz\n"
    assert commands.value("bash_login")["stdout"].startswith("login\n")


def test_streaming_callbacks(commands: ClientRun) -> None:
    got = commands.value("callbacks")
    assert got["on_stdout"] == got["stdout"] == "line1\nline2\nline3\n"
    assert got["on_stderr"] == "err1\nerr2\nerr3\n"


def test_timeout_kills(commands: ClientRun, served: Served) -> None:
    got = commands.value("timeout")
    # 2.20.3 and older surface httpx's own ReadTimeout (a TimeoutException too) at the deadline.
    assert "TimeoutException" in [got["error"], *got.get("bases", [])], got
    assert got["seconds"] < 5, got
    assert got["left"] == []  # the process is gone, not just the stream
    assert _finished(served, commands.value("id"), "overslept")["exit_code"] != 0


def test_background_stdin_reconnect_kill(commands: ClientRun) -> None:
    got = commands.value("background")
    pid = got["pid"]
    assert isinstance(pid, int) and 0 < pid < 2**32
    assert any(p["pid"] == pid for p in got["listed"])
    assert got["kill"] is True
    wait = got["wait"]
    # The reconnected handle sees what came after it (no replay of the first line) and the end.
    assert wait["exit_code"] == -1, wait
    assert "seen by the new handle" in (wait["stdout"] or "")
    assert pid not in got["after_kill"]
    assert got["kill_again"] is False
    assert commands.value("kill_unknown") is False
    assert commands.value("kill_sandbox") is True


def test_stream_input_close_stdin(commands: ClientRun, sdk: str) -> None:
    got = commands.value("stdin_stream_close")
    if sdk != "latest" and got.get("unsupported"):
        return  # stream_input is newer than these SDKs
    assert got == {"stdout": "streamed in\ncat-ended\n", "exit_code": 0}


# -- 3. files ------------------------------------------------------------------------------------


def test_write_and_read(files: ClientRun, served: Served) -> None:
    w = files.value("write_text")
    assert w["path"] == "/home/user/hello.txt" and w["name"] == "hello.txt"
    assert files.value("write_relative")["path"] == "/home/user/relative.txt"
    assert files.value("read_relative") == "relative\n"
    assert files.value("write_bytes")["path"] == "/home/user/blob.bin"
    assert files.value("read_text") == "hello, files\n"
    assert files.value("read_bytes") is True
    assert files.value("read_stream") is True
    assert [w["path"] for w in files.value("write_files")] == [
        "/home/user/multi/a.txt", "/home/user/multi/b.txt"]
    assert files.value("read_multi") == ["A", "B"]
    # The file API and commands agree on paths.
    out = files.value("seen_by_commands")
    assert out.startswith("hello, files\nA") and hashlib.sha256(BLOB).hexdigest() in out
    sid = files.value("id")
    written = {e["data"]["path"]: e["data"] for e in served.audit(sid)
               if e["type"] in ("file.write", "file.upload")}
    blob = [d for p, d in written.items() if p.endswith("/blob.bin")]
    assert blob and blob[0]["sha256"] == hashlib.sha256(BLOB).hexdigest()
    assert any(e["type"] in ("file.read", "file.download") for e in served.audit(sid))


def test_gzip_and_stream_writes(files: ClientRun, sdk: str) -> None:
    assert files.value("write_stream")["path"] == "/home/user/stream.bin"
    if sdk in ("min",):  # 2.7.0 has no gzip= on files (E2B-COMPAT.md §6.6: envd 0.5.7+)
        return
    assert files.value("write_gzip")["path"] == "/home/user/gz.txt"
    assert files.value("read_gzip_written") == "zipped text\n"
    assert files.value("read_gzip") == "hello, files\n"


def test_missing_and_directory(files: ClientRun) -> None:
    raised(files, "read_missing", "FileNotFoundException", "NotFoundException")
    raised(files, "get_info_missing", "FileNotFoundException", "NotFoundException")
    raised(files, "read_directory", "InvalidArgumentException", "SandboxException")
    raised(files, "outside_root", "SandboxException")


def test_list_depths(files: ClientRun) -> None:
    assert [e["path"] for e in files.value("list")] == ["/home/user/multi/a.txt",
                                                         "/home/user/multi/b.txt"]
    depth1 = {e["path"]: e["type"] for e in files.value("list_depth1")}
    assert depth1["/home/user/multi"] == "dir" and depth1["/home/user/blob.bin"] == "file"
    assert "/home/user/multi/a.txt" not in depth1
    depth2 = {e["path"] for e in files.value("list_depth2")}
    assert {"/home/user/multi", "/home/user/multi/a.txt", "/home/user/multi/b.txt",
            "/home/user/blob.bin"} <= depth2


def test_exists_info_mkdir_rename_remove(files: ClientRun, served: Served) -> None:
    assert files.value("exists_yes") is True and files.value("exists_no") is False
    info = files.value("get_info")
    assert info["size"] == len(BLOB) and info["type"] == "file"
    assert info["path"] == "/home/user/blob.bin"
    assert files.value("make_dir") is True and files.value("make_dir_again") is False
    assert files.value("rename")["path"] == "/home/user/renamed.txt"
    assert files.value("renamed_read") == "hello, files\n"
    assert files.value("renamed_old_gone") is False
    raised(files, "rename_missing", "FileNotFoundException", "NotFoundException")
    assert files.value("removed_gone") is False
    files.value("remove")
    files.value("remove_missing")  # RemoveAll semantics: a missing path is fine
    kinds = {e["type"] for e in served.audit(files.value("id"))}
    assert {"file.mkdir", "file.rename", "file.remove"} <= kinds


def test_signed_urls(files: ClientRun) -> None:
    assert files.value("signed_read") == {"status": 200, "body": "signed content"}
    for bad in ("signed_read_bad", "signed_read_other_path", "signed_read_expired",
                "signed_read_unsigned"):
        assert files.value(bad)["status"] == 401, (bad, files.value(bad))
    assert files.value("signed_write")["status"] == 200
    assert files.value("signed_written") == "uploaded through a signed url"
    assert files.value("signed_write_bad")["status"] == 401
    assert files.value("kill_sandbox") is True
