"""The audit layer needs nothing of the control plane: it is given small sources and a sink.
These run without root, with in-memory stand-ins for the store and the secret store."""

from __future__ import annotations

import ast
import json
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from corral._audit.auditor import Auditor
from corral._audit.metrics import Metrics, render
from corral._control.counters import CounterBuffer

SRC = Path(__file__).resolve().parents[2] / "src" / "corral"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved against its package."""
    package = ".".join(path.relative_to(SRC.parent).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            found.add(".".join(p for p in (base, node.module or "") if p))
    return found


def test_the_audit_layer_imports_nothing_of_the_control_plane() -> None:
    for path in sorted((SRC / "_audit").glob("*.py")):
        upward = {m for m in _imports(path) if m.startswith(("corral._control", "corral._server",
                                                             "corral._sdk"))}
        assert not upward, f"{path.name} imports {upward}"


class _Sink:
    def __init__(self) -> None:
        self.writes: list[list[tuple[str, str, float]]] = []
        self.totals: dict[tuple[str, str], float] = {}

    def add_counters(self, rows: Sequence[tuple[str, str, float]]) -> None:
        self.writes.append(list(rows))
        for name, labels, value in rows:
            self.totals[(name, labels)] = self.totals.get((name, labels), 0.0) + value


class _Secrets:
    def values(self) -> Iterable[str]:
        return ["s3cr3t-value"]


class _Placeholders:
    def placeholders(self, sandbox_id: str) -> Iterable[str]:
        return ["CORRAL_PLACEHOLDER_abc"] if sandbox_id == "sbx_000000000001" else []


def test_the_auditor_redacts_with_what_it_is_given(tmp_path: Path) -> None:
    auditor = Auditor(directory=tmp_path, secrets=_Secrets(), placeholders=_Placeholders(),
                      counters=_Sink(), enabled=True, output_limit_bytes=1024)
    auditor.event("sbx_000000000001", "note", {"text": "s3cr3t-value CORRAL_PLACEHOLDER_abc"})
    auditor.close()
    line = json.loads((tmp_path / "sbx_000000000001.jsonl").read_text().splitlines()[0])
    assert "s3cr3t-value" not in json.dumps(line)
    assert "CORRAL_PLACEHOLDER_abc" not in json.dumps(line)


def test_counting_a_command_writes_nothing_until_the_buffer_flushes() -> None:
    sink = _Sink()
    buffer = CounterBuffer(sink.add_counters, flush_after_s=3600)
    metrics = Metrics(buffer)
    for _ in range(100):
        metrics.inc("corral_commands_started")
        metrics.command_finished(outcome="ok", duration_s=0.01, cpu_s=0.001,
                                 peak_memory_bytes=1 << 20)
    assert sink.writes == []  # the hot path did no write at all
    buffer.flush()
    assert len(sink.writes) == 1  # one transaction for everything pending
    assert sink.totals[("corral_commands_started", "{}")] == 100
    assert sink.totals[("corral_commands_finished", '{"outcome": "ok"}')] == 100
    buffer.flush()
    assert len(sink.writes) == 1  # nothing pending, nothing written


def test_pending_counts_reach_the_sink_on_their_own_within_the_interval() -> None:
    sink = _Sink()
    flushed = threading.Event()

    def write(rows: Sequence[tuple[str, str, float]]) -> None:
        sink.add_counters(rows)
        flushed.set()

    buffer = CounterBuffer(write, flush_after_s=0.05)
    buffer.add([("corral_sandboxes_created", "{}", 1.0)])
    assert flushed.wait(5), "an idle process must still publish its counts"
    assert sink.totals == {("corral_sandboxes_created", "{}"): 1.0}
    buffer.close()


def test_close_flushes_and_later_counts_are_written_directly() -> None:
    sink = _Sink()
    buffer = CounterBuffer(sink.add_counters, flush_after_s=3600)
    buffer.add([("corral_sandboxes_created", "{}", 2.0)])
    buffer.close()
    assert sink.totals == {("corral_sandboxes_created", "{}"): 2.0}
    buffer.add([("corral_sandboxes_created", "{}", 1.0)])
    assert sink.totals == {("corral_sandboxes_created", "{}"): 3.0}


class _Source:
    def __init__(self, sink: _Sink) -> None:
        self._sink = sink

    def counters(self) -> dict[tuple[str, str], float]:
        return dict(self._sink.totals)

    def state_counts(self) -> dict[str, int]:
        return {"running": 2}


def test_render_reads_a_source_not_a_store() -> None:
    sink = _Sink()
    Metrics(sink).inc("corral_sandboxes_destroyed", labels={"reason": "requested"})
    text = render(_Source(sink))
    assert 'corral_sandboxes_destroyed_total{reason="requested"} 1.0' in text
    assert 'corral_sandboxes{state="running"} 2.0' in text
