"""The CLI, driven as a user would: a separate process, exit codes, --json on every command."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from corral._settings import Settings

pytestmark = pytest.mark.needs_root


@pytest.fixture
def corral(settings: Settings, home: str):  # type: ignore[no-untyped-def]
    env = {**os.environ, "CORRAL_HOME": str(settings.home),
           "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}

    def run(*args: str, stdin: str | bytes | None = None,
            text: bool = True) -> subprocess.CompletedProcess[Any]:
        return subprocess.run([sys.executable, "-m", "corral", *args], env=env, input=stdin,
                              capture_output=True, text=text, timeout=120)

    return run


def test_run_prints_json_and_exits_with_the_command_code(corral) -> None:  # type: ignore[no-untyped-def]
    done = corral("run", "--json", "--", "echo hi; echo oops >&2; exit 3")
    assert done.returncode == 3
    result = json.loads(done.stdout)
    assert result["exit_code"] == 3
    assert result["stdout"] == "hi\n" and result["stderr"] == "oops\n"
    assert result["timed_out"] is False
    assert set(result["usage"]) == {"wall_s", "cpu_s", "peak_memory_bytes", "oom_killed"}


def test_run_streams_plain_output_and_argv_form(corral) -> None:  # type: ignore[no-untyped-def]
    done = corral("run", "--", "printf", "%s|", "a b", "c")
    assert done.returncode == 0
    assert done.stdout == "a b|c|"


def test_run_timeout_exits_124(corral) -> None:  # type: ignore[no-untyped-def]
    done = corral("run", "--timeout", "1", "--", "sleep 30")
    assert done.returncode == 124
    assert "timed out" in done.stderr


def test_persistent_sandbox_workflow(corral) -> None:  # type: ignore[no-untyped-def]
    created = corral("create", "--json", "--label", "team=agents")
    assert created.returncode == 0, created.stderr
    sandbox_id = json.loads(created.stdout)["id"]
    try:
        assert corral("exec", sandbox_id, "--", "echo 41 > n.txt").returncode == 0
        wrote = corral("files", "write", sandbox_id, "src/app.py", stdin="print(42)\n")
        assert wrote.returncode == 0, wrote.stderr
        ran = corral("exec", sandbox_id, "--json", "--", "python3 src/app.py; cat n.txt")
        assert json.loads(ran.stdout)["stdout"] == "42\n41\n"
        assert corral("files", "read", sandbox_id, "n.txt").stdout == "41\n"
        listing = json.loads(corral("files", "ls", sandbox_id, "--json").stdout)
        assert {e["name"] for e in listing} == {"n.txt", "src"}
        listed = json.loads(corral("ls", "--json").stdout)
        assert any(s["id"] == sandbox_id and s["labels"] == {"team": "agents"} for s in listed)
        info = json.loads(corral("info", sandbox_id, "--json").stdout)
        assert info["resources"] == "small"
    finally:
        assert corral("rm", sandbox_id).returncode == 0
    gone = corral("exec", sandbox_id, "--json", "--", "true")
    assert gone.returncode == 4
    assert json.loads(gone.stderr)["code"] == "sandbox_not_found"


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (("run", "--resources", "huge", "--", "true"), 2, "unknown resource tier"),
        (("run",), 2, "no command"),
        (("exec", "sbx_000000000000", "--", "true"), 4, "does not exist"),
        (("exec", "not-an-id", "--", "true"), 4, "not a sandbox id"),
        (("rm", "sbx_000000000000"), 4, "does not exist"),
        (("run", "--env", "NOEQUALS", "--", "true"), 2, "KEY=VALUE"),
        (("run", "--cwd", "../..", "--", "true"), 2, "out of /workspace"),
        # Any directory of the sandbox may be the working directory; a missing one is refused
        # by the sandbox's own chdir, saying so, with nothing of bwrap's on the stream.
        (("run", "--cwd", "/no/such/dir", "--", "true"), 2,
         "cannot enter the working directory /no/such/dir: No such file or directory"),
    ],
)
def test_bad_input_gives_a_clear_error_and_exit_code(  # type: ignore[no-untyped-def]
    corral, args: tuple[str, ...], code: int, needle: str
) -> None:
    done = corral(*args)
    assert done.returncode == code, done.stderr
    assert needle in done.stderr
    assert "Traceback" not in done.stderr and "bwrap" not in done.stderr


def test_path_refusal_through_the_cli(corral) -> None:  # type: ignore[no-untyped-def]
    sandbox_id = corral("create").stdout.strip()
    try:
        done = corral("files", "read", sandbox_id, "../../etc/passwd", "--json")
        assert done.returncode == 2
        assert json.loads(done.stderr)["code"] == "path_refused"
    finally:
        corral("rm", sandbox_id)


def test_doctor_reports_a_healthy_host(corral) -> None:  # type: ignore[no-untyped-def]
    done = corral("doctor", "--json")
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["ok"] is True
    assert {c["name"] for c in report["checks"]} >= {"bwrap", "seccomp", "cgroups", "root"}
    # What a hibernate keeps here, said: files and /tmp on the namespace tier at least.
    assert "namespace" in report["hibernation"]["without_processes"]
    # Processes' memory: the microVM tier's, where it runs here; never the host tiers'.
    assert report["hibernation"]["with_processes"] == [
        t for t in report["hibernation"]["without_processes"] if t == "microvm"]


def test_reap_removes_expired_sandboxes(corral) -> None:  # type: ignore[no-untyped-def]
    sandbox_id = corral("create", "--ttl", "1").stdout.strip()
    import time

    time.sleep(1.2)
    done = corral("reap", "--json")
    assert done.returncode == 0, done.stderr
    assert f"sandbox {sandbox_id}" in json.loads(done.stdout)["removed"]


def test_refuses_to_run_unprivileged(settings: Settings) -> None:
    """As a normal user a sandbox would share that user's uid: Corral refuses instead."""
    from corral import BackendUnavailable
    from corral._control.manager import Manager

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child drops to nobody and reports what Corral said
        try:
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            Manager(settings)
            os.write(write_end, b"started")
        except BackendUnavailable as exc:
            os.write(write_end, exc.message.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    message = os.read(read_end, 4096).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    assert "must run as root" in message


@pytest.mark.parametrize("command", [[], ["run"], ["exec"], ["files"], ["files", "write"],
                                     ["doctor"], ["demo"], ["create"], ["ls"], ["rm"],
                                     ["reap"], ["replay"], ["metrics"], ["secrets"]])
def test_help_is_available_everywhere(corral, command: list[str]) -> None:  # type: ignore[no-untyped-def]
    done = corral(*command, "--help")
    assert done.returncode == 0
    assert "Usage:" in done.stdout


def test_demo_runs_end_to_end_and_everything_is_contained(corral) -> None:  # type: ignore[no-untyped-def]
    done = corral("demo", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["destroyed"] is True
    assert summary["report"]["words"] == 29
    steps = {s["step"]: s for s in summary["steps"]}
    assert steps["run agent script"]["ok"] is True
    for name in ("write outside /workspace", "open a connection to the internet",
                 "resolve a host name", "runaway loop", "see the host's processes"):
        assert steps[name]["contained"] is True, steps[name]


def test_metrics_command_prints_parseable_prometheus_text(corral) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client.parser import text_string_to_metric_families

    done = corral("metrics")
    assert done.returncode == 0, done.stderr
    names = {f.name for f in text_string_to_metric_families(done.stdout)}
    assert "corral_commands_finished" in names and "corral_sandboxes" in names


def test_secrets_are_added_from_stdin_and_never_listed_with_values(corral) -> None:  # type: ignore[no-untyped-def]
    value = "tok-" + "9" * 20
    added = corral("secrets", "add", "CLI_TOKEN", "--host", "api.example.com", stdin=value)
    assert added.returncode == 0, added.stderr
    # A host without a port is bound on 443, written out, and the echo risk
    # is said where the secret is added.
    assert "api.example.com:443;" in added.stderr
    assert "echoes requests back" in added.stderr
    listed = corral("secrets", "ls", "--json")
    bound = ["api.example.com:443"]
    assert {"name": "CLI_TOKEN", "hosts": bound}.items() <= next(
        s for s in json.loads(listed.stdout) if s["name"] == "CLI_TOKEN").items()
    assert value not in listed.stdout and value not in corral("secrets", "ls").stdout
    bad = corral("secrets", "add", "not a name", stdin="x")
    assert bad.returncode == 2 and "invalid secret name" in bad.stderr
    assert corral("secrets", "rm", "CLI_TOKEN").returncode == 0
    missing = corral("secrets", "rm", "CLI_TOKEN")
    assert missing.returncode == 2 and "no secret named" in missing.stderr


def test_replay_of_an_unknown_sandbox(corral) -> None:  # type: ignore[no-untyped-def]
    done = corral("replay", "sbx_000000000000")
    assert done.returncode == 4 and "no audit trail" in done.stderr


def test_unknown_options_are_refused_and_after_the_separator_is_verbatim(corral) -> None:  # type: ignore[no-untyped-def]
    refused = corral("run", "--resource", "large", "--", "echo", "hi")
    assert refused.returncode == 2, refused.stderr
    assert "No such option '--resource'" in refused.stderr
    assert "Did you mean '--resources'?" in refused.stderr and "after --" in refused.stderr
    assert refused.stdout == ""
    ran = corral("run", "--json", "--", "echo", "--resource", "large", "--json")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["stdout"] == "--resource large --json\n"


def test_binary_output_is_byte_exact_with_binary(corral) -> None:  # type: ignore[no-untyped-def]
    blob = bytes(range(256)) * 4 + b"\xff\xfe\x00\x80"  # not UTF-8: decoding would change it
    sandbox_id = corral("create").stdout.strip()
    try:
        assert corral("exec", sandbox_id, "--stdin", "--", "cat > r.bin", stdin=blob,
                      text=False).returncode == 0
        raw = corral("exec", sandbox_id, "--binary", "--", "cat", "r.bin", text=False)
        assert raw.returncode == 0 and raw.stdout == blob
        out = json.loads(corral("exec", sandbox_id, "--binary", "--json", "--", "cat", "r.bin",
                                text=False).stdout)
        assert base64.b64decode(out["stdout_b64"]) == blob
    finally:
        corral("rm", sandbox_id)
