"""The pure parts of the E2B process service: who a request runs as, its deadline, and the end
event envd's clients read (E2B-COMPAT §6.5)."""

from __future__ import annotations

import pytest

from corral._control.processes import BackgroundProcess
from corral._e2b.connect import ConnectError
from corral._e2b.process import end_event, requested_user, timeout_of
from corral.models import CommandResult, Usage


def _exited(code: int, *, kill_requested: bool = False, timed_out: bool = False,
            oom: bool = False) -> BackgroundProcess:
    process = BackgroundProcess(id="proc_1", sandbox_id="sbx_000000000001",
                                command_id="cmd_000000000001", argv=["true"], started_at=0.0,
                                kill_requested=kill_requested)
    process._finished(CommandResult(exit_code=code, stdout="", stderr="", timed_out=timed_out,
                                    duration_s=0.0, usage=Usage(0.0, 0.0, 0, oom),
                                    command_id="cmd_000000000001"), None)
    return process


def test_end_events_as_go_reports_them() -> None:
    assert end_event(_exited(0)) == {
        "event": {"end": {"exitCode": 0, "exited": True, "status": "exit status 0"}}}
    assert end_event(_exited(137))["event"]["end"]["exited"] is True
    killed = {"event": {"end": {"exitCode": -1, "exited": False, "status": "signal: killed"}}}
    assert end_event(_exited(137, kill_requested=True)) == killed
    assert end_event(_exited(124, timed_out=True)) == killed  # the sandbox's lifetime ended
    assert end_event(_exited(137, oom=True)) == killed
    # Asked to kill, but it had exited on its own first: its exit stands.
    assert end_event(_exited(0, kill_requested=True))["event"]["end"]["exitCode"] == 0
    failed = BackgroundProcess(id="proc_2", sandbox_id="sbx_000000000001",
                               command_id="cmd_000000000002", argv=["x"], started_at=0.0)
    failed._finished(None, "backend_error: it broke")
    assert end_event(failed)["event"]["end"] == {"exitCode": -1, "exited": False,
                                                 "status": "error",
                                                 "error": "backend_error: it broke"}


@pytest.mark.parametrize(("header", "user"), [
    (None, "user"), ("", "user"), ("Basic dXNlcjo=", "user"), ("basic Og==", "user")])
def test_the_named_user_is_the_sandbox_user(header: str | None, user: str) -> None:
    assert requested_user(header) == user


@pytest.mark.parametrize(("header", "code", "words"), [
    ("Basic cm9vdDo=", "permission_denied", "never runs commands as root"),
    ("Basic Ym9iOg==", "permission_denied", "no user 'bob'"),
    ("Basic !!!", "unauthenticated", "not valid"),
    ("Bearer abc", "unauthenticated", "Basic"),
])
def test_root_and_strangers_are_refused(header: str, code: str, words: str) -> None:
    with pytest.raises(ConnectError) as caught:
        requested_user(header)
    assert caught.value.code == code and words in caught.value.message


def test_connect_timeout_ms_is_the_deadline() -> None:
    assert timeout_of(None) is None and timeout_of("0") is None
    assert timeout_of("60000") == 60.0 and timeout_of(" 1500 ") == 1.5
    for bad in ("-1", "1e3", "12345678901", "soon"):
        with pytest.raises(ConnectError) as caught:
            timeout_of(bad)
        assert caught.value.code == "invalid_argument"
