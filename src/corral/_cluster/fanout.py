"""The gateway's requests to its nodes: one HTTP client, the live node list, one whole request
to a node (``ask``) and the same request to every live node (``fan_out``), each naming the
caller with a token the gateway signs (``peer``). The gateway's routing (``service``), its E2B
side (``e2b``) and its dashboard (``ui``) all take one :class:`NodeFanout`; none of them knows
the others' members."""

from __future__ import annotations

import asyncio

import httpx
from starlette.concurrency import run_in_threadpool

from .._control.plane import Tenant
from .gateway import Cluster
from .peer import sign_caller

__all__ = ["GatewayError", "NodeFanout"]

_NODE_TIMEOUT = httpx.Timeout(600.0, connect=10.0)


class GatewayError(Exception):
    """An answer the gateway gives itself (not a node's): its status, code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class NodeFanout:
    """Requests from the gateway to the nodes of ``cluster``. Close with :meth:`aclose` (the
    gateway's lifespan does)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._secret = cluster.state.peer_secret()
        self._client: httpx.AsyncClient | None = None

    def token(self, tenant: Tenant) -> bytes:
        return f"Bearer {sign_caller(tenant, self._secret)}".encode()

    def credential(self, tenant: Tenant, service: str) -> tuple[bytes, bytes]:
        """The header that names the caller to the node's ``service``: Corral's API takes
        it as a bearer token, E2B's control plane as its API key."""
        if service.startswith("e2b"):
            return b"x-api-key", sign_caller(tenant, self._secret).encode()
        return b"authorization", self.token(tenant)

    async def url(self, node_id: str, service: str = "http") -> str:
        known = self.cluster.cached_services(node_id)
        if known is None:
            known = await run_in_threadpool(self.cluster.services, node_id)
        return known[service]

    def http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=_NODE_TIMEOUT)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def ask(self, node_id: str, method: str, path: str, caller: Tenant, *,
                  query: bytes = b"", body: bytes | None = None,
                  service: str = "http") -> httpx.Response:
        """One whole request to a node (what the gateway reads itself). Raises GatewayError
        (502) when the node does not answer."""
        url = await self.url(node_id, service)
        name, value = self.credential(caller, service)
        headers = {name.decode(): value.decode()}
        if body is not None:
            headers["content-type"] = "application/json"
        target = f"{url}{path}" + (f"?{query.decode('latin-1')}" if query else "")
        try:
            return await self.http().request(method, target, content=body, headers=headers)
        except httpx.TransportError as exc:
            raise GatewayError(502, "node_unreachable", f"cluster node {node_id[:12]} did not "
                               f"answer ({exc.__class__.__name__}); try again") from None

    async def alive_nodes(self) -> list[str]:
        return [n.node_id for n in await run_in_threadpool(self.cluster.nodes)]

    async def fan_out(self, method: str, path: str, caller: Tenant, query: bytes = b"",
                      service: str = "http") -> list[httpx.Response]:
        """The same request to every live node, their answers in the node list's order."""
        nodes = await self.alive_nodes()
        return list(await asyncio.gather(*(self.ask(n, method, path, caller, query=query,
                                                    service=service) for n in nodes)))
