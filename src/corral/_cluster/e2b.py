"""The E2B dialect through the cluster gateway (``corral serve --cluster --e2b-port``).

Each node runs the E2B app over its own control plane (``NodeAgent.serve``); this app only
decides what the node cannot: which node a request is for. A sandbox's envd and code
interpreter calls name their sandbox in the ``E2b-Sandbox-Id`` header (URL mode, E2B SDKs
≥ 2.7) and go, access token and all, to that sandbox's node, which checks the token it issued.
Control-plane calls are authenticated here with the caller's E2B key, which becomes a caller
token the node verifies (``peer``): creates are placed as Corral's own are (from a snapshot
template on any node, the snapshot copied there once), lists are asked of every node, and a
sandbox's own calls go to its node. Refusals are E2B-shaped (``{"code", "message"}``), as the
node's own are.

Domain mode (``--e2b-domain``; TLS ends here): ``<port>-<id>.<domain>`` names its sandbox,
so envd, the interpreter, an app's ports and signed URLs go to that sandbox's node, whose own
E2B app for the same domain routes by the Host this gateway passes on; ``api.<domain>`` is
the control plane. Not through a gateway: the URL-mode calls that name no sandbox (signed
``/files`` URLs without ``E2b-Sandbox-Id``, an access token alone): they are refused with a
message that says why, since only a scan of every node could place them.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from .._control.plane import Store, Tenant, TenantDirectory
from .._e2b.app import _own_port
from .._http.deps import scope as scope_of
from .._http.guard import HostGuard, ServiceNames
from .._http.relay import send_json
from .._ids import from_e2b, to_e2b
from ..errors import AuthError, CorralError, SandboxLost, SandboxNotFound
from .fanout import GatewayError
from .gateway import Cluster
from .service import _Gateway, _read_request

__all__ = ["create_cluster_e2b_app"]

# The paths of a sandbox's envd and code interpreter (the E2B app's own list).
_SANDBOX_PATH = re.compile(r"/health|/files|/execute|/contexts(/.*)?|"
                           r"/(process\.Process|filesystem\.Filesystem)/[A-Za-z]+")
_BY_ID = re.compile(r"(?:/v2)?/sandboxes/([A-Za-z0-9_-]{1,80})(/[a-z]+)?")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


class _E2BGateway:
    def __init__(self, core: _Gateway, tenants: TenantDirectory, names: ServiceNames,
                 domain: str | None) -> None:
        self._core = core
        self._cluster: Cluster = core._cluster
        self._tenants = tenants
        self._names = names
        # Domain mode: each node's E2B app for the same domain routes by the client's Host,
        # which the relay passes on.
        self._service = f"e2b:{domain}" if domain else "e2b"
        self._sandbox_host = re.compile(rf"\d{{1,5}}-([a-z0-9-]{{1,63}})\.{re.escape(domain)}") \
            if domain else None
        self._domain = domain
        self._api_host = f"api.{domain}" if domain else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._core._lifespan(receive, send)
            return
        if scope["type"] not in ("http", "websocket"):
            return
        try:
            await self._dispatch(scope, receive, send)
        except (CorralError, GatewayError) as exc:
            await send_json(send, exc.status, {"code": exc.status, "message": exc.message})

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        named = _header(scope, b"e2b-sandbox-id")
        if self._sandbox_host is not None:
            host = _header(scope, b"host") or ""
            name = host.rsplit(":", 1)[0].lower()
            by_host = self._sandbox_host.fullmatch(name)
            if by_host is not None:  # <port>-<id>.DOMAIN: envd, the interpreter, an app
                await self._to_sandbox(scope, receive, send, by_host.group(1), None)
                return
            if name != self._api_host and not self._names.allows(host, _own_port(scope)):
                raise GatewayError(421, "misdirected_request", f"Host {host[:80]!r} is neither "
                             f"{self._api_host} nor <port>-<sandbox>.{self._domain}")
        if _SANDBOX_PATH.fullmatch(path):
            if named is None:
                raise GatewayError(400, "invalid_request", "through a Corral cluster gateway, name "
                             "the sandbox with the E2b-Sandbox-Id header (E2B SDKs >= 2.7 do, "
                             "with E2B_SANDBOX_URL set); signed URLs and domain mode are not "
                             "served here")
            await self._to_sandbox(scope, receive, send, named, None)
            return
        try:
            caller = await run_in_threadpool(self._tenants.authenticate_key,
                                             _header(scope, b"x-api-key"))
        except AuthError as exc:
            raise GatewayError(401, exc.code, exc.message) from None
        method = scope.get("method", "GET")
        if path in ("/sandboxes", "/v2/sandboxes") and method == "POST":
            await self._create(scope, receive, send, caller)
        elif path in ("/sandboxes", "/v2/sandboxes", "/snapshots") and method == "GET":
            await self._list(send, path, caller, scope.get("query_string", b""))
        elif (found := _BY_ID.fullmatch(path)) is not None:
            await self._to_sandbox(scope, receive, send, found.group(1), caller)
        elif path.startswith("/templates/") and method == "DELETE":
            snapshot = from_e2b(path.removeprefix("/templates/"))
            if snapshot is not None and snapshot.startswith("snap_"):  # its copies first
                await run_in_threadpool(self._core._drop_copies, snapshot, scope_of(caller))
            answers = await self._core.nodes.fan_out("DELETE", path, caller, service=self._service)
            hit = [a for a in answers if a.status_code != 404]
            await self._core._send_answer(send, (hit or answers)[0])
        else:  # the rest is the same on every node (health, what is not offered)
            alive = await self._core.nodes.alive_nodes()
            if not alive:
                raise GatewayError(503, "backend_unavailable", "no cluster node is alive")
            node_id = alive[0]
            await self._core._relay(scope, receive, send, node_id, "", caller, self._service)

    async def _to_sandbox(self, scope: Scope, receive: Receive, send: Send, e2b_id: str,
                          caller: Tenant | None) -> None:
        sandbox_id = from_e2b(e2b_id)
        owner = None if caller is None else scope_of(caller)
        try:
            if sandbox_id is None:
                raise SandboxNotFound(e2b_id)
            node_id = await self._core._node_for(sandbox_id, owner)
        except SandboxNotFound:
            # E2B's own answer for a sandbox it does not know (E2B-COMPAT §7.5).
            await send_json(send, 404 if caller is not None else 502, {
                "sandboxId": e2b_id[:64], "message": "The sandbox was not found",
                "code": 404 if caller is not None else 502})
            return
        except SandboxLost as exc:
            await send_json(send, 410, {"code": 410, "message": exc.message})
            return
        status = await self._core._relay(scope, receive, send, node_id, sandbox_id, caller,
                                         self._service)
        if caller is not None and scope.get("method") == "DELETE" and \
                scope["path"].count("/") == 2 and status == 204:
            await run_in_threadpool(self._cluster._forget, sandbox_id)

    async def _create(self, scope: Scope, receive: Receive, send: Send,
                      caller: Tenant) -> None:
        body, request = await _read_request(receive)
        template = request.get("templateID")
        snapshot = from_e2b(template) if isinstance(template, str) else None
        await self._core._send_answer(send, await self._core.create_on(
            None, caller, scope["path"], body, service=self._service,
            snapshot=snapshot if snapshot is not None and snapshot.startswith("snap_")
            else None,
            naming=lambda request, local: {**request, "templateID": to_e2b(local)},
            made_id=lambda made: from_e2b(str(made.get("sandboxID", "")))))

    async def _list(self, send: Send, path: str, caller: Tenant, query: bytes) -> None:
        """Every node's answer in one list. Paging is per node, so the gateway asks each for
        everything and passes no next token on."""
        answers = await self._core.nodes.fan_out("GET", path, caller, query, service=self._service)
        # Nodes' copies of other nodes' snapshots are theirs: the caller sees the originals.
        hidden = {to_e2b(i) for i in await run_in_threadpool(self._cluster.state.copy_ids)} \
            if path == "/snapshots" else set()
        items: list[Any] = []
        for answer in answers:
            if answer.status_code != 200:
                await self._core._send_answer(send, answer)
                return
            items.extend(item for item in answer.json()
                         if item.get("snapshotID") not in hidden)
        await send_json(send, 200, items)


def create_cluster_e2b_app(cluster: Cluster, store: Store, *, listen_host: str = "127.0.0.1",
                           host_names: tuple[str, ...] | list[str] = ()) -> ASGIApp:
    """The gateway's E2B listener: Host checked, then routed as above (in domain mode, for
    ``cluster.e2b_domain``, the domain's names are its own too)."""
    tenants = TenantDirectory(store)
    names = ServiceNames.of(listen_host, host_names)
    app = _E2BGateway(_Gateway(cluster, tenants), tenants, names, cluster.e2b_domain)
    return app if cluster.e2b_domain else HostGuard(app, names=names)

