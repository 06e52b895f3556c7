"""``corral serve --cluster``: Corral's HTTP API over a Ray cluster of Corral nodes.

The gateway authenticates the caller with its own keys (this data directory's tenants), then
relays each request, unchanged but for its credentials, to the node that holds the sandbox:
the node's own service (``NodeAgent.serve``) runs the same app as ``corral serve`` over that
node's control plane, and it is told who calls by a caller token the gateway signs
(``peer``). Streaming command output, files and tar streams, PTY WebSockets, background
processes and exposed ports therefore behave exactly as on one host, and the tenancy,
ceilings, quotas and audit that hold there hold here, enforced on the node again.

The gateway itself decides only what spans nodes: where a new sandbox goes (``Cluster.place``;
a snapshot's or volume's own node when the request names one), the tenant's sandbox quota
across the cluster, forks whose children land on other nodes (``Cluster.fork``), the lists
(asked of every node), a lost sandbox's answers (410 ``sandbox_lost``, at once; its audit trail
from the gateway's shipped copy), and the sandbox → node map, kept in Ray's GCS so another
gateway, or this one restarted, routes the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._control.plane import Store, Tenant, TenantDirectory, validate
from .._http.bodies import BODY_LIMITS
from .._http.deps import scope as scope_of
from .._http.errors import Failure, as_native, failure
from .._http.guard import (
    Authenticate,
    BodyLimit,
    HostGuard,
    OriginGuard,
    ServiceNames,
    scope_tenant,
)
from .._http.keys import is_loopback, is_protected, key_authenticator
from .._http.relay import (
    HOP_HEADERS,
    HttpRelay,
    Refusal,
    WebSocketRelay,
    framing_refusal,
    send_json,
    send_status,
)
from .._ui.routes import install_pages
from .._ui.session import UISessions
from ..errors import AuthError, CorralError, SandboxLost, SandboxNotFound, UsageError
from .fanout import GatewayError, NodeFanout
from .gateway import Cluster
from .ui import GatewayUI

__all__ = ["create_cluster_app"]

log = logging.getLogger(__name__)

_SANDBOX = re.compile(r"/v1/sandboxes/(sbx_[a-z0-9]{1,50})(/.*)?")
_PORT = re.compile(r"/ports/(sbx_[a-z0-9]{1,50})/\d{1,5}(/.*)?")
_BY_REF = re.compile(r"/v1/(snapshots|volumes)/([^/]{1,200})")
# The dashboard's pieces that need no control plane (``_ui.routes.install_pages``).
_PAGES = frozenset({"/ui", "/ui/", "/docs", "/ui/session", "/ui/api/me"})
# Request headers the gateway never passes on: the caller's credentials are replaced by a
# signed caller token; Origin was judged here (the node would judge it against its names).
_NOT_PASSED = HOP_HEADERS | {b"host", b"authorization", b"origin"}
# What of a node's whole answer the gateway passes on (it sets the length itself).
_ANSWER_HEADERS = frozenset({"content-type", "x-corral-torn-tail", "link", "x-total-count"})


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise GatewayError(400, "invalid_request", "the client went away mid-request")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _read_request(receive: Receive) -> tuple[bytes, dict[str, Any]]:
    """The body as sent (relayed to a node byte for byte) and its JSON object, for what the
    gateway reads of it to place the call ({} when it is not one: the node refuses it)."""
    body = await _read_body(receive)
    try:
        request = json.loads(body or b"{}")
    except ValueError:
        request = None
    return body, request if isinstance(request, dict) else {}


class _Gateway:
    """The gateway's own routing, inside the same guards as ``corral serve``'s."""

    def __init__(self, cluster: Cluster, tenants: TenantDirectory,
                 pages: ASGIApp | None = None) -> None:
        self._cluster = cluster
        self._tenants = tenants
        self.nodes = NodeFanout(cluster)
        self._pages = pages  # the dashboard's page, assets, /docs, sign-in (``_ui``)
        self._ui = GatewayUI(self.nodes, tenants)

    # -- the pieces ---------------------------------------------------------------------------

    def _headers(self, scope: Scope, caller: Tenant | None,
                 service: str = "http") -> list[tuple[bytes, bytes]]:
        # The client's Host, already judged here: the node builds its URLs (an exposed
        # port's) from it, so they name the gateway.
        dropped = _NOT_PASSED | ({b"x-api-key"} if service.startswith("e2b") else set())
        headers = [(k, v) for k, v in scope.get("headers", ()) if k not in dropped or
                   k == b"host"]
        if caller is not None:
            headers.append(self.nodes.credential(caller, service))
        return headers

    async def _node_for(self, sandbox_id: str, owner: str | None) -> str:
        # From memory on the event loop when it can be (a thread hop costs more than the
        # lookup); the GCS only for a sandbox not seen yet, or a stale membership view.
        known = self._cluster.cached_node(sandbox_id, owner)
        if known is not None:
            return known
        return await run_in_threadpool(self._cluster.node_for, sandbox_id, owner)

    async def _holder(self, kind: str, ref: str, caller: Tenant) -> str | None:
        """The node that holds a snapshot or volume of the caller's, if any does."""
        nodes = await self.nodes.alive_nodes()
        answers = await asyncio.gather(*(self.nodes.ask(n, "GET", f"/v1/{kind}/{ref}", caller)
                                         for n in nodes))
        for node_id, answer in zip(nodes, answers, strict=True):
            if answer.status_code == 200:
                return node_id
        return None

    async def _send_answer(self, send: Send, answer: httpx.Response) -> None:
        headers = [(k.encode(), v.encode()) for k, v in answer.headers.items()
                   if k.lower() in _ANSWER_HEADERS]
        body = answer.content
        await send({"type": "http.response.start", "status": answer.status_code,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    # -- ASGI ---------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] not in ("http", "websocket"):
            return
        try:
            await self._dispatch(scope, receive, send)
        except (CorralError, GatewayError) as exc:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008,
                            "reason": exc.message[:120]})
                return
            failed = failure(exc) if isinstance(exc, CorralError) else Failure(
                exc.status, exc.code, exc.message, exc)
            await send_json(send, *as_native(failed))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.nodes.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope.get("method", "GET")
        if path == "/healthz":
            nodes = await self.nodes.alive_nodes()
            await send_json(send, 200, {"status": "ok", "nodes": len(nodes)})
            return
        port = _PORT.fullmatch(path)
        if port is not None:
            await self._relay_port(scope, receive, send, port.group(1))
            return
        if self._pages is not None and (path in _PAGES or path.startswith("/ui/static/")):
            await self._pages(scope, receive, send)
            return
        if path == "/openapi.json":  # every node's API is the same: /docs reads it
            nodes = await self.nodes.alive_nodes()
            if not nodes:
                raise GatewayError(503, "backend_unavailable", "no cluster node is alive")
            await self._relay(scope, receive, send, nodes[0], "", None)
            return
        if not is_protected(path):
            raise GatewayError(404, "not_found", "Not Found")
        caller = scope_tenant(scope)
        if path.startswith("/ui/api/"):
            await self._ui(scope, receive, send, caller, lambda sandbox_id: self._relay_sandbox(
                scope, receive, send, sandbox_id, "/family", caller))
            return
        if path == "/v1/sandboxes":
            if method == "POST":
                await self._create(scope, receive, send, caller)
            elif method == "GET":
                await self._list(send, "/v1/sandboxes", caller, scope.get("query_string", b""))
            else:
                raise GatewayError(405, "method_not_allowed", "Method Not Allowed")
            return
        found = _SANDBOX.fullmatch(path)
        if found is not None:
            sandbox_id, rest = found.group(1), found.group(2) or ""
            if rest == "/fork" and method == "POST":
                await self._fork(receive, send, sandbox_id, caller)
            else:
                await self._relay_sandbox(scope, receive, send, sandbox_id, rest, caller)
            return
        if path in ("/v1/snapshots", "/v1/volumes") and method == "GET":
            await self._list(send, path, caller, scope.get("query_string", b""))
            return
        if path == "/v1/volumes" and method == "POST":
            await self._create_volume(receive, send, caller)
            return
        by_ref = _BY_REF.fullmatch(path)
        if by_ref is not None and method in ("GET", "DELETE"):
            if by_ref.group(1) == "snapshots" and method == "DELETE":
                await run_in_threadpool(self._drop_copies, by_ref.group(2), scope_of(caller))
            answers = await self.nodes.fan_out(method, path, caller)
            hit = [a for a in answers if a.status_code != 404]
            await self._send_answer(send, (hit or answers)[0] if answers else _no_node())
            return
        if path == "/metrics":
            await self._metrics(send, caller)
            return
        raise GatewayError(404, "not_found", "Not Found")

    # -- what spans nodes ---------------------------------------------------------------------

    async def _create(self, scope: Scope, receive: Receive, send: Send,
                      caller: Tenant) -> None:
        body, request = await _read_request(receive)
        node_id = None
        snapshot = None
        template = request.get("template")
        volumes = request.get("volumes")
        if isinstance(request.get("snapshot"), str) and validate_ref(request["snapshot"]):
            snapshot = request["snapshot"]
        if isinstance(volumes, dict) and volumes:
            first = next(iter(volumes))
            if isinstance(first, str) and validate_ref(first):
                node_id = await self._holder("volumes", first, caller)
        await self._send_answer(send, await self.create_on(
            node_id, caller, "/v1/sandboxes", body, made_id=lambda made: made.get("id"),
            snapshot=snapshot, template=template if isinstance(template, str) else None))

    async def create_on(self, node_id: str | None, caller: Tenant, path: str, body: bytes,
                        *, made_id: Callable[[dict[str, Any]], str | None],
                        service: str = "http", snapshot: str | None = None,
                        naming: Callable[[dict[str, Any], str], dict[str, Any]] | None = None,
                        template: str | None = None) -> httpx.Response:
        """A create, for either dialect: the caller's quota counted across the cluster, the
        request sent to ``node_id`` (a volume's holder) or where ``place`` says (for one
        from ``snapshot``, with the nodes holding its layers preferred), the snapshot copied
        to that node first if it is not there yet (``naming`` puts the copy's id in the
        request; default: as ``snapshot``), and the new sandbox (``made_id`` reads it from
        the answer) recorded there."""
        admitted = await run_in_threadpool(lambda: self._cluster.admit(
            caller.name, _limit(caller), node_id=node_id, snapshot=snapshot,
            any_tenants=scope_of(caller) is None, template=template))
        try:
            if admitted.snapshot is not None and admitted.snapshot != snapshot:
                name = naming or (lambda request, local: {**request, "snapshot": local})
                body = json.dumps(name(json.loads(body), admitted.snapshot)).encode()
            answer = await self.nodes.ask(admitted.node_id, "POST", path, caller, body=body,
                                     service=service)
            made: Any = answer.json() if answer.status_code in (200, 201) else None
            sandbox_id = made_id(made) if isinstance(made, dict) else None
            if sandbox_id:
                await run_in_threadpool(self._cluster._placed_on, sandbox_id,
                                        admitted.node_id, caller.name)
        finally:
            await run_in_threadpool(self._cluster.release, admitted.claim)
        return answer

    async def _create_volume(self, receive: Receive, send: Send, caller: Tenant) -> None:
        body = await _read_body(receive)
        node_id = await run_in_threadpool(self._cluster.place, caller.name)
        await self._send_answer(send, await self.nodes.ask(node_id, "POST", "/v1/volumes", caller,
                                                      body=body))

    def _drop_copies(self, ref: str, owner: str | None) -> None:
        """Before a snapshot goes: its copies on other nodes (``copies``)."""
        if validate_ref(ref):  # else the node answers for a ref that cannot be
            self._cluster.drop_copies_of(ref, owner)

    async def _list(self, send: Send, path: str, caller: Tenant, query: bytes) -> None:
        answers = await self.nodes.fan_out("GET", path, caller, query)
        # Nodes' copies of other nodes' snapshots are theirs: the caller sees the originals.
        hidden = await run_in_threadpool(self._cluster.state.copy_ids) \
            if path == "/v1/snapshots" else set()
        items: list[Any] = []
        for answer in answers:
            if answer.status_code != 200:
                await self._send_answer(send, answer)
                return
            items.extend(item for item in answer.json() if item.get("id") not in hidden)
        items.sort(key=lambda item: (item.get("created_at", 0), item.get("id", "")))
        await send_json(send, 200, items)

    async def _fork(self, receive: Receive, send: Send, sandbox_id: str,
                    caller: Tenant) -> None:
        body = await _read_body(receive)
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            raise GatewayError(400, "invalid_request", "the fork request is not JSON") from None
        if not isinstance(request, dict) or set(request) - {"count", "memory"}:
            raise GatewayError(422, "invalid_request", "a fork takes {\"count\": N, \"memory\": "
                         "false}")
        count = validate.fork_count(request.get("count", 1))
        memory = request.get("memory", False)
        if not isinstance(memory, bool):
            raise UsageError("memory must be true or false")
        owner = scope_of(caller)
        limit = _limit(caller)
        children = await run_in_threadpool(
            lambda: self._cluster.fork(sandbox_id, count, tenant=owner, max_for_tenant=limit,
                                       caller=caller, memory=memory))
        await send_json(send, 201, [child.model_dump(mode="json") for child in children])

    async def _metrics(self, send: Send, caller: Tenant) -> None:
        """Every node's counters, each line labelled with its node."""
        nodes = await self.nodes.alive_nodes()
        answers = await asyncio.gather(*(self.nodes.ask(n, "GET", "/metrics", caller)
                                         for n in nodes))
        lines: list[str] = []
        seen: set[str] = set()
        for node_id, answer in zip(nodes, answers, strict=True):
            if answer.status_code != 200:
                await self._send_answer(send, answer)
                return
            lines.extend(_labelled(answer.text, node_id, seen))
        data = ("\n".join(lines) + "\n").encode()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
            (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    # -- relaying -----------------------------------------------------------------------------

    async def _relay_sandbox(self, scope: Scope, receive: Receive, send: Send,
                             sandbox_id: str, rest: str, caller: Tenant) -> None:
        owner = scope_of(caller)
        try:
            node_id = await self._node_for(sandbox_id, owner)
        except SandboxLost:
            if rest == "/audit" and scope["type"] == "http":
                await self._lost_audit(send, sandbox_id, owner)
                return
            if rest == "" and scope.get("method") == "DELETE":
                await run_in_threadpool(self._cluster.destroy, sandbox_id, tenant=owner)
                await send({"type": "http.response.start", "status": 204, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            raise
        if rest == "" and scope.get("method") == "DELETE":
            send = self._forgetting(send, sandbox_id)
        await self._relay(scope, receive, send, node_id, sandbox_id, caller)

    def _forgetting(self, send: Send, sandbox_id: str) -> Send:
        """``send`` for a relayed destroy: the node's 204 reaches the caller only once the map
        has forgotten the sandbox, so a caller that lists right after its delete (or counts
        its quota) never sees it live."""
        async def forgetting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 204:
                await run_in_threadpool(self._cluster._forget, sandbox_id)
            await send(message)
        return forgetting_send

    async def _relay_port(self, scope: Scope, receive: Receive, send: Send,
                          sandbox_id: str) -> None:
        """An exposed port's request: the node's port proxy judges who may pass (a port
        token, a signed link, public, or the owner's key, which becomes a caller token)."""
        caller = None
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if header is not None:
            with contextlib.suppress(AuthError):
                caller = await run_in_threadpool(self._tenants.authenticate,
                                                 header.decode("latin-1"), auth_required=True)
        try:
            node_id = await run_in_threadpool(self._cluster.node_for, sandbox_id, None)
        except SandboxNotFound:
            raise GatewayError(404, "sandbox_not_found", f"sandbox {sandbox_id} does not exist, or "
                         "its port is not exposed") from None
        await self._relay(scope, receive, send, node_id, sandbox_id, caller)

    async def _relay(self, scope: Scope, receive: Receive, send: Send, node_id: str,
                     sandbox_id: str, caller: Tenant | None, service: str = "http") -> int:
        url = urlsplit(await self.nodes.url(node_id, service))
        headers = self._headers(scope, caller, service)
        # The WebSocket relay writes the handshake from the scope's headers (so the client's
        # Origin and key stay here); the HTTP relay reads only the client's framing from it.
        relayed = {**scope, "headers": headers}

        async def broken(exc: BaseException) -> Refusal:
            lost = await run_in_threadpool(self._cluster.after_break, sandbox_id)
            if lost is not None:
                return Refusal(lost.status, lost.code, lost.message)
            return Refusal(502, "node_unreachable", f"the connection to cluster node "
                           f"{node_id[:12]} broke ({exc.__class__.__name__}); try again")

        websocket = scope["type"] == "websocket"
        relay: HttpRelay | WebSocketRelay = WebSocketRelay(
            relayed, receive, send, broken=broken) if websocket else HttpRelay(
            scope, receive, send, broken=broken)
        path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        target = path + (b"?" + query if query else b"")
        try:
            sock = await _connect(url.hostname or "127.0.0.1", url.port or 80)
        except OSError as exc:
            refusal = await broken(exc)
            raise GatewayError(refusal.status, refusal.code, refusal.message) from None
        try:
            if isinstance(relay, WebSocketRelay):
                await relay.run(sock, target, headers)
            else:
                await relay.run(sock, target, headers)
        finally:
            sock.close()
        return relay.status

    async def _lost_audit(self, send: Send, sandbox_id: str, owner: str | None) -> None:
        trail = await run_in_threadpool(lambda: self._cluster.audit(sandbox_id, tenant=owner))
        body = "".join(event.model_dump_json() + "\n" for event in trail.events).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/x-ndjson"),
            (b"content-length", str(len(body)).encode()),
            (b"x-corral-torn-tail", str(trail.torn_tail).lower().encode())]})
        await send({"type": "http.response.body", "body": body})


def _limit(caller: Tenant) -> int | None:
    """The caller's sandbox quota; none for the local operator."""
    return None if caller.is_local else caller.max_sandboxes


def validate_ref(ref: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9_.-]{1,200}", ref))


def _no_node() -> httpx.Response:
    return httpx.Response(503, json={"error": "backend_unavailable",
                                     "message": "no cluster node is alive"})


def _labelled(text: str, node_id: str, seen: set[str]) -> list[str]:
    """Prometheus text with ``node="..."`` on every sample; HELP and TYPE once."""
    out = []
    label = f'node="{node_id[:12]}"'
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            if line not in seen:
                seen.add(line)
                out.append(line)
            continue
        name, sep, rest = line.partition("{")
        if sep:
            out.append(f"{name}{{{label},{rest}")
        else:
            metric, _, value = line.partition(" ")
            out.append(f"{metric}{{{label}}} {value}")
    return out


async def _connect(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), 10)
    except BaseException:
        sock.close()
        raise
    return sock


def create_cluster_app(cluster: Cluster, store: Store, *, listen_host: str = "127.0.0.1",
                       host_names: Sequence[str] = (), allow_keyless: bool = False) -> ASGIApp:
    """The gateway's app: ``corral serve``'s guards (Host, body limits, key, Origin) around
    the cluster routing. Keys are those of ``store`` (the gateway's data directory)."""
    tenants = TenantDirectory(store)
    names = ServiceNames.of(listen_host, host_names)
    sessions = UISessions(lambda: cluster.home, tenants)
    pages = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    install_pages(pages, sessions)

    @pages.exception_handler(CorralError)
    async def refused(request: Request, exc: CorralError) -> JSONResponse:
        status, body = as_native(failure(exc))
        return JSONResponse(body, status_code=status)

    gateway = _Gateway(cluster, tenants, pages)
    app: ASGIApp = OriginGuard(gateway, names=names)

    async def session(cookie: str) -> Tenant:
        return await run_in_threadpool(sessions.tenant, cookie)

    app = Authenticate(app, protected=is_protected, authenticate=key_authenticator(
        store, tenants, loopback=is_loopback(listen_host), allow_keyless=allow_keyless),
        session=session)
    app = BodyLimit(app, limits=BODY_LIMITS)
    return _PortsFirst(HostGuard(app, names=names), gateway, names)


class _PortsFirst:
    """An exposed port's requests go to the node that holds the sandbox before the gateway's
    own guards (body limits, keys, Origin), which judge the service's requests, not an app's
    (as ``_http.portproxy.PortRouting`` on one host): the node's port proxy admits them and
    keeps Corral's credentials from the app. Only the Host is judged here (DNS rebinding),
    and the framing (the relay rebuilds it)."""

    def __init__(self, app: ASGIApp, gateway: _Gateway, names: ServiceNames) -> None:
        self._app, self._gateway, self._names = app, gateway, names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not _PORT.fullmatch(scope["path"]):
            await self._app(scope, receive, send)
            return
        host = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"),
                    "")
        server = scope.get("server")
        refusal = None if self._names.allows(host, server[1] if server else None) else Refusal(
            421, "host_refused", "this Host is not a name of the service")
        if refusal is None and scope["type"] == "http":
            refusal = framing_refusal(scope)
        if refusal is None:
            await self._gateway(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": refusal.message})
        else:
            await send_status(send, refusal, accept="", prefix="http.response")

