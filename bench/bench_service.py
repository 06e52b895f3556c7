"""The HTTP service: a command's round trip through the API, concurrency, and idle density.

Run as root::

    .venv/bin/python bench/bench_service.py [--runs N] [--clients C] [--commands M]
                                            [--density N] [--out FILE]

Three parts, against ``python -m corral serve`` in a subprocess on 127.0.0.1 (its own data
directory and uid range; anonymous, as on loopback with no keys):

1. ``latency``: ``sb.commands.run(["true"])`` through the remote SDK (HTTP) and through the
   embedded SDK (a second data directory in this process), interleaved in shuffled rounds.
2. ``concurrency``: C client threads, each with its own sandbox made beforehand, run M commands
   each through the API at once: throughput, p50/p99 and errors.
3. ``density``: N idle sandboxes made through the API, then memory (server RSS, host MemAvailable)
   and disk (``du`` of the data directory, allocated blocks) per sandbox; all destroyed after.

Prints one JSON document (progress on stderr). Everything it made is removed at the end (server,
sandboxes, cgroups, network namespaces, mounts, data directories) and checked for leftovers.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

SRC = Path(__file__).resolve().parent.parent / "src"
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import emit_report, log, machine_info, percentile, summarize, teardown  # noqa: E402

from corral import Sandbox  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

# Apart from the other benches (2_050_…, 2_060_…, 2_070_…) and the tests (2_100_… and up).
EMBEDDED_UID_START = 2_080_000_000
SERVICE_UID_START = 2_080_100_000
WARMUP = 5
SANDBOX_LIFETIME_S = 3 * 3600.0  # outlives the bench; everything is destroyed at the end anyway


def summarize99(seconds: list[float]) -> dict[str, float | int]:
    out = summarize(seconds)
    out["p99_ms"] = round(percentile(sorted(s * 1000.0 for s in seconds), 0.99), 3)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            out[name] = int(rest.split()[0]) * 1024
    return out


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def du_bytes(path: Path, apparent: bool = False) -> int:
    """Bytes under ``path`` on its own filesystem (``-x``: not the mounted workspaces' contents,
    which live inside the images that are counted)."""
    argv = ["du", "-sx", "--block-size=1", str(path)]
    if apparent:
        argv.insert(2, "--apparent-size")
    return int(subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()[0])


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def process_counts() -> dict[str, int]:
    """Host processes: user processes and kernel threads (parent kthreadd, pid 2)."""
    counts = {"user": 0, "kernel_threads": 0}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        kernel = p.name == "2" or ppid == 2
        counts["kernel_threads" if kernel else "user"] += 1
    return counts


def tenth_p50(seconds: list[float]) -> float:
    return round(percentile(sorted(s * 1000.0 for s in seconds), 0.5), 3) if seconds else 0.0


def loop_devices_in_use() -> int:
    out = subprocess.run(["losetup", "-n", "-l", "-O", "NAME"], capture_output=True, text=True)
    return len(out.stdout.split())


class Server:
    """``python -m corral serve`` in a subprocess with its own home and uid range."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.settings = settings
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.argv = [sys.executable, "-m", "corral", "serve", "--host", "127.0.0.1",
                     "--port", str(self.port)]

    def start(self) -> None:
        env = {**os.environ, "CORRAL_HOME": str(self.settings.home),
               "CORRAL_UID_START": str(self.settings.uid_start),
               "CORRAL_UID_COUNT": str(self.settings.uid_count),
               "PYTHONPATH": str(SRC)}
        for name in ("CORRAL_URL", "CORRAL_API_KEY", "CORRAL_PORTS_URL", "CORRAL_PORTS_DOMAIN"):
            env.pop(name, None)
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not answer /healthz within 30 s")
            time.sleep(0.1)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


# -- 1. latency: HTTP vs embedded ---------------------------------------------------------------


def bench_latency(url: str, embedded_home: str, runs: int, seed: int) -> dict[str, Any]:
    remote = Sandbox.create(url=url, timeout=SANDBOX_LIFETIME_S)
    embedded = Sandbox.create(home=embedded_home, timeout=SANDBOX_LIFETIME_S)
    sandboxes = {"http": remote, "embedded": embedded}
    samples: dict[str, list[float]] = {name: [] for name in sandboxes}
    failures = {name: 0 for name in sandboxes}
    try:
        for _ in range(WARMUP):
            for sb in sandboxes.values():
                sb.commands.run(["true"])
        rng = random.Random(seed)
        order = list(sandboxes)
        while min(len(v) for v in samples.values()) < runs:
            if sum(failures.values()) > runs:
                raise RuntimeError(f"more than {runs} failed commands; giving up")
            rng.shuffle(order)
            for name in order:
                start = time.perf_counter()
                result = sandboxes[name].commands.run(["true"])
                elapsed = time.perf_counter() - start
                if result.exit_code != 0:
                    failures[name] += 1
                else:
                    samples[name].append(elapsed)
    finally:
        for sb in sandboxes.values():
            sb.kill()
    results = {name: summarize99(values) for name, values in samples.items()}
    return {
        "runs": runs,
        "results": results,
        "http_added_p50_ms": round(results["http"]["p50_ms"] - results["embedded"]["p50_ms"], 3),
        "http_p50_over_embedded_p50": round(
            results["http"]["p50_ms"] / results["embedded"]["p50_ms"], 3),
        "failures": failures,
        "failures_total": sum(failures.values()),
    }


# -- 2. concurrency -----------------------------------------------------------------------------


def bench_concurrency(url: str, clients: int, commands: int) -> dict[str, Any]:
    log(f"concurrency: creating {clients} sandboxes")
    sandboxes = [Sandbox.create(url=url, timeout=SANDBOX_LIFETIME_S) for _ in range(clients)]
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors: list[list[str]] = [[] for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        sb = sandboxes[i]
        barrier.wait()
        for _ in range(commands):
            start = time.perf_counter()
            try:
                result = sb.commands.run(["true"])
            except Exception as exc:  # counted, not fatal: the error count is the measure
                errors[i].append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            elapsed = time.perf_counter() - start
            if result.exit_code != 0:
                errors[i].append(f"exit {result.exit_code}: {result.stderr.strip()[:160]}")
            else:
                latencies[i].append(elapsed)

    try:
        for sb in sandboxes:  # one warm-up command each, outside the measurement
            sb.commands.run(["true"])
        threads = [threading.Thread(target=client, args=(i,), daemon=True)
                   for i in range(clients)]
        for t in threads:
            t.start()
        barrier.wait()
        start = time.perf_counter()
        cpu_start = cpu_times()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        cpu_end = cpu_times()
    finally:
        log("concurrency: destroying its sandboxes")
        for sb in sandboxes:
            sb.kill()
    flat = [x for per in latencies for x in per]
    all_errors = [e for per in errors for e in per]
    lat = summarize99(flat) if flat else {}
    p50, p99 = lat.get("p50_ms", 0.0), lat.get("p99_ms", 0.0)
    return {
        "clients": clients,
        "commands_per_client": commands,
        "wall_s": round(wall, 3),
        "commands_ok": len(flat),
        "throughput_commands_per_s": round(len(flat) / wall, 1),
        "latency": lat,
        "p99_over_p50": round(p99 / p50, 2) if p50 else None,
        # Near 100: the host's CPUs were the limit (server, bwrap, sandboxes and these clients
        # all share them), not waiting.
        "host_cpu_busy_percent": round(
            100 * (cpu_end[0] - cpu_start[0]) / max(1, cpu_end[1] - cpu_start[1]), 1),
        "errors": len(all_errors),
        "error_examples": sorted(set(all_errors))[:5],
        "targets": {"zero_errors": not all_errors,
                    "p99_under_10x_p50": bool(p50) and p99 < 10 * p50},
    }


# -- 3. idle density ----------------------------------------------------------------------------


def bench_density(server: Server, count: int) -> dict[str, Any]:
    assert server.proc is not None
    pid = server.proc.pid
    home = server.settings.home
    url = server.url
    time.sleep(1)
    before = {"rss": rss_bytes(pid), "mem": meminfo(), "du": du_bytes(home),
              "du_apparent": du_bytes(home, apparent=True), "loops": loop_devices_in_use(),
              "procs": process_counts()}
    log(f"density: creating {count} idle sandboxes (server RSS "
        f"{before['rss'] / 2**20:.1f} MiB, MemAvailable {before['mem']['MemAvailable'] / 2**30:.2f}"
        " GiB)")
    ids: list[str] = []
    create_s: list[float] = []
    stopped_at: str | None = None
    started = time.perf_counter()
    try:
        for i in range(count):
            t0 = time.perf_counter()
            try:
                ids.append(Sandbox.create(url=url, timeout=SANDBOX_LIFETIME_S).id)
            except Exception as exc:  # report how far it got and why, then measure that
                stopped_at = f"stopped after {len(ids)} sandboxes: {type(exc).__name__}: {exc}"
                log(f"density: {stopped_at}")
                break
            create_s.append(time.perf_counter() - t0)
            if (i + 1) % max(1, count // 10) == 0:
                log(f"  {i + 1}/{count} ({time.perf_counter() - started:.0f} s)")
        create_wall = time.perf_counter() - started
        time.sleep(2)  # let deferred work (page cache writeback, ext4 lazy init) settle a little
        n = len(ids)
        listed = len(Sandbox.list(url=url))
        after = {"rss": rss_bytes(pid), "mem": meminfo(), "du": du_bytes(home),
                 "du_apparent": du_bytes(home, apparent=True), "loops": loop_devices_in_use(),
              "procs": process_counts()}
    finally:
        log(f"density: destroying {len(ids)} sandboxes")
        t0 = time.perf_counter()
        destroy_errors: list[str] = []
        for sandbox_id in ids:
            try:
                Sandbox.connect(sandbox_id, url=url).kill()
            except Exception as exc:  # counted and shown; teardown() removes what is left
                destroy_errors.append(f"{sandbox_id}: {type(exc).__name__}: {exc}"[:300])
        destroy_wall = time.perf_counter() - t0

    def per(delta: float) -> float:
        return round(delta / n, 1) if n else 0.0

    rss_delta = after["rss"] - before["rss"]
    avail_delta = before["mem"]["MemAvailable"] - after["mem"]["MemAvailable"]
    slab_delta = after["mem"]["Slab"] - before["mem"]["Slab"]
    du_delta = after["du"] - before["du"]
    return {
        "requested": count,
        "created": n,
        "listed_by_server": listed,
        "stopped": stopped_at,
        "create_wall_s": round(create_wall, 1),
        "create_latency": summarize99(create_s) if create_s else {},
        # Does creating get slower as sandboxes pile up? p50 of the first and last tenth.
        "create_p50_ms_first_tenth": tenth_p50(create_s[:max(1, len(create_s) // 10)]),
        "create_p50_ms_last_tenth": tenth_p50(create_s[-max(1, len(create_s) // 10):]),
        "destroy_wall_s": round(destroy_wall, 1),
        "destroy_errors": len(destroy_errors),
        "destroy_error_examples": destroy_errors[:5],
        "loop_devices_in_use": {"before": before["loops"], "after_create": after["loops"]},
        # Host processes and kernel threads added by the idle sandboxes.
        "host_processes_delta": {k: after["procs"][k] - before["procs"][k]
                                 for k in before["procs"]},
        "memory": {
            "server_rss_before_mib": round(before["rss"] / 2**20, 1),
            "server_rss_after_mib": round(after["rss"] / 2**20, 1),
            "server_rss_per_sandbox_kib": round(per(rss_delta) / 1024, 1),
            "memavailable_drop_mib": round(avail_delta / 2**20, 1),
            "memavailable_drop_per_sandbox_kib": round(per(avail_delta) / 1024, 1),
            "slab_growth_per_sandbox_kib": round(per(slab_delta) / 1024, 1),
        },
        "disk": {
            "du_allocated_delta_mib": round(du_delta / 2**20, 1),
            "du_allocated_per_sandbox_kib": round(per(du_delta) / 1024, 1),
            "apparent_per_sandbox_mib": round(
                per(after["du_apparent"] - before["du_apparent"]) / 2**20, 1),
        },
    }


# -- set-up and clean-up ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="commands per transport (latency)")
    parser.add_argument("--clients", type=int, default=50, help="concurrent client threads")
    parser.add_argument("--commands", type=int, default=20, help="commands per client")
    parser.add_argument("--density", type=int, default=500, help="idle sandboxes (0: skip)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the order shuffle")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    if min(args.runs, args.clients, args.commands) < 1 or args.density < 0:
        parser.error("--runs, --clients and --commands must be at least 1, --density at least 0")
    if os.geteuid() != 0:
        log("bench_service: run as root (sandboxes need namespaces, cgroups and mounts)")
        return 2
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    load_start = os.getloadavg()[0]
    started = time.time()

    embedded = Settings(home=Path(tempfile.mkdtemp(prefix="corral-bench-svc-embedded-")),
                        uid_start=EMBEDDED_UID_START, uid_count=100)
    service = Settings(home=Path(tempfile.mkdtemp(prefix="corral-bench-svc-server-")),
                       uid_start=SERVICE_UID_START,
                       uid_count=max(1000, args.density + args.clients + 100))
    server_log = Path(tempfile.mkstemp(prefix="corral-bench-svc-", suffix=".log")[1])
    # Registered first, so Sandbox.create(home=...) finds this manager with our uid range.
    manager_mod.get_manager(embedded)
    server = Server(service, server_log)
    report: dict[str, Any] = {"benchmark": "corral HTTP service: latency, concurrency, density"}
    leftovers: list[str] = []
    try:
        log(f"bench_service: server {server.url}, home {service.home}, seed {seed}")
        server.start()
        log(f"latency: {args.runs} interleaved rounds, HTTP vs embedded")
        report["latency"] = bench_latency(server.url, str(embedded.home), args.runs, seed)
        log(f"concurrency: {args.clients} clients x {args.commands} commands")
        report["concurrency"] = bench_concurrency(server.url, args.clients, args.commands)
        if args.density:
            report["density"] = bench_density(server, args.density)
        cgroups = manager_mod.get_manager(embedded).backend.cgroups.describe()  # type: ignore[attr-defined]
    finally:
        server.stop()
        # The server's sandboxes (if a part failed half-way) go with its home: open that home
        # here, now that the server is gone, and tear it down like any other.
        manager_mod.get_manager(service)
        leftovers += teardown(service)
        leftovers += teardown(embedded)
    # The server's log is kept when something went wrong (tracebacks of 5xx answers are there).
    troubled = bool(leftovers) or any(
        report.get(part, {}).get(key) for part, key in (
            ("latency", "failures_total"), ("concurrency", "errors"), ("density", "stopped"),
            ("density", "destroy_errors")))
    if troubled:
        report["server_log"] = str(server_log)
    else:
        server_log.unlink(missing_ok=True)
    if leftovers:
        log("bench_service: leftovers after clean-up:\n  " + "\n  ".join(leftovers))
    report.update({
        "seed": seed,
        "warmup_runs": WARMUP,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "machine": machine_info("bwrap", cgroups, load_start),
        "cleanup": {"ok": not leftovers, "leftovers": leftovers},
    })
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
