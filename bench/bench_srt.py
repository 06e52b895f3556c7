"""A command in a Corral sandbox against the same command under Anthropic's sandbox-runtime.

Run as root, after installing the pinned srt (and the tools it needs on Linux)::

    npm ci --prefix bench/srt && apt-get install ripgrep socat
    .venv/bin/python bench/bench_srt.py [--runs 30] [--out F]

Each round runs, in a shuffled order: ``srt true`` (sandbox-runtime's CLI, which builds its
bwrap sandbox and proxies per invocation: what an agent harness using it pays per command),
``sb.commands.run(["true"])`` in one Corral sandbox that already exists, and bare
``bwrap --unshare-all true`` as the floor. Reported: p50/p95/mean of each and the ratio of
srt's p50 to Corral's (the issue's target: at least 50x). srt is not started as a service
here: its CLI is its interface. As root, srt's bwrap is no sandbox (Corral's commands run as
their own unprivileged uid); the timing is the same path either way.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import DEFAULT_UID_START, emit_report, summarize, teardown, timed  # noqa: E402

from corral import Sandbox  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

SRT = Path(__file__).resolve().parent / "srt" / "node_modules" / ".bin" / "srt"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        log("bench_srt: run as root")
        return 2
    missing = [what for what, ok in (
        (f"srt ({SRT}: npm ci --prefix bench/srt)", SRT.exists()),
        ("ripgrep (apt-get install ripgrep)", shutil.which("rg") is not None),
        ("socat (apt-get install socat)", shutil.which("socat") is not None),
        ("bwrap", shutil.which("bwrap") is not None)) if not ok]
    if missing:
        log("bench_srt: missing " + "; ".join(missing))
        return 2
    bwrap = shutil.which("bwrap")
    assert bwrap is not None
    work = Path(tempfile.mkdtemp(prefix="corral-bench-srt-"))
    work.chmod(0o711)  # the sandboxes' own uids reach Corral's data directory inside
    # srt reads its settings from this file: no network, the defaults for the rest.
    srt_settings = work / "srt-settings.json"
    srt_settings.write_text(json.dumps({"network": {"allowedDomains": [], "deniedDomains": []},
                                        "filesystem": {"denyRead": [], "allowWrite": [],
                                                       "denyWrite": []}}))
    home = work / "corral"
    settings = Settings(home=home, uid_start=int(os.environ.get(
        "CORRAL_UID_START", DEFAULT_UID_START)), uid_count=100)
    manager_mod.get_manager(settings)
    samples: dict[str, list[float]] = {"srt_true": [], "sandbox_command": [], "bwrap_true": []}
    failures: dict[str, str] = {}
    try:
        sandbox = Sandbox.create(home=str(home))
        srt_argv = [str(SRT), "--settings", str(srt_settings), "true"]
        bare = [bwrap, "--unshare-all", "--ro-bind", "/", "/", "--dev", "/dev", "--proc",
                "/proc", "true"]

        def run_srt() -> None:
            done = subprocess.run(srt_argv, capture_output=True, text=True, timeout=60,
                                  cwd=work)
            if done.returncode != 0:
                raise RuntimeError(f"srt exited {done.returncode}: {done.stderr.strip()[:300]}")

        def run_corral() -> None:
            if sandbox.commands.run(["true"]).exit_code != 0:
                raise RuntimeError("`true` failed in the sandbox")

        def run_bwrap() -> None:
            subprocess.run(bare, check=True, capture_output=True, timeout=30)

        series = {"srt_true": run_srt, "sandbox_command": run_corral, "bwrap_true": run_bwrap}
        for _ in range(3):  # warm-up: node's and the page cache's first runs
            for fn in series.values():
                fn()
        order = list(series)
        for round_ in range(args.runs):
            random.shuffle(order)
            for name in order:
                try:
                    samples[name].append(timed(series[name]))
                except Exception as exc:  # reported, not fatal: the others still compare
                    failures[name] = f"{type(exc).__name__}: {exc}"[:300]
            if round_ % 10 == 9:
                log(f"bench_srt: {round_ + 1}/{args.runs} rounds")
        sandbox.kill()
    finally:
        left = teardown(settings)
        shutil.rmtree(work, ignore_errors=True)
    results = {name: summarize(values) for name, values in samples.items() if values}
    ratio = None
    if "srt_true" in results and "sandbox_command" in results:
        ratio = round(results["srt_true"]["p50_ms"] / results["sandbox_command"]["p50_ms"], 1)
    report = {
        "benchmark": "a command: Corral vs Anthropic sandbox-runtime (srt) vs bare bwrap",
        "runs": args.runs,
        "srt_version": json.loads((SRT.parent.parent / "@anthropic-ai" / "sandbox-runtime"
                                   / "package.json").read_text())["version"],
        "results": results,
        "ratios": {"srt_p50_over_sandbox_command_p50": ratio},
        "targets": {"srt_at_least_50x": ratio is not None and ratio >= 50},
        "failures": failures,
        "cleanup": {"ok": not left, "leftovers": left},
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
