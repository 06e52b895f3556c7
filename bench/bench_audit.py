"""Cost of auditing: the same commands with the audit trail (and metrics) on and off.

Run as root::

    .venv/bin/python bench/bench_audit.py [--runs N] [--flood-runs M] [--out FILE]

Two data directories are set up side by side in one process, one with ``audit=True`` and one with
``audit=False``, each with one sandbox. Every round runs each series once in a shuffled order:

* ``short_*``: ``commands.run(["true"])`` — the per-command overhead (event writes, the fdatasync
  at the end of the command, the metrics transaction).
* ``flood_*``: a command printing 100 MB of text lines (``yes | head -c 100000000``) — the cost of
  streaming output through the recorder (line buffering, redaction, the per-stream cap).

Prints one JSON document (progress on stderr) with p50/p95 and the added p50 in percent.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import emit_report, log, machine_info, summarize, teardown  # noqa: E402

from corral import Sandbox  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

UID_START = 2_060_000_000
FLOOD = "yes 'a line of agent output, sixty-odd bytes long, repeated......' | head -c 100000000"
WARMUP = 5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="short commands per setting")
    parser.add_argument("--flood-runs", type=int, default=10, help="100 MB floods per setting")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        log("bench_audit: run as root")
        return 2
    load_start = os.getloadavg()[0]
    settings = {
        "on": Settings(home=Path(tempfile.mkdtemp(prefix="corral-bench-audit-on-")),
                       uid_start=UID_START, uid_count=100, audit=True),
        "off": Settings(home=Path(tempfile.mkdtemp(prefix="corral-bench-audit-off-")),
                        uid_start=UID_START + 100, uid_count=100, audit=False),
    }
    samples: dict[str, list[float]] = {f"{kind}_{mode}": [] for kind in ("short", "flood")
                                       for mode in settings}
    leftover: list[str] = []
    try:
        sandboxes = {mode: Sandbox.create(home=str(s.home), resources="large")
                     for mode, s in settings.items()}
        for sb in sandboxes.values():
            for _ in range(WARMUP):
                sb.commands.run(["true"])

        def short(mode: str) -> float:
            start = time.perf_counter()
            result = sandboxes[mode].commands.run(["true"])
            elapsed = time.perf_counter() - start
            assert result.exit_code == 0, result.stderr
            return elapsed

        def flood(mode: str) -> float:
            start = time.perf_counter()
            result = sandboxes[mode].commands.run(FLOOD, timeout=300)
            elapsed = time.perf_counter() - start
            assert result.exit_code == 0 and result.stdout_truncated > 0, result.stderr
            return elapsed

        for round_no in range(args.runs):
            jobs = [("short", m) for m in settings]
            if round_no < args.flood_runs:
                jobs += [("flood", m) for m in settings]
            random.shuffle(jobs)
            for kind, mode in jobs:
                samples[f"{kind}_{mode}"].append(short(mode) if kind == "short" else flood(mode))
            if round_no % 50 == 0:
                log(f"round {round_no}/{args.runs}")
        audit_file = settings["on"].home / "audit" / f"{sandboxes['on'].id}.jsonl"
        audit_bytes = audit_file.stat().st_size
        backend = manager_mod.get_manager(settings["on"]).backend
        cgroups = backend.cgroups.describe()  # type: ignore[attr-defined]
    finally:
        for s in settings.values():
            leftover += teardown(s)
    results = {name: summarize(values) for name, values in samples.items()}

    def added(kind: str) -> float:
        on, off = results[f"{kind}_on"]["p50_ms"], results[f"{kind}_off"]["p50_ms"]
        return round((on - off) / off * 100, 2)

    report: dict[str, Any] = {
        "benchmark": "cost of auditing (audit trail + metrics on vs off)",
        "runs": {"short": args.runs, "flood": args.flood_runs},
        "results": results,
        "added_p50_percent": {"short": added("short"), "flood_100MB": added("flood")},
        "targets": {"short_added_p50_under_10_percent": added("short") < 10.0},
        "audit_log_bytes_after_run": audit_bytes,
        "machine": machine_info("bwrap", cgroups, load_start),
        "cleanup": {"ok": not leftover, "leftovers": leftover},
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
