"""Relaying one HTTP/1.1 request or WebSocket from an ASGI client to an upstream socket, both
ways, never buffering a body: the port proxy's (a server inside a sandbox) and the cluster
gateway's (the node that holds a sandbox).

Request bodies go up as they arrive (chunked when the client gave no length), responses come
down as they are read; h11 frames the upstream side. One upstream connection per request
(``Connection: close``): nothing is shared between clients. WebSockets are relayed message by
message through the ``websockets`` client, so close codes and subprotocols pass through, with
a 16 MiB message bound (the service's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import h11
from starlette.types import Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.typing import Origin, Subprotocol

__all__ = ["HOP_HEADERS", "AnswerHeaders", "Broken", "HttpRelay", "Refusal", "WebSocketRelay",
           "framing_refusal", "send_json", "send_status"]

# Reads from the upstream socket. Fewer, larger reads: on the 2-core dev VM 1 MiB relays a
# large body about 1.7x as fast as 256 KiB (2 and 4 MiB were slower again). A connection holds
# at most about two chunks: uvicorn pauses the next send while the client is behind.
_CHUNK = 1024 * 1024
_WS_MAX_MESSAGE = 16 * 1024 * 1024
#: Hop-by-hop headers (RFC 9110 §7.6.1) and the ones a relay sets itself.
HOP_HEADERS = frozenset({b"connection", b"keep-alive", b"proxy-authenticate",
                         b"proxy-authorization", b"te", b"trailer", b"transfer-encoding",
                         b"upgrade", b"proxy-connection"})
# What the websockets client writes itself on the upstream handshake.
_WS_OWN = frozenset({b"host", b"upgrade", b"connection", b"sec-websocket-key",
                     b"sec-websocket-version", b"sec-websocket-extensions",
                     b"sec-websocket-protocol", b"origin", b"user-agent"})


@dataclass(frozen=True, slots=True)
class Refusal:
    """An answer a relay gives itself: status, error code, message."""

    status: int
    code: str
    message: str


#: What to answer when the upstream fails (connect refused, reset, not HTTP/1.1).
Broken = Callable[[BaseException], Awaitable[Refusal]]
#: The answer's headers as the client gets them, from the upstream's (hop-by-hop ones gone).
AnswerHeaders = Callable[[list[tuple[bytes, bytes]]], list[tuple[bytes, bytes]]]


def framing_refusal(scope: Scope) -> Refusal | None:
    """Why a client's request cannot be relayed as framed, or None. The relay rebuilds the
    framing it sends upstream from what the server parsed, so a request the server and an
    upstream could read two ways (RFC 9112 §6.3: Content-Length beside Transfer-Encoding, a
    coding other than chunked, two lengths) is refused, as the egress gateway refuses it,
    instead of being forwarded with a body that does not match its head."""
    lengths = [v for k, v in scope.get("headers", ()) if k == b"content-length"]
    codings = [v for k, v in scope.get("headers", ()) if k == b"transfer-encoding"]
    if lengths and codings:
        return Refusal(400, "bad_framing", "the request has both Content-Length and "
                       "Transfer-Encoding (RFC 9112 §6.3); send exactly one of them")
    if codings and (len(codings) > 1 or codings[0].strip().lower() != b"chunked"):
        return Refusal(501, "bad_framing", "the only Transfer-Encoding relayed is chunked")
    if codings and scope.get("http_version") == "1.0":
        return Refusal(400, "bad_framing", "Transfer-Encoding on an HTTP/1.0 request (RFC 9112 "
                       "§6.1); send Content-Length instead")
    if len(lengths) > 1 or (lengths and not lengths[0].strip().isdigit()):
        return Refusal(400, "bad_framing", "the request has more than one Content-Length, or "
                       "one that is not a number; send exactly one")
    return None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def send_json(send: Send, status: int, body: Any,
                    headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """A whole JSON answer."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        *headers]})
    await send({"type": "http.response.body", "body": data})


async def send_status(send: Send, refusal: Refusal, *, accept: str, prefix: str) -> None:
    """A status page a person can read (HTML, for a browser), or Corral's JSON error."""
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


class HttpRelay:
    """One request up, its response down. ``broken`` says what to answer when the upstream
    fails: the whole answer if nothing was sent yet; appended as a last ``error`` event to an
    NDJSON stream already under way (Corral's command streams end with one); else the body
    just ends short."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, *, broken: Broken,
                 answer: AnswerHeaders | None = None) -> None:
        """``answer``: what of the upstream's headers the client gets (all but hop-by-hop
        ones when None)."""
        self._scope, self._receive, self._send = scope, receive, send
        self._broken = broken
        self._answer = answer
        self.status = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self._ndjson = False

    async def run(self, sock: socket.socket, path: bytes,
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
                method=scope["method"], target=path, headers=headers)))
            response = asyncio.create_task(self._relay_response(upstream, sock))
            pump = asyncio.create_task(self._pump_request(upstream, sock, response))
            await asyncio.wait({response})
            if response.cancelled():
                return  # the client went away: an endless answer (events, a log) ends here
            response.result()
        except (h11.ProtocolError, ConnectionError, OSError) as exc:
            await self._fail(exc)
        finally:
            if pump is not None and not pump.done():
                pump.cancel()
                with contextlib.suppress(BaseException):
                    await pump

    async def _fail(self, exc: BaseException) -> None:
        refusal = await self._broken(exc)
        if self.status == 0:
            self.status = refusal.status
            await send_status(self._send, refusal, accept="", prefix="http.response")
        elif self._ndjson:
            line = json.dumps({"type": "error", "error": refusal.code,
                               "message": refusal.message}).encode() + b"\n"
            with contextlib.suppress(Exception):
                await self._send({"type": "http.response.body", "body": line})
        with contextlib.suppress(Exception):  # no-op when the body had already ended
            await self._send({"type": "http.response.body", "body": b""})

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
                continue  # 100 Continue: the relay already streams the body
            if isinstance(event, h11.Response):
                headers = [(k, v) for k, v in event.headers if k not in HOP_HEADERS]
                if self._answer is not None:
                    headers = self._answer(headers)
                self._ndjson = any(k == b"content-type" and v.startswith(b"application/x-ndjson")
                                   for k, v in headers)
                await self._send({"type": "http.response.start", "status": event.status_code,
                                  "headers": headers})
                self.status = event.status_code
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


class WebSocketRelay:
    """One WebSocket, message by message, both ways. ``broken`` gives the close reason when
    the upstream handshake fails."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, *, broken: Broken) -> None:
        self._scope, self._receive, self._send = scope, receive, send
        self._broken = broken
        self.status = 0
        self.bytes_in = 0
        self.bytes_out = 0

    async def run(self, sock: socket.socket, path: bytes,
                  headers: list[tuple[bytes, bytes]], *, host: str | None = None) -> None:
        """``host``: the Host to send upstream (default: the client's)."""
        first = await self._receive()
        if first["type"] != "websocket.connect":
            return
        scope = self._scope
        host = host or _header(scope, b"host") or "localhost"
        extra = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers
                 if k not in _WS_OWN]
        subprotocols: Sequence[str] = scope.get("subprotocols") or ()
        origin = _header(scope, b"origin")
        sock.setblocking(False)
        try:
            upstream = await connect(
                f"ws://{host}{path.decode('latin-1')}", sock=sock,
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
            refusal = await self._broken(exc)
            self.status = refusal.status
            await self._send({"type": "websocket.close", "code": 1011,
                              "reason": refusal.message[:120]})
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
