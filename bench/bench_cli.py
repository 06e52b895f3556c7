"""Start-up of the ``corral`` command line: ``corral run -- true`` beside bare Python.

Run as root::

    .venv/bin/python bench/bench_cli.py [--runs N] [--against CHECKOUT] [--out FILE]

Each series is a new process, timed from spawn to exit:

- ``python_pass``: ``python -c pass``, the interpreter's own floor;
- ``import_corral``: ``python -c "import corral"``, the package's import;
- ``corral_help``: ``corral --help``, which loads every command to list it;
- ``corral_ls``: ``corral ls --json`` on an empty data directory;
- ``corral_run``: ``corral run -- true``: create a sandbox, run ``true``, destroy it.

With ``--against CHECKOUT`` every ``corral`` series runs a second time with that checkout's
``src`` first on ``PYTHONPATH`` (``..._against``), so a change is measured beside the code it
replaces, on the same machine, in the same run. The interpreter is the one running this script.
Each round runs every series once in a new random order, after warm-up rounds that are not
counted; the JSON goes to stdout, progress to stderr. The bench uses a temporary data directory
and its own uid range, and checks at the end that it left nothing behind.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import emit_report, log, summarize, teardown  # noqa: E402

from corral._settings import Settings  # noqa: E402

DEFAULT_UID_START = 2_060_000_000  # apart from bench_sandbox's and the tests' ranges
UID_COUNT = 1000
WARMUP = 3
SRC = Path(__file__).resolve().parent.parent / "src"

SERIES: dict[str, list[str]] = {
    "python_pass": ["-c", "pass"],
    "import_corral": ["-c", "import corral"],
    "corral_help": ["-m", "corral", "--help"],
    "corral_ls": ["-m", "corral", "ls", "--json"],
    "corral_run": ["-m", "corral", "run", "--", "true"],
}


def timed_process(args: list[str], env: Mapping[str, str]) -> tuple[float, int, str]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=120)
    return time.perf_counter() - started, done.returncode, done.stderr[-500:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="measured runs per series")
    parser.add_argument("--against", type=Path, default=None,
                        help="a checkout (with src/corral) to measure beside this one")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    parser.add_argument("--seed", type=int, default=None, help="seed of the order shuffle")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if os.geteuid() != 0:
        log("bench_cli: run as root (corral run needs namespaces, cgroups and mounts)")
        return 2
    against = args.against.resolve() / "src" if args.against else None
    if against is not None and not (against / "corral" / "__init__.py").exists():
        parser.error(f"--against {args.against}: no src/corral there; give a Corral checkout")
    seed = args.seed if args.seed is not None else random.randrange(2**32)

    home = Path(tempfile.mkdtemp(prefix="corral-bench-cli-"))
    home.chmod(0o711)  # sandboxes (their own uids) must reach their workspaces under it
    uid_start = int(os.environ.get("CORRAL_UID_START", DEFAULT_UID_START))
    settings = Settings(home=home, uid_start=uid_start, uid_count=UID_COUNT)
    # Bytecode is cached (as an installed package has it), in a directory of the bench's own,
    # so neither checkout gets __pycache__ written into it.
    pycache = Path(tempfile.mkdtemp(prefix="corral-bench-pyc-"))
    base_env = {k: v for k, v in os.environ.items()
                if not k.startswith("CORRAL_")
                and k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    base_env.update(CORRAL_HOME=str(home), CORRAL_UID_START=str(uid_start),
                    CORRAL_UID_COUNT=str(UID_COUNT), PYTHONPYCACHEPREFIX=str(pycache))
    envs = {"": {**base_env, "PYTHONPATH": str(SRC)}}
    if against is not None:
        envs["_against"] = {**base_env, "PYTHONPATH": str(against)}
    plan = [(name + suffix, argv_, env) for suffix, env in envs.items()
            for name, argv_ in SERIES.items() if suffix == "" or name.startswith("corral")]

    samples: dict[str, list[float]] = {name: [] for name, _, _ in plan}
    failures: dict[str, list[str]] = {}
    rng = random.Random(seed)
    started = time.time()
    load_start = os.getloadavg()[0]
    log(f"bench_cli: {args.runs} rounds of {len(plan)} series, home {home}, seed {seed}")
    try:
        for round_ in range(WARMUP + args.runs):
            order = plan[:]
            rng.shuffle(order)
            for name, argv_, env in order:
                seconds, code, stderr = timed_process(argv_, env)
                if code != 0:
                    failures.setdefault(name, []).append(f"exit {code}: {stderr}")
                elif round_ >= WARMUP:
                    samples[name].append(seconds)
            if round_ >= WARMUP and (round_ - WARMUP + 1) % 10 == 0:
                log(f"  {round_ - WARMUP + 1}/{args.runs}")
    finally:
        # The runs' manager lived in their processes: one here removes the instance they made.
        from corral._control.manager import get_manager

        get_manager(settings)
        left = teardown(settings)
        shutil.rmtree(pycache, ignore_errors=True)
    if left:
        log("bench_cli: leftovers after clean-up:\n  " + "\n  ".join(left))

    s = {name: summarize(values) for name, values in samples.items() if values}
    floor = s["python_pass"]["p50_ms"] if "python_pass" in s else None
    report: dict[str, Any] = {
        "benchmark": "corral CLI start-up (`corral run -- true` beside `python -c pass`)",
        "runs": args.runs,
        "warmup_runs": WARMUP,
        "order": "interleaved: each round runs every series once in a shuffled order",
        "seed": seed,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "bytecode": "cached (PYTHONPYCACHEPREFIX in a temporary directory)",
        "machine": {"nproc": os.cpu_count(), "python": sys.version.split()[0],
                    "load_1m_start": round(load_start, 2),
                    "load_1m_end": round(os.getloadavg()[0], 2)},
        "against": str(against.parent) if against else None,
        "results": s,
        # What Corral adds over starting the interpreter, at the median.
        "over_python_pass_p50_ms": {name: round(v["p50_ms"] - floor, 3)
                                    for name, v in s.items() if floor is not None},
        "failures": failures,
        "cleanup": {"ok": not left, "leftovers": left},
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
