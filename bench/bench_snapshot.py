"""Snapshot, fork and restore time against workspace size, beside ``cp -a`` of the same tree.

Run as root::

    .venv/bin/python bench/bench_snapshot.py [--runs N] [--sizes 1,100,1000] [--out FILE]

For each size (MB) one ``large``-tier sandbox gets a tree of that size (100 files of size/100
MB, in 10 directories, written from /dev/urandom inside the sandbox). Then, per run:

* ``snapshot``: change one small file, then ``sb.snapshot()`` (seal the writable layer).
* ``fork``: ``sb.fork(1)`` — a seal plus a new sandbox on the shared layers — timed until the
  child exists; the child is destroyed outside the timing.
* ``restore``: ``sb.restore(first_snapshot)``.
* ``fork_first_command``: the fork plus the child's first command (``true``).
* ``snapshot_after_fresh_write``: ``head -c 300M /dev/urandom > blob`` (not timed), then
  ``sb.snapshot()`` at once, while the 300 MB are still dirty in memory (fewer runs: each
  writes 300 MB to disk).
* reference ``cp_a``: ``cp -a`` of the workspace's tree to a fresh directory on the same host
  disk (what a copy-based snapshot costs), page cache warm, ``sync`` excluded.

Target (issue 6): snapshot and fork flat in size and at most 20 ms p50. Prints one JSON
document (progress on stderr).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
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

UID_START = 2_070_000_000
FRESH_WRITE_MB = 300
FRESH_WRITE_RUNS = 5


def populate(sb: Sandbox, size_mb: int) -> None:
    per_file_kb = max(1, size_mb * 1024 // 100)
    script = (f"for d in $(seq 10); do mkdir -p d$d; for f in $(seq 10); do "
              f"head -c {per_file_kb}K /dev/urandom > d$d/f$f; done; done; sync")
    r = sb.commands.run(script, timeout=600)
    if r.exit_code != 0:
        raise RuntimeError(f"populating {size_mb} MB failed: {r.stderr}")


def used_bytes(sb: Sandbox) -> int:
    r = sb.commands.run("du -sb /workspace | cut -f1")
    return int(r.stdout.strip())


def bench_size(home: str, size_mb: int, runs: int) -> dict[str, Any]:
    sb = Sandbox.create(home=home, resources="large")
    try:
        log(f"  populating {size_mb} MB")
        populate(sb, size_mb)
        first = sb.snapshot()
        samples: dict[str, list[float]] = {
            "snapshot": [], "fork": [], "fork_first_command": [], "restore": [], "cp_a": [],
            "snapshot_after_fresh_write": []}
        workspace = Path(home) / "sandboxes" / sb.id / "workspace"
        for i in range(runs):
            sb.commands.run(f"echo {i} > counter")
            time.sleep(0.05)  # let the spare image refill, as between an agent's steps
            start = time.perf_counter()
            sb.snapshot()
            samples["snapshot"].append(time.perf_counter() - start)

            time.sleep(0.05)
            start = time.perf_counter()
            (child,) = sb.fork(1)
            samples["fork"].append(time.perf_counter() - start)
            r = child.commands.run(["true"])
            samples["fork_first_command"].append(time.perf_counter() - start)
            if r.exit_code != 0:
                raise RuntimeError(f"first command in a fork failed: {r.stderr}")
            child.kill()

            time.sleep(0.05)
            start = time.perf_counter()
            sb.restore(first)
            samples["restore"].append(time.perf_counter() - start)

            if i < 3:  # the copy is the slow reference; three runs say enough
                target = Path(tempfile.mkdtemp(prefix="corral-bench-cp-", dir=home))
                start = time.perf_counter()
                subprocess.run(["cp", "-a", f"{workspace}/.", str(target)], check=True)
                samples["cp_a"].append(time.perf_counter() - start)
                shutil.rmtree(target)

            if i < FRESH_WRITE_RUNS:
                sb.commands.run(f"rm -f fresh; head -c {FRESH_WRITE_MB}M /dev/urandom > fresh",
                                timeout=300)
                start = time.perf_counter()
                sb.snapshot()
                samples["snapshot_after_fresh_write"].append(time.perf_counter() - start)
        return {"size_mb": size_mb, "bytes_in_workspace": used_bytes(sb),
                **{name: summarize(values) for name, values in samples.items()}}
    finally:
        sb.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="measured runs per size")
    parser.add_argument("--sizes", default="1,100,1000", help="workspace sizes in MB")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    settings = Settings(home=Path(tempfile.mkdtemp(prefix="corral-bench-snap-")),
                        uid_start=UID_START, uid_count=1000)
    manager_mod.get_manager(settings)
    results = []
    leftover: list[str] = []
    try:
        for size in sizes:
            log(f"size {size} MB")
            results.append(bench_size(str(settings.home), size, args.runs))
    finally:
        leftover += teardown(settings)
    worst = {k: max(r[k]["p50_ms"] for r in results)
             for k in ("snapshot", "fork", "snapshot_after_fresh_write")}
    report = {
        "benchmark": "snapshot",
        "results": results,
        "target": {"p50_ms_max": 20.0, "worst_p50_ms": worst,
                   "met": all(v <= 20.0 for v in worst.values())},
        "cleanup": {"ok": not leftover, "leftovers": leftover},
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
