"""The E2B dialect's ASGI app: one listener for E2B's control plane and every sandbox's envd and
code interpreter, over the same control-plane services as Corral's own API.

Why a listener of its own (``corral serve --e2b-port``) rather than routes on Corral's: the E2B
SDKs address the same host for two planes (``/health`` and ``/files`` mean a sandbox's envd there,
not the service), every answer must be E2B-shaped (``{"code", "message"}``, Connect errors) down to
an unknown path or a refused key, authentication is a different header (``X-API-KEY``, per-sandbox
``X-Access-Token``), and domain mode needs TLS and wildcard host names while the native API stays
plain on loopback. Same process, same Manager: tenancy, quotas, ceilings and audit are the
control plane's, below both.

Routing (E2B-COMPAT §2): a request is for a sandbox when it names one, by the ``E2b-Sandbox-Id``
and ``E2b-Sandbox-Port`` headers (URL mode, SDK ≥ 2.7) or by ``Host: <port>-<id>.<domain>``
(domain mode); anything else is the control plane (``api.<domain>`` in domain mode). A signed
``/files`` URL names no sandbox in URL mode (P3): its signature does.

URL mode has two more ways in, for what the SDKs build from the ``domain`` create answers
(``control.sandbox_domain``): ``Host: <port>-<id>.localhost`` (``get_host`` on a plain listener,
the name browsers and curl send to loopback), and, over TLS, the user part of
``https://<port>-<id>.corral@HOST:PORT`` (``Authorization: Basic``), the only name a code
interpreter client older than 2.9.0 can dial here with no DNS of its own.

Pure ASGI, no ``BaseHTTPMiddleware``: that buffers streaming responses (P17).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router
from starlette.types import Message, Receive, Scope, Send

from .._control.plane import Manager, Tenant, TenantDirectory, Who, local_tenant
from .._http.errorlog import PROXIED, ServerErrorLog
from .._http.errors import as_connect, as_e2b, failure, refused
from .._http.guard import AnyName, BodyLimit, BodyLimits, ServiceNames
from .._http.portproxy import PortProxy, Target
from .._http.relay import send_json as _send_json
from .._ids import from_e2b, to_e2b
from ..errors import AuthError, CorralError, SandboxNotFound
from . import control, files, filesystem, jupyter, process, templates, watch
from .state import E2BState, follow_destroys
from .target import ENVD_PORT, JUPYTER_PORT, SCOPE_KEY, TENANT_KEY, SandboxTarget
from .tokens import SandboxTokens

__all__ = ["E2BConfig", "E2BApp", "create_e2b_app"]

_CONNECT_PATH = re.compile(r"/(process\.Process|filesystem\.Filesystem)/[A-Za-z]+")
# What envd and the code interpreter serve. Old SDKs (≤ 2.20) send the E2b-Sandbox-* headers
# on control-plane calls too (connect), so the headers route only these paths to a sandbox.
_SANDBOX_PATH = re.compile(r"/health|/files|/execute|/contexts(/.*)?|"
                           r"/(process\.Process|filesystem\.Filesystem)/[A-Za-z]+")
# What a URL-mode sandbox host looks like (``control.sandbox_domain``): `<port>-<id>.localhost`
# on a plain listener, `<port>-<id>.corral` as the user of a TLS listener's URL.
_LOCAL_HOST = re.compile(r"(\d{1,5})-([a-z0-9-]{1,63})\.localhost")
_USERINFO = re.compile(r"(\d{1,5})-([a-z0-9-]{1,63})\.corral")
_JUPYTER_PATH = re.compile(r"/execute|/contexts(/.*)?")
_MAX_CONTROL_BODY = 1024 * 1024
_MAX_RPC_BODY = 4 * 1024 * 1024
_MAX_STREAM_INPUT = 64 * 1024 * 1024
# /files uploads stream into the workspace, whose own size limit (ENOSPC → 507) is the bound.
_MAX_UPLOAD = 64 * 1024 * 1024 * 1024


def _parse_templates(text: str) -> dict[str, str]:
    mapping: dict[str, str] = {}
    for item in text.split(","):
        name, eq, target = item.strip().partition("=")
        if item.strip() and (not eq or not name.strip() or not target.strip()):
            raise ValueError(f"{item.strip()!r} is not NAME=TEMPLATE")
        if eq:
            mapping[name.strip()] = target.strip()
    return mapping


DEFAULT_TEMPLATES = "base=base,code-interpreter-v1=code-interpreter"


@dataclass(frozen=True, slots=True)
class E2BConfig:
    """How the surface is reached and what its names mean."""

    listen_host: str = "127.0.0.1"
    host_names: Sequence[str] = ()
    domain: str | None = None  # domain mode: `api.<domain>`, `<port>-<id>.<domain>`
    templates: Mapping[str, str] = field(
        default_factory=lambda: _parse_templates(DEFAULT_TEMPLATES))

    @classmethod
    def build(cls, *, listen_host: str = "127.0.0.1", host_names: Sequence[str] = (),
              domain: str | None = None, templates: str | None = None) -> E2BConfig:
        """Raises ValueError naming what is malformed."""
        if domain is not None:
            domain = domain.strip().lower().rstrip(".")
            if not re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)+",
                                domain):
                raise ValueError(f"{domain!r} is not a DNS domain (e.g. sandbox.example.internal)")
        mapping = _parse_templates(DEFAULT_TEMPLATES)
        if templates:
            mapping.update(_parse_templates(templates))
        return cls(listen_host=listen_host, host_names=tuple(host_names), domain=domain,
                   templates=mapping)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _url_mode_sandbox(scope: Scope, host: str) -> tuple[str, int] | None:
    """The (id, port) a URL-mode request names by its host (``<port>-<id>.localhost``) or by
    the user of its URL (``https://<port>-<id>.corral@HOST``, sent as ``Authorization:
    Basic``); the header that named it is dropped so neither the sandbox's app nor envd sees
    it."""
    name = host.rsplit(":", 1)[0].lower() if not host.startswith("[") else host
    match = _LOCAL_HOST.fullmatch(name)
    if match is not None:
        return match.group(2), int(match.group(1))
    authorization = _header(scope, b"authorization") or ""
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
    except (ValueError, UnicodeDecodeError):
        return None
    match = _USERINFO.fullmatch(user)
    if match is None:
        return None
    scope["headers"] = [(k, v) for k, v in scope.get("headers", ()) if k != b"authorization"]
    return match.group(2), int(match.group(1))


async def _refuse(scope: Scope, send: Send, status: int, message: str) -> None:
    """An E2B-shaped refusal: Connect JSON on RPC paths, ``{"code","message"}`` elsewhere."""
    shape = as_connect if _CONNECT_PATH.fullmatch(scope.get("path", "")) else as_e2b
    await _send_json(send, *shape(refused(status, message)))


def _render_refusal(error: CorralError) -> tuple[int, bytes]:
    # The listener's own refusal, like its Host and key ones: its status (413) stands.
    status, body = as_e2b(refused(error.status, error.message))
    return status, json.dumps(body).encode()


def _sandbox_gone(e2b_id: str) -> dict[str, Any]:
    # Exactly E2B's proxy answer for an unknown, killed or expired sandbox (E2B-COMPAT §7.5).
    return {"sandboxId": e2b_id, "message": "The sandbox was not found", "code": 502}


async def _health(request: Request) -> Response:
    return Response(status_code=204)


class E2BApp:
    """The ASGI app; ``state`` is what handlers reach as ``request.app.state``."""

    def __init__(self, manager: Manager, config: E2BConfig,
                 tenants: TenantDirectory | None = None) -> None:
        """``tenants``: who callers are, instead of the keys in ``manager``'s store (a cluster
        node's: the gateways' signed callers)."""
        self.config = config
        # A cluster node's (``tenants`` given) answers any Host: its gateway judged it.
        self.names = ServiceNames.of(config.listen_host, config.host_names) if tenants is \
            None else AnyName()
        self.tenants = tenants or manager.tenants
        self.tokens = SandboxTokens(manager.settings.home)
        self.e2b = E2BState(manager.settings.home / "e2b.db")
        follow_destroys(self.e2b, manager)  # forgotten on every destroy path, not only kill
        # Any other port of a sandbox (E2B's get_host) goes through Corral's port proxy.
        self.ports = PortProxy(manager, self.tenants, host_form=False)
        self.state = State()
        self.state.manager = manager
        self.state.tokens = self.tokens
        self.state.e2b = self.e2b
        self.state.config = config
        self.state.e2b_metrics = control.MetricSamples(manager)
        self._control = Router(routes=[*templates.routes, *control.routes])
        self._envd = Router(routes=[Route("/health", _health, methods=["GET"]),
                                    *process.routes, *filesystem.routes,
                                    *watch.routes, *files.routes])
        self._jupyter = Router(routes=[Route("/health", _health, methods=["GET"]),
                                       *jupyter.routes])
        limits = BodyLimits(default=_MAX_RPC_BODY, routes=(
            ("POST", re.compile(r"/files"), _MAX_UPLOAD, "the workspace's size is the bound"),
            ("POST", re.compile(r"/process\.Process/StreamInput"), _MAX_STREAM_INPUT,
             "send input in several streams"),
        ))
        self._envd_limited = BodyLimit(self._envd, limits=limits, render=_render_refusal)
        self._jupyter_limited = BodyLimit(self._jupyter, limits=BodyLimits(
            default=_MAX_RPC_BODY), render=_render_refusal)
        self._control_limited = BodyLimit(self._control, limits=BodyLimits(
            default=_MAX_CONTROL_BODY, routes=(("PUT", templates.UPLOAD_PATH,
                                                templates.MAX_UPLOAD, "a COPY archive"),)),
            render=_render_refusal)
        domain = re.escape(config.domain) if config.domain else None
        self._sandbox_host = (re.compile(rf"(\d{{1,5}})-([a-z0-9-]{{1,63}})\.{domain}")
                              if domain else None)
        self._api_host = f"api.{config.domain}" if config.domain else None
        # Every 5xx of the surface gets its line, but a sandbox's own app's (``_serve_port``).
        self._logged = ServerErrorLog(self._dispatch, surface="e2b")

    @property
    def manager(self) -> Manager:
        manager: Manager = self.state.manager
        return manager

    # -- ASGI ----------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        scope["app"] = self
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._logged(scope, receive, tracked)
        except HTTPException as exc:  # the router's own: unknown path, wrong method
            if not started:
                failed = failure(exc)
                message = ("no such endpoint in Corral's E2B API" if failed.status == 404
                           else failed.message)
                await _refuse(scope, send, failed.status, f"{message}: {scope['method']} "
                              f"{scope['path'][:120]}")
        except Exception as exc:
            failed = failure(exc, where=f"the E2B surface: {scope.get('method')} "
                                        f"{scope.get('path')}")
            if not started:
                await _refuse(scope, send, failed.status, failed.message)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Only an app's own port has WebSockets (envd and the interpreter have none): by
        host name in domain mode, or by the E2b-Sandbox-* headers."""
        sandbox: tuple[str, int] | None = None
        host = (_header(scope, b"host") or "").lower()
        match = (self._sandbox_host.fullmatch(host.rsplit(":", 1)[0])
                 if self._sandbox_host else None)
        if match is not None:
            sandbox = (match.group(2), int(match.group(1)))
        elif self.config.domain is None and (found := _url_mode_sandbox(scope, host)):
            sandbox = found
        elif (header_id := _header(scope, b"e2b-sandbox-id")) is not None:
            port = _header(scope, b"e2b-sandbox-port") or ""
            if self.names.allows(host, _own_port(scope)) and port.isdigit():
                sandbox = (header_id, int(port))
        if sandbox is None or sandbox[1] in (ENVD_PORT, JUPYTER_PORT):
            await send({"type": "websocket.close", "code": 1008})
            return
        resolved = await run_in_threadpool(self._resolve, sandbox[0])
        if resolved is None:
            await send({"type": "websocket.close", "code": 1008,
                        "reason": "The sandbox was not found"})
            return
        await self._serve_port(scope, receive, send, resolved[0], sandbox[0], sandbox[1])

    async def _serve_port(self, scope: Scope, receive: Receive, send: Send, corral_id: str,
                          e2b_id: str, port: int) -> None:
        """A server the sandbox runs. E2B's traffic token (or the envd token) opens every
        port of its own sandbox; without one, Corral's own rules for exposed ports apply
        (public ports, port tokens, signed links): private unless its owner exposes it."""
        scope[PROXIED] = True  # its answers are the sandbox's app's, not the service's
        raw: bytes = scope.get("raw_path") or scope["path"].encode()
        query: bytes = scope.get("query_string", b"")
        # Routed by E2b-Sandbox-* headers, every sandbox answers on this listener's origin.
        target = Target(corral_id, port, "", raw + (b"?" + query if query else b""),
                        shared_origin=not self._own_origin(scope, e2b_id, port))
        if not (self.tokens.check_traffic(corral_id, _header(
                scope, b"e2b-traffic-access-token")) or self.tokens.check_envd(
                corral_id, _header(scope, b"x-access-token"))):
            await self.ports(scope, receive, send, target)
            return
        try:
            record = await run_in_threadpool(self.manager.sandboxes.get, corral_id)
        except CorralError:
            await _send_json(send, 502, _sandbox_gone(e2b_id[:64]))
            return

        def render(status: int, code: str, message: str) -> tuple[int, dict[str, Any]]:
            if code == "port_closed":  # the SDKs raise SandboxUnreachable for this message
                message = f"The sandbox is running but port is not open ({message})"
            status, body = as_e2b(refused(status, message))
            return status, {"sandboxId": e2b_id, "port": port, **body}

        await self.ports.serve(scope, receive, send, target, record, Who("e2b"), render=render)

    def _own_origin(self, scope: Scope, e2b_id: str, port: int) -> bool:
        """Whether the request came to the port's own host name (domain mode, or
        ``<port>-<id>.localhost`` in URL mode)."""
        host = (_header(scope, b"host") or "").lower()
        pattern = self._sandbox_host or _LOCAL_HOST
        match = pattern.fullmatch(host.rsplit(":", 1)[0])
        return match is not None and (match.group(2), int(match.group(1))) == (e2b_id, port)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                watchers = getattr(self.state, "e2b_watchers", None)
                if watchers is not None:
                    watchers.close()
                self.state.e2b_metrics.close()
                self.e2b.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = _header(scope, b"host") or ""
        header_id = _header(scope, b"e2b-sandbox-id")
        header_port = _header(scope, b"e2b-sandbox-port")
        sandbox: tuple[str, int] | None = None
        if self.config.domain is not None:
            name = host.rsplit(":", 1)[0].lower() if not host.startswith("[") else host
            match = self._sandbox_host.fullmatch(name) if self._sandbox_host else None
            if match is not None:
                sandbox = (match.group(2), int(match.group(1)))
            elif name != self._api_host and not self.names.allows(host, _own_port(scope)):
                await _refuse(scope, send, 421, f"Host {host[:80]!r} is neither "
                              f"{self._api_host} nor <port>-<sandbox>.{self.config.domain}")
                return
        elif (sandbox := _url_mode_sandbox(scope, host)) is not None:
            pass
        elif not self.names.allows(host, _own_port(scope)):
            await _refuse(scope, send, 421, f"Host {host[:80]!r} is not a name of this "
                          f"service (it answers to {self.names.describe()}); add it with "
                          "`corral serve --host-name NAME`")
            return
        if header_id is not None and sandbox is None and not _SANDBOX_PATH.fullmatch(
                scope["path"]):
            header_id = None  # a control-plane call that names its sandbox in the path
        if header_id is not None:
            try:
                port = int(header_port) if header_port else ENVD_PORT
            except ValueError:
                await _refuse(scope, send, 400, "E2b-Sandbox-Port must be a port number")
                return
            if sandbox is not None and sandbox != (header_id, port):
                await _refuse(scope, send, 400, "the Host and the E2b-Sandbox-* headers name "
                              "different sandboxes or ports")
                return
            sandbox = (header_id, port)
        access = _header(scope, b"x-access-token")
        if sandbox is None and access and _SANDBOX_PATH.fullmatch(scope["path"]):
            # SDKs 2.7–2.20 reconnected by `connect` send envd calls with only the token in
            # URL mode (no E2b-Sandbox-Id): the token, an HMAC of one id, names its sandbox.
            found = await run_in_threadpool(self._sandbox_of_token, access)
            if found is None:
                await _refuse(scope, send, 401, "the access token is no running sandbox's")
                return
            # Code interpreters < 2.9.0 send only the token to /execute and /contexts.
            default = JUPYTER_PORT if _JUPYTER_PATH.fullmatch(scope["path"]) else ENVD_PORT
            sandbox = (found, int(header_port) if header_port and header_port.isdigit()
                       else default)
        if sandbox is None and scope["path"] == "/files" and b"signature=" in scope.get(
                "query_string", b""):
            found = await run_in_threadpool(self._signed_files_sandbox, scope)
            if found is None:
                await _refuse(scope, send, 401, "the signature matches no running sandbox "
                              "(wrong, or its sandbox is gone)")
                return
            sandbox = (found, ENVD_PORT)
        if sandbox is None:
            await self._serve_control(scope, receive, send)
        else:
            await self._serve_sandbox(scope, receive, send, *sandbox)

    # -- control plane -------------------------------------------------------------------------

    async def _serve_control(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            tenant = await run_in_threadpool(self.tenants.authenticate_key,
                                             _header(scope, b"x-api-key"))
        except AuthError as exc:
            await _refuse(scope, send, 401, exc.message)
            return
        scope[TENANT_KEY] = tenant
        await self._control_limited(scope, receive, send)

    # -- sandbox plane -------------------------------------------------------------------------

    def _resolve(self, e2b_id: str) -> tuple[str, Tenant] | None:
        corral_id = from_e2b(e2b_id)
        if corral_id is None:
            return None
        try:
            record = self.manager.sandboxes.get(corral_id)  # expires what is past its life
        except SandboxNotFound:
            return None
        if record.state == "destroying":
            return None
        if record.tenant == "local":
            return corral_id, local_tenant(self.manager.ceiling)
        try:
            return corral_id, self.tenants.get(record.tenant)
        except CorralError:
            return None

    def _sandbox_of_token(self, token: str) -> str | None:
        for record in self.manager.records():
            if record.state != "destroying" and self.tokens.check_envd(record.id, token):
                return to_e2b(record.id)
        return None

    def _signed_files_sandbox(self, scope: Scope) -> str | None:
        query = {k: v[0] for k, v in parse_qs(
            scope.get("query_string", b"").decode("latin-1")).items()}
        operation = "read" if scope["method"] in ("GET", "HEAD") else "write"
        found: str | None = files.resolve_signed(
            self.manager, self.tokens, query.get("path", ""), operation,
            query.get("username"), query.get("signature", ""),
            query.get("signature_expiration"))
        return None if found is None else to_e2b(found)

    async def _serve_sandbox(self, scope: Scope, receive: Receive, send: Send,
                             e2b_id: str, port: int) -> None:
        resolved = await run_in_threadpool(self._resolve, e2b_id)
        if resolved is None:
            await _send_json(send, 502, _sandbox_gone(e2b_id[:64]))
            return
        corral_id, owner = resolved
        if port not in (ENVD_PORT, JUPYTER_PORT):
            await self._serve_port(scope, receive, send, corral_id, e2b_id, port)
            return
        access = _header(scope, b"x-access-token")
        traffic = _header(scope, b"e2b-traffic-access-token")
        envd_ok = self.tokens.check_envd(corral_id, access)
        traffic_ok = port == JUPYTER_PORT and self.tokens.check_traffic(corral_id, traffic)
        presented = access is not None or (port == JUPYTER_PORT and traffic is not None)
        if presented and not (envd_ok or traffic_ok):
            await _refuse(scope, send, 401, "the access token is not this sandbox's")
            return
        authenticated = envd_ok or traffic_ok
        if not authenticated and not (port == ENVD_PORT and scope["path"] == "/files"):
            await _refuse(scope, send, 401, "this sandbox needs its access token: send "
                          "X-Access-Token (the envdAccessToken from create or connect)")
            return
        scope[SCOPE_KEY] = SandboxTarget(
            sandbox_id=corral_id, e2b_id=e2b_id, owner=owner, port=port,
            envd_token=self.tokens.envd(corral_id), authenticated=authenticated)
        app = self._envd_limited if port == ENVD_PORT else self._jupyter_limited
        await app(scope, receive, send)


def _own_port(scope: Scope) -> int | None:
    server = scope.get("server")
    return int(server[1]) if server and server[1] is not None else None


def create_e2b_app(manager: Manager, config: E2BConfig | None = None, *,
                   tenants: TenantDirectory | None = None) -> E2BApp:
    return E2BApp(manager, config or E2BConfig(), tenants)
