"""Corral over a Ray cluster (``corral._cluster``) beside one node, in the same run.

Run as root::

    .venv/bin/python bench/bench_cluster.py [--runs N] [--out FILE]

It starts a real Ray cluster on loopback (token authentication on, two raylets on this
machine, ``ray.cluster_utils``) and measures:

* ``gateway_command`` vs ``embedded_command``: ``true`` in the *same* sandbox, once through the
  gateway (gateway → node agent actor → control plane) and once through a control plane
  embedded in this process on the node's own data directory. The difference is what the
  cluster path adds (issue 17's target: +3 ms p50 at most, there against `corral serve` on one
  node, which is slower than embedded, so this comparison is the stricter one);
* ``served_command`` vs ``single_serve_command``: the same, over HTTP with the SDK, through
  ``corral serve --cluster`` (gateway process → node's service → control plane) and through
  ``corral serve`` on one node (its own data directory), interleaved: the issue's comparison;
* ``create_throughput``: 16 creates + first command through the gateway, 8 at a time, with the
  worker node's slots at 0 (one node) and then with both nodes (target: 1.7× with 2). Both
  nodes share this machine's 2 cores, so this is a lower bound of what two machines give;
* ``fork16``: a sandbox holding 100 MB forked to 16 children spread over both nodes, until a
  first command has finished in all (target: 2 s).

Prints one JSON document (progress on stderr); exit status 1 when anything is left behind.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import emit_report, log, summarize  # noqa: E402

from corral._cluster.gateway import IDENTITY_LABEL, Cluster  # noqa: E402
from corral._cluster.node import node_settings  # noqa: E402
from corral._control.manager import get_manager  # noqa: E402
from corral._settings import Settings  # noqa: E402

SLOTS = 64


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _serve(args: list[str], settings: Settings, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CORRAL_HOME": str(settings.home),
           "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    process = subprocess.Popen([sys.executable, "-m", "corral", "serve", "--port", str(port),
                                *args], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"corral serve {' '.join(args)} did not start")
        time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def served_against_single(address: str, base: Settings, runs: int
                          ) -> tuple[list[float], list[float]]:
    """``true`` over HTTP through ``corral serve --cluster`` and ``corral serve``,
    interleaved, the order alternating."""
    from corral import Sandbox

    single_home = Path(tempfile.mkdtemp(prefix="corral-bench-single-"))
    single_home.chmod(0o711)
    single = Settings(home=single_home, uid_start=base.uid_start + 100 * base.uid_count,
                      uid_count=base.uid_count)
    ports = (_free_port(), _free_port())
    processes = [_serve(["--cluster", address], base, ports[0]),
                 _serve([], single, ports[1])]
    boxes: list[Any] = []
    try:
        boxes = [Sandbox.create(url=f"http://127.0.0.1:{port}") for port in ports]
        for _ in range(5):
            for box in boxes:
                box.commands.run(["true"])
        served, one = [], []
        for i in range(runs):
            order = [(0, served), (1, one)]
            for index, out in (order if i % 2 else order[::-1]):
                out.append(timed(lambda b=boxes[index]: b.commands.run(["true"])))
        return served, one
    finally:
        for box in boxes:
            box.kill()
        for process in processes:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=20)
        manager = get_manager(single)  # the serve process's instance: swept, removed
        manager.backend.sweep(set())
        manager.backend.remove_instance()  # type: ignore[attr-defined]
        manager.close()
        shutil.rmtree(single_home, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        log("bench_cluster: run as root")
        return 2
    temp = tempfile.mkdtemp(prefix="corral-ray-bench-")
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                       "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_TMPDIR": temp})
    import ray
    from ray.cluster_utils import Cluster as RayCluster

    home = Path(tempfile.mkdtemp(prefix="corral-bench-cluster-"))
    home.chmod(0o711)
    base = Settings(home=home, uid_start=2_060_000_000, uid_count=1000)
    log("starting a two-node Ray cluster on loopback")
    cluster = RayCluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"corral": SLOTS}, "include_dashboard": False,
        "node_ip_address": "127.0.0.1", "labels": {IDENTITY_LABEL: "head"}})
    cluster.add_node(num_cpus=1, resources={"corral": SLOTS}, node_ip_address="127.0.0.1",
                     labels={IDENTITY_LABEL: "w1"})
    cluster.wait_for_nodes()
    gateway = Cluster(cluster.address, base)
    report: dict[str, Any] = {"benchmark": "corral over a Ray cluster (2 raylets, one host)",
                              "runs": args.runs, "started_at": time.strftime("%FT%T%z"),
                              "load_start": os.getloadavg()[0]}
    made: list[str] = []
    left: list[str] = []
    try:
        # -- per command: the same sandbox, through the gateway and embedded ------------
        info = gateway.create(tenant="bench")
        made.append(info.id)
        node = gateway.node_of(info.id)
        identity = gateway._identity_of(node)
        embedded = get_manager(Settings(**node_settings(base, gateway.state.node_index(identity),
                                                        identity)))
        for _ in range(5):
            gateway.run(info.id, ["true"], tenant="bench")
            embedded.run(info.id, ["true"])
        through, direct = [], []
        for i in range(args.runs):  # interleaved, the order alternating
            pair = [("g", lambda: gateway.run(info.id, ["true"], tenant="bench")),
                    ("e", lambda: embedded.run(info.id, ["true"]))]
            for name, fn in (pair if i % 2 else pair[::-1]):
                (through if name == "g" else direct).append(timed(fn))
        report["gateway_command"] = summarize(through)
        report["embedded_command"] = summarize(direct)
        added = report["gateway_command"]["p50_ms"] - report["embedded_command"]["p50_ms"]
        report["gateway_adds_p50_ms"] = round(added, 3)
        log(f"command: gateway adds {added:.2f} ms p50")

        # -- per command over HTTP: corral serve --cluster vs corral serve ---------------
        served_ms, single_ms = served_against_single(cluster.address, base, args.runs)
        report["served_command"] = summarize(served_ms)
        report["single_serve_command"] = summarize(single_ms)
        served_added = report["served_command"]["p50_ms"] - \
            report["single_serve_command"]["p50_ms"]
        report["served_adds_p50_ms"] = round(served_added, 3)
        log(f"command over HTTP: corral serve --cluster adds {served_added:.2f} ms p50")

        # -- create throughput, one node then two ---------------------------------------
        def burst(label: str, tenant: str) -> float:
            def one() -> str:
                child = gateway.create(tenant=tenant)
                gateway.run(child.id, ["true"], tenant=tenant)
                return child.id

            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                ids = list(pool.map(lambda _: one(), range(16)))
            elapsed = time.perf_counter() - start
            made.extend(ids)
            for sid in ids:
                gateway.destroy(sid, tenant=tenant)
                made.remove(sid)
            log(f"{label}: 16 creates + first command in {elapsed:.2f} s")
            return 16 / elapsed

        # Both node agents up and warm first: an agent's start (an actor, a control plane,
        # its recovery) is paid once per node, not per create.
        for view in gateway.nodes():
            ray.get(gateway.agent(view.node_id).describe.remote())
        burst("warm-up", "burst-0")
        original = gateway.nodes
        head_only = [n for n in original() if n.identity == "head"]
        gateway.nodes = lambda: head_only  # type: ignore[method-assign]
        try:
            one_node = burst("one node", "burst-1")
        finally:
            gateway.nodes = original  # type: ignore[method-assign]
            gateway._alive_cache = None  # the one-node view must not outlive the patch
        two_nodes = burst("two nodes", "burst-2")
        report["create_throughput_per_s"] = {"one_node": round(one_node, 2),
                                             "two_nodes": round(two_nodes, 2),
                                             "ratio": round(two_nodes / one_node, 3)}

        # -- fork of a 100 MB sandbox to 16 over both nodes -----------------------------
        big = gateway.create(tenant="fork")
        made.append(big.id)
        gateway.run(big.id, "head -c 100000000 /dev/urandom > blob", tenant="fork",
                    timeout=60)
        start = time.perf_counter()
        children = gateway.fork(big.id, 16, tenant="fork")
        made.extend(c.id for c in children)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda c: gateway.run(c.id, ["true"], tenant="fork"), children))
        fork_s = time.perf_counter() - start
        spread = {}
        for child in children:
            spread[gateway._identity_of(gateway.node_of(child.id))] = spread.get(
                gateway._identity_of(gateway.node_of(child.id)), 0) + 1
        report["fork16_100mb_s"] = round(fork_s, 3)
        report["fork16_spread"] = spread
        log(f"fork x16 of 100 MB: {fork_s:.2f} s, spread {spread}")
        # -- a sandbox from a 100 MB snapshot on another node: the copy, then cached ----
        snap = gateway.snapshot(big.id, tenant="fork")
        home_node = gateway.node_of(big.id)
        other = next(n.node_id for n in gateway.nodes() if n.node_id != home_node)

        def started_on(node_id: str, snapshot_id: str) -> float:
            def one() -> None:
                child = ray.get(gateway.agent(node_id).create.remote(
                    {"snapshot": snapshot_id, "tenant": "fork"}))
                ray.get(gateway.agent(node_id).run.remote(child.id, ["true"], "fork", {}))
                ray.get(gateway.agent(node_id).destroy.remote(child.id, "fork"))
            return timed(one)

        at_home = [started_on(home_node, snap.id) for _ in range(5)]
        copy_s = timed(lambda: gateway.snapshot_on(other, home_node, snap.id))
        local = gateway.snapshot_on(other, home_node, snap.id)
        from_copy = [started_on(other, local) for _ in range(5)]
        report["snapshot_100mb_copy_s"] = round(copy_s, 3)
        report["create_from_snapshot_at_home"] = summarize(at_home)
        report["create_from_snapshot_copy"] = summarize(from_copy)
        log(f"100 MB snapshot to the other node once: {copy_s:.2f} s; then create + first "
            f"command + destroy from the copy {report['create_from_snapshot_copy']['p50_ms']}"
            f" ms p50 against {report['create_from_snapshot_at_home']['p50_ms']} ms at home")
        gateway.destroy(big.id, tenant="fork")
        made.remove(big.id)
        gateway.delete_snapshot(snap.id, tenant="fork")
        report["targets"] = {
            "gateway_adds_at_most_3ms": added <= 3.0,
            "served_gateway_adds_at_most_3ms": served_added <= 3.0,
            "two_nodes_create_at_least_1.7x": two_nodes / one_node >= 1.7,
            "fork16_at_most_2s": fork_s <= 2.0}
    finally:
        for sid in made:
            try:
                gateway.destroy(sid)
            except Exception as exc:  # noqa: BLE001 - reported below
                left.append(f"sandbox {sid}: {exc}")
        gateway.close_nodes()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
    report["load_end"] = os.getloadavg()[0]
    report["cleanup"] = {"ok": not left, "leftovers": left}
    return emit_report(report, args.out) or (1 if left else 0)


if __name__ == "__main__":
    raise SystemExit(main())
