"""The gVisor tier against bare runsc: create + first command, and one command, beside
`runsc do true`, in the same run.

Run as root on a host where `corral doctor` says the gVisor tier works::

    .venv/bin/python bench/bench_gvisor.py [--runs N] [--out FILE]

Series (each round runs every series once, in a freshly shuffled order, as bench_sandbox.py
does, so slow drift of the machine spreads over all of them):

* ``runsc_do_true``: ``runsc --network=none do true``, the issue's baseline (``do``'s default
  network needs iptables, which these hosts lack);
* ``runsc_run_true``: ``runsc run`` of a minimal bundle with exactly the flags and spec Corral
  uses (host network in a network namespace, user namespace, seccomp profile), without Corral:
  what the tier costs before any of Corral's own work;
* ``gvisor_lifecycle``: ``Sandbox.create(isolation="gvisor")``, its first ``commands.run(["true"])``
  and ``kill()``, split into ``create``, ``first_command`` and ``destroy`` (the first command
  waits for what is left of the resident gVisor sandbox's start, begun by ``create``);
* ``gvisor_command``: ``commands.run(["true"])`` in a gVisor sandbox that already exists: the
  tier's default, through its resident gVisor sandbox;
* ``namespace_lifecycle`` and ``namespace_command``: the same for the namespace tier;
* ``runsc_exec_true``: ``runsc exec --user=1000:1000`` of ``true`` into one long-lived sandbox of
  Corral's kind (started once with ``create`` + ``start``), without Corral: issue 14's first
  candidate. Once per run the bench also asks such an exec'd process for its seccomp state
  (``runsc_exec_seccomp`` in the report);
* ``resident_command``: ``true`` through the in-sandbox helper of a long-lived sandbox
  (``gvisor.resident``, issue 14's design: own mount and PID namespace, fresh ``/tmp``, the
  seccomp filter per command), started once, without Corral;
* ``gvisor_per_command_sandbox_command``: ``commands.run(["true"])`` in a gVisor sandbox of a
  second data directory whose backend starts a gVisor sandbox per command
  (``gvisor_resident=False``, the tier's path before issue 14).

Prints one JSON document (progress goes to stderr). Targets (p50): a gVisor command within 1.5x
of a namespace-tier command and at most 50 ms (issue 14); ``create + first command`` of the
gVisor tier within 1.5x of ``runsc_do_true`` (wave 1's, which the resident's start now misses
when the first command follows ``create`` at once). The bench uses a temporary data
directory and its own uid range and removes everything it made; any leftover (sandboxes,
cgroups, network namespaces, mounts, runsc state, gVisor processes) makes the exit status 1.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import (  # noqa: E402
    emit_report,
    log,
    machine_info,
    percentile,
    summarize,
    teardown,
)

from corral import Sandbox  # noqa: E402
from corral._backends._linux import netns  # noqa: E402
from corral._backends._linux.template import load_template  # noqa: E402
from corral._backends.gvisor.bundle import (  # noqa: E402
    RUNTIME_UID_OFFSET,
    build_config,
    ensure_rootfs,
    runtime_uid,
    write_config,
)
from corral._backends.gvisor.launcher import reap_orphans  # noqa: E402
from corral._backends.gvisor.resident import Resident, ensure_launcher  # noqa: E402
from corral._backends.gvisor.runsc import Runsc, find_runsc, runsc_version  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

DEFAULT_UID_START = 2_060_000_000
UID_COUNT = 1000
WARMUP = 3
TARGET_RATIO = 1.5


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_checked(argv: list[str]) -> None:
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} exited {proc.returncode}: {proc.stderr.decode().strip()}")


class BareRunsc:
    """``runsc run`` of Corral's own kind of bundle, driven by hand: no cgroup, no Corral."""

    def __init__(self, runsc: str, work: Path, settings: Settings) -> None:
        self.work = work
        self.runsc = Runsc(runsc, work / "state")
        self.runsc.prepare()
        # Pinned where Corral pins its own (the directory keeps its usual mount), under a name
        # no sweep takes for a sandbox's.
        self.netns = settings.run_dir / f"corral-bench-{settings.instance}-{os.getpid()}"
        netns.create_netns(self.netns)
        template = load_template("base", settings.home / "templates")
        self.workspace = work / "workspace"
        self.workspace.mkdir(mode=0o700)
        self.uid = settings.uid_start + settings.uid_count - 1  # never handed to a sandbox here
        os.chown(self.workspace, self.uid, self.uid)
        self.config = build_config(
            rootfs=ensure_rootfs(work, template), template=template, workspace=self.workspace,
            netns=self.netns, uid=self.uid, argv=["true"], cwd="/workspace",
            env={"PATH": "/usr/bin:/bin"}, tmp_bytes=64 << 20, pids=128, terminal=False)
        self.count = 0

    def __call__(self) -> None:
        self.count += 1
        container_id = f"bench.{os.getpid()}.{self.count}"
        bundle = self.work / container_id
        write_config(bundle, self.config)
        try:
            run_checked(self.runsc.run_argv(bundle=bundle, container_id=container_id))
        finally:
            shutil.rmtree(bundle, ignore_errors=True)
        # runsc returns before its gofer and Sentry are gone; as a subreaper we inherit them.
        reap_orphans(runtime_uid(self.uid))

    def close(self) -> None:
        netns.remove_netns(self.netns)


# Asks the kernel it runs on whether it is filtered: gVisor's Seccomp field, and whether
# unshare(CLONE_NEWUSER) (refused by Corral's filter) goes through.
SECCOMP_PROBE = ("import ctypes;l=ctypes.CDLL(None,use_errno=True);r=l.unshare(0x10000000);"
                 "s=open('/proc/self/status').read().split('Seccomp:')[1].split()[0];"
                 "print(s, 'unshare-newuser', 'allowed' if r == 0 else 'refused')")


class LongLived:
    """One long-lived sandbox of Corral's kind (``runsc create`` + ``start``, ``sleep`` as its
    init), commands by ``runsc exec``; and one resident helper sandbox beside it."""

    def __init__(self, bare: BareRunsc, spawner: netns.Spawner) -> None:
        self.bare = bare
        self.container_id = f"bench.{os.getpid()}.long"
        self.bundle = bare.work / self.container_id
        config = dict(bare.config)
        config["process"] = dict(config["process"], args=["sleep", "1000000"])
        write_config(self.bundle, config)
        self.base = bare.runsc.run_argv(bundle=self.bundle, container_id=self.container_id)[:-3]
        # create's stdout and stderr must not be pipes: the sandbox inherits them and create
        # waits for their EOF, forever.
        t0 = time.perf_counter()
        with open(bare.work / "create.err", "w+b") as err:
            created = subprocess.run(
                [*self.base, "create", f"--bundle={self.bundle}", self.container_id],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, timeout=60)
            if created.returncode != 0:
                err.seek(0)
                raise RuntimeError(f"runsc create exited {created.returncode}: "
                                   f"{err.read().decode(errors='replace').strip()}")
        t1 = time.perf_counter()
        run_checked([*self.base, "start", self.container_id])
        self.create_s, self.start_s = t1 - t0, time.perf_counter() - t1
        probe = subprocess.run(
            [*self.base, "exec", "--user=1000:1000", self.container_id, "python3", "-c",
             SECCOMP_PROBE], capture_output=True, text=True, timeout=60,
            stdin=subprocess.DEVNULL)
        self.exec_seccomp = (probe.stdout or probe.stderr).strip()
        self.resident: Resident | None = None
        t2 = time.perf_counter()
        try:
            self.resident = Resident(
                bare.runsc, bare.work / f"bench.{os.getpid()}.resident",
                f"bench.{os.getpid()}.resident", bare.config, ensure_launcher(bare.work),
                lambda argv: spawner.run(bare.netns, lambda: subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"})))
        except BaseException:
            self.close()  # the long-lived sandbox above is running: never leave it
            raise
        self.resident_start_s = time.perf_counter() - t2
        probe_result = self.resident.run(["python3", "-c", SECCOMP_PROBE],
                                         env={"PATH": "/usr/bin:/bin"})
        self.resident_seccomp = probe_result.stdout.decode().strip()

    def exec_true(self) -> None:
        run_checked([*self.base, "exec", "--user=1000:1000", self.container_id, "true"])

    def resident_true(self) -> None:
        assert self.resident is not None
        result = self.resident.run(["true"], env={"PATH": "/usr/bin:/bin"})
        if result.exit_code != 0:
            raise RuntimeError(f"resident `true` exited {result.exit_code}")

    def close(self) -> None:
        if self.resident is not None:
            self.resident.close()
        subprocess.run([*self.base, "kill", self.container_id, "KILL"], timeout=30,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
        subprocess.run([*self.base, "delete", "--force", self.container_id], timeout=60,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
        self.bare.runsc.remove_state(self.container_id)
        shutil.rmtree(self.bundle, ignore_errors=True)
        reap_orphans(runtime_uid(self.bare.uid))


class Bench:
    def __init__(self, home: Path, runsc: str, bare: BareRunsc, long: LongLived,
                 per_command_home: Path) -> None:
        self.home = str(home)
        self.per_command_home = str(per_command_home)
        self.runsc = runsc
        self.bare = bare
        self.long = long
        self.sandboxes: dict[str, Sandbox] = {}
        self.rounds = 0
        self.samples: dict[str, list[float]] = {name: [] for name in (
            "runsc_do_true", "runsc_run_true",
            "gvisor_lifecycle", "gvisor_create", "gvisor_first_command",
            "gvisor_create_plus_first_command", "gvisor_destroy", "gvisor_command",
            "namespace_lifecycle", "namespace_create_plus_first_command", "namespace_command",
            "runsc_exec_true", "resident_command", "gvisor_per_command_sandbox_command",
        )}
        self.failures: dict[str, int] = {}

    def failed(self, series: str, exit_code: int, stderr: str) -> None:
        self.failures[series] = self.failures.get(series, 0) + 1
        log(f"  {series}: `true` exited {exit_code} {stderr.strip()[:160]!r}")

    def runsc_do_true(self, record: bool) -> None:
        t = timed(lambda: run_checked([self.runsc, "--network=none", "do", "true"]))
        if record:
            self.samples["runsc_do_true"].append(t)

    def runsc_run_true(self, record: bool) -> None:
        t = timed(self.bare)
        if record:
            self.samples["runsc_run_true"].append(t)

    def runsc_exec_true(self, record: bool) -> None:
        t = timed(self.long.exec_true)
        if record:
            self.samples["runsc_exec_true"].append(t)

    def resident_command(self, record: bool) -> None:
        t = timed(self.long.resident_true)
        if record:
            self.samples["resident_command"].append(t)

    def _command(self, tier: str, record: bool) -> None:
        sandbox = self.sandboxes[tier]
        start = time.perf_counter()
        result = sandbox.commands.run(["true"])
        t = time.perf_counter() - start
        if result.exit_code != 0:
            self.failed(f"{tier}_command", result.exit_code, result.stderr)
        elif record:
            self.samples[f"{tier}_command"].append(t)

    def _lifecycle(self, tier: str, record: bool) -> None:
        t0 = time.perf_counter()
        sb = Sandbox.create(home=self.home, isolation=tier)
        t1 = time.perf_counter()
        try:
            result = sb.commands.run(["true"])
            t2 = time.perf_counter()
        finally:
            sb.kill()
        t3 = time.perf_counter()
        if result.exit_code != 0:
            self.failed(f"{tier}_lifecycle", result.exit_code, result.stderr)
        elif record:
            self.samples[f"{tier}_lifecycle"].append(t3 - t0)
            self.samples[f"{tier}_create_plus_first_command"].append(t2 - t0)
            if tier == "gvisor":
                self.samples["gvisor_create"].append(t1 - t0)
                self.samples["gvisor_first_command"].append(t2 - t1)
                self.samples["gvisor_destroy"].append(t3 - t2)

    def run(self, runs: int, seed: int) -> None:
        steps: list[Callable[[bool], None]] = [
            self.runsc_do_true, self.runsc_run_true,
            lambda record: self._lifecycle("gvisor", record),
            lambda record: self._command("gvisor", record),
            lambda record: self._lifecycle("namespace", record),
            lambda record: self._command("namespace", record),
            self.runsc_exec_true, self.resident_command,
            lambda record: self._command("gvisor_per_command_sandbox", record),
        ]
        for tier in ("gvisor", "namespace"):
            self.sandboxes[tier] = Sandbox.create(home=self.home, isolation=tier)
        self.sandboxes["gvisor_per_command_sandbox"] = Sandbox.create(
            home=self.per_command_home, isolation="gvisor")
        log(f"warming up ({WARMUP} runs of each series)")
        for _ in range(WARMUP):
            for step in steps:
                step(False)
        rng = random.Random(seed)
        progress_every = max(1, runs // 10)
        while min(len(v) for v in self.samples.values()) < runs:
            if sum(self.failures.values()) > 2 * runs + 20:
                raise RuntimeError("too many failed runs; giving up")
            order = steps[:]
            rng.shuffle(order)
            for step in order:
                step(True)
            self.rounds += 1
            if self.rounds % progress_every == 0:
                p50 = percentile(sorted(self.samples["gvisor_command"] or [0.0]), 0.5) * 1000
                log(f"  round {self.rounds}: gvisor_command p50 so far {p50:.1f} ms")

    def close(self) -> None:
        for sandbox in self.sandboxes.values():
            sandbox.kill()
        self.sandboxes.clear()


def gvisor_leftovers(settings: Settings) -> list[str]:
    """runsc state and gVisor processes of this bench's uids still around after clean-up."""
    found = [str(p) for p in settings.run_dir.glob(f"corral-bench-{settings.instance}-*")]
    state = settings.home / "gvisor" / "state"
    if state.is_dir():
        found += [str(p) for p in state.iterdir()]
    low = settings.uid_start + RUNTIME_UID_OFFSET
    high = low + settings.uid_count
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                uid = os.stat(f"/proc/{entry}").st_uid
            except OSError:
                continue
            if low <= uid < high:
                found.append(f"process {entry} of runtime uid {uid}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="measured runs per series")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    parser.add_argument("--seed", type=int, default=None, help="seed of the order shuffle")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if os.geteuid() != 0:
        log("bench_gvisor: run as root (sandboxes need namespaces, cgroups and mounts)")
        return 2
    runsc, bwrap = find_runsc(), shutil.which("bwrap")
    if runsc is None or bwrap is None:
        log("bench_gvisor: needs runsc and bwrap; run `corral doctor`")
        return 2
    seed = args.seed if args.seed is not None else random.randrange(2**32)

    home = Path(tempfile.mkdtemp(prefix="corral-bench-"))
    os.chmod(home, 0o711)
    uid_start = int(os.environ.get("CORRAL_UID_START", DEFAULT_UID_START))
    settings = Settings(home=home, uid_start=uid_start, uid_count=UID_COUNT)
    mgr = manager_mod.get_manager(settings)
    started = time.time()
    load_start = os.getloadavg()[0]
    (home / "bare").mkdir(mode=0o711)
    bare = BareRunsc(runsc, home / "bare", settings)
    long: LongLived | None = None
    try:
        long = LongLived(bare, netns.Spawner())
    except BaseException:
        bare.close()
        teardown(settings, gvisor_leftovers)
        raise
    # A second data directory (its own uids) whose gVisor backend starts a gVisor sandbox per
    # command: the setting is read when its manager is made.
    per_command_home = Path(tempfile.mkdtemp(prefix="corral-bench-"))
    os.chmod(per_command_home, 0o711)
    per_command_settings = Settings(home=per_command_home, uid_start=uid_start + UID_COUNT,
                                    uid_count=UID_COUNT, gvisor_resident=False)
    manager_mod.get_manager(per_command_settings).backend_for("gvisor")
    bench = Bench(home, runsc, bare, long, per_command_home)
    try:
        gc.collect()
        log(f"bench: {args.runs} rounds, home {home}, uids from {uid_start}, seed {seed}")
        bench.run(args.runs, seed)
        cgroups = mgr.backend.cgroups.describe()  # type: ignore[attr-defined]
    finally:
        bench.close()
        long.close()
        bare.close()
        left = teardown(settings, gvisor_leftovers)
        left += teardown(per_command_settings, gvisor_leftovers)
    if left:
        log("bench: leftovers after clean-up:\n  " + "\n  ".join(left))

    s = {name: summarize(values) for name, values in bench.samples.items()}
    baseline = s["runsc_do_true"]["p50_ms"]
    first = s["gvisor_create_plus_first_command"]["p50_ms"]
    machine = machine_info(bwrap, cgroups, load_start)
    machine["runsc"] = runsc_version(runsc)[0]
    report: dict[str, Any] = {
        "benchmark": "corral gVisor tier against bare runsc (`true`)",
        "runs": args.runs,
        "rounds": bench.rounds,
        "warmup_runs": WARMUP,
        "order": "interleaved: each round runs every series once in a shuffled order",
        "seed": seed,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "machine": machine,
        "results": {k: s[k] for k in (
            "runsc_do_true", "runsc_run_true", "gvisor_create_plus_first_command",
            "gvisor_command", "gvisor_lifecycle", "namespace_create_plus_first_command",
            "namespace_command", "namespace_lifecycle", "runsc_exec_true", "resident_command",
            "gvisor_per_command_sandbox_command")},
        "long_lived": {
            "runsc_create_ms": round(long.create_s * 1000, 1),
            "runsc_start_ms": round(long.start_s * 1000, 1),
            "resident_start_ms": round(long.resident_start_s * 1000, 1),
            "runsc_exec_seccomp": long.exec_seccomp,
            "resident_command_seccomp": long.resident_seccomp,
        },
        "gvisor_lifecycle_parts": {
            "create": s["gvisor_create"],
            "first_command": s["gvisor_first_command"],
            "destroy": s["gvisor_destroy"],
        },
        "ratios": {
            "gvisor_create_plus_first_command_p50_over_runsc_do_true_p50":
                round(first / baseline, 3),
            "gvisor_command_p50_over_runsc_do_true_p50":
                round(s["gvisor_command"]["p50_ms"] / baseline, 3),
            "runsc_run_true_p50_over_runsc_do_true_p50":
                round(s["runsc_run_true"]["p50_ms"] / baseline, 3),
            "gvisor_command_p50_over_namespace_command_p50":
                round(s["gvisor_command"]["p50_ms"] / s["namespace_command"]["p50_ms"], 3),
            "gvisor_per_command_sandbox_command_p50_over_runsc_do_true_p50":
                round(s["gvisor_per_command_sandbox_command"]["p50_ms"] / baseline, 3),
            "resident_command_p50_over_namespace_command_p50":
                round(s["resident_command"]["p50_ms"] / s["namespace_command"]["p50_ms"], 3),
            "runsc_exec_true_p50_over_namespace_command_p50":
                round(s["runsc_exec_true"]["p50_ms"] / s["namespace_command"]["p50_ms"], 3),
        },
        "targets": {
            f"gvisor_command_within_{TARGET_RATIO}x_namespace_command":
                s["gvisor_command"]["p50_ms"] <= TARGET_RATIO * s["namespace_command"]["p50_ms"],
            "gvisor_command_at_most_50_ms": s["gvisor_command"]["p50_ms"] <= 50.0,
            f"gvisor_create_plus_first_command_within_{TARGET_RATIO}x_runsc_do_true":
                first <= TARGET_RATIO * baseline,
        },
        "failures": bench.failures,
        "cleanup": {"ok": not left, "leftovers": left},
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
