"""Connect RPC over HTTP/1.1 with the JSON codec: the framing envd's clients speak.

Every E2B SDK since 1.0 sends JSON only (E2B-COMPAT §7.1): unary calls are a JSON body in and
out (``application/json``); streams are 5-byte envelopes (``flags:u8 | length:u32be``) of JSON
messages, and a stream response ends with an end-stream frame (flags ``0x02``) that carries the
error, if any. Hand-framed rather than generated from the protos: the surface is fixed and small,
and the ``connectrpc`` runtime's pins clash with the SDK's own (E2B-COMPAT §11, P18).

Handlers are plain async functions on dicts; this module does the framing and keepalives, and
sends every failure as a Connect error (``corral._http.errors.as_connect`` maps Corral's errors
onto Connect codes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .._http.errors import CONNECT_STATUS, as_connect, failure, refused

__all__ = [
    "ConnectError",
    "Endpoint",
    "client_stream",
    "decode_envelopes",
    "end_stream",
    "envelope",
    "error_response",
    "route",
    "server_stream",
    "unary",
]

Endpoint = Callable[[Request], Awaitable[Response]]
Message = dict[str, Any]

_FLAG_COMPRESSED = 0x01
_FLAG_END_STREAM = 0x02
_UNARY_TYPES = ("application/json",)
_STREAM_TYPES = ("application/connect+json",)
# A request message bigger than this is refused: envd's requests are small (file contents go
# through /files, not RPCs); StreamInput chunks are what the SDK sends, well below it.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_DEFAULT_KEEPALIVE_S = 50.0


class ConnectError(Exception):
    """An RPC's failure, sent as a Connect error (``code`` is one of ``CONNECT_STATUS``)."""

    def __init__(self, code: str, message: str) -> None:
        if code not in CONNECT_STATUS:
            raise ValueError(f"not a Connect error code: {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message

    def to_json(self) -> Message:
        return {"code": self.code, "message": self.message}


def _to_connect(exc: BaseException) -> ConnectError:
    if isinstance(exc, ConnectError):
        return exc
    # A Corral error's status is its Connect code's: sent from the code, before the stream
    # or in its end frame (which has none).
    _, body = as_connect(failure(exc, where="an envd RPC"))
    return ConnectError(body["code"], body["message"])


# -- framing --------------------------------------------------------------------------------------


def envelope(message: Message, *, flags: int = 0) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


def end_stream(error: ConnectError | None = None) -> bytes:
    return envelope({} if error is None else {"error": error.to_json()}, flags=_FLAG_END_STREAM)


async def decode_envelopes(chunks: AsyncIterator[bytes]) -> AsyncIterator[Message]:
    """The JSON messages of an enveloped request body, as they arrive (client streams are
    half-duplex: the SDK sends a chunked body and reads the answer after it)."""
    buffer = bytearray()
    async for chunk in chunks:
        buffer += chunk
        while len(buffer) >= 5:
            flags, length = struct.unpack(">BI", buffer[:5])
            if length > MAX_MESSAGE_BYTES:
                raise ConnectError("resource_exhausted",
                                   f"a request message of {length} bytes is over the "
                                   f"{MAX_MESSAGE_BYTES}-byte limit")
            if len(buffer) < 5 + length:
                break
            payload = bytes(buffer[5:5 + length])
            del buffer[:5 + length]
            if flags & _FLAG_COMPRESSED:
                raise ConnectError("unimplemented", "compressed messages are not supported; "
                                   "send connect-content-encoding: identity")
            if flags & _FLAG_END_STREAM:
                return
            yield _parse(payload)
    if buffer:
        raise ConnectError("invalid_argument", "the request ended inside a message envelope")


def _parse(payload: bytes) -> Message:
    try:
        message = json.loads(payload or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise ConnectError("invalid_argument", "the request message is not valid JSON") from None
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "the request message must be a JSON object")
    return message


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def _check_encoding(request: Request, header: str) -> None:
    encoding = request.headers.get(header, "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ConnectError("unimplemented", f"{header} {encoding!r} is not supported; "
                           "send identity")


def error_response(error: ConnectError) -> JSONResponse:
    """A unary (or pre-stream) error: the code's status, the Connect JSON body."""
    return JSONResponse(error.to_json(), status_code=CONNECT_STATUS[error.code])


def _unsupported_type(request: Request, expected: tuple[str, ...]) -> Response:
    status, body = as_connect(refused(
        415, f"content type {_media_type(request) or '(none)'!r} is not supported here; this "
             f"RPC takes {' or '.join(expected)} (Corral speaks Connect's JSON codec only)"))
    return JSONResponse(body, status_code=status, headers={"Accept-Post": ", ".join(expected)})


# -- endpoints ------------------------------------------------------------------------------------


def unary(fn: Callable[[Message, Request], Awaitable[Message]]) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        if _media_type(request) not in _UNARY_TYPES:
            return _unsupported_type(request, _UNARY_TYPES)
        try:
            _check_encoding(request, "content-encoding")
            body = await request.body()
            if len(body) > MAX_MESSAGE_BYTES:
                raise ConnectError("resource_exhausted", "the request message is too large")
            return JSONResponse(await fn(_parse(body), request))
        except Exception as exc:  # every failure is a Connect error on the wire
            return error_response(_to_connect(exc))

    return endpoint


def _keepalive_interval(request: Request) -> float:
    raw = request.headers.get("keepalive-ping-interval", "")
    try:
        seconds = float(raw)
    except ValueError:
        return _DEFAULT_KEEPALIVE_S
    return min(max(seconds, 1.0), 600.0)


async def _first_message(request: Request) -> Message:
    async for message in decode_envelopes(request.stream()):
        return message
    raise ConnectError("invalid_argument", "the stream request carries no message")


def server_stream(fn: Callable[[Message, Request], AsyncIterator[Message]], *,
                  keepalive: Message | None = None) -> Endpoint:
    """A server-streaming RPC. Errors before the first message go out as a plain Connect
    error response; later ones in the end-stream frame."""

    async def endpoint(request: Request) -> Response:
        if _media_type(request) not in _STREAM_TYPES:
            return _unsupported_type(request, _STREAM_TYPES)
        try:
            _check_encoding(request, "connect-content-encoding")
            message = await _first_message(request)
            messages = fn(message, request)
            first = await anext(messages)
        except StopAsyncIteration:
            return _stream_response(request, _empty(), None, keepalive)
        except Exception as exc:
            return error_response(_to_connect(exc))
        return _stream_response(request, messages, first, keepalive)

    return endpoint


async def _empty() -> AsyncIterator[Message]:
    return
    yield  # pragma: no cover - makes this an async generator


def _stream_response(request: Request, messages: AsyncIterator[Message],
                     first: Message | None, keepalive: Message | None) -> StreamingResponse:
    interval = _keepalive_interval(request)

    async def body() -> AsyncIterator[bytes]:
        if first is not None:
            yield envelope(first)
        pending: asyncio.Task[Message] | None = None
        error: ConnectError | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(messages))
                done, _ = await asyncio.wait({pending}, timeout=interval)
                if not done:
                    if keepalive is not None:
                        yield envelope(keepalive)
                    continue
                task, pending = pending, None
                try:
                    message = task.result()
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    error = _to_connect(exc)
                    break
                yield envelope(message)
        finally:
            if pending is not None:  # the client went away: stop following, nothing more
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            with contextlib.suppress(BaseException):
                await messages.aclose()  # type: ignore[attr-defined]
        yield end_stream(error)

    return StreamingResponse(body(), media_type="application/connect+json")


def client_stream(fn: Callable[[AsyncIterator[Message], Request],
                               Awaitable[Message]]) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        if _media_type(request) not in _STREAM_TYPES:
            return _unsupported_type(request, _STREAM_TYPES)
        try:
            _check_encoding(request, "connect-content-encoding")
            reply = await fn(decode_envelopes(request.stream()), request)
            error = None
        except Exception as exc:
            reply, error = None, _to_connect(exc)
        frames = (envelope(reply) if reply is not None else b"") + end_stream(error)
        return Response(frames, media_type="application/connect+json")

    return endpoint


def route(service_method: str, endpoint: Endpoint) -> Route:
    """The route of ``"package.Service/Method"``; Connect calls are always POST."""
    return Route(f"/{service_method}", endpoint, methods=["POST"])
