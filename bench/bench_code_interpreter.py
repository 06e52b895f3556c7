"""The code interpreter: a warm cell, and create → first cell with the kernel started on demand,
beside a bare ``python3 -c`` run as a command in the same sandbox (the reference).

Run as root::

    .venv/bin/python bench/bench_code_interpreter.py [--runs N] [--out FILE] [--url URL]

Series (embedded, or through ``corral serve`` with ``--url``; base template, IPython from the
host's Debian packages):

* ``run_code_warm``: ``sb.run_code("1+1")`` on a context whose kernel is running.
* ``create_to_first_run_code``: ``Sandbox.create()`` then ``sb.run_code("1+1")`` (the kernel
  starts on demand: IPython's import is most of it); the sandbox is killed outside the timing.
* ``kernel_start``: the same first cell alone, the sandbox already created.
* reference ``python3_c``: ``sb.commands.run(["python3", "-c", "1+1"])`` in a warm sandbox —
  what a cell costs without a kernel (a fresh interpreter per cell, no state).
* reference ``commands_true``: ``sb.commands.run(["true"])``, the command floor.

Targets (issue 13): ``run_code_warm`` p50 ≤ 20 ms; ``create_to_first_run_code`` p50 ≤ 500 ms.
Prints one JSON document (progress on stderr).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import emit_report, log, summarize, teardown  # noqa: E402

from corral import Sandbox  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

UID_START = 2_075_000_000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="warm samples per series")
    parser.add_argument("--cold", type=int, default=10, help="create → first cell samples")
    parser.add_argument("--url", help="a corral serve to use instead of embedded")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    settings = Settings(home=Path(tempfile.mkdtemp(prefix="corral-bench-code-")),
                        uid_start=UID_START, uid_count=1000)
    manager_mod.get_manager(settings)
    where: dict[str, Any] = {"url": args.url} if args.url else {"home": str(settings.home)}
    samples: dict[str, list[float]] = {k: [] for k in (
        "run_code_warm", "python3_c", "commands_true", "create_to_first_run_code",
        "kernel_start")}
    leftover: list[str] = []
    try:
        log(f"warm: {args.runs} runs per series")
        with Sandbox.create(**where) as sb:
            sb.run_code("1+1")
            for _ in range(5):
                sb.commands.run(["true"])
                sb.commands.run(["python3", "-c", "1+1"])
            for _ in range(args.runs):
                for name, call in (
                        ("run_code_warm", lambda: sb.run_code("1+1")),
                        ("python3_c", lambda: sb.commands.run(["python3", "-c", "1+1"])),
                        ("commands_true", lambda: sb.commands.run(["true"]))):
                    start = time.perf_counter()
                    call()
                    samples[name].append(time.perf_counter() - start)
        log(f"cold: {args.cold} sandboxes")
        for _ in range(args.cold):
            start = time.perf_counter()
            sb = Sandbox.create(**where)
            created = time.perf_counter()
            result = sb.run_code("1+1")
            done = time.perf_counter()
            sb.kill()
            sb.close()
            assert result.text == "2", result
            samples["create_to_first_run_code"].append(done - start)
            samples["kernel_start"].append(done - created)
    finally:
        leftover += teardown(settings)
    results = {name: summarize(values) for name, values in samples.items()}
    warm = results["run_code_warm"]["p50_ms"]
    cold = results["create_to_first_run_code"]["p50_ms"]
    report = {
        "benchmark": "code_interpreter",
        "transport": "remote" if args.url else "embedded",
        "results": results,
        "ratios": {"run_code_warm_vs_python3_c": round(warm / results["python3_c"]["p50_ms"], 3)},
        "targets": {"run_code_warm_p50_le_20ms": warm <= 20.0,
                    "create_to_first_run_code_p50_le_500ms": cold <= 500.0},
        "cleanup": {"ok": not leftover, "leftovers": leftover},
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
