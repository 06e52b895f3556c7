"""The audit trail, read back from the files on disk (never from in-memory objects)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from corral import Sandbox, read_audit
from corral._audit.metrics import render
from corral._control.manager import Manager
from corral._settings import Settings

from ..conftest import PrivateIds

pytestmark = pytest.mark.needs_root

SECRET = "s3cr3t-Zq8vW2-value"


def _log_lines(settings: Settings, sandbox_id: str) -> list[dict[str, Any]]:
    path = settings.home / "audit" / f"{sandbox_id}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def secret(manager: Manager) -> Iterator[str]:
    manager.secrets.add("TEST_API_TOKEN", SECRET, ["api.example.com"])
    yield SECRET
    manager.secrets.remove("TEST_API_TOKEN")


def test_a_scripted_session_writes_every_event_type_in_order(
    home: str, settings: Settings
) -> None:
    sb = Sandbox.create(home=home, labels={"suite": "audit"})
    sb.set_timeout(600)
    result = sb.commands.run(
        "echo out; echo err >&2; head -c 300000 /dev/zero | tr '\\0' x; exit 3",
        envs={"ANSWER": "42"}, cwd="/workspace", context={"tool_call_id": "call_7"},
    )
    sb.files.make_dir("src")
    sb.files.write("src/app.py", "print('hi')\n")
    assert sb.files.read("src/app.py") == "print('hi')\n"
    sb.files.remove("src/app.py")
    sb.kill()

    events = _log_lines(settings, sb.id)
    types = [e["type"] for e in events]
    assert types[0] == "sandbox.created" and types[-1] == "sandbox.destroyed"
    expected_order = ["sandbox.created", "sandbox.timeout_changed", "command.started",
                      "command.output", "command.output_truncated", "command.finished",
                      "file.mkdir", "file.write", "file.read", "file.remove",
                      "sandbox.destroyed"]
    positions = [types.index(t) for t in expected_order]
    assert positions == sorted(positions), types
    # Sequence numbers start at 1 and have no gaps; every event names the sandbox.
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["sandbox"] == sb.id and e["v"] == 1 for e in events)
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)

    created = events[0]["data"]
    assert created["labels"] == {"suite": "audit"} and created["resources"] == "small"
    started = next(e for e in events if e["type"] == "command.started")
    assert started["command"] == result.command_id
    assert started["data"]["argv"][:2] == ["/bin/bash", "-c"]
    assert started["data"]["env_names"] == ["ANSWER"]  # names only
    assert "42" not in json.dumps(started["data"]["env_names"])
    assert started["data"]["context"] == {"tool_call_id": "call_7"}
    outputs = [e for e in events if e["type"] == "command.output"]
    assert all(e["command"] == result.command_id for e in outputs)
    streams = {e["data"]["stream"] for e in outputs}
    assert streams == {"stdout", "stderr"}
    truncated = next(e for e in events if e["type"] == "command.output_truncated")
    kept = sum(len(e["data"]["text"].encode()) for e in outputs if e["data"]["stream"] == "stdout")
    assert kept <= settings.audit_output_bytes
    assert truncated["data"]["dropped_bytes"] == len("out\n") + 300_000 - kept
    finished = next(e for e in events if e["type"] == "command.finished")
    assert finished["data"]["exit_code"] == 3
    assert finished["data"]["timed_out"] is False
    assert finished["data"]["cpu_s"] >= 0 and finished["data"]["peak_memory_bytes"] > 0
    write = next(e for e in events if e["type"] == "file.write")
    assert write["data"]["path"] == "/workspace/src/app.py"
    assert write["data"]["size"] == len("print('hi')\n")
    assert write["data"]["sha256"] == (
        __import__("hashlib").sha256(b"print('hi')\n").hexdigest())
    assert events[-1]["data"]["reason"] == "requested"


def test_expiry_is_recorded(home: str, settings: Settings) -> None:
    sb = Sandbox.create(home=home, timeout=1)
    time.sleep(1.1)
    assert sb.id not in {i.id for i in Sandbox.list(home=home)}
    types = [e["type"] for e in _log_lines(settings, sb.id)]
    assert types[-2:] == ["sandbox.expired", "sandbox.destroyed"]
    assert _log_lines(settings, sb.id)[-1]["data"]["reason"] == "expired"


def test_sdk_and_cli_read_the_same_trail_with_filters(home: str, settings: Settings) -> None:
    with Sandbox.create(home=home) as sb:
        first = sb.commands.run("echo one")
        sb.commands.run("echo two")
        finished = sb.audit.events(types=["command.finished"])
        assert [e.command for e in finished][0] == first.command_id and len(finished) == 2
        assert {e.type for e in sb.audit.events(command=first.command_id)} == {
            "command.started", "command.output", "command.finished"}
        assert sb.audit.events(since=time.time() + 60) == []
        assert {e.type for e in sb.audit.events(types=["file.*"])} == set()
    # After destruction the trail stays readable.
    trail = read_audit(sb.id, home=home, types=["command.*"])
    assert not trail.torn_tail and len(trail.events) == 6
    env = {**os.environ, "CORRAL_HOME": home, "CORRAL_UID_START": str(settings.uid_start)}
    done = subprocess.run([sys.executable, "-m", "corral", "replay", sb.id, "--json",
                           "--type", "command.output"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    texts = [json.loads(line)["data"]["text"] for line in done.stdout.splitlines()]
    assert texts == ["one\n", "two\n"]
    pretty = subprocess.run([sys.executable, "-m", "corral", "replay", sb.id], env=env,
                            capture_output=True, text=True, timeout=60)
    assert pretty.returncode == 0 and "echo one" in pretty.stdout and "exit 0" in pretty.stdout
    bad = subprocess.run([sys.executable, "-m", "corral", "replay", sb.id, "--type", "nope"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown event type" in bad.stderr


def test_replay_follow_tails_a_live_sandbox(home: str, settings: Settings) -> None:
    sb = Sandbox.create(home=home)
    env = {**os.environ, "CORRAL_HOME": home, "CORRAL_UID_START": str(settings.uid_start)}
    follower = subprocess.Popen(
        [sys.executable, "-m", "corral", "replay", sb.id, "--follow", "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        sb.commands.run("echo live")
        sb.kill()
        out, err = follower.communicate(timeout=30)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    types = [json.loads(line)["type"] for line in out.splitlines()]
    assert types[0] == "sandbox.created" and types[-1] == "sandbox.destroyed", err
    assert "command.output" in types


def test_no_registered_secret_reaches_any_file(
    home: str, settings: Settings, secret: str
) -> None:
    """The session prints the secret, writes it to files, passes it in argv, env and context.

    Afterwards every file under the data directory is scanned, except the secrets store itself
    (which must hold the value); the sandbox's own workspace image is gone with the sandbox.
    """
    with Sandbox.create(home=home) as sb:
        sb.commands.run(["echo", secret])
        sb.commands.run(f"echo {secret} > leaked.txt; cat leaked.txt; echo {secret} >&2")
        sb.commands.run("printf '%s' \"$TOKEN\"; echo", envs={"TOKEN": secret},
                        context={"model_input": f"use the token {secret}"})
        # Split across two writes with a pause: two chunks for the pump, one line for the log.
        half = len(secret) // 2
        sb.commands.run(f"printf '{secret[:half]}'; sleep 0.2; printf '{secret[half:]}\\n'")
        sb.files.write("notes.txt", f"the token is {secret}\n")
        assert secret in sb.files.read("notes.txt")
    # grep in another process: opening and closing the store's SQLite files from this process
    # would drop the POSIX locks its open connection holds on them (and invite corruption).
    found = subprocess.run(["grep", "-rlF", "--exclude=secrets.db*", "--", secret, home],
                           capture_output=True, text=True, timeout=60)
    assert found.returncode in (0, 1), found.stderr
    offenders = found.stdout.split()
    assert offenders == []
    text = (settings.home / "audit" / f"{sb.id}.jsonl").read_text()
    assert text.count("[REDACTED]") >= 6
    # Nor can it be put back together from pieces: joined per command and stream, the output a
    # replay shows still lacks it (the split write above is the case this catches).
    joined: dict[tuple[str, str], str] = {}
    for event in read_audit(sb.id, home=home, types=["command.output"]).events:
        key = (event.command or "", event.data["stream"])
        joined[key] = joined.get(key, "") + event.data["text"]
    assert joined and not [k for k, v in joined.items() if secret in v]


def test_credential_shapes_are_redacted(sandbox: Sandbox, settings: Settings) -> None:
    aws = "AKIA" + "ABCDEFGHIJKLMNOP"
    key = "-----BEGIN RSA PRIVATE KEY-----\nMIIEabc\n-----END RSA PRIVATE KEY-----"
    script = (f"echo 'Authorization: Bearer abcdefghijklmnop1234'; echo {aws}; "
              f"echo 'password=hunter2 user=bob'; printf '%s\\n' '{key}'")
    sandbox.commands.run(script)
    text = (settings.home / "audit" / f"{sandbox.id}.jsonl").read_text()
    for leaked in ("abcdefghijklmnop1234", aws, "hunter2", "MIIEabc"):
        assert leaked not in text
    assert "user=bob" in text  # only the credential is cut, not the line


def test_sigkill_during_a_long_command_leaves_a_readable_complete_log(
    settings: Settings, manager: Manager
) -> None:
    env = {**os.environ, "CORRAL_HOME": str(settings.home),
           "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        from corral import Sandbox
        sb = Sandbox.create()
        for i in range(3):
            sb.commands.run(f"echo done {i}")
        print(sb.id, flush=True)
        sb.commands.run("for i in $(seq 1 600); do echo tick $i; sleep 0.05; done", timeout=60)
    """)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    sandbox_id = proc.stdout.readline().strip()
    path = settings.home / "audit" / f"{sandbox_id}.jsonl"
    deadline = time.monotonic() + 20
    while path.read_text().count("tick") < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    proc.stderr.close()

    trail = read_audit(sandbox_id, home=str(settings.home))
    assert trail.skipped == 0
    finished = [e for e in trail.events if e.type == "command.finished"]
    assert len(finished) == 3 and all(e.data["exit_code"] == 0 for e in finished)
    started = [e for e in trail.events if e.type == "command.started"]
    assert len(started) == 4  # the killed one is there, unfinished
    ticks = [e for e in trail.events
             if e.type == "command.output" and e.command == started[-1].command]
    assert ticks and "tick 1" in ticks[0].data["text"]
    outputs = [e for e in trail.events if e.type == "command.output"]
    assert [e.data["text"] for e in outputs[:3]] == ["done 0\n", "done 1\n", "done 2\n"]

    # Simulate the one thing a crash can do to the file: tear the line being written.
    with open(path, "ab") as f:
        f.write(b'{"v":1,"seq":99999,"ts":1.0,"sand')
    torn = read_audit(sandbox_id, home=str(settings.home))
    assert torn.torn_tail and len(torn.events) == len(trail.events)
    # The next writer cuts the torn tail, says so, and the numbering goes on without a gap.
    sb = Sandbox.connect(sandbox_id, home=str(settings.home))
    sb.commands.run("echo after")
    sb.kill()
    healed = read_audit(sandbox_id, home=str(settings.home))
    assert not healed.torn_tail
    assert [e.seq for e in healed.events] == list(range(1, len(healed.events) + 1))
    recovered = [e for e in healed.events if e.type == "audit.recovered"]
    assert len(recovered) == 1 and recovered[0].data["dropped_bytes"] > 0


def test_metrics_parse_and_count_the_session(home: str, manager: Manager) -> None:
    def value(text: str, name: str, **labels: str) -> float:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v
                                                for k, v in labels.items()):
                    return float(sample.value)
        return 0.0

    before = render(manager.store)
    with Sandbox.create(home=home) as sb:
        sb.commands.run("true")
        sb.commands.run("exit 1")
        sb.commands.run("sleep 5", timeout=0.5)
        sb.files.write("a", "b")
    after = render(manager.store)
    families = {f.name for f in text_string_to_metric_families(after)}
    assert {"corral_sandboxes", "corral_commands_started", "corral_commands_finished",
            "corral_command_duration_seconds", "corral_command_cpu_seconds",
            "corral_command_peak_memory_bytes", "corral_reaper_actions"} <= families
    for name, labels, delta in [
        ("corral_commands_started_total", {}, 3),
        ("corral_commands_finished_total", {"outcome": "ok"}, 1),
        ("corral_commands_finished_total", {"outcome": "error"}, 1),
        ("corral_commands_finished_total", {"outcome": "timeout"}, 1),
        ("corral_command_duration_seconds_count", {}, 3),
        ("corral_sandboxes_created_total", {}, 1),
        ("corral_sandboxes_destroyed_total", {"reason": "requested"}, 1),
        ("corral_file_operations_total", {"op": "write"}, 1),
    ]:
        assert value(after, name, **labels) - value(before, name, **labels) == delta, name
    assert value(after, "corral_command_duration_seconds_bucket", le="+Inf") == value(
        after, "corral_command_duration_seconds_count")


def test_counts_made_in_another_process_reach_corral_metrics(settings: Settings,
                                                            manager: Manager) -> None:
    """Counters are batched in memory (no SQLite write per command); a process that exits
    without closing anything still adds its counts, and the service's reader sees them."""

    def started(text: str) -> float:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "corral_commands_started_total":
                    return float(sample.value)
        return 0.0

    before = started(render(manager.store))
    env = {**os.environ, "CORRAL_HOME": str(settings.home),
           "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    code = textwrap.dedent("""
        from corral import Sandbox
        sb = Sandbox.create()
        sb.commands.run("true")
        sb.commands.run("true")
        sb.kill()
    """)  # and exit: no close(), as a script or a CLI call ends
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert started(render(manager.store)) - before == 2


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=PrivateIds())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


def test_spans_per_command_with_child_work(sandbox: Sandbox, spans: InMemorySpanExporter) -> None:
    spans.clear()
    result = sandbox.commands.run("exit 4")
    finished = spans.get_finished_spans()
    root = next(s for s in finished if s.name == "corral.command")
    assert root.parent is None
    assert root.attributes is not None
    assert root.attributes["corral.sandbox.id"] == sandbox.id
    assert root.attributes["corral.command.id"] == result.command_id
    assert root.attributes["corral.tier"] == "small"
    assert root.attributes["corral.outcome"] == "error"
    assert root.attributes["corral.exit_code"] == 4
    children = {s.name: s for s in finished if s.parent is not None}
    assert {"corral.process.start", "corral.process.run", "corral.process.reap",
            "corral.audit.commit"} <= set(children)
    for child in children.values():
        assert child.parent is not None
        assert child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id
