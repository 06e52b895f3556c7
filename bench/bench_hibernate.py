"""Sleep and wake (issue 40): what a frozen sandbox holds, and how fast a call wakes it.

Run as root::

    .venv/bin/python bench/bench_hibernate.py [--runs N] [--isolation namespace|gvisor]
                                              [--density N] [--out FILE]

Through the embedded SDK, on one tier, interleaved in shuffled rounds, after warm-ups:

- ``wake_to_first_command``: a sandbox with ``lifecycle={"on_timeout": "pause",
  "auto_resume": True}``, paused, then ``commands.run(["true"])``: the call resumes it and runs
  (the frozen state's wake). Target p50 <= 10 ms on the namespace tier.
- ``command`` (reference): ``commands.run(["true"])`` in a running sandbox.
- ``create_and_first_command`` (reference): ``Sandbox.create()`` then its first command.
- ``pause`` and ``resume``: the explicit calls, timed apart.

``density``: N sandboxes created and paused, then per sandbox: the host's ``MemAvailable`` drop
(and ``Slab`` growth), processes, mounts, loop devices and network namespaces still held. A
frozen sandbox keeps all of them (that is what hibernation, still to come, removes); the figures
say how much that is. Prints one JSON document; everything made is removed and checked.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import emit_report, log, summarize, teardown  # noqa: E402

from corral import Lifecycle, Sandbox  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

# Apart from the other benches (2_050_... to 2_090_...) and the tests (2_100_... and up).
UID_START = 2_093_000_000
UID_COUNT = 2_000
WARMUP = 3
SLEEPY = Lifecycle(on_timeout="pause", auto_resume=True)


def _meminfo() -> dict[str, int]:
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            values[name] = int(rest.split()[0]) * 1024
    return values


def _kernel_objects() -> dict[str, int]:
    """Host-wide counts of what sandboxes hold: mounts, loop devices, network namespaces."""
    with open("/proc/self/mountinfo") as f:
        mounts = sum(1 for _ in f)
    loops = sum(1 for d in Path("/sys/block").iterdir() if d.name.startswith("loop")
                and (d / "loop" / "backing_file").exists())
    netns = len({os.readlink(f"/proc/{p}/ns/net") for p in os.listdir("/proc")
                 if p.isdigit() and os.path.exists(f"/proc/{p}/ns/net")
                 and _readable_link(f"/proc/{p}/ns/net")})
    processes = sum(1 for p in os.listdir("/proc") if p.isdigit())
    return {"mounts": mounts, "loop_devices": loops, "network_namespaces_with_a_process": netns,
            "processes": processes}


def _readable_link(path: str) -> bool:
    try:
        os.readlink(path)
    except OSError:
        return False
    return True


def _series(home: Path, isolation: str, runs: int, seed: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in (
        "wake_to_first_command", "command", "create_and_first_command", "pause", "resume")}
    running = Sandbox.create(home=str(home), isolation=isolation)
    sleepy = Sandbox.create(home=str(home), isolation=isolation, lifecycle=SLEEPY)
    rng = random.Random(seed)

    def wake() -> None:
        sleepy.pause()
        began = time.perf_counter()
        result = sleepy.commands.run(["true"])
        samples["wake_to_first_command"].append(time.perf_counter() - began)
        assert result.exit_code == 0

    def command() -> None:
        began = time.perf_counter()
        assert running.commands.run(["true"]).exit_code == 0
        samples["command"].append(time.perf_counter() - began)

    def create() -> None:
        began = time.perf_counter()
        sb = Sandbox.create(home=str(home), isolation=isolation)
        assert sb.commands.run(["true"]).exit_code == 0
        samples["create_and_first_command"].append(time.perf_counter() - began)
        sb.kill()

    def pause_resume() -> None:
        began = time.perf_counter()
        sleepy.pause()
        samples["pause"].append(time.perf_counter() - began)
        began = time.perf_counter()
        sleepy.resume()
        samples["resume"].append(time.perf_counter() - began)

    steps = [wake, command, create, pause_resume]
    try:
        for _ in range(WARMUP):
            for fn in steps:
                fn()
        for values in samples.values():
            values.clear()
        for round_no in range(runs):
            rng.shuffle(steps)
            for fn in steps:
                fn()
            if (round_no + 1) % 20 == 0:
                log(f"round {round_no + 1}/{runs}")
    finally:
        running.kill()
        sleepy.kill()
    return samples


def _density(home: Path, isolation: str, count: int) -> dict[str, Any]:
    if count <= 0:
        return {"skipped": True}
    gc.collect()
    mem_before, objects_before = _meminfo(), _kernel_objects()
    made = []
    try:
        for _ in range(count):
            sb = Sandbox.create(home=str(home), isolation=isolation, lifecycle=SLEEPY)
            sb.pause()
            made.append(sb)
        time.sleep(1.0)  # let the kernel's counters settle
        mem_after, objects_after = _meminfo(), _kernel_objects()
    finally:
        for sb in made:
            sb.kill()
    per = {name: round((objects_after[name] - objects_before[name]) / count, 2)
           for name in objects_before}
    return {
        "sandboxes": count,
        "per_sandbox": {
            "mem_available_drop_kib": round(
                (mem_before["MemAvailable"] - mem_after["MemAvailable"]) / count / 1024, 1),
            "slab_growth_kib": round((mem_after["Slab"] - mem_before["Slab"]) / count / 1024, 1),
            **per,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="rounds (each series once each)")
    parser.add_argument("--isolation", default="namespace", choices=["namespace", "gvisor"])
    parser.add_argument("--density", type=int, default=100, help="paused sandboxes (0: skip)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the order shuffle")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = parser.parse_args()
    if os.geteuid() != 0:
        log("bench_hibernate: run as root (sandboxes need namespaces, cgroups and mounts)")
        return 2
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    home = Path(tempfile.mkdtemp(prefix="corral-bench-sleep-"))
    settings = Settings(home=home, uid_start=UID_START, uid_count=UID_COUNT)
    manager_mod.get_manager(settings)  # registered first: Sandbox.create(home=) finds it
    started = time.time()
    load_start = os.getloadavg()[0]
    try:
        samples = _series(home, args.isolation, args.runs, seed)
        density = _density(home, args.isolation, args.density)
    finally:
        left = teardown(settings)
    results = {name: summarize(values) for name, values in samples.items()}
    wake = results["wake_to_first_command"]["p50_ms"]
    report = {
        "benchmark": "sleep and wake: a frozen sandbox's wake, beside a command and a create",
        "isolation": args.isolation,
        "runs": args.runs,
        "seed": seed,
        "load_average_start": load_start,
        "duration_s": round(time.time() - started, 1),
        "results": results,
        "ratios": {
            "wake_p50_over_command_p50": round(wake / results["command"]["p50_ms"], 2),
            "wake_p50_over_create_and_first_command_p50": round(
                wake / results["create_and_first_command"]["p50_ms"], 3),
        },
        "targets": {"frozen_wake_p50_at_most_10ms": wake <= 10.0},
        "density": density,
        "cleanup": {"ok": not left, "leftovers": left},
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
