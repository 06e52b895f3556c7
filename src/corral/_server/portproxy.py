"""The port proxy: HTTP/1.1 and WebSocket from a client of ``corral serve`` to a server inside a
sandbox, through a socket the tier connects inside the sandbox (``IsolationBackend.open_port``),
so no host port is bound per sandbox and the sandbox never reaches the service.

URLs: ``/ports/<sandbox>/<port>/...`` (the path form; the app sees ``X-Forwarded-Prefix``) and
``<port>-<sandbox>.<domain>`` (the host form, E2B's ``get_host``). Who may pass, what the
tier is asked for and what is recorded are the control plane's (``_control.ports``); this
module only speaks the protocols.

Streaming both ways, never buffering a body: request bodies go up as they arrive (chunked when
the client gave no length), responses come down as they are read; h11 frames the upstream side.
One upstream connection per request (``Connection: close``): nothing is shared between clients.
WebSockets are relayed message by message through the ``websockets`` client, so close codes
and subprotocols pass through, with the same 16 MiB message bound as the service's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import logging
import re
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, urlencode

import h11
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.typing import Origin, Subprotocol

from .._control.manager import Manager
from .._control.ports import Who
from .._control.records import SandboxRecord
from .._control.tenants import TenantDirectory
from .._e2b.ids import from_e2b
from ..errors import AuthError, CorralError, SandboxBusy, SandboxNotFound
from .guard import ServiceNames

__all__ = ["PortProxy", "PortRouting", "Render", "Target"]

logger = logging.getLogger(__name__)

_PATH = re.compile(r"/ports/(sbx_[a-z0-9]{1,50})/(\d{1,5})(/.*)?")
# Reads from the upstream socket. Fewer, larger reads: on the 2-core dev VM 1 MiB relays a
# large body about 1.7x as fast as 256 KiB (2 and 4 MiB were slower again). A connection holds
# at most about two chunks: uvicorn pauses the next send while the client is behind.
_CHUNK = 1024 * 1024
_WS_MAX_MESSAGE = 16 * 1024 * 1024
# Hop-by-hop headers (RFC 9110 §7.6.1) and the ones this proxy sets itself.
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
                  b"te", b"trailer", b"transfer-encoding", b"upgrade", b"proxy-connection"})
_OURS = frozenset({b"x-corral-port-token", b"x-forwarded-for", b"x-forwarded-host",
                   b"x-forwarded-proto", b"x-forwarded-prefix", b"forwarded"})
# What the websockets client writes itself on the upstream handshake.
_WS_OWN = frozenset({b"host", b"upgrade", b"connection", b"sec-websocket-key",
                     b"sec-websocket-version", b"sec-websocket-extensions",
                     b"sec-websocket-protocol", b"origin", b"user-agent"})


@dataclass(frozen=True, slots=True)
class Target:
    """The sandbox port a request names, and the path prefix the URL put before the app's."""

    sandbox_id: str
    port: int
    prefix: str  # "" for the host form
    path: bytes  # what the app sees, with the query string


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
                      rest + (b"?" + query if query else b""))

    # -- ASGI ---------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send,
                       target: Target) -> None:
        # One trip to a worker thread admits the request and connects to the port: a trip
        # costs a few tenths of a millisecond, the work itself a few hundredths.
        link = self._link(scope) if scope["type"] == "http" else None
        checked, opened = await run_in_threadpool(self._admit_and_open, scope, target,
                                                  link is None)
        if isinstance(checked, _Refusal):
            await _refuse(scope, receive, send, checked)
            return
        _, who, strip_authorization = checked
        if link is not None:
            await self._redeem_link(scope, send, target, link)
            return
        assert opened is not None
        await self._relay(scope, receive, send, target, who, opened,
                          strip=(b"authorization",) if strip_authorization else (), render=None)

    async def serve(self, scope: Scope, receive: Receive, send: Send, target: Target,
                    record: SandboxRecord, who: Who, *, strip: Sequence[bytes] = (),
                    render: Render | None = None) -> None:
        """Relay one admitted request or WebSocket to the sandbox's port and record it.
        ``strip``: more request headers that are the caller's credentials for Corral (never
        passed on); ``render``: another surface's shape for the refusals (E2B's)."""
        opened = await run_in_threadpool(self._open, record, target.port)
        await self._relay(scope, receive, send, target, who, opened, strip=strip, render=render)

    def _admit_and_open(self, scope: Scope, target: Target, connect: bool
                        ) -> tuple[tuple[SandboxRecord, Who, bool] | _Refusal, _Opened | None]:
        checked = self._admit(scope, target)
        if isinstance(checked, _Refusal) or not connect:
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
                     who: Who, opened: _Opened, *, strip: Sequence[bytes],
                     render: Render | None) -> None:
        started, sock = opened
        if isinstance(sock, SandboxBusy):
            await _refuse(scope, receive, send, _Refusal(503, "sandbox_paused", sock.message),
                          render)
            return
        if isinstance(sock, CorralError):
            await _refuse(scope, receive, send, _Refusal(sock.status, sock.code, sock.message),
                          render)
            return
        headers = self._upstream_headers(scope, target, strip)
        websocket = scope["type"] == "websocket"
        relay = _WebSocketRelay(scope, receive, send) if websocket else _HttpRelay(
            scope, receive, send)
        try:
            await relay.run(sock, target, headers)
        finally:
            sock.close()
            await run_in_threadpool(
                self._manager.ports.record, target.sandbox_id, target.port, who,
                kind="websocket" if websocket else "http", status=relay.status,
                bytes_in=relay.bytes_in, bytes_out=relay.bytes_out,
                seconds=time.monotonic() - started, method=scope.get("method", "GET"),
                path=target.path.decode("latin-1"))

    # -- who may pass -------------------------------------------------------------------------

    def _admit(self, scope: Scope, target: Target) -> tuple[SandboxRecord, Who, bool] | _Refusal:
        """The sandbox, who the request is for and whether its Authorization header was ours
        (then it is not passed on): or why it may not pass."""
        gone = _Refusal(404, "sandbox_not_found", f"sandbox {target.sandbox_id} does not exist: "
                        "it was destroyed, expired, or never made")
        try:
            record = self._manager.sandboxes.get(target.sandbox_id)  # expires what is past
        except SandboxNotFound:
            return gone
        except CorralError as exc:
            return _Refusal(exc.status, exc.code, exc.message)
        exposure = self._manager.ports.exposure(record.id, target.port)
        if exposure is None:
            return _Refusal(404, "port_not_exposed", f"port {target.port} of sandbox "
                            f"{record.id} is not exposed; its owner exposes it with "
                            f"`corral ports expose {record.id} {target.port}`")
        ports = self._manager.ports
        query = _query(scope)
        if "corral_sig" in query:
            if ports.check_link(exposure, query.get("corral_expires"), query.get("corral_sig")):
                return record, Who("link"), False
            return _Refusal(401, "link_invalid", "this signed link is expired or not valid for "
                            "this port; ask the sandbox's owner for a new one")
        if exposure["public"]:
            return record, Who("public"), False
        if ports.check_token(exposure, _header(scope, b"x-corral-port-token")):
            return record, Who("token"), False
        cookie = SimpleCookie()
        with contextlib.suppress(Exception):
            cookie.load(_header(scope, b"cookie") or "")
        held = cookie.get(_cookie_name(target))
        if held is not None and ports.check_token(exposure, held.value):
            return record, Who("link"), False
        authorization = _header(scope, b"authorization")
        if authorization and authorization.lower().startswith("bearer "):
            credential = authorization[7:].strip()
            if ports.check_token(exposure, credential):
                return record, Who("token"), True
            if credential.startswith("ck_"):
                try:
                    tenant = self._tenants.authenticate(authorization, auth_required=True)
                except AuthError as exc:
                    return _Refusal(401, exc.code, exc.message)
                if tenant.name != "local" and tenant.name != record.tenant:
                    return gone  # another tenant's sandbox does not exist for this one
                return record, Who("key", tenant.name), True
        return _Refusal(401, "unauthorized", f"port {target.port} of sandbox {record.id} is "
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
            await _refuse(scope, _no_body, send, _Refusal(404, "port_not_exposed", "the port "
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

    def _upstream_headers(self, scope: Scope, target: Target,
                          strip: Sequence[bytes]) -> list[tuple[bytes, bytes]]:
        """The client's headers minus hop-by-hop ones and Corral's credentials, plus the
        ``X-Forwarded-*`` a framework needs to build its own links."""
        cookie_prefix = f"{_cookie_name(target)}=".encode()
        headers: list[tuple[bytes, bytes]] = []
        for key, value in scope.get("headers", ()):
            if key in _HOP or key in _OURS:
                continue
            if key in strip:
                continue
            if key == b"cookie":
                kept = [part for part in (p.strip() for p in value.split(b";"))
                        if part and not part.startswith(cookie_prefix)]
                if not kept:
                    continue
                value = b"; ".join(kept)
            headers.append((key, value))
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


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


@dataclass(frozen=True, slots=True)
class _Refusal:
    status: int
    code: str
    message: str


# Another surface's refusal: (status, code, message) to (status, JSON body).
Render = Callable[[int, str, str], tuple[int, dict[str, Any]]]
# When the proxy began connecting to a port, and the socket or why there is none.
_Opened = tuple[float, socket.socket | CorralError]


async def _refuse(scope: Scope, receive: Receive, send: Send, refusal: _Refusal,
                  render: Render | None = None) -> None:
    """A status page a person can read (HTML for a browser), or JSON for a program."""
    if render is not None:
        status, shaped = render(refusal.status, refusal.code, refusal.message)
        refusal = _Refusal(status, refusal.code, json.dumps(shaped))
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
            await _send_status(send, refusal, accept="application/json",
                               prefix="websocket.http.response")
        else:
            await send({"type": "websocket.close", "code": 1008,
                        "reason": refusal.message[:120]})
        return
    await _send_status(send, refusal, accept=_header(scope, b"accept") or "",
                       prefix="http.response")


async def _send_status(send: Send, refusal: _Refusal, *, accept: str, prefix: str) -> None:
    if "text/html" in accept:
        body = (f"<!doctype html><html lang=en><meta charset=utf-8><title>{refusal.status} "
                f"· Corral</title><body style='font:16px system-ui;margin:3em'><h1>"
                f"{refusal.status}</h1><p>{html.escape(refusal.message)}</p></body></html>"
                ).encode()
        kind = b"text/html; charset=utf-8"
    else:
        body = json.dumps({"error": refusal.code, "message": refusal.message}).encode()
        kind = b"application/json"
    await send({"type": f"{prefix}.start", "status": refusal.status, "headers": [
        (b"content-type", kind), (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store")]})
    await send({"type": f"{prefix}.body", "body": body})


class _HttpRelay:
    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._scope, self._receive, self._send = scope, receive, send
        self.status = 0
        self.bytes_in = 0
        self.bytes_out = 0

    async def run(self, sock: socket.socket, target: Target,
                  headers: list[tuple[bytes, bytes]]) -> None:
        # The socket's own loop methods, not asyncio streams: each stream layer copies every
        # chunk once more, and the copies were most of the proxy's time on a large body.
        scope = self._scope
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        upstream = h11.Connection(h11.CLIENT)
        has_length = any(k == b"content-length" for k, _ in headers)
        chunked = any(k == b"transfer-encoding" and b"chunked" in v.lower()
                      for k, v in scope.get("headers", ()))
        if chunked and not has_length:
            headers.append((b"transfer-encoding", b"chunked"))
        headers.append((b"connection", b"close"))
        if not any(k == b"host" for k, _ in headers):
            headers.insert(0, (b"host", b"localhost"))
        pump: asyncio.Task[None] | None = None
        try:
            await loop.sock_sendall(sock, upstream.send(h11.Request(
                method=scope["method"], target=target.path, headers=headers)))
            response = asyncio.create_task(self._relay_response(upstream, sock))
            pump = asyncio.create_task(self._pump_request(upstream, sock, response))
            await asyncio.wait({response})
            if response.cancelled():
                return  # the client went away: an endless answer (events, a log) ends here
            response.result()
        except (h11.ProtocolError, ConnectionError, OSError) as exc:
            if self.status == 0:
                self.status = 502
                await _send_status(self._send, _Refusal(
                    502, "bad_upstream", f"the server on port {target.port} in sandbox "
                    f"{target.sandbox_id} broke off or answered what is not HTTP/1.1 "
                    f"({exc.__class__.__name__})"), accept="", prefix="http.response")
        finally:
            if pump is not None and not pump.done():
                pump.cancel()
                with contextlib.suppress(BaseException):
                    await pump

    async def _pump_request(self, upstream: h11.Connection, sock: socket.socket,
                            response: asyncio.Task[None]) -> None:
        """The request body up as it arrives; then, until the answer is done, the client's
        disconnect, which stops the answer (the server drops what is sent to a client that
        left, so without this an endless answer would be relayed for ever)."""
        loop = asyncio.get_running_loop()
        sending = True
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                response.cancel()
                return
            body = message.get("body", b"")
            if body and sending:
                self.bytes_in += len(body)
                await loop.sock_sendall(sock, upstream.send(h11.Data(data=body)))
            if sending and not message.get("more_body", False):
                await loop.sock_sendall(sock, upstream.send(h11.EndOfMessage()))
                sending = False

    async def _relay_response(self, upstream: h11.Connection, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            event = upstream.next_event()
            if event is h11.NEED_DATA:
                upstream.receive_data(await loop.sock_recv(sock, _CHUNK))
                continue
            if isinstance(event, h11.InformationalResponse):
                continue  # 100 Continue: the proxy already streams the body
            if isinstance(event, h11.Response):
                self.status = event.status_code
                headers = [(k, v) for k, v in event.headers if k not in _HOP]
                await self._send({"type": "http.response.start", "status": event.status_code,
                                  "headers": headers})
                length = _sized_body(self._scope["method"], event)
                if length is not None:
                    await self._relay_sized(upstream, sock, length)
                    return
            elif isinstance(event, h11.Data):
                self.bytes_out += len(event.data)
                await self._send({"type": "http.response.body", "body": bytes(event.data),
                                  "more_body": True})
            elif isinstance(event, h11.EndOfMessage):
                await self._send({"type": "http.response.body", "body": b""})
                return
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the upstream closed before a whole response")

    async def _relay_sized(self, upstream: h11.Connection, sock: socket.socket,
                           length: int) -> None:
        """A body of a known length goes down as it comes off the socket, past h11 (which
        copies each chunk three times): what h11 already holds first, then up to ``length``
        bytes more; bytes past it are ignored, as h11 would."""
        loop = asyncio.get_running_loop()
        left = length
        data = upstream.trailing_data[0][:left]
        while True:
            if data:
                left -= len(data)
                self.bytes_out += len(data)
                await self._send({"type": "http.response.body", "body": data,
                                  "more_body": True})
            if left <= 0:
                break
            data = await loop.sock_recv(sock, min(_CHUNK, left))
            if not data:
                raise ConnectionError("the upstream closed before a whole response")
        await self._send({"type": "http.response.body", "body": b""})


def _sized_body(method: str, response: h11.Response) -> int | None:
    """The body length of a response framed by Content-Length alone (h11 has checked the
    header), or None when h11 must frame it: chunked, read to the close, or no body whatever
    the headers say (HEAD, CONNECT, 204, 304; RFC 9112 §6.3, as h11's ``_body_framing``)."""
    if response.status_code in (204, 304) or method in ("HEAD", "CONNECT"):
        return None
    length = None
    for key, value in response.headers:
        if key == b"transfer-encoding":
            return None
        if key == b"content-length":
            length = int(value)
    return length


class _WebSocketRelay:
    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._scope, self._receive, self._send = scope, receive, send
        self.status = 0
        self.bytes_in = 0
        self.bytes_out = 0

    async def run(self, sock: socket.socket, target: Target,
                  headers: list[tuple[bytes, bytes]]) -> None:
        first = await self._receive()
        if first["type"] != "websocket.connect":
            return
        scope = self._scope
        host = _header(scope, b"host") or "localhost"
        extra = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers
                 if k not in _WS_OWN]
        subprotocols: Sequence[str] = scope.get("subprotocols") or ()
        origin = _header(scope, b"origin")
        sock.setblocking(False)
        try:
            upstream = await connect(
                f"ws://{host}{target.path.decode('latin-1')}", sock=sock,
                additional_headers=extra,
                subprotocols=[Subprotocol(p) for p in subprotocols] or None,
                origin=None if origin is None else Origin(origin), compression=None,
                max_size=_WS_MAX_MESSAGE, open_timeout=10,
                ping_interval=None, user_agent_header=_header(scope, b"user-agent"))
        except InvalidStatus as exc:
            self.status = exc.response.status_code
            await self._send({"type": "websocket.close", "code": 1011,
                              "reason": f"the server refused the WebSocket ({self.status})"})
            return
        except (WebSocketException, OSError, TimeoutError) as exc:
            self.status = 502
            await self._send({"type": "websocket.close", "code": 1011,
                              "reason": f"the server broke off the handshake "
                                        f"({exc.__class__.__name__})"})
            return
        self.status = 101
        await self._send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
        down = asyncio.create_task(self._down(upstream))
        try:
            await self._up(upstream)
        finally:
            await upstream.close()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(down, 5)
            if not down.done():
                down.cancel()

    async def _up(self, upstream: ClientConnection) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "websocket.disconnect":
                with contextlib.suppress(ConnectionClosed):
                    await upstream.close(code=message.get("code", 1000) or 1000)
                return
            if message["type"] != "websocket.receive":
                continue
            data: Any = message.get("text")
            if data is None:
                data = message.get("bytes") or b""
            self.bytes_in += len(data)
            try:
                await upstream.send(data)
            except ConnectionClosed:
                return

    async def _down(self, upstream: ClientConnection) -> None:
        try:
            async for data in upstream:
                self.bytes_out += len(data)
                key = "text" if isinstance(data, str) else "bytes"
                await self._send({"type": "websocket.send", key: data})
        except ConnectionClosed:
            pass
        code = upstream.close_code or 1000
        with contextlib.suppress(Exception):
            await self._send({"type": "websocket.close", "code": code if code != 1005 else 1000,
                              "reason": upstream.close_reason or ""})


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
                    await _refuse(scope, receive, send, _Refusal(
                        421, "host_refused", "this Host is not a name of the service"))
                    return
                await self._proxy(scope, receive, send, target)
                return
        await self._app(scope, receive, send)


def _own_port(scope: Scope) -> int | None:
    server = scope.get("server")
    return int(server[1]) if server and server[1] is not None else None
