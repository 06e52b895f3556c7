"""A real Ray cluster for the tests: a GCS and two raylets on loopback in this machine
(``ray.cluster_utils.Cluster``), token authentication on, named "head" and "w1" for Corral;
and a gateway over it, embedded (``Cluster``) or as ``corral serve --cluster``.

Bounded: loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps Ray from advertising the
host's other address); teardown destroys every node's sandboxes (a dead node's through its own
data directory's recovery, as a node coming back would) and checks no Ray process is left.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from corral._backends._linux.ready import spare_owner
from corral._backends._linux.storage import mounts_under
from corral._cluster.gateway import IDENTITY_LABEL, Cluster
from corral._cluster.node import node_settings
from corral._core.owner import owner_alive
from corral._settings import Settings

from ..conftest import managed
from .servers import free_port

SLOTS = 12
_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_TMPDIR")
# One per test process: Ray reads the token once per process, so every cluster a session
# starts (one per module) must share it.
_TOKEN = secrets.token_hex(32)


def add_worker(cluster: Any) -> Any:
    """The second node, always under the Corral name "w1" (a restart is the same node)."""
    return cluster.add_node(num_cpus=1, resources={"corral": SLOTS},
                            node_ip_address="127.0.0.1", labels={IDENTITY_LABEL: "w1"})


@contextlib.contextmanager
def ray_cluster() -> Iterator[tuple[Any, Any]]:
    """(the Ray cluster, its worker node); this process is not connected to it yet."""
    saved = {k: os.environ.get(k) for k in _ENV}
    temp = tempfile.mkdtemp(prefix="corral-ray-")
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": _TOKEN,
                       "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_TMPDIR": temp})
    from ray.cluster_utils import Cluster as RayCluster

    cluster = RayCluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"corral": SLOTS}, "include_dashboard": False,
        "node_ip_address": "127.0.0.1", "labels": {IDENTITY_LABEL: "head"}})
    try:
        worker = add_worker(cluster)
        yield cluster, worker
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(temp, ignore_errors=True)
        left = subprocess.run(["pgrep", "-f", temp], capture_output=True, text=True)
        assert left.stdout == "", f"Ray processes left: {left.stdout}"


def gateway_settings() -> Settings:
    home = Path(tempfile.mkdtemp(prefix="corral-cluster-"))
    home.chmod(0o711)
    return Settings(home=home, uid_start=2_080_000_000 + secrets.randbelow(500) * 10_000,
                    uid_count=1000)


@contextlib.contextmanager
def embedded_gateway(cluster: Any, base: Settings | None = None) -> Iterator[Cluster]:
    """A ``Cluster`` in this process; on the way out, every node's sandboxes destroyed and
    its agent stopped, and the gateway's data directory removed."""
    base = base or gateway_settings()
    gw = Cluster(cluster.address, base)
    try:
        yield gw
    finally:
        indices = {name: gw.state.node_index(name) for name in ("head", "w1")}
        gw.close_nodes()
        for name, index in indices.items():
            overrides = node_settings(base, index, name)
            if Path(overrides["home"]).exists():
                _stop_spare_owners(Path(overrides["home"]))
                with managed(Settings(**overrides)) as manager:
                    manager.recover()
        left = mounts_under(base.home)
        shutil.rmtree(base.home, ignore_errors=True)
        assert left == [], left


def _stop_spare_owners(home: Path, timeout: float = 30) -> None:
    """Stop the node processes still holding spare workspaces (``.ready.<pid>.<start>...``)
    in ``home`` once ``close_nodes`` is done: a node whose raylet was removed outlives it,
    under load for more than 30 s (its Ray worker notices late), and its spares are swept only
    once it is gone. SIGKILL is the death Ray would deliver; the start time guards against a
    reused pid."""
    root = home / "sandboxes"
    if not root.is_dir():
        return
    owners = {owner for owner in (spare_owner(p.name) for p in root.iterdir()) if owner}
    live = [(pid, start) for pid, start in (o.split(".", 1) for o in owners)
            if owner_alive(pid, start)]
    for pid, _ in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(owner_alive(*owner) for owner in live) and time.monotonic() < deadline:
        time.sleep(0.1)


class ServedGateway:
    """``corral serve --cluster`` in a process of its own, on loopback, with the E2B
    dialect beside it."""

    def __init__(self, cluster: Any, base: Settings, *, host: str = "127.0.0.1",
                 e2b_port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        self.host = host
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.e2b_port = e2b_port or free_port()
        self.e2b_url = f"http://{host}:{self.e2b_port}"
        self.base = base
        self._extra = extra
        self._cluster = cluster
        self._process: subprocess.Popen[bytes] | None = None
        self.log = base.home / "gateway.log"

    def start(self) -> ServedGateway:
        env = {**os.environ, "CORRAL_HOME": str(self.base.home),
               "CORRAL_UID_START": str(self.base.uid_start),
               "CORRAL_UID_COUNT": str(self.base.uid_count)}
        with self.log.open("ab") as out:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "corral", "serve", "--cluster", self._cluster.address,
                 "--host", self.host, "--port", str(self.port), "--e2b-port",
                 str(self.e2b_port), *self._extra], env=env,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            assert self._process.poll() is None, self.log.read_text()[-3000:]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200:
                    return self
            assert time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.2)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait(timeout=10)
        self._process = None

    def kill(self) -> None:
        """A gateway crash."""
        if self._process is not None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait(timeout=10)
        self._process = None


@contextlib.contextmanager
def served_gateway(cluster: Any) -> Iterator[tuple[ServedGateway, Cluster]]:
    """``corral serve --cluster`` and, in this process, the same gateway embedded (to look
    at the map and the nodes, and to tear down)."""
    base = gateway_settings()
    with embedded_gateway(cluster, base) as gw:
        served = ServedGateway(cluster, base).start()
        try:
            yield served, gw
        finally:
            served.stop()
