"""What a CLI call pays for the sandboxes already in the store: ``corral run -- true`` and
``corral ls --json`` in an empty data directory beside one holding a running sandbox of every
tier (namespace, gVisor, microVM).

Run as root (with ``CORRAL_MICROVM_ALLOW_TCG=1`` where the host has no usable KVM)::

    .venv/bin/python bench/bench_cli_recovery.py [--runs N] [--against CHECKOUT] [--out FILE]

Each sample is a new process, timed from spawn to exit:

- ``python_pass``: ``python -c pass``, the interpreter's floor (the reference);
- ``run_empty`` / ``run_full``: ``corral run -- true`` (create, run, destroy on the default,
  namespace tier) in the empty home / the full one;
- ``ls_empty`` / ``ls_full``: ``corral ls --json`` in each.

Each process starts a control plane, so each runs recovery before its first use; what that
costs beyond the empty home is what the store's other tiers make every call pay. Issue 36's
target: ``run_full`` within 10 % of ``run_empty`` (``targets``). With ``--against CHECKOUT``
the four ``corral`` series run a second time with that checkout's ``src`` first on
``PYTHONPATH`` (``..._against``), in the same rounds and the same homes.

Each round runs every series once in a new random order, after warm-up rounds that are not
counted (the first processes of a boot check the host; later ones reuse what they found).
``paired`` is the median over rounds of full / empty taken within each round, which holds
when the machine's speed drifts. JSON goes to stdout, progress to stderr. The bench uses two
temporary data directories and uid ranges of its own, checks at the end that the full home's
sandboxes are all still running (and the microVM's QEMU the same process), then destroys
everything and checks it left nothing behind.
"""

from __future__ import annotations

import argparse
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

from bench_cli import timed_process  # noqa: E402
from bench_gvisor import gvisor_leftovers  # noqa: E402
from bench_sandbox import emit_report, log, summarize, teardown  # noqa: E402

from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402
from corral.errors import CorralError  # noqa: E402

DEFAULT_UID_START = 2_062_000_000  # apart from bench_cli's, bench_sandbox's and the tests'
UID_COUNT = 1000
WARMUP = 2
SRC = Path(__file__).resolve().parent.parent / "src"
TIERS = ("namespace", "gvisor", "microvm")

COMMANDS: dict[str, list[str]] = {
    "run": ["-m", "corral", "run", "--", "true"],
    "ls": ["-m", "corral", "ls", "--json"],
}


def _vm_processes(sandbox_id: str) -> set[int]:
    """QEMU and keeper processes of one microVM sandbox."""
    out = subprocess.run(["pgrep", "-f", "qemu-system|microvm.keeper"], capture_output=True,
                         text=True, check=False).stdout
    found = set()
    for pid in out.split():
        try:
            if sandbox_id in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                found.add(int(pid))
        except OSError:
            continue
    return found


def microvm_leftovers(settings: Settings) -> list[str]:
    """Keeper run directories and QEMU processes of this bench's instance."""
    from corral._backends.microvm.backend import RUN_ROOT

    found = [str(p) for p in RUN_ROOT.glob(f"{settings.instance}-*")] if RUN_ROOT.is_dir() \
        else []
    out = subprocess.run(["pgrep", "-af", "qemu-system|microvm.keeper"], capture_output=True,
                         text=True, check=False).stdout
    found += [line for line in out.splitlines()
              if str(settings.home) in line or settings.instance in line]
    return found


def populate(settings: Settings) -> dict[str, Any]:
    """One running sandbox of every tier this host can run, made in this process; the tiers
    it cannot run are reported with the reason."""
    mgr = manager_mod.get_manager(settings)
    made: dict[str, Any] = {}
    for tier in TIERS:
        try:
            info = mgr.create(isolation=tier, timeout=3600)
        except CorralError as exc:
            log(f"  {tier}: not in the store ({exc.message})")
            made[tier] = {"skipped": exc.message}
            continue
        made[tier] = {"id": info.id}
        log(f"  {tier}: {info.id}")
    return made


def intact(settings: Settings, made: Mapping[str, Any],
           vm_before: set[int] | None) -> dict[str, bool]:
    """Whether every sandbox made is still running, and the microVM's QEMU the same one."""
    mgr = manager_mod.get_manager(settings)
    running = {info.id for info in mgr.store.list() if info.state == "running"}
    result = {tier: entry["id"] in running for tier, entry in made.items() if "id" in entry}
    if vm_before is not None:
        result["microvm_same_qemu"] = _vm_processes(made["microvm"]["id"]) == vm_before
    return result


def _settings(home: Path, uid_start: int) -> Settings:
    return Settings(home=home, uid_start=uid_start, uid_count=UID_COUNT)


def _env(base: Mapping[str, str], settings: Settings, src: Path) -> dict[str, str]:
    return {**base, "CORRAL_HOME": str(settings.home),
            "CORRAL_UID_START": str(settings.uid_start),
            "CORRAL_UID_COUNT": str(settings.uid_count), "PYTHONPATH": str(src)}


def _ratios(s: Mapping[str, Mapping[str, float]], samples: Mapping[str, list[float]],
            suffix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for command in COMMANDS:
        full, empty = f"{command}_full{suffix}", f"{command}_empty{suffix}"
        if full in s and empty in s:
            pairs = [a / b for a, b in zip(samples[full], samples[empty], strict=False)]
            out[command + suffix] = {
                "full_over_empty_p50": round(s[full]["p50_ms"] / s[empty]["p50_ms"], 3),
                "paired_median": round(statistics.median(pairs), 3),
                "full_minus_empty_p50_ms": round(s[full]["p50_ms"] - s[empty]["p50_ms"], 1),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="measured runs per series")
    parser.add_argument("--against", type=Path, default=None,
                        help="a checkout (with src/corral) to measure beside this one")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    parser.add_argument("--seed", type=int, default=None, help="seed of the order shuffle")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if os.geteuid() != 0:
        log("bench_cli_recovery: run as root (sandboxes need namespaces, cgroups and mounts)")
        return 2
    against = args.against.resolve() / "src" if args.against else None
    if against is not None and not (against / "corral" / "__init__.py").exists():
        parser.error(f"--against {args.against}: no src/corral there; give a Corral checkout")
    seed = args.seed if args.seed is not None else random.randrange(2**32)

    uid_start = int(os.environ.get("CORRAL_UID_START", DEFAULT_UID_START))
    homes = {name: Path(tempfile.mkdtemp(prefix=f"corral-bench-rec-{name}-"))
             for name in ("empty", "full")}
    for home in homes.values():
        home.chmod(0o711)  # sandboxes (their own uids) must reach their workspaces under it
    settings = {"full": _settings(homes["full"], uid_start),
                "empty": _settings(homes["empty"], uid_start + UID_COUNT)}
    pycache = Path(tempfile.mkdtemp(prefix="corral-bench-pyc-"))
    base_env = {k: v for k, v in os.environ.items()
                if not k.startswith("CORRAL_") or k == "CORRAL_MICROVM_ALLOW_TCG"}
    base_env.pop("PYTHONDONTWRITEBYTECODE", None)
    base_env["PYTHONPYCACHEPREFIX"] = str(pycache)
    sources = {"": SRC, **({"_against": against} if against is not None else {})}
    plan: list[tuple[str, list[str], dict[str, str]]] = [("python_pass", ["-c", "pass"],
                                                          dict(base_env))]
    for suffix, src in sources.items():
        for command, argv_ in COMMANDS.items():
            for where in ("empty", "full"):
                plan.append((f"{command}_{where}{suffix}", argv_,
                             _env(base_env, settings[where], src)))

    samples: dict[str, list[float]] = {name: [] for name, _, _ in plan}
    failures: dict[str, list[str]] = {}
    rng = random.Random(seed)
    started = time.time()
    load_start = os.getloadavg()[0]
    made: dict[str, Any] = {}
    after: dict[str, bool] = {}
    try:
        log(f"bench_cli_recovery: the full home {homes['full']}:")
        made = populate(settings["full"])
        vm_before = (_vm_processes(made["microvm"]["id"]) if "id" in made["microvm"]
                     else None)
        log(f"bench_cli_recovery: {args.runs} rounds of {len(plan)} series, seed {seed}")
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
        after = intact(settings["full"], made, vm_before)
    finally:
        manager_mod.get_manager(settings["empty"])  # to remove the instance its runs made
        left = []
        for own in settings.values():  # (the host checks recorded there go with the home)
            left += teardown(own, lambda s: gvisor_leftovers(s) + microvm_leftovers(s))
        shutil.rmtree(pycache, ignore_errors=True)
    if left:
        log("bench_cli_recovery: leftovers after clean-up:\n  " + "\n  ".join(left))

    s = {name: summarize(values) for name, values in samples.items() if values}
    ratios = {**_ratios(s, samples, ""),
              **(_ratios(s, samples, "_against") if against is not None else {})}
    report: dict[str, Any] = {
        "benchmark": "corral CLI calls with every tier in the store beside an empty home",
        "runs": args.runs,
        "warmup_runs": WARMUP,
        "order": "interleaved: each round runs every series once in a shuffled order",
        "seed": seed,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "machine": {"nproc": os.cpu_count(), "python": sys.version.split()[0],
                    "kernel": os.uname().release,
                    "load_1m_start": round(load_start, 2),
                    "load_1m_end": round(os.getloadavg()[0], 2)},
        "against": str(against.parent) if against else None,
        "store_of_full_home": made,
        "full_home_intact_after": after,
        "results": s,
        "ratios": ratios,
        "targets": {
            f"{command}_full_within_10pct_of_empty": (
                ratios[command]["full_over_empty_p50"] <= 1.10
                and ratios[command]["paired_median"] <= 1.10)
            for command in COMMANDS if command in ratios},
        "failures": failures,
        "cleanup": {"ok": not left, "leftovers": left},
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
