"""The cluster gateway: places each new sandbox on a Corral node and routes its calls there.

Nodes come from Ray's membership: every alive node that offers the ``corral`` resource gets a
Corral node agent (``node``), a detached named actor pinned to it. Placement is by free slots
(the node's ``corral`` resource is its slot count) with tenants spread (fewest of the caller's
sandboxes first, then fewest in all) and, from a snapshot, the nodes that hold its layers
preferred. Creates and forks claim their places before they reach a node, so the tenant's
quota holds across the cluster and across gateways. The shared state (sandbox → node, claims,
snapshot copies) is in Ray's GCS (``state``).

A dead node's sandboxes are reported ``lost`` (``SandboxLost``) on every call instead of a
hang, and destroyed by the node if it comes back under its name; every node's audit lines are
shipped as they are written to a sink beside the gateway (``audit``), so a lost sandbox's
trail still reads back. Forks and creates from a snapshot may land on other nodes: the
workspace moves node to node through Ray's object store, once per node (``copies``).

This is the gateway's Python face; ``service`` serves the HTTP API over it
(``corral serve --cluster``), relaying each sandbox's calls to its node's own service.
"""

from __future__ import annotations

import builtins
import logging
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._audit.log import AuditTrail
from .._control.plane import Tenant, check_sandbox_count, network_spec
from .._settings import Settings
from ..errors import (
    BackendUnavailable,
    QuotaExceeded,
    SandboxLost,
    SandboxNotFound,
    SnapshotNotFound,
    UsageError,
)
from ..models import CommandResult, SandboxInfo, SnapshotInfo
from .audit import AuditSink
from .auth import require_token_auth
from .node import NodeAgent, node_settings
from .state import NAMESPACE, ClusterState

__all__ = ["IDENTITY_LABEL", "Cluster", "NodeView"]

log = logging.getLogger(__name__)

RESOURCE = "corral"
# Placement counts a node without a snapshot's layers as holding this many more of the
# tenant's sandboxes: creates from one snapshot stay where its layers are until the load is
# this uneven, then the layers are copied over (once per node) and creates spread.
_COPY_WEIGHT = 2
_CAPACITY_TTL_S = 5.0
# Threads per node agent: its commands run side by side (Ray's default actor is one thread).
_AGENT_CONCURRENCY = 256
_MEMBERSHIP_TTL_S = 0.5
# How old a sandbox, or its record, must be before reconcile judges the map against a node.
_SETTLE_S = 30.0


#: The Ray node label that names a Corral node across restarts (``ray start --labels``): a
#: node started again under the same name gets the same data directory and uid range back, so
#: it finds and cleans what its previous run left. Without it the Ray node id names it.
IDENTITY_LABEL = "corral-node"


@dataclass(frozen=True, slots=True)
class NodeView:
    """An alive Ray node that offers Corral slots."""

    node_id: str
    address: str
    slots: int
    #: the Corral node's name: its ``corral-node`` label, else its Ray node id
    identity: str


@dataclass(frozen=True, slots=True)
class SnapshotSource:
    """Where a snapshot was taken."""

    node_id: str
    snapshot_id: str
    memory: bool


@dataclass(frozen=True, slots=True)
class Admission:
    """New sandboxes admitted (``Cluster.admit``): their node and the claim holding their
    places until they are recorded."""

    node_id: str  # "" when admitted for the quota only
    claim: str
    #: the snapshot to start from, as that node names it (its own copy, if it is another's)
    snapshot: str | None


class Cluster:
    """A connection to a Ray cluster of Corral nodes, as a gateway uses it. Thread-safe."""

    def __init__(self, address: str, settings: Settings | None = None, *,
                 e2b_domain: str | None = None) -> None:
        require_token_auth("the gateway")
        try:
            import ray
        except ImportError:  # pragma: no cover - ray is in the lock
            raise BackendUnavailable("the cluster needs Ray: pip install 'corral[cluster]'") \
                from None
        self._ray = ray
        self._settings = settings or Settings()
        #: E2B's domain mode, if this gateway serves it: each node then serves it too
        self.e2b_domain = e2b_domain
        if not ray.is_initialized():
            ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING,
                     log_to_driver=False, configure_logging=False)
        self.state = ClusterState()
        self._lock = threading.Lock()
        self._agents: dict[str, Any] = {}
        self._alive_cache: tuple[float, set[str]] | None = None
        self._identities: dict[str, str] = {}  # Ray node id -> Corral node name
        # sandbox -> node: never changes once written (a lost state is re-read, see _route)
        self._placed: dict[str, str] = {}
        self._service_urls: dict[str, dict[str, str]] = {}
        self._copying: dict[tuple[str, str], threading.Lock] = {}
        self._admitting = threading.Lock()
        self._capacity: tuple[float, dict[str, dict[str, Any]]] | None = None
        self._secret = self.state.peer_secret()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # The audit copy lives beside the first gateway (its node, its data directory).
        self._sink: Any = ray.remote(AuditSink).options(
            name="corral-audit-sink", namespace=NAMESPACE, get_if_exists=True,
            lifetime="detached", num_cpus=0, max_concurrency=64,
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(str(self._settings.home / "cluster-audit"))

    @property
    def home(self) -> Path:
        """The gateway's data directory (its keys, sessions and the audit copy)."""
        return Path(self._settings.home)

    # -- membership and node agents ---------------------------------------------------------

    def nodes(self) -> builtins.list[NodeView]:
        """The alive nodes that offer the ``corral`` resource."""
        views = [NodeView(node["NodeID"], node.get("NodeManagerAddress", ""),
                          int(node["Resources"][RESOURCE]),
                          _identity(node.get("Labels") or {}, node["NodeID"]))
                 for node in self._ray.nodes()  # type: ignore[no-untyped-call]
                 if node.get("Alive") and node.get("Resources", {}).get(RESOURCE, 0) >= 1]
        with self._lock:  # a Ray node's identity never changes: remembered for _identity_of
            self._identities.update((view.node_id, view.identity) for view in views)
        return views

    def _alive(self) -> set[str]:
        """The alive nodes' ids, asked of the GCS at most every ``_MEMBERSHIP_TTL_S`` on the
        call path (a call to a node that died meanwhile fails as the actor dies, and says
        lost then)."""
        now = time.monotonic()
        with self._lock:
            cached = self._alive_cache
        if cached is not None and now - cached[0] < _MEMBERSHIP_TTL_S:
            return cached[1]
        alive = {node.node_id for node in self.nodes()}
        with self._lock:
            self._alive_cache = (now, alive)
        return alive

    def _identity_of(self, node_id: str) -> str:
        with self._lock:
            known = self._identities.get(node_id)
        if known is None:
            self.nodes()
            with self._lock:
                known = self._identities.get(node_id, node_id)
        return known

    def agent(self, node_id: str) -> Any:
        """The node's agent (a detached named actor pinned to it), started on first use."""
        with self._lock:
            handle = self._agents.get(node_id)
        if handle is not None:
            return handle
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        identity = self._identity_of(node_id)
        overrides = node_settings(self._settings, self.state.node_index(identity), identity)
        remote = self._ray.remote(NodeAgent)
        handle = remote.options(
            name=f"corral-node-{node_id}", namespace=NAMESPACE, get_if_exists=True,
            lifetime="detached", num_cpus=0, max_concurrency=_AGENT_CONCURRENCY,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(overrides, node_id, self._sink)
        with self._lock:
            self._agents[node_id] = handle
        return handle

    # -- the sandbox map ----------------------------------------------------------------------

    def _route(self, sandbox_id: str, tenant: str | None) -> Any:
        """The agent of the sandbox's node (``node_for``)."""
        return self.agent(self.node_for(sandbox_id, tenant))

    def cached_node(self, sandbox_id: str, tenant: str | None) -> str | None:
        """``node_for`` from memory alone, without any I/O (the event loop's fast path), or
        None when it would have to ask the GCS."""
        now = time.monotonic()
        with self._lock:
            known = self._placed.get(f"{tenant}\0{sandbox_id}")
            cached = self._alive_cache
        if known is None or cached is None or now - cached[0] >= _MEMBERSHIP_TTL_S:
            return None
        return known if known in cached[1] else None

    def cached_services(self, node_id: str) -> dict[str, str] | None:
        with self._lock:
            return self._service_urls.get(node_id)

    def node_for(self, sandbox_id: str, tenant: str | None) -> str:
        """The sandbox's node; SandboxNotFound when it is not the tenant's (``None``: any
        tenant), SandboxLost when its node is gone. A sandbox this gateway placed or saw
        alive is routed from memory (its node never changes); the store is asked only
        otherwise, and when its node is not alive."""
        with self._lock:
            known = self._placed.get(f"{tenant}\0{sandbox_id}")
        if known is not None and known in self._alive():
            return known
        record = self.state.record(sandbox_id)
        if tenant is not None and record.get("tenant") != tenant:
            raise SandboxNotFound(f"no sandbox {sandbox_id} in this cluster")
        if record.get("state") != "lost" and record["node"] not in self._alive():
            with self._lock:  # a node missing from a cached view: asked again, not assumed
                self._alive_cache = None
        if record.get("state") == "lost" or record["node"] not in self._alive():
            self._lose(sandbox_id, record)
            raise SandboxLost(
                f"sandbox {sandbox_id} was on cluster node {record['node'][:12]}, which is "
                "gone: its processes and workspace went with it. Create a new sandbox (from a "
                "snapshot, if you kept one)")
        with self._lock:
            self._placed[f"{tenant}\0{sandbox_id}"] = record["node"]
        return str(record["node"])

    def after_break(self, sandbox_id: str) -> SandboxLost | None:
        """A connection to the sandbox's node broke: SandboxLost (and the sandbox marked
        lost) if the node's agent is dead or its node left the cluster, else None (the node
        lives: the break was the connection's)."""
        try:
            record = self.state.record(sandbox_id)
        except SandboxNotFound:
            return None
        agent = self.agent(record["node"])
        try:
            self._ray.get(agent.describe.remote(), timeout=10)
            return None
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
            pass
        self._lose(sandbox_id, record)
        with self._lock:
            self._alive_cache = None
        return SandboxLost(f"sandbox {sandbox_id}'s cluster node died during the call: its "
                           "processes and workspace went with it. Create a new sandbox (from "
                           "a snapshot, if you kept one)")

    def services(self, node_id: str) -> dict[str, str]:
        """The node's service URLs (``NodeAgent.serve``: ``http``, ``e2b``, and
        ``e2b:DOMAIN`` for this gateway's ``e2b_domain``), started on first use."""
        with self._lock:
            known = self._service_urls.get(node_id)
        if known is not None:
            return known
        urls: dict[str, str] = self._call_node(self.agent(node_id).serve.remote(
            self._secret, None, self.e2b_domain))
        with self._lock:
            self._service_urls[node_id] = urls
        return urls

    def _placed_on(self, sandbox_id: str, node_id: str, tenant: str | None) -> None:
        """Record a new sandbox's node, in the store and in this gateway's routing memory."""
        self.state.put_record(sandbox_id, {"node": node_id, "identity": self._identity_of(node_id),
                               "tenant": tenant, "state": "live", "at": time.time()})
        with self._lock:
            self._placed[f"{tenant}\0{sandbox_id}"] = node_id

    def _lose(self, sandbox_id: str, record: dict[str, Any]) -> None:
        if record.get("state") != "lost":
            self.state.put_record(sandbox_id, {**record, "state": "lost"})
            log.warning("sandbox %s is lost with node %s", sandbox_id, record["node"][:12])

    def _call_node(self, ref: Any) -> Any:
        """Wait for a call to a node that is about no sandbox; its own errors raised as
        themselves."""
        try:
            return self._ray.get(ref)
        except self._ray.exceptions.RayTaskError as exc:
            cause = exc.as_instanceof_cause()  # type: ignore[no-untyped-call]
            raise (cause.cause if hasattr(cause, "cause") and isinstance(
                cause.cause, Exception) else cause) from None

    def _call(self, sandbox_id: str, ref: Any) -> Any:
        """Wait for a call to a node; a node that dies under it makes the sandbox lost."""
        try:
            return self._call_node(ref)
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.ActorDiedError):
            record = self.state.record(sandbox_id)
            self._lose(sandbox_id, record)
            raise SandboxLost(f"sandbox {sandbox_id}'s cluster node died during the call")\
                from None

    def reconcile(self) -> builtins.list[str]:
        """Mark the sandboxes of dead nodes lost; have a node that is back (the same Corral
        node name under a new Ray node) destroy what was declared lost while it was away.
        Returns the ids newly marked lost."""
        nodes = self.nodes()
        alive = {node.node_id for node in nodes}
        back = {node.identity: node.node_id for node in nodes}
        newly = []
        forget: dict[str, builtins.list[str]] = {}
        for sandbox_id, record in self.state.records().items():
            if record["node"] not in alive and record.get("state") != "lost":
                self._lose(sandbox_id, record)
                newly.append(sandbox_id)
            if record["node"] not in alive and not record.get("forgotten") and \
                    record.get("identity") in back:
                forget.setdefault(back[record["identity"]], []).append(sandbox_id)
        for node_id, ids in forget.items():
            self._ray.get(self.agent(node_id).forget.remote(ids))
            for sandbox_id in ids:  # still lost to callers; nothing of it is left anywhere
                self.state.put_record(sandbox_id,
                                      {**self.state.record(sandbox_id), "forgotten": True})
        self._tidy(nodes, self.state.records())
        return newly

    def _tidy(self, nodes: builtins.list[NodeView], records: dict[str, dict[str, Any]]) -> None:
        """Make the map agree with what the alive nodes hold, for sandboxes older than
        ``_SETTLE_S`` (younger ones may be between a node's answer and their record): record
        what a node holds that the map lacks (a gateway that died between a node's create
        and its own record: a gateway crash loses nothing), and forget what a node no longer
        holds (it expired there). Only agents this gateway already reaches are asked."""
        now = time.time()
        with self._lock:
            started = [n for n in nodes if n.node_id in self._agents]
        for node in started:
            held = {sandbox_id: (tenant, created) for sandbox_id, tenant, created in
                    self._ray.get(self.agent(node.node_id).holdings.remote())}
            for sandbox_id, (tenant, created) in held.items():
                if sandbox_id not in records and now - created > _SETTLE_S:
                    log.warning("adopting sandbox %s of node %s, which no gateway recorded",
                                sandbox_id, node.node_id[:12])
                    self._placed_on(sandbox_id, node.node_id, tenant)
            for sandbox_id, record in records.items():
                if record["node"] == node.node_id and sandbox_id not in held and \
                        now - record.get("at", 0) > _SETTLE_S:
                    self._forget(sandbox_id)

    # -- placement and the sandbox calls ------------------------------------------------------

    def _counts(self, tenant: str | None) -> tuple[dict[str, int], dict[str, int], int]:
        """Live sandboxes per node, the tenant's per node, and the tenant's in all (lost ones
        released), with the places claimed for sandboxes being made (a claim without a node
        counts for the quota only)."""
        per_node: dict[str, int] = {}
        per_tenant: dict[str, int] = {}
        total = 0
        held = [(r["node"], r.get("tenant"), 1) for r in self.state.records().values()
                if r.get("state") != "lost"]
        held += [(c.get("node"), c.get("tenant"), int(c.get("count", 1)))
                 for c in self.state.claims()]
        for node_id, owner, count in held:
            if node_id is not None:
                per_node[node_id] = per_node.get(node_id, 0) + count
            if owner == tenant:
                total += count
                if node_id is not None:
                    per_tenant[node_id] = per_tenant.get(node_id, 0) + count
        return per_node, per_tenant, total

    def place(self, tenant: str | None, pending: dict[str, int] | None = None,
              holding: Collection[str] = (),
              counts: tuple[dict[str, int], dict[str, int], int] | None = None) -> str:
        """The node for a new sandbox: one with a free slot, fewest of this tenant's sandboxes
        first (spread), then fewest in all. ``pending``: sandboxes of this tenant already
        placed on a node but not recorded yet (a fork's other children). ``holding``: the
        nodes that hold the layers it starts from, preferred by ``_COPY_WEIGHT``. ``counts``:
        ``_counts(tenant)`` if the caller has just read it."""
        nodes = self.nodes()
        if not nodes:
            raise BackendUnavailable("no cluster node offers the 'corral' resource: start one "
                                     "with `ray start ... --resources='{\"corral\": N}'`")
        read = counts or self._counts(tenant)
        per_node, per_tenant = dict(read[0]), dict(read[1])
        for node_id, extra in (pending or {}).items():
            per_node[node_id] = per_node.get(node_id, 0) + extra
            per_tenant[node_id] = per_tenant.get(node_id, 0) + extra
        free = [n for n in nodes if per_node.get(n.node_id, 0) < n.slots]
        if not free:
            raise QuotaExceeded(f"every cluster node is full ({sum(n.slots for n in nodes)} "
                                "slots in all): destroy sandboxes or add nodes")

        def cost(node: NodeView) -> tuple[int, int, str]:
            copying = _COPY_WEIGHT if holding and node.node_id not in holding else 0
            return (per_tenant.get(node.node_id, 0) + copying, per_node.get(node.node_id, 0),
                    node.node_id)

        return min(free, key=cost).node_id

    # -- snapshots across nodes ---------------------------------------------------------------

    def snapshot_source(self, ref: str, tenant: str | None) -> SnapshotSource | None:
        """Where the snapshot ``ref`` (id or name, the tenant's) was taken: its node, its id,
        whether it holds memory. None when no alive node has it."""
        nodes = self.nodes()
        asked = [(n.node_id, self.agent(n.node_id).find_snapshot.remote(ref, tenant))
                 for n in nodes]
        for node_id, ref_found in asked:
            try:
                found = self._ray.get(ref_found, timeout=60)
            except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
                continue  # a node dying meanwhile: its snapshots are gone with it
            if found is not None:
                return SnapshotSource(node_id, str(found["id"]), bool(found["memory"]))
        return None

    def snapshot_on(self, node_id: str, home: str, origin: str) -> str:
        """The id on ``node_id`` of ``home``'s snapshot ``origin``: itself at home, else that
        node's copy, made first if it has none (the workspace moves through Ray's object store
        from ``home`` to ``node_id``, never through this gateway)."""
        if node_id == home:
            return origin
        agent = self.agent(node_id)
        local: str | None = self._ray.get(agent.snapshot_copy.remote(origin), timeout=60)
        if local is None:
            with self._lock:
                making = self._copying.setdefault((node_id, origin), threading.Lock())
            with making:  # one export per node, however many creates of it wait here
                local = self._ray.get(agent.snapshot_copy.remote(origin), timeout=60)
                if local is None:
                    exported = self.agent(home).export_snapshot.remote(origin, None)
                    local = self._ray.get(agent.copy_snapshot.remote(exported))
        assert local is not None
        self.state.put_copy(origin, node_id, local)
        return local

    def drop_copies_of(self, ref: str, tenant: str | None) -> SnapshotSource | None:
        """Find snapshot ``ref`` (the tenant's; anyone's with None) and delete every node's
        copy of it (``drop_copies``); its source, or None when no alive node has it."""
        source = self.snapshot_source(ref, tenant)
        if source is not None:
            self.drop_copies(source.snapshot_id)
        return source

    def drop_copies(self, origin: str) -> None:
        """Delete every node's copy of snapshot ``origin`` (before the snapshot itself goes);
        ``SnapshotInUse`` from a node where a sandbox is built on its copy (and what was not
        dropped yet stays)."""
        alive = self._alive()
        for node_id in self.state.copies(origin):
            if node_id in alive:
                self._call_node(self.agent(node_id).drop_snapshot_copy.remote(origin))
            self.state.delete_copy(origin, node_id)

    def _check_quota(self, tenant: str | None, max_for_tenant: int | None, adding: int,
                     live: int | None = None) -> None:
        """The tenant's sandboxes across the cluster (``live``, unless read here), those
        being made included, checked here; each node checks its own share again."""
        if max_for_tenant is None:
            return
        if live is None:
            live = self._counts(tenant)[2]
        # The control plane's rule and words, with the cluster's count.
        check_sandbox_count(tenant or "local", live, max_for_tenant, adding=adding)

    def capacity(self, *, max_age_s: float = 0.0) -> dict[str, dict[str, Any]]:
        """Every alive node's ``describe()`` (sandboxes, free memory and disk, templates
        present) with its slots, asked of the nodes at once; reused for ``max_age_s``."""
        now = time.monotonic()
        with self._lock:
            cached = self._capacity
        if cached is not None and now - cached[0] < max_age_s:
            return cached[1]
        views = self.nodes()
        asked = [(view, self.agent(view.node_id).describe.remote()) for view in views]
        found = {}
        for view, ref in asked:
            try:
                found[view.node_id] = {**self._ray.get(ref, timeout=30), "slots": view.slots,
                                       "identity": view.identity}
            except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
                continue  # a node dying meanwhile has no capacity to speak of
        with self._lock:
            self._capacity = (now, found)
        return found

    def admit(self, tenant: str | None, max_for_tenant: int | None, *, count: int = 1,
              node_id: str | None = None, snapshot: str | None = None,
              any_tenants: bool = False, place: bool = True,
              template: str | None = None) -> Admission:
        """Admit ``count`` new sandboxes of ``tenant``: its quota across the cluster checked,
        a node chosen (``node_id`` if decided already; none with ``place=False``), and the
        places claimed, so that creates at once, through this gateway or another, never
        pass the quota together. From ``snapshot`` (the tenant's; anyone's with
        ``any_tenants``), the nodes holding its layers are preferred and it is copied to the node
        chosen if it is not there. ``release`` the claim once the sandboxes are recorded (or
        were not made)."""
        holding: set[str] = set()
        source = None
        if snapshot is not None:
            source = self.snapshot_source(snapshot, None if any_tenants else tenant)
        if source is not None and source.memory:  # its memory image cannot travel
            if node_id is not None and node_id != source.node_id:
                raise UsageError(f"snapshot {snapshot} holds memory, which stays on its own "
                                 "cluster node, and the volume is on another: start the "
                                 "sandbox without one of them")
            node_id = source.node_id
        elif source is not None:
            holding = {source.node_id, *self.state.copies(source.snapshot_id)}
        elif template not in (None, "base") and node_id is None and place:
            # A template is built per node: the nodes that have it, if any do.
            holding = {n for n, c in self.capacity(max_age_s=_CAPACITY_TTL_S).items()
                       if template in c.get("templates", ())}
        with self._admitting:
            # One read of the map and the claims serves the quota and the placement.
            counts = self._counts(tenant)
            self._check_quota(tenant, max_for_tenant, count, live=counts[2])
            if node_id is None and place:
                node_id = self.place(tenant, holding=holding, counts=counts)
            claim = self.state.claim(tenant, node_id, count)
        try:
            # Another gateway's claim made meanwhile is counted now: if both passed the
            # check above, both see the other here (at worst both refuse).
            self._check_quota(tenant, max_for_tenant, 0)
            local = None
            if source is not None and node_id is not None:
                local = self.snapshot_on(node_id, source.node_id, source.snapshot_id)
        except BaseException:
            self.release(claim)
            raise
        return Admission(node_id or "", claim, local)

    def release(self, claim: str) -> None:
        self.state.release(claim)

    def create(self, *, tenant: str | None = None, max_for_tenant: int | None = None,
               **kwargs: Any) -> SandboxInfo:
        """Create a sandbox on the node ``place`` picks, within the tenant's cluster-wide
        ``max_for_tenant`` (the node's control plane checks the request again, exactly as on
        one host)."""
        admitted = self.admit(tenant, max_for_tenant, snapshot=kwargs.get("snapshot"),
                              template=kwargs.get("template"))
        try:
            if max_for_tenant is not None:
                kwargs["max_for_tenant"] = max_for_tenant
            if admitted.snapshot is not None:
                kwargs["snapshot"] = admitted.snapshot
            agent = self.agent(admitted.node_id)
            info: SandboxInfo = self._call_node(agent.create.remote(
                {**kwargs, "tenant": tenant}))
            self._placed_on(info.id, admitted.node_id, tenant)
        finally:
            self.release(admitted.claim)
        return info

    def fork(self, sandbox_id: str, count: int = 1, *, tenant: str | None = None,
             max_for_tenant: int | None = None, caller: Tenant | None = None,
             memory: bool = False) -> builtins.list[SandboxInfo]:
        """``count`` children of a sandbox, placed like new sandboxes (so they may land on
        other nodes), each within ``caller``'s ceiling. On the sandbox's own node they are
        native forks; for the others the workspace is exported once and moves node to node
        through Ray's object store, once per node, where the first child is made from it and
        the rest fork from that one, with the source's template, tier, isolation, labels,
        network policy, idle timeout and lifecycle. A memory fork, or one of a sandbox holding
        secrets (a node's secret store is its own), stays on the sandbox's node."""
        if count < 1:
            raise UsageError(f"fork needs a count of at least 1, not {count}")
        admitted = self.admit(tenant, max_for_tenant, count=count, place=False)
        try:
            return self._fork(sandbox_id, count, tenant, caller, memory)
        finally:
            self.release(admitted.claim)

    def _fork(self, sandbox_id: str, count: int, tenant: str | None, caller: Tenant | None,
              memory: bool) -> builtins.list[SandboxInfo]:
        source = self._route(sandbox_id, tenant)
        home = self.node_of(sandbox_id)
        info: SandboxInfo = self._call(sandbox_id, source.get.remote(sandbox_id, tenant))
        per_node: dict[str, int] = {}
        for _ in range(count):
            target = home if (memory or info.secrets) else self.place(tenant, per_node)
            per_node[target] = per_node.get(target, 0) + 1
        children: builtins.list[SandboxInfo] = []

        def record(node_id: str, made: builtins.list[SandboxInfo]) -> None:
            for child in made:
                self._placed_on(child.id, node_id, tenant)
            children.extend(made)

        if per_node.get(home):
            # First and alone: a fork seals the workspace, and the export below forks too.
            record(home, self._call(sandbox_id, source.fork.remote(
                sandbox_id, per_node[home], tenant, caller, memory)))
        others = {n: c for n, c in per_node.items() if n != home}
        if others:
            kwargs = {"template": info.template, "resources": info.resources,
                      "labels": dict(info.labels), "isolation": info.isolation,
                      "network": network_spec(info.network), "idle_timeout": info.idle_timeout,
                      "lifecycle": info.lifecycle, "tenant": tenant, "caller": caller}
            workspace = source.export_fork.remote(sandbox_id, tenant)  # a reference only
            imports = [(node_id, self.agent(node_id).import_fork.remote(workspace, kwargs, n))
                       for node_id, n in others.items()]
            for node_id, ref in imports:
                record(node_id, self._call(sandbox_id, ref))
        return children

    def snapshot(self, sandbox_id: str, *, name: str | None = None,
                 tenant: str | None = None) -> SnapshotInfo:
        """Snapshot a sandbox on its node; sandboxes on any node can start from it
        (``create(snapshot=...)``)."""
        agent = self._route(sandbox_id, tenant)
        snap: SnapshotInfo = self._call(sandbox_id, agent.snapshot.remote(sandbox_id, tenant,
                                                                          name))
        return snap

    def delete_snapshot(self, ref: str, *, tenant: str | None = None) -> None:
        """Delete a snapshot and every node's copy of it (``SnapshotInUse`` while a sandbox
        is built on it or on a copy: then the snapshot stays)."""
        source = self.drop_copies_of(ref, tenant)
        if source is None:
            raise SnapshotNotFound(f"snapshot {ref!r} is on no alive node of this cluster")
        self._call_node(self.agent(source.node_id).delete_snapshot.remote(
            source.snapshot_id, tenant))

    def audit(self, sandbox_id: str, *, tenant: str | None = None) -> AuditTrail:
        """The sandbox's audit trail as shipped from its node: everything committed there up
        to the last shipment (every 0.1 s), readable whether the node is alive or lost."""
        record = self.state.record(sandbox_id)
        if tenant is not None and record.get("tenant") != tenant:
            raise SandboxNotFound(f"no sandbox {sandbox_id} in this cluster")
        trail: AuditTrail = self._ray.get(self._sink.trail.remote(sandbox_id))
        return trail

    def node_of(self, sandbox_id: str) -> str:
        return str(self.state.record(sandbox_id)["node"])

    def get(self, sandbox_id: str, *, tenant: str | None = None) -> SandboxInfo:
        agent = self._route(sandbox_id, tenant)
        info: SandboxInfo = self._call(sandbox_id, agent.get.remote(sandbox_id, tenant))
        return info

    def list(self, *, tenant: str | None = None) -> builtins.list[SandboxInfo]:
        """Every live sandbox of the alive nodes (a dead node's are lost, not listed)."""
        infos: builtins.list[SandboxInfo] = []
        for node in self.nodes():
            infos.extend(self._ray.get(self.agent(node.node_id).list.remote(tenant)))
        return infos

    def run(self, sandbox_id: str, cmd: str | Sequence[str], *, tenant: str | None = None,
            **kwargs: Any) -> CommandResult:
        agent = self._route(sandbox_id, tenant)
        result: CommandResult = self._call(
            sandbox_id, agent.run.remote(sandbox_id, cmd, tenant, kwargs))
        return result

    def write_file(self, sandbox_id: str, path: str, data: bytes, *,
                   tenant: str | None = None) -> None:
        agent = self._route(sandbox_id, tenant)
        self._call(sandbox_id, agent.write_file.remote(sandbox_id, tenant, path, data))

    def read_file(self, sandbox_id: str, path: str, *, tenant: str | None = None) -> bytes:
        agent = self._route(sandbox_id, tenant)
        data: bytes = self._call(sandbox_id, agent.read_file.remote(sandbox_id, tenant, path))
        return data

    def destroy(self, sandbox_id: str, *, tenant: str | None = None) -> None:
        try:
            agent = self._route(sandbox_id, tenant)
        except SandboxLost:
            self._forget(sandbox_id)  # nothing is left of it to destroy
            return
        self._call(sandbox_id, agent.destroy.remote(sandbox_id, tenant))
        self._forget(sandbox_id)

    def _forget(self, sandbox_id: str) -> None:
        with self._lock:
            for key in [k for k in self._placed if k.endswith("\0" + sandbox_id)]:
                del self._placed[key]
        self.state.delete_record(sandbox_id)

    def close_nodes(self) -> None:
        """Destroy every sandbox of every alive node and stop the node agents (tests, and an
        operator taking the cluster down)."""
        for node in self.nodes():
            agent = self.agent(node.node_id)
            try:
                self._ray.get(agent.close.remote())
            finally:
                self._ray.kill(agent)
        for sandbox_id in self.state.records():
            self._forget(sandbox_id)
        with self._lock:
            self._agents.clear()


def _identity(labels: dict[str, str], node_id: str) -> str:
    """A node's Corral name: its label if it is a plain name, else its Ray node id."""
    name = labels.get(IDENTITY_LABEL, "")
    if name and len(name) <= 63 and all(c.isalnum() or c in "._-" for c in name) \
            and name[0].isalnum():
        return name
    return node_id
