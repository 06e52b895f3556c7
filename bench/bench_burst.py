"""Bursts: N sandboxes created at once, each to its first command's result, embedded and over HTTP.

Run as root::

    .venv/bin/python bench/bench_burst.py [--sizes 10,100,500] [--modes embedded,http] [--out F]

For each mode and size N, N threads wait at a barrier, then each creates a sandbox and runs
``true`` in it; a sample is the time from the barrier to that thread's result. Then the same
number of sandboxes (at most ``--serial-max``) is made one after another in one thread: the
serial rate is the reference measured in the same run. Reported per burst: p50/p95/p99 of
create-to-first-result, the burst's throughput (N over the time to the last result) and its
ratio to the serial rate (above 1: concurrency bought something). The sandboxes of a burst
are destroyed after it (timed apart, as ``destroy_s``). First, as the host's own reference,
bare ``bwrap --unshare-all true`` (root) one after another and then as many at once (at most
100): the ratio it reaches bounds what namespaces allow here.

``embedded`` uses one in-process manager; ``http`` starts ``python -m corral serve`` on
127.0.0.1 with its own data directory. Everything made is removed at the end; a leftover is
listed under ``cleanup`` and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import (  # noqa: E402
    BWRAP_ROOT,
    DEFAULT_UID_START,
    emit_report,
    percentile,
    run_checked,
    teardown,
)
from bench_service import Server  # noqa: E402

from corral import Sandbox  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

LIFETIME_S = 600


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _target(mode: str, home: Path, url: str | None) -> dict[str, Any]:
    return {"url": url} if mode == "http" else {"home": str(home)}


def one(target: dict[str, Any]) -> tuple[Sandbox, float]:
    """Create a sandbox and run its first command; the sandbox and when the result came."""
    sandbox = Sandbox.create(timeout=LIFETIME_S, **target)
    result = sandbox.commands.run(["true"])
    if result.exit_code != 0:
        raise RuntimeError(f"`true` exited {result.exit_code}: {result.stderr}")
    return sandbox, time.perf_counter()


def _at_once(n: int, worker: Callable[[], None], barrier: threading.Barrier) -> float:
    """Run ``worker`` on ``n`` threads that each wait at ``barrier`` (of ``n + 1``) first;
    when they were let go, once all have finished."""
    threads = [threading.Thread(target=worker) for _ in range(n)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    return start


def _host_mounts() -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(1 for _ in f)


def _bare_bwrap_ms(bwrap: str, runs: int = 20) -> float:
    """p50 of a bare root bwrap run now: its mount namespace is a copy of the host's whole
    mount table, so it grows with every mount a live sandbox adds."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run_checked([bwrap, *BWRAP_ROOT])
        times.append((time.perf_counter() - start) * 1000)
    return round(percentile(sorted(times), 0.5), 2)


def burst(target: dict[str, Any], n: int, bwrap: str) -> dict[str, Any]:
    barrier = threading.Barrier(n + 1)
    done: list[tuple[Sandbox, float]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        barrier.wait()
        try:
            got = one(target)
        except Exception as exc:  # a failed create is counted, not fatal
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
            return
        with lock:
            done.append(got)

    start = _at_once(n, worker, barrier)
    latencies = sorted((at - start) * 1000 for _, at in done)
    end = max((at for _, at in done), default=start)
    alive = {"host_mounts": _host_mounts(), "bare_bwrap_p50_ms": _bare_bwrap_ms(bwrap)}
    destroy_start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda item: item[0].kill(), done))
    report: dict[str, Any] = {
        "n": n, "ok": len(done), "failed": len(errors), "errors": sorted(set(errors))[:5],
        "destroy_s": round(time.perf_counter() - destroy_start, 3),
        "while_alive": alive,
        "after": {"host_mounts": _host_mounts(), "bare_bwrap_p50_ms": _bare_bwrap_ms(bwrap)},
    }
    if latencies:
        report |= {
            "p50_ms": round(percentile(latencies, 0.5), 1),
            "p95_ms": round(percentile(latencies, 0.95), 1),
            "p99_ms": round(percentile(latencies, 0.99), 1),
            "max_ms": round(latencies[-1], 1),
            "throughput_per_s": round(len(done) / max(end - start, 1e-9), 1),
        }
    return report


def serial(target: dict[str, Any], n: int) -> dict[str, Any]:
    made: list[Sandbox] = []
    start = time.perf_counter()
    for _ in range(n):
        made.append(one(target)[0])
    took = time.perf_counter() - start
    for sandbox in made:
        sandbox.kill()
    return {"n": n, "rate_per_s": round(n / took, 1), "mean_ms": round(took / n * 1000, 2)}


def bare_bwrap(bwrap: str, n: int) -> dict[str, Any]:
    """The kernel's own reference: ``n`` bare ``bwrap --unshare-all true`` one after another,
    then ``n`` at once from ``n`` threads. Namespace set-up (a network namespace, a copy of
    the mount table) takes locks of the kernel's; what these reach is what any sandbox built
    on namespaces can reach on this host."""
    argv = [bwrap, *BWRAP_ROOT]
    start = time.perf_counter()
    for _ in range(n):
        run_checked(argv)
    serial_rate = n / (time.perf_counter() - start)
    barrier = threading.Barrier(n + 1)
    ends: list[float] = []

    def worker() -> None:
        barrier.wait()
        run_checked(argv)
        ends.append(time.perf_counter())

    start = _at_once(n, worker, barrier)
    if len(ends) != n:
        raise RuntimeError(f"only {len(ends)} of {n} bare bwrap runs succeeded")
    latencies = sorted((at - start) * 1000 for at in ends)
    burst_rate = n / (max(ends) - start)
    return {"n": n, "serial_rate_per_s": round(serial_rate, 1),
            "burst_rate_per_s": round(burst_rate, 1),
            "burst_over_serial": round(burst_rate / serial_rate, 2),
            "p50_ms": round(percentile(latencies, 0.5), 1),
            "p99_ms": round(percentile(latencies, 0.99), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,100,500")
    parser.add_argument("--modes", default="embedded,http")
    parser.add_argument("--serial-max", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        log("bench_burst: run as root")
        return 2
    sizes = [int(s) for s in args.sizes.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    if not sizes or min(sizes) < 1 or set(modes) - {"embedded", "http"}:
        parser.error("--sizes takes positive integers; --modes embedded and/or http")
    uid_count = max(1000, 2 * max(sizes))
    results: dict[str, Any] = {}
    leftovers: list[str] = []
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        log("bench_burst: needs bwrap (Debian's bubblewrap) for its reference")
        return 2
    log("reference: bare bwrap, serial then at once")
    reference_rows = [bare_bwrap(bwrap, n) for n in sorted({min(n, 100) for n in sizes})]
    for mode in modes:
        home = Path(tempfile.mkdtemp(prefix="corral-bench-"))
        settings = Settings(home=home, uid_start=int(os.environ.get(
            "CORRAL_UID_START", DEFAULT_UID_START)), uid_count=uid_count)
        server: Server | None = None
        url = None
        try:
            if mode == "http":
                server = Server(settings, home.parent / f"{home.name}.log")
                server.start()
                url = server.url
            else:
                manager_mod.get_manager(settings)
            target = _target(mode, home, url)
            one(target)[0].kill()  # warm: templates loaded, recovery done
            rows = []
            for n in sizes:
                log(f"{mode}: serial reference ({min(n, args.serial_max)}), then a burst of {n}")
                reference = serial(target, min(n, args.serial_max))
                row = burst(target, n, bwrap)
                row["serial"] = reference
                if "throughput_per_s" in row:
                    row["throughput_over_serial"] = round(
                        row["throughput_per_s"] / reference["rate_per_s"], 2)
                rows.append(row)
            results[mode] = rows
        finally:
            if server is not None:
                server.stop()
                (home.parent / f"{home.name}.log").unlink(missing_ok=True)
                manager_mod.get_manager(settings)  # to sweep what the server left
            leftovers += teardown(settings)
            shutil.rmtree(home, ignore_errors=True)
    report = {
        "benchmark": "burst: N concurrent create -> first command result",
        "nproc": os.cpu_count(),
        "bare_bwrap": reference_rows,
        "results": results,
        # None where no burst of 100 ran (all() of nothing would say it was met).
        "targets": {"p99_under_1s_at_100": all(at_100) if (at_100 := [
            r.get("p99_ms", 1e9) <= 1000 for rows in results.values() for r in rows
            if r["n"] == 100]) else None},
        "cleanup": {"ok": not leftovers, "leftovers": leftovers},
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
