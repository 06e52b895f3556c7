"""The port proxy: HTTP/1.1 and WebSocket from a client of ``corral serve`` to a server inside a
sandbox, through a socket the tier connects inside the sandbox (``IsolationBackend.open_port``),
so no host port is bound per sandbox and the sandbox never reaches the service.

URLs: ``/ports/<sandbox>/<port>/...`` (the path form; the app sees ``X-Forwarded-Prefix``) and
``<port>-<sandbox>.<domain>`` (the host form, E2B's ``get_host``). Who may pass, what the
tier is asked for and what is recorded are the control plane's (``_control.ports``); this
module only speaks the protocols. What of a request reaches the app and what of its answer
reaches the client is ``preview``'s: no Corral credential up, no Corral cookie down, and the
path form's pages sandboxed in an opaque origin (it is the service's own origin); a browser
that navigates to a path URL is sent to the port's host URL when there is one.

The protocols themselves (HTTP/1.1 streaming both ways, WebSockets message by message) are
``relay``'s, shared with the cluster gateway.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, urlencode

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._control.plane import Manager, PortURLs, SandboxRecord, TenantDirectory, Who
from .._ids import from_e2b
from ..errors import AuthError, CorralError, SandboxBusy, SandboxNotFound
from .guard import ServiceNames
from .preview import answer_headers, is_corral_credential, request_headers
from .relay import HOP_HEADERS, HttpRelay, Refusal, WebSocketRelay, framing_refusal, send_status

__all__ = ["PortProxy", "PortRouting", "Render", "Target"]

logger = logging.getLogger(__name__)

_PATH = re.compile(r"/ports/(sbx_[a-z0-9]{1,50})/(\d{1,5})(/.*)?")
# Set by the proxy itself: a client's own are never passed on.
_OURS = frozenset({b"x-forwarded-for", b"x-forwarded-host", b"x-forwarded-proto",
                   b"x-forwarded-prefix", b"forwarded"})
_NOT_PASSED = HOP_HEADERS | _OURS


@dataclass(frozen=True, slots=True)
class Target:
    """The sandbox port a request names, and the path prefix the URL put before the app's.
    ``shared_origin``: the URL's origin is not the port's own (the path form, E2B's URL mode),
    so the answer is sandboxed (``preview.answer_headers``)."""

    sandbox_id: str
    port: int
    prefix: str  # "" for the host form
    path: bytes  # what the app sees, with the query string
    shared_origin: bool = False


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _query(scope: Scope) -> dict[str, str]:
    return dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))


def _cookie_name(target: Target) -> str:
    return f"corral_port_{target.sandbox_id}_{target.port}"


class PortProxy:
    def __init__(self, manager: Manager, tenants: TenantDirectory, *,
                 host_form: bool = True) -> None:
        """``host_form``: also route ``<port>-<sandbox>.<domain>`` for the ports domain the
        control plane has (read per request: ``corral serve`` may set it after this)."""
        self._manager = manager
        self._tenants = tenants
        self._host_form = host_form
        self._host: tuple[str, re.Pattern[str]] | None = None

    def _host_pattern(self) -> re.Pattern[str] | None:
        domain = self._manager.ports.urls.domain if self._host_form else None
        if domain is None:
            return None
        if self._host is None or self._host[0] != domain:
            self._host = (domain, re.compile(
                rf"(\d{{1,5}})-([a-z0-9-]{{1,63}})\.{re.escape(domain)}"))
        return self._host[1]

    # -- routing ------------------------------------------------------------------------------

    def match(self, scope: Scope) -> Target | None:
        """The port a request is for, or None when it is the service's own."""
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        query: bytes = scope.get("query_string", b"")
        pattern = self._host_pattern()
        if pattern is not None:
            host = (_header(scope, b"host") or "").lower()
            name = host.rsplit(":", 1)[0] if not host.startswith("[") else host
            found = pattern.fullmatch(name)
            if found is not None:
                corral_id = from_e2b(found.group(2))
                if corral_id is not None and 0 < int(found.group(1)) < 65536:
                    return Target(corral_id, int(found.group(1)), "",
                                  raw_path + (b"?" + query if query else b""))
        found = _PATH.fullmatch(scope["path"])
        if found is None or not 0 < int(found.group(2)) < 65536:
            return None
        prefix = f"/ports/{found.group(1)}/{found.group(2)}"
        rest = raw_path[len(prefix):] or b"/"
        return Target(found.group(1), int(found.group(2)), prefix,
                      rest + (b"?" + query if query else b""), shared_origin=True)

    def host_url(self, scope: Scope, target: Target) -> str | None:
        """Where a browser should open ``target``: its host URL (the port's own origin), or
        None when the service has no ports domain."""
        urls = self._manager.ports.urls
        if urls.domain is None or not self._host_form:
            return None
        base = urls.base or _request_base(scope)
        url = PortURLs(base=base, domain=urls.domain).host_url(target.sandbox_id, target.port)
        return None if url is None else url + target.path.decode("latin-1").lstrip("/")

    # -- ASGI ---------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send,
                       target: Target) -> None:
        refusal = framing_refusal(scope) if scope["type"] == "http" else None
        if refusal is not None:
            await _refuse(scope, receive, send, refusal)
            return
        if target.prefix and _navigation(scope):
            moved = self.host_url(scope, target)
            if moved is not None:  # a browser's page gets an origin of its own
                await _redirect(send, moved)
                return
        # One trip to a worker thread admits the request and connects to the port: a trip
        # costs a few tenths of a millisecond, the work itself a few hundredths.
        link = self._link(scope) if scope["type"] == "http" else None
        checked, opened = await run_in_threadpool(self._admit_and_open, scope, target,
                                                  link is None)
        if isinstance(checked, Refusal):
            await _refuse(scope, receive, send, checked)
            return
        _, who = checked
        if link is not None:
            await self._redeem_link(scope, send, target, link)
            return
        assert opened is not None
        await self._relay(scope, receive, send, target, who, opened, render=None)

    async def serve(self, scope: Scope, receive: Receive, send: Send, target: Target,
                    record: SandboxRecord, who: Who, *, render: Render | None = None) -> None:
        """Relay one admitted request or WebSocket to the sandbox's port and record it.
        ``render``: another surface's shape for the refusals (E2B's)."""
        refusal = framing_refusal(scope) if scope["type"] == "http" else None
        if refusal is not None:
            await _refuse(scope, receive, send, refusal, render)
            return
        opened = await run_in_threadpool(self._open, record, target.port)
        await self._relay(scope, receive, send, target, who, opened, render=render)

    def _admit_and_open(self, scope: Scope, target: Target, connect: bool
                        ) -> tuple[tuple[SandboxRecord, Who] | Refusal, _Opened | None]:
        checked = self._admit(scope, target)
        if isinstance(checked, Refusal) or not connect:
            return checked, None
        return checked, self._open(checked[0], target.port)

    def _open(self, record: SandboxRecord, port: int) -> _Opened:
        """When the connection began, and the socket to the port or why there is none."""
        started = time.monotonic()
        try:
            return started, self._manager.ports.open(record, port)
        except CorralError as exc:  # PortClosed, SandboxBusy, or the tier's own
            return started, exc

    async def _relay(self, scope: Scope, receive: Receive, send: Send, target: Target,
                     who: Who, opened: _Opened, *, render: Render | None) -> None:
        started, sock = opened
        if isinstance(sock, SandboxBusy):
            await _refuse(scope, receive, send, Refusal(503, "sandbox_paused", sock.message),
                          render)
            return
        if isinstance(sock, CorralError):
            await _refuse(scope, receive, send, Refusal(sock.status, sock.code, sock.message),
                          render)
            return
        headers = self._upstream_headers(scope, target)
        websocket = scope["type"] == "websocket"
        async def broken(exc: BaseException) -> Refusal:
            return Refusal(502, "bad_upstream", f"the server on port {target.port} in sandbox "
                           f"{target.sandbox_id} broke off or answered what is not HTTP/1.1 "
                           f"({exc.__class__.__name__})")

        def answer(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
            return answer_headers(headers, shared_origin=target.shared_origin)

        relay = WebSocketRelay(scope, receive, send, broken=broken) if websocket else \
            HttpRelay(scope, receive, send, broken=broken, answer=answer)
        try:
            await relay.run(sock, target.path, headers)
        finally:
            sock.close()
            await run_in_threadpool(
                self._manager.ports.record, target.sandbox_id, target.port, who,
                kind="websocket" if websocket else "http", status=relay.status,
                bytes_in=relay.bytes_in, bytes_out=relay.bytes_out,
                seconds=time.monotonic() - started, method=scope.get("method", "GET"),
                path=target.path.decode("latin-1"))

    # -- who may pass -------------------------------------------------------------------------

    def _admit(self, scope: Scope, target: Target) -> tuple[SandboxRecord, Who] | Refusal:
        """The sandbox and who the request is for, or why it may not pass."""
        gone = Refusal(404, "sandbox_not_found", f"sandbox {target.sandbox_id} does not exist: "
                        "it was destroyed, expired, or never made")
        try:
            record = self._manager.sandboxes.get(target.sandbox_id)  # expires what is past
        except SandboxNotFound:
            return gone
        except CorralError as exc:
            return Refusal(exc.status, exc.code, exc.message)
        exposure = self._manager.ports.exposure(record.id, target.port)
        if exposure is None:
            return Refusal(404, "port_not_exposed", f"port {target.port} of sandbox "
                            f"{record.id} is not exposed; its owner exposes it with "
                            f"`corral ports expose {record.id} {target.port}`")
        ports = self._manager.ports
        query = _query(scope)
        if "corral_sig" in query:
            if ports.check_link(exposure, query.get("corral_expires"), query.get("corral_sig")):
                return record, Who("link")
            return Refusal(401, "link_invalid", "this signed link is expired or not valid for "
                            "this port; ask the sandbox's owner for a new one")
        if exposure["public"]:
            return record, Who("public")
        if ports.check_token(exposure, _header(scope, b"x-corral-port-token")):
            return record, Who("token")
        cookie = SimpleCookie()
        with contextlib.suppress(Exception):
            cookie.load(_header(scope, b"cookie") or "")
        held = cookie.get(_cookie_name(target))
        if held is not None and ports.check_token(exposure, held.value):
            return record, Who("link")
        authorization = _header(scope, b"authorization")
        if authorization and authorization.lower().startswith("bearer "):
            credential = authorization[7:].strip()
            if ports.check_token(exposure, credential):
                return record, Who("token")
            # An API key, or on a cluster node the gateway's signed caller in its place.
            if is_corral_credential(credential):
                try:
                    tenant = self._tenants.authenticate(authorization, auth_required=True)
                except AuthError as exc:
                    return Refusal(401, exc.code, exc.message)
                if tenant.name != "local" and tenant.name != record.tenant:
                    return gone  # another tenant's sandbox does not exist for this one
                return record, Who("key", tenant.name)
        return Refusal(401, "unauthorized", f"port {target.port} of sandbox {record.id} is "
                        "private: send its token (X-Corral-Port-Token, or Authorization: "
                        "Bearer), the owner's API key, or open its signed link")

    def _link(self, scope: Scope) -> dict[str, str] | None:
        query = _query(scope)
        return query if "corral_sig" in query else None

    async def _redeem_link(self, scope: Scope, send: Send, target: Target,
                           query: dict[str, str]) -> None:
        """A valid signed link: set the port's cookie and send the browser to the plain URL,
        so the signature is not left in its history, its address bar or Referer headers."""
        exposure = self._manager.ports.exposure(target.sandbox_id, target.port)
        if exposure is None:  # unexposed between the check and here
            await _refuse(scope, _no_body, send, Refusal(404, "port_not_exposed", "the port "
                          "is no longer exposed"))
            return
        rest = {k: v for k, v in query.items() if k not in ("corral_sig", "corral_expires")}
        path = target.prefix + target.path.split(b"?", 1)[0].decode("latin-1")
        location = path + ("?" + urlencode(rest) if rest else "")
        secure = "; Secure" if scope.get("scheme") in ("https", "wss") else ""
        cookie = (f"{_cookie_name(target)}={self._manager.ports.token_for(exposure)}; "
                  f"Path={target.prefix or '/'}; HttpOnly; SameSite=Lax{secure}")
        await send({"type": "http.response.start", "status": 303, "headers": [
            (b"location", location.encode("latin-1")), (b"set-cookie", cookie.encode()),
            (b"cache-control", b"no-store"), (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    def _upstream_headers(self, scope: Scope, target: Target) -> list[tuple[bytes, bytes]]:
        """The client's headers minus hop-by-hop ones and Corral's credentials, plus the
        ``X-Forwarded-*`` a framework needs to build its own links."""
        headers = request_headers(scope.get("headers", ()), _NOT_PASSED)
        client = scope.get("client")
        scheme = str(scope.get("scheme", "http"))
        forwarded_proto = {"ws": "http", "wss": "https"}.get(scheme, scheme)
        if client:
            headers.append((b"x-forwarded-for", str(client[0]).encode()))
        headers.append((b"x-forwarded-proto", forwarded_proto.encode()))
        host = _header(scope, b"host")
        if host:
            headers.append((b"x-forwarded-host", host.encode("latin-1")))
        if target.prefix:
            headers.append((b"x-forwarded-prefix", target.prefix.encode()))
        return headers


def _navigation(scope: Scope) -> bool:
    """A browser loading a page (every current browser sends ``Sec-Fetch-Mode``)."""
    return scope["type"] == "http" and _header(scope, b"sec-fetch-mode") == "navigate"


def _request_base(scope: Scope) -> str:
    """``scheme://host[:port]`` as the client reached the service."""
    scheme = str(scope.get("scheme", "http"))
    scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    return f"{scheme}://{_header(scope, b'host') or 'localhost'}"


async def _redirect(send: Send, location: str) -> None:
    await send({"type": "http.response.start", "status": 307, "headers": [
        (b"location", location.encode("latin-1")), (b"cache-control", b"no-store"),
        (b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


# Another surface's refusal: (status, code, message) to (status, JSON body).
Render = Callable[[int, str, str], tuple[int, dict[str, Any]]]
# When the proxy began connecting to a port, and the socket or why there is none.
_Opened = tuple[float, socket.socket | CorralError]


async def _refuse(scope: Scope, receive: Receive, send: Send, refusal: Refusal,
                  render: Render | None = None) -> None:
    """A status page a person can read (HTML for a browser), or JSON for a program."""
    if render is not None:
        status, shaped = render(refusal.status, refusal.code, refusal.message)
        refusal = Refusal(status, refusal.code, json.dumps(shaped))
        if scope["type"] == "http":
            body = refusal.message.encode()
            await send({"type": "http.response.start", "status": status, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
    if scope["type"] == "websocket":
        # Before accepting: an HTTP answer if the server can send one, else a policy close.
        if "websocket.http.response" in scope.get("extensions", {}):
            await send_status(send, refusal, accept="application/json",
                               prefix="websocket.http.response")
        else:
            await send({"type": "websocket.close", "code": 1008,
                        "reason": refusal.message[:120]})
        return
    await send_status(send, refusal, accept=_header(scope, b"accept") or "",
                       prefix="http.response")


class PortRouting:
    """The outermost app of ``corral serve``: requests for an exposed port go to the proxy
    (before the service's own Host and Origin guards, which judge the service's requests);
    path-form requests must still name the service (DNS rebinding)."""

    def __init__(self, app: ASGIApp, proxy: PortProxy, names: ServiceNames) -> None:
        self._app, self._proxy, self._names = app, proxy, names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            target = self._proxy.match(scope)
            if target is not None:
                if target.prefix and not self._names.allows(_header(scope, b"host") or "",
                                                           _own_port(scope)):
                    await _refuse(scope, receive, send, Refusal(
                        421, "host_refused", "this Host is not a name of the service"))
                    return
                await self._proxy(scope, receive, send, target)
                return
        await self._app(scope, receive, send)


def _own_port(scope: Scope) -> int | None:
    server = scope.get("server")
    return int(server[1]) if server and server[1] is not None else None
