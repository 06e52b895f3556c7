"""Start-up of the ``corral`` command line: ``run``, ``exec``, ``ls`` and ``--help`` beside bare
Python, in an empty data directory and in one holding a sandbox of every tier.

Run as root (with ``CORRAL_MICROVM_ALLOW_TCG=1`` where the host has no usable KVM)::

    .venv/bin/python bench/bench_cli.py [--runs N] [--against CHECKOUT] [--out FILE]

Each series is a new process, timed from spawn to exit:

- ``python_pass``: ``python -c pass``, the interpreter's own floor;
- ``help``: ``corral --help``, which loads every command to list it (no data directory);
- ``run_empty`` / ``run_full``: ``corral run -- true`` (create, run ``true``, destroy, on the
  default namespace tier) in the empty home / the full one;
- ``ls_empty`` / ``ls_full``: ``corral ls`` in each;
- ``exec_full_<tier>``: ``corral exec ID -- true`` into the full home's sandbox of that tier.

The full home holds one running sandbox of every tier this host can run (namespace; gVisor
where ``runsc`` works; microVM where it starts); a tier it cannot run is left out and named
under ``tiers`` with the reason. The empty home has had calls made in it (its database, its
CA), never a sandbox left in it. With ``--against CHECKOUT`` every ``corral`` series runs a
second time with that checkout's ``src`` first on ``PYTHONPATH`` (``..._against``), so a change
is measured beside the code it replaces, on the same machine, in the same rounds and homes
(e.g. ``git worktree add /tmp/before <commit>``); ``paired_over_against_median`` is the median
over rounds of each series' time over its twin's, taken within a round. The interpreter is
the one running this script. Each round runs every series once in a new random order, after
warm-up rounds that are not counted; the JSON goes to stdout, progress to stderr. The bench
uses temporary data directories and uid ranges of its own, and checks at the end that it left
nothing behind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import statistics
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
TIERS = ("namespace", "gvisor", "microvm")


def timed_process(args: list[str], env: Mapping[str, str]) -> tuple[float, int, str]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=120)
    return time.perf_counter() - started, done.returncode, done.stderr[-500:]


def _populate(settings: Settings) -> dict[str, dict[str, str]]:
    """One running sandbox of every tier this host can run: ``{tier: {"id": ...}}``, or
    ``{tier: {"skipped": why}}``."""
    from corral._control.manager import get_manager
    from corral.errors import CorralError

    mgr = get_manager(settings)
    made: dict[str, dict[str, str]] = {}
    for tier in TIERS:
        if tier == "gvisor" and shutil.which("runsc") is None:
            made[tier] = {"skipped": "runsc is not installed"}
            continue
        try:
            # Created only: a command run here would start the tier's resident helper in this
            # process, which then outlives the sandbox's destroy until this process exits.
            info = mgr.create(isolation=tier, timeout=3600)
        except CorralError as exc:
            why = getattr(exc, "message", None) or str(exc)
            log(f"  {tier}: left out ({why})")
            made[tier] = {"skipped": why}
            continue
        made[tier] = {"id": info.id}
        log(f"  {tier}: {info.id}")
    return made


def _env(base: Mapping[str, str], settings: Settings, src: Path) -> dict[str, str]:
    return {**base, "CORRAL_HOME": str(settings.home),
            "CORRAL_UID_START": str(settings.uid_start),
            "CORRAL_UID_COUNT": str(settings.uid_count), "PYTHONPATH": str(src)}


def _reap_orphans() -> None:
    """Reap exited processes re-parented to this one: loading the namespace tier made it a
    child subreaper, so what the `corral` processes left to run after them (a gVisor tier's
    resident, stopping as its process ended) ends here as a zombie, never reaped otherwise,
    and would be counted as left behind."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == me:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(entry), os.WNOHANG)


def _leftovers(settings: Settings) -> list[str]:
    """The gVisor and microVM tiers' own leftovers. A resident gVisor sandbox a `corral exec`
    process started stops on its own once the sandbox is gone: waited for (bounded)."""
    from bench_cli_recovery import microvm_leftovers
    from bench_gvisor import gvisor_leftovers

    deadline = time.monotonic() + 30  # a CLI process's resident stops as that process ends
    while True:
        _reap_orphans()
        left = gvisor_leftovers(settings) + microvm_leftovers(settings)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _paired(samples: Mapping[str, list[float]]) -> dict[str, float]:
    """Per series with an ``_against`` twin: the median over rounds of this / against, each
    pair from one round (it holds when the machine's speed drifts between rounds)."""
    out = {}
    for name, values in samples.items():
        twin = samples.get(f"{name}_against")
        if not name.endswith("_against") and twin and values:
            ratios = [a / b for a, b in zip(values, twin, strict=False)]
            out[name] = round(statistics.median(ratios), 3)
    return out


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

    uid_start = int(os.environ.get("CORRAL_UID_START", DEFAULT_UID_START))
    homes = {name: Path(tempfile.mkdtemp(prefix=f"corral-bench-cli-{name}-"))
             for name in ("empty", "full")}
    for home in homes.values():
        home.chmod(0o711)  # sandboxes (their own uids) must reach their workspaces under it
    settings = {"empty": Settings(home=homes["empty"], uid_start=uid_start,
                                  uid_count=UID_COUNT),
                "full": Settings(home=homes["full"], uid_start=uid_start + UID_COUNT,
                                 uid_count=UID_COUNT)}
    # Bytecode is cached (as an installed package has it), in a directory of the bench's own,
    # so neither checkout gets __pycache__ written into it.
    pycache = Path(tempfile.mkdtemp(prefix="corral-bench-pyc-"))
    base_env = {k: v for k, v in os.environ.items()
                if (not k.startswith("CORRAL_") or k == "CORRAL_MICROVM_ALLOW_TCG")
                and k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    base_env["PYTHONPYCACHEPREFIX"] = str(pycache)

    started = time.time()
    load_start = os.getloadavg()[0]
    samples: dict[str, list[float]] = {}
    failures: dict[str, list[str]] = {}
    made: dict[str, dict[str, str]] = {}
    try:
        log(f"bench_cli: the full home {homes['full']}:")
        made = _populate(settings["full"])
        sources = {"": SRC, **({"_against": against} if against is not None else {})}
        plan: list[tuple[str, list[str], dict[str, str]]] = [
            ("python_pass", ["-c", "pass"], dict(base_env))]
        for suffix, src in sources.items():
            plan.append((f"help{suffix}", ["-m", "corral", "--help"],
                         _env(base_env, settings["empty"], src)))
            for where in ("empty", "full"):
                env = _env(base_env, settings[where], src)
                plan.append((f"run_{where}{suffix}", ["-m", "corral", "run", "--", "true"], env))
                plan.append((f"ls_{where}{suffix}", ["-m", "corral", "ls"], env))
            for tier, entry in made.items():
                if "id" in entry:
                    plan.append((f"exec_full_{tier}{suffix}",
                                 ["-m", "corral", "exec", entry["id"], "--", "true"],
                                 _env(base_env, settings["full"], src)))
        samples = {name: [] for name, _, _ in plan}
        rng = random.Random(seed)
        log(f"bench_cli: {args.runs} rounds of {len(plan)} series, seed {seed}")
        for round_ in range(WARMUP + args.runs):
            order = plan[:]
            rng.shuffle(order)
            for name, argv_, env in order:
                seconds, code, stderr = timed_process(argv_, env)
                if code != 0:
                    failures.setdefault(name, []).append(f"exit {code}: {stderr}")
                elif round_ >= WARMUP:
                    samples[name].append(seconds)
            if round_ >= WARMUP and (round_ - WARMUP + 1) % 5 == 0:
                log(f"  {round_ - WARMUP + 1}/{args.runs}")
    finally:
        # The runs' managers lived in their processes: one here removes what they made.
        from corral._control.manager import get_manager

        get_manager(settings["empty"])
        left = []
        for own in settings.values():
            left += teardown(own, _leftovers)
        shutil.rmtree(pycache, ignore_errors=True)
    if left:
        log("bench_cli: leftovers after clean-up:\n  " + "\n  ".join(left))

    s = {name: summarize(values) for name, values in samples.items() if values}
    floor = s["python_pass"]["p50_ms"] if "python_pass" in s else None
    report: dict[str, Any] = {
        "benchmark": "corral CLI start-up (run, exec, ls, --help beside `python -c pass`)",
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
        "tiers": made,
        "results": s,
        # What Corral adds over starting the interpreter, at the median (target for run, exec
        # and ls: 150 ms).
        "over_python_pass_p50_ms": {name: round(v["p50_ms"] - floor, 3)
                                    for name, v in s.items() if floor is not None},
        # Only rounds where both ran are paired; a failure shifts the pairs (see failures).
        "paired_over_against_median": _paired(samples),
        "failures": failures,
        "cleanup": {"ok": not left, "leftovers": left},
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
