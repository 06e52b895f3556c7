"""Corral over a real Ray cluster (issue 17, first part): two Ray nodes on loopback in this
process's machine (``ray.cluster_utils.Cluster``: a real GCS and two real raylets), token
authentication on, a Corral node agent per node, the gateway placing and routing.

Bounded: every command has a timeout, the cluster is loopback-only
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps Ray from advertising the host's other address),
and teardown destroys every node's sandboxes (the dead node's through its own data directory's
recovery) and checks no raylet is left.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral._cluster.auth import require_token_auth
from corral._cluster.gateway import Cluster
from corral._cluster.node import NodeAgent
from corral._templates.catalog import METADATA, build_dir, set_current
from corral.errors import (
    ConfigError,
    QuotaExceeded,
    SandboxLost,
    SandboxNotFound,
    SnapshotInUse,
    SnapshotNotFound,
)

from .raycluster import add_worker, embedded_gateway
from .raycluster import ray_cluster as start_ray_cluster

pytestmark = pytest.mark.needs_root


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[tuple[Any, Any]]:
    with start_ray_cluster() as pair:
        yield pair


@pytest.fixture(scope="module")
def gateway(ray_cluster: tuple[Any, Any]) -> Iterator[Cluster]:
    with embedded_gateway(ray_cluster[0]) as gw:
        yield gw


def host_pieces(sandbox_id: str) -> list[str]:
    """What of a sandbox is on the host: mounts, cgroups, network namespace pins, processes
    in its cgroups."""
    found = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
             if sandbox_id in line]
    found += [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/*/{sandbox_id}")]
    found += [str(p) for p in Path("/run").glob(f"**/*{sandbox_id}*")]
    return found


def test_sandboxes_spread_over_the_nodes_and_calls_reach_their_node(gateway: Cluster) -> None:
    nodes = {node.node_id for node in gateway.nodes()}
    assert len(nodes) == 2
    made = [gateway.create(tenant=("team-a" if i % 2 else "team-b")) for i in range(20)]
    try:
        placed = {info.id: gateway.node_of(info.id) for info in made}
        per_node = {node: sum(1 for n in placed.values() if n == node) for node in nodes}
        assert sorted(per_node.values()) == [10, 10], per_node
        for tenant in ("team-a", "team-b"):  # each tenant spread too
            mine = [placed[i.id] for i in made if gateway.state.record(i.id)["tenant"] == tenant]
            assert sorted(mine.count(n) for n in nodes) == [5, 5]
        for node in nodes:  # a node's agent holds exactly the sandboxes placed on it
            held = {info.id for info in gateway._ray.get(gateway.agent(node).list.remote(None))}
            assert held == {sid for sid, n in placed.items() if n == node}
        for info in made[:4]:
            tenant = gateway.state.record(info.id)["tenant"]
            gateway.write_file(info.id, "/workspace/in.txt", info.id.encode(), tenant=tenant)
            result = gateway.run(info.id, "cat in.txt; echo; whoami", tenant=tenant, timeout=30)
            assert result.exit_code == 0 and result.stdout.split()[0] == info.id, result
            assert gateway.read_file(info.id, "/workspace/in.txt", tenant=tenant) == \
                info.id.encode()
        # Another tenant's sandbox is not found, as on one host.
        owner = gateway.state.record(made[0].id)["tenant"]
        with pytest.raises(SandboxNotFound):
            gateway.run(made[0].id, "true", tenant="team-a" if owner == "team-b" else "team-b")
        assert {info.id for info in gateway.list()} >= set(placed)
    finally:
        for info in made:
            gateway.destroy(info.id)
    assert not gateway.state.records()


TREE_HASH = ("cd /workspace && find . -type f -print0 | sort -z | xargs -0 sha256sum | "
             "sha256sum && find . | sort | sha256sum")


def test_a_fork_lands_on_both_nodes_with_the_same_tree(gateway: Cluster) -> None:
    source = gateway.create(tenant="team-f")
    children: list[Any] = []
    try:
        made = gateway.run(source.id, "mkdir -p d/e && head -c 3000000 /dev/urandom > d/big "
                           "&& echo hi > d/e/small && ln -s d/e/small link && chmod 750 d/e",
                           tenant="team-f", timeout=30)
        assert made.exit_code == 0, made
        want = gateway.run(source.id, TREE_HASH, tenant="team-f", timeout=30).stdout
        children = gateway.fork(source.id, 4, tenant="team-f")
        nodes = {gateway.node_of(child.id) for child in children}
        assert len(nodes) == 2, "the children did not spread over both nodes"
        assert gateway.node_of(source.id) in nodes  # native forks beside the copies
        for child in children:
            got = gateway.run(child.id, TREE_HASH, tenant="team-f", timeout=30)
            assert got.stdout == want, (gateway.node_of(child.id), got)
        # The children are independent of their source and of each other.
        gateway.run(children[0].id, "echo changed > d/e/small", tenant="team-f")
        assert gateway.run(children[1].id, "cat d/e/small", tenant="team-f").stdout == "hi\n"
        assert gateway.run(source.id, "cat d/e/small", tenant="team-f").stdout == "hi\n"
    finally:
        for info in [*children, source]:
            gateway.destroy(info.id, tenant="team-f")


def test_a_snapshot_starts_sandboxes_on_either_node(gateway: Cluster) -> None:
    source = gateway.create(tenant="team-s")
    made: list[Any] = []
    try:
        gateway.write_file(source.id, "/workspace/state.txt", b"sealed", tenant="team-s")
        snap = gateway.snapshot(source.id, name="team-s-seed", tenant="team-s")
        made = [gateway.create(tenant="team-s", snapshot="team-s-seed") for _ in range(3)]
        assert len({gateway.node_of(info.id) for info in made}) == 2
        for info in made:
            assert gateway.read_file(info.id, "/workspace/state.txt", tenant="team-s") == \
                b"sealed"
        with pytest.raises(SnapshotInUse):
            gateway.delete_snapshot("team-s-seed", tenant="team-s")
    finally:
        for info in [*made, source]:
            gateway.destroy(info.id, tenant="team-s")
    assert len(gateway.state.copies(snap.id)) == 1
    gateway.delete_snapshot("team-s-seed", tenant="team-s")
    assert gateway.state.copies(snap.id) == {}
    with pytest.raises(SnapshotNotFound):
        gateway.delete_snapshot("team-s-seed", tenant="team-s")


def test_nodes_publish_capacity_and_a_template_draws_creates_to_its_node(
        gateway: Cluster) -> None:
    capacity = gateway.capacity()
    assert len(capacity) == 2
    for node in capacity.values():
        assert node["slots"] > 0 and node["free_memory_bytes"] > 0
        assert node["free_disk_bytes"] > 0 and "base" in node["templates"]
    # A template present on one node only (laid out as a build is): creates naming it go there.
    target = sorted(capacity)[1]
    templates = Path(capacity[target]["home"]) / "templates"
    templates.mkdir(exist_ok=True)
    build = build_dir(templates, "onlyhere", "0" * 16)
    (build / "root").mkdir(parents=True)
    (build / METADATA).write_text(json.dumps({"built_at": time.time(), "build_s": 0,
                                              "size_bytes": 0, "spec": {"packages": []}}))
    set_current(templates, "onlyhere", "0" * 16)
    try:
        assert "onlyhere" in gateway.capacity()[target]["templates"]
        for _ in range(3):
            admitted = gateway.admit("team-t", None, template="onlyhere")
            gateway.release(admitted.claim)
            assert admitted.node_id == target
    finally:
        shutil.rmtree(build)
        (templates / "onlyhere.current").unlink()
    assert not [c for c in gateway.state.claims() if c.get("tenant") == "team-t"]


def test_a_sandbox_cannot_reach_the_ray_ports(gateway: Cluster,
                                              ray_cluster: tuple[Any, Any]) -> None:
    cluster, _ = ray_cluster
    host, port = cluster.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5):
        pass  # the GCS listens on the host's loopback
    info = gateway.create(tenant="team-a")
    try:
        probe = ("import socket,sys\n"
                 f"s=socket.socket(); s.settimeout(3)\n"
                 f"try: s.connect(('127.0.0.1', {port})); print('connected')\n"
                 "except OSError as e: print('refused', e.errno)\n")
        result = gateway.run(info.id, ["python3", "-c", probe], tenant="team-a", timeout=30)
        assert result.stdout.startswith("refused"), result
    finally:
        gateway.destroy(info.id, tenant="team-a")


def test_a_dead_node_makes_its_sandboxes_lost_and_the_rest_keeps_working(
        gateway: Cluster, ray_cluster: tuple[Any, Any]) -> None:
    cluster, worker = ray_cluster
    made = [gateway.create(tenant="team-c") for _ in range(4)]
    on_worker = [i.id for i in made if gateway.node_of(i.id) == worker.node_id]
    on_head = [i.id for i in made if gateway.node_of(i.id) != worker.node_id]
    assert on_worker and on_head
    outcome: dict[str, BaseException | object] = {}

    def long_command() -> None:
        try:
            outcome["result"] = gateway.run(on_worker[0], "sleep 50", tenant="team-c",
                                            timeout=55)
        except BaseException as exc:
            outcome["error"] = exc

    runner = threading.Thread(target=long_command)
    runner.start()
    time.sleep(2)  # the command is in flight on the worker node
    started = time.monotonic()
    cluster.remove_node(worker)  # its raylet, and the node agent with it, die
    runner.join(timeout=60)
    assert not runner.is_alive(), "the in-flight command hung after its node died"
    assert isinstance(outcome.get("error"), SandboxLost), outcome
    assert time.monotonic() - started < 60
    for sandbox_id in on_worker:  # every call now says lost, at once
        for name, call in (("run", lambda sid: gateway.run(sid, "true", tenant="team-c")),
                           ("get", lambda sid: gateway.get(sid, tenant="team-c"))):
            before = time.monotonic()
            with pytest.raises(SandboxLost, match="gone|died"):
                call(sandbox_id)
            assert time.monotonic() - before < 10, name
    gateway.reconcile()
    assert all(gateway.state.record(s)["state"] == "lost" for s in on_worker)
    # The lost sandbox's trail reads back from the gateway's copy, up to the command that was
    # in flight: shipped as written, in order, no line twice.
    trail = gateway.audit(on_worker[0], tenant="team-c")
    types = [event.type for event in trail.events]
    assert types[0] == "sandbox.created" and "command.started" in types, types
    started = [e for e in trail.events if e.type == "command.started"][-1]
    assert "sleep 50" in str(started.data), started
    assert "command.finished" not in types[types.index("command.started"):], types
    assert [e.seq for e in trail.events] == list(range(1, len(trail.events) + 1))
    assert not trail.torn_tail and trail.skipped == 0
    with pytest.raises(SandboxNotFound):
        gateway.audit(on_worker[0], tenant="team-a")
    for sandbox_id in on_head:  # the surviving node and the gateway keep working
        assert gateway.run(sandbox_id, "echo alive", tenant="team-c").stdout == "alive\n"
    # The lost sandboxes no longer count against the tenant's cluster-wide quota.
    assert sum(1 for r in gateway.state.records().values()
               if r["tenant"] == "team-c" and r["state"] != "lost") == len(on_head)
    new = gateway.create(tenant="team-c", max_for_tenant=len(on_head) + 1)
    assert gateway.node_of(new.id) != worker.node_id  # placed on the surviving node only
    with pytest.raises(QuotaExceeded, match="team-c"):
        gateway.create(tenant="team-c", max_for_tenant=len(on_head) + 1)
    assert all(host_pieces(s) for s in on_worker)  # the dead node's leftovers, for now
    # The node comes back (a new raylet, the same Corral node): it cleans what its previous
    # run left, and destroys the sandboxes the cluster declared lost; they stay lost.
    restarted = add_worker(cluster)
    cluster.wait_for_nodes()
    assert restarted.node_id in {n.node_id for n in gateway.nodes()}
    gateway.reconcile()
    assert all(host_pieces(s) == [] for s in on_worker), [host_pieces(s) for s in on_worker]
    held = gateway._ray.get(gateway.agent(restarted.node_id).list.remote(None))
    assert not {info.id for info in held} & set(on_worker)
    with pytest.raises(SandboxLost):
        gateway.run(on_worker[0], "true", tenant="team-c")
    for sandbox_id in [*on_worker, *on_head, new.id]:
        gateway.destroy(sandbox_id, tenant="team-c")  # a lost one is only forgotten


def test_ray_without_token_auth_is_refused() -> None:
    with pytest.raises(ConfigError, match="token authentication"):
        require_token_auth("the gateway", {"RAY_AUTH_MODE": "disabled"})
    with pytest.raises(ConfigError, match="RAY_AUTH_MODE=token"):
        require_token_auth("the gateway", {})
    require_token_auth("the gateway", {"RAY_AUTH_MODE": "token"})
    # A node whose raylet runs without it refuses before it serves anything.
    saved = os.environ.pop("RAY_AUTH_MODE", None)
    try:
        with pytest.raises(ConfigError, match="Corral node"):
            NodeAgent({"home": "/nonexistent"}, "0" * 56)
    finally:
        if saved is not None:
            os.environ["RAY_AUTH_MODE"] = saved
