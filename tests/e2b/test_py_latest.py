"""PTY, watch, code interpreter (also mid) and security through the latest Python SDKs
(E2B-COMPAT.md §12 scenarios 4-7, URL mode), asserted on the SDK's results and on Corral's audit
trail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import ClientRun, Served, events_of, run_client
from .test_py_core import raised

pytestmark = [pytest.mark.e2b, pytest.mark.needs_root]


@pytest.fixture(scope="module")
def pty_watch(served: Served) -> ClientRun:
    return run_client(served, "latest", "pty_watch.py")


@pytest.fixture(scope="module", params=["latest", "mid"])
def interp(served: Served, request: pytest.FixtureRequest) -> ClientRun:
    """latest, and mid (e2b-code-interpreter 2.9.0: the first that honours E2B_SANDBOX_URL and
    sends only the traffic token to /contexts, E2B-COMPAT.md §8.2)."""
    return run_client(served, str(request.param), "interpreter.py", timeout=300)


@pytest.fixture(scope="module")
def security(served: Served) -> ClientRun:
    return run_client(served, "latest", "security.py", env={"BETA_KEY": served.keys["beta"]})


# -- 4. PTY --------------------------------------------------------------------------------------


def test_pty_input_resize_ctrl_d(pty_watch: ClientRun, served: Served) -> None:
    got = pty_watch.value("pty")
    assert "hi-42" in got["before"] and "24 80" in got["before"]
    assert "30 100" in got["after"] and "24 80" not in got["after"]
    assert got["exit_code"] == 0  # Ctrl-D ended the shell normally
    starts = [e for e in events_of(served, pty_watch.value("id"), "command.started")
              if e["data"]["argv"][:3] == ["/bin/bash", "-i", "-l"]]
    assert starts, "the PTY shell is not in the audit trail"


def test_pty_kill(pty_watch: ClientRun) -> None:
    got = pty_watch.value("pty_kill")
    assert got["kill"] is True and got["exit_code"] == -1


# -- 5. watch ------------------------------------------------------------------------------------


def test_watch_sync_polling(pty_watch: ClientRun) -> None:
    got = pty_watch.value("watch_sync")
    kinds = {tuple(e) for e in got["first"]}
    assert ("a.txt", "create") in kinds and ("a.txt", "remove") in kinds, got["first"]
    assert ("a.txt", "write") in kinds
    assert not any(name.endswith("deep.txt") for name, _ in got["first"])  # not recursive
    assert got["second"] == []
    assert any(name == "sub/deeper.txt" and kind == "create" for name, kind in got["recursive"])
    raised(pty_watch, "watch_missing", "NotFoundException", "FileNotFoundException")


def test_watch_async_stream(pty_watch: ClientRun) -> None:
    got = pty_watch.value("watch_async")
    kinds = [tuple(e) for e in got["events"]]
    assert ("x.txt", "create") in kinds and ("x.txt", "remove") in kinds, kinds
    assert got["after_stop"] == []
    assert pty_watch.value("kill_sandbox") is True


# -- 6. code interpreter -------------------------------------------------------------------------


def test_state_across_cells(interp: ClientRun, served: Served) -> None:
    assert interp.value("first_cell")["error"] is None
    assert interp.value("state_kept")["text"] == "2"
    sid = interp.value("id")
    assert events_of(served, sid, "command.started"), "the kernel's start is not audited"
    # Each cell lands in the same trail as a native run_code: code.started, code.finished.
    cells = [e["data"]["code"] for e in events_of(served, sid, "code.started")]
    assert "x = 1" in cells and "x + 1" in cells and "1/0" in cells
    failed = [e["data"] for e in events_of(served, sid, "code.finished") if e["data"]["error"]]
    assert any(d["error"]["name"] == "ZeroDivisionError" for d in failed)


def test_streams(interp: ClientRun) -> None:
    got = interp.value("streams")
    # How the kernel chunks a print is not part of the protocol; the text and its order are.
    assert "".join(got["stdout"]) == "to out\n" and "".join(got["stderr"]) == "to err\n"
    assert got["on_stdout"] == got["stdout"] and got["on_stderr"] == got["stderr"]


def test_rich_results(interp: ClientRun) -> None:
    png = interp.value("png")
    assert png["error"] is None, png
    assert any("png" in r["formats"] and r["png_head"].startswith("iVBORw0KGgo")
               for r in png["results"]), png["results"]
    df = interp.value("dataframe")
    main = [r for r in df["results"] if r["is_main"]]
    assert main and "html" in main[0]["formats"] and "<table" in main[0]["html"]


def test_error_and_counts(interp: ClientRun) -> None:
    err = interp.value("zero_division")["error"]
    assert err["name"] == "ZeroDivisionError" and "division by zero" in err["value"]
    assert "ZeroDivisionError" in err["traceback"]
    a, b = interp.value("count_a")["count"], interp.value("count_b")["count"]
    assert isinstance(a, int) and b == a + 1
    assert interp.value("envs")["text"] == "'from envs'"
    assert interp.value("cwd")["text"] == "'/home/user'"
    assert interp.value("create_envs")["text"] == "'from-create'"  # create's envs reach code


def test_contexts(interp: ClientRun) -> None:
    got = interp.value("contexts")
    assert got["ctx"]["language"] == "python" and got["ctx"]["cwd"] == "/home/user"
    assert got["get"]["text"] == "5"
    assert got["default_lacks"]["error"]["name"] == "NameError"  # contexts are separate
    assert got["ctx"]["id"] in got["listed"]
    assert got["after_restart"]["error"]["name"] == "NameError"  # restart clears the state
    assert got["ctx"]["id"] not in got["listed_after_remove"]
    raised(interp, "language_and_context", "InvalidArgumentException", "SandboxException")
    assert interp.value("kill_sandbox") is True


# -- 7. security ---------------------------------------------------------------------------------


def test_tokens_fail_closed(security: ClientRun) -> None:
    assert security.value("own_token")["status"] == 200  # the control: the route works
    for name in ("a_token_for_b", "no_token", "bad_token", "files_no_token",
                 "jupyter_no_token", "jupyter_a_token_for_b"):
        assert security.value(name)["status"] == 401, (name, security.value(name))
    unknown = security.value("unknown_sandbox")
    assert unknown["status"] == 502 and unknown["body"]["code"] == 502
    assert unknown["body"]["message"] == "The sandbox was not found"


def test_keys_and_tenants(security: ClientRun) -> None:
    for name in ("wrong_key_rest", "no_key_rest"):
        got = security.value(name)
        assert got["status"] == 401 and got["body"]["code"] == 401, got
        assert isinstance(got["body"]["message"], str)
    raised(security, "other_tenant_connect", "SandboxNotFoundException")
    raised(security, "other_tenant_info", "SandboxNotFoundException")
    assert security.value("other_tenant_kill") is False
    a_id = security.value("ids")[0]
    assert a_id not in security.value("other_tenant_list")
    assert security.value("still_alive") == "alive\n"


def test_network_refused_by_default(security: ClientRun) -> None:
    for name, got in security.value("network_default").items():
        # Refused: the connection fails, or Corral's gateway answers 403 saying it was its
        # network policy (curl without -f exits 0 on that answer).
        assert got["exit_code"] not in (0, None) or got["stdout"] == "403", (name, got)
    asked = security.value("network_asked")
    if asked["created"]:
        assert asked["stdout"].endswith("refused\n"), asked
    else:
        assert asked["message"], asked  # refused, and it says why
    assert security.value("kill_a") is True and security.value("kill_b") is True


# -- pause at the timeout, and wake (issue 40) ------------------------------------------------


@pytest.fixture(scope="module")
def sleep_run(served: Served) -> ClientRun:
    env = {**os.environ, "CORRAL_HOME": str(served.home)}
    made = subprocess.run([sys.executable, "-m", "corral", "keys", "create", "alpha", "--json"],
                          env=env, capture_output=True, text=True, timeout=60, check=True)
    native = {"CORRAL_URL": served.url, "CORRAL_KEY": json.loads(made.stdout)["key"]}
    return run_client(served, "latest", "sleep.py", env=native, timeout=300)


def test_a_sandbox_paused_at_its_timeout_resumes_on_connect_intact(sleep_run: ClientRun,
                                                                    served: Served) -> None:
    assert sleep_run.value("info_lifecycle") == {"on_timeout": "pause", "auto_resume": False}
    assert sleep_run.value("paused") == "paused"
    # Paused without auto_resume: a call is refused (the SDK raises what the server said).
    refused = sleep_run["refused_while_paused"]
    assert "error" in refused and "paused" in refused.get("message", ""), refused
    assert sleep_run.value("state_after_connect") == "running"
    assert sleep_run.value("kept") == "kept across the pause"
    first, then = sleep_run.value("counting")
    assert then > first > 0, "the background process did not survive the pause"
    assert sleep_run.value("processes") >= 1
    paused = events_of(served, sleep_run.value("id"), "sandbox.paused")
    assert paused and paused[0]["data"]["reason"] == "timeout"


def test_auto_resume_wakes_a_paused_sandbox_on_the_next_call(sleep_run: ClientRun) -> None:
    assert sleep_run.value("auto_paused") == "paused"
    assert sleep_run.value("auto_run") == "auto"
    assert sleep_run.value("auto_state") == "running"


def test_a_hibernated_sandbox_is_paused_to_e2b_and_connect_wakes_it_intact(
        sleep_run: ClientRun, served: Served) -> None:
    assert sleep_run.value("deep_paused") == "paused"
    assert sleep_run.value("deep_hibernate") == "hibernated"
    assert sleep_run.value("deep_state") == "paused"  # E2B knows two states
    assert sleep_run.value("deep_kept") == "kept while hibernated"
    assert sleep_run.value("deep_run") == "awake\n"
    woke = events_of(served, sleep_run.value("deep_id"), "sandbox.resumed")
    assert woke and woke[-1]["data"]["from"] == "hibernated"
