"""What the cluster's gateways share, kept in Ray's GCS key-value store: the sandbox → node map,
the places claimed for sandboxes being made, which nodes hold a copy of which snapshot, the
node indices and the peer secret.

The GCS store, not a detached actor: it outlives any gateway and any one actor, several
gateways read and write it at once, and with GCS fault tolerance (external Redis) it survives
a head restart. Its one atomic operation, a put that does not overwrite, is enough for what
must be claimed once (a node index, the peer secret); everything else is written by one
gateway per key.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..errors import QuotaExceeded, SandboxNotFound
from .peer import new_secret

__all__ = ["NAMESPACE", "ClusterState"]

NAMESPACE = "corral"
_SANDBOX = "sandbox/"  # sandbox/<id> -> {"node", "identity", "tenant", "state", "at", ...}
_NODE_INDEX = "node-index/"  # node-index/<identity> -> n; node-index/#<n> -> identity
# claim/<random> -> {"tenant", "node", "count", "at"}: places held for sandboxes being made
_CLAIM = "claim/"
_COPY = "snapshot-copy/"  # snapshot-copy/<snapshot id>/<node id> -> that node's copy's id
_PEER_SECRET = b"peer-secret"
_MAX_NODES = 1024
_CLAIM_TTL_S = 600.0  # older: a crashed gateway's, no longer counted


class ClusterState:
    """The cluster's shared state, through Ray's internal KV (``ray.experimental``)."""

    def __init__(self) -> None:
        from ray.experimental import internal_kv

        self._kv = internal_kv

    # -- primitives ---------------------------------------------------------------------------

    def _get(self, key: str) -> bytes | None:
        value: bytes | None = self._kv._internal_kv_get(key.encode(), namespace=NAMESPACE)
        return value

    def _put(self, key: str, value: bytes, *, overwrite: bool = True) -> bool:
        """True when the key existed already (Ray's convention)."""
        existed: bool = self._kv._internal_kv_put(key.encode(), value, overwrite=overwrite,
                                                  namespace=NAMESPACE)
        return existed

    def _delete(self, key: str) -> None:
        self._kv._internal_kv_del(key.encode(), namespace=NAMESPACE)

    def _prefixed(self, prefix: str) -> dict[str, bytes]:
        """Every key under ``prefix`` (without it) and its value."""
        found = {}
        for key in self._kv._internal_kv_list(prefix.encode(), namespace=NAMESPACE):
            value = self._kv._internal_kv_get(key, namespace=NAMESPACE)
            if value is not None:
                found[key.decode()[len(prefix):]] = value
        return found

    # -- the sandbox map ----------------------------------------------------------------------

    def record(self, sandbox_id: str) -> dict[str, Any]:
        raw = self._get(_SANDBOX + sandbox_id)
        if raw is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id} in this cluster")
        record: dict[str, Any] = json.loads(raw)
        return record

    def put_record(self, sandbox_id: str, record: dict[str, Any]) -> None:
        self._put(_SANDBOX + sandbox_id, json.dumps(record).encode())

    def records(self) -> dict[str, dict[str, Any]]:
        return {sandbox_id: json.loads(raw)
                for sandbox_id, raw in self._prefixed(_SANDBOX).items()}

    def delete_record(self, sandbox_id: str) -> None:
        self._delete(_SANDBOX + sandbox_id)

    # -- claims -------------------------------------------------------------------------------

    def claim(self, tenant: str | None, node_id: str | None, count: int) -> str:
        """Hold ``count`` places of ``tenant`` (on ``node_id``, or for the quota alone);
        returns the claim's name, for ``release``."""
        name = new_secret().hex()[:24]
        self._put(_CLAIM + name, json.dumps({"tenant": tenant, "node": node_id, "count": count,
                                             "at": time.time()}).encode())
        return name

    def claims(self) -> list[dict[str, Any]]:
        now = time.time()
        claims = [json.loads(raw) for raw in self._prefixed(_CLAIM).values()]
        return [c for c in claims if now - float(c.get("at", 0)) < _CLAIM_TTL_S]

    def release(self, claim: str) -> None:
        self._delete(_CLAIM + claim)

    # -- snapshot copies ----------------------------------------------------------------------

    def copies(self, origin: str) -> dict[str, str]:
        """node → that node's copy of snapshot ``origin``."""
        return {node_id: local.decode()
                for node_id, local in self._prefixed(f"{_COPY}{origin}/").items()}

    def copy_ids(self) -> set[str]:
        """Every node's copy of any snapshot."""
        return {local.decode() for local in self._prefixed(_COPY).values()}

    def put_copy(self, origin: str, node_id: str, local: str) -> None:
        self._put(f"{_COPY}{origin}/{node_id}", local.encode())

    def delete_copy(self, origin: str, node_id: str) -> None:
        self._delete(f"{_COPY}{origin}/{node_id}")

    # -- once per cluster ---------------------------------------------------------------------

    def node_index(self, identity: str) -> int:
        """A small number per Corral node, the same for every gateway and across the node's
        restarts: the first free one, claimed with a put that does not overwrite."""
        known = self._get(_NODE_INDEX + identity)
        if known is not None:
            return int(known)
        for index in range(_MAX_NODES):
            if not self._put(f"{_NODE_INDEX}#{index}", identity.encode(), overwrite=False):
                self._put(_NODE_INDEX + identity, str(index).encode())
                return index
        raise QuotaExceeded(f"the cluster has more than {_MAX_NODES} Corral nodes")

    def peer_secret(self) -> bytes:
        """The cluster's secret for signing callers to nodes (``peer``): made by the first
        gateway, read by the others."""
        self._put(_PEER_SECRET.decode(), new_secret(), overwrite=False)
        secret = self._get(_PEER_SECRET.decode())
        assert secret is not None
        return secret
