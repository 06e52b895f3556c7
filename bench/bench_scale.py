"""Snapshots and sandboxes at scale: many snapshots of one sandbox, many sandboxes beside
them, what the snapshots hold of the kernel, and what recovery costs on that data directory.

Run as root::

    .venv/bin/python bench/bench_scale.py [--snapshots 10000] [--sandboxes 1000] [--out FILE]

Phases, in one temporary data directory (its own uid range):

1. ``snapshot``: one sandbox; ``--snapshots`` times, write a small file (a line appended to a
   log, a file of its own) and ``sb.snapshot()``; each snapshot is timed (every
   ``MAX_LAYERS``-th one squashes the chain: a copy of the workspace). Every 500 snapshots the
   layer mounts and loop devices held are counted (``held_max``).
2. ``stored``: the sandbox destroyed, what the snapshots hold (issue 36's target: no loop
   device, no mount), and ``create_from_snapshot``: a sandbox made from the first, a middle
   and the last snapshot, timed until its first command has read its file back (checked).
3. ``sandboxes``: ``--sandboxes`` sandboxes created (long lifetimes, nothing running).
4. ``recovery``: each sample a new process, timed from spawn to exit: ``corral ls --json`` (the
   recovery every process runs before its first use, then the list) and ``corral reap``
   (recovery of every tier, the reaper's pass) on this data directory, beside ``corral ls
   --json`` on an empty one (the reference, measured in the same rounds).

JSON on stdout, progress on stderr. At the end every sandbox and snapshot is destroyed and
the bench checks that nothing is left behind.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cli import timed_process  # noqa: E402
from bench_sandbox import emit_report, log, summarize, teardown  # noqa: E402

from corral import Sandbox  # noqa: E402
from corral._backends._linux.storage import MAX_LAYERS  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

UID_START = 2_074_000_000  # apart from the other benches' and the tests' ranges
SRC = Path(__file__).resolve().parent.parent / "src"


def held(home: Path) -> dict[str, int]:
    """Layer mounts and loop devices of the data directory now."""
    root = str(home.resolve())
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split(" ")[4] for line in f]
    loops = 0
    for device in Path("/sys/block").glob("loop*"):
        try:
            if (device / "loop" / "backing_file").read_text().startswith(root + "/"):
                loops += 1
        except OSError:
            continue
    return {"layer_mounts": sum(m.startswith(f"{root}/layers/") for m in mounts),
            "loop_devices": loops}


def disk_used(path: Path) -> int:
    out = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def snapshots_phase(home: str, count: int) -> tuple[dict[str, Any], list[str]]:
    sb = Sandbox.create(home=home, timeout=24 * 3600)
    times: list[float] = []
    held_max = {"layer_mounts": 0, "loop_devices": 0}
    ids: list[str] = []
    try:
        for i in range(count):
            sb.files.write(f"f/{i % 100}/file{i}", f"{i}\n".encode())
            start = time.perf_counter()
            ids.append(sb.snapshot().id)
            times.append(time.perf_counter() - start)
            if i % 500 == 499 or i == count - 1:
                now = held(Path(home))
                held_max = {k: max(v, now[k]) for k, v in held_max.items()}
                log(f"  {i + 1} snapshots, p50 so far {sorted(times)[len(times) // 2] * 1e3:.1f}"
                    f" ms, held now {now}")
    finally:
        sb.kill()
    return {"count": count, "snapshot": summarize(times), "held_max_while_live": held_max,
            "max_layers": MAX_LAYERS}, ids


def stored_phase(home: str, manager: Any, ids: list[str]) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the destroyed sandbox's teardown ends behind it
        manager.layers.release_idle()
        now = held(Path(home))
        if not any(now.values()):
            break
        time.sleep(0.1)
    result: dict[str, Any] = {"held_after_destroy": held(Path(home)),
                              "layers_bytes_on_disk": disk_used(Path(home) / "layers"),
                              "create_from_snapshot": []}
    for index in sorted({0, len(ids) // 2, len(ids) - 1}):
        start = time.perf_counter()
        sb = Sandbox.create(home=home, snapshot=ids[index])
        try:
            got = sb.files.read(f"f/{index % 100}/file{index}")
            elapsed = time.perf_counter() - start
            ok = got == f"{index}\n"
        finally:
            sb.kill()
        result["create_from_snapshot"].append(
            {"snapshot_index": index, "ms": round(elapsed * 1e3, 1), "content_ok": ok})
    result["held_after_creates"] = held(Path(home))
    return result


def sandboxes_phase(home: str, count: int) -> dict[str, Any]:
    times = []
    for i in range(count):
        start = time.perf_counter()
        Sandbox.create(home=home, timeout=24 * 3600)
        times.append(time.perf_counter() - start)
        if i % 200 == 199:
            log(f"  {i + 1} sandboxes")
    return {"count": count, "create": summarize(times)}


def recovery_phase(settings: Settings, empty: Settings, runs: int) -> dict[str, Any]:
    def env(s: Settings) -> dict[str, str]:
        return {**os.environ, "CORRAL_HOME": str(s.home), "CORRAL_UID_START": str(s.uid_start),
                "CORRAL_UID_COUNT": str(s.uid_count), "PYTHONPATH": str(SRC)}

    series = {
        "ls_full": (["-m", "corral", "ls", "--json"], env(settings)),
        "reap_full": (["-m", "corral", "reap"], env(settings)),
        "ls_empty": (["-m", "corral", "ls", "--json"], env(empty)),
    }
    samples: dict[str, list[float]] = {name: [] for name in series}
    for round_ in range(runs + 1):
        for name, (args, environment) in series.items():
            elapsed, status, err = timed_process(args, environment)
            if status != 0:
                raise RuntimeError(f"{name} failed ({status}): {err}")
            if round_ > 0:  # the first round warms the host checks and the page cache
                samples[name].append(elapsed)
    return {name: summarize(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--snapshots", type=int, default=10_000)
    parser.add_argument("--sandboxes", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5, help="recovery samples per series")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    settings = Settings(home=Path(tempfile.mkdtemp(prefix="corral-bench-scale-")),
                        uid_start=UID_START, uid_count=args.sandboxes + 100)
    empty = Settings(home=Path(tempfile.mkdtemp(prefix="corral-bench-scale-empty-")),
                     uid_start=UID_START + args.sandboxes + 100, uid_count=100)
    manager = manager_mod.get_manager(settings)
    report: dict[str, Any] = {"benchmark": "scale"}
    leftover: list[str] = []
    try:
        log(f"{args.snapshots} snapshots of one sandbox")
        report["snapshots"], ids = snapshots_phase(str(settings.home), args.snapshots)
        log("what the stored snapshots hold")
        report["stored"] = stored_phase(str(settings.home), manager, ids)
        log(f"{args.sandboxes} sandboxes")
        report["sandboxes"] = sandboxes_phase(str(settings.home), args.sandboxes)
        log("recovery")
        report["recovery"] = recovery_phase(settings, empty, args.runs)
    finally:
        log("tearing down")
        leftover += teardown(settings)
        shutil.rmtree(empty.home, ignore_errors=True)
    stored = report.get("stored", {})
    report["target"] = {
        "stored_snapshots_hold_nothing": not any(stored.get("held_after_destroy", {1: 1})
                                                 .values()),
        "create_from_snapshot_ok": all(c["content_ok"]
                                       for c in stored.get("create_from_snapshot", [])),
    }
    report["cleanup"] = {"ok": not leftover, "leftovers": leftover}
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
