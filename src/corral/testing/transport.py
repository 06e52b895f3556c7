"""SDK transports that drive the HTTP API in-process, without a server or a socket.

    app = create_app(manager)
    with Sandbox.create(transport=asgi_transport(app)) as sb: ...
    async with await AsyncSandbox.create(transport=async_asgi_transport(app)) as sb: ...

The async one is ``httpx.ASGITransport``; the sync one runs that same transport on a private
event loop (a blocking portal) per request, so it also works inside a running loop. Requests
come from ``127.0.0.1`` to ``http://127.0.0.1``, so a keyless app on loopback answers them as
it would a local client; pass ``api_key`` for an app with keys. The whole HTTP layer runs (routing,
validation, auth, error mapping, the NDJSON stream), but a response body arrives only once the
endpoint has produced it all, so a streamed command's callbacks fire after it ends.
"""

from __future__ import annotations

from typing import Any

import anyio.from_thread
import httpx

from .._sdk._async.http import AsyncHTTPTransport
from .._sdk._sync.http import HTTPTransport

__all__ = ["async_asgi_transport", "asgi_transport"]

_BASE = "http://127.0.0.1"
_CLIENT = ("127.0.0.1", 50000)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def async_asgi_transport(app: Any, *, api_key: str | None = None) -> AsyncHTTPTransport:
    """An ``AsyncSandbox`` transport over ``app`` (an ASGI app, e.g. ``create_app(...)``)."""
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app, client=_CLIENT),
                               base_url=_BASE, headers=_headers(api_key))
    return AsyncHTTPTransport(client=client)


class _BlockingASGI(httpx.BaseTransport):
    """``httpx.ASGITransport`` for a synchronous ``httpx.Client``."""

    def __init__(self, app: Any) -> None:
        self._asgi = httpx.ASGITransport(app, client=_CLIENT)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()  # the SDK's bodies are bytes or a finite iterator of chunks

        async def call() -> tuple[int, httpx.Headers, bytes]:
            forwarded = httpx.Request(request.method, request.url, headers=request.headers,
                                      content=body)
            response = await self._asgi.handle_async_request(forwarded)
            try:
                return response.status_code, response.headers, await response.aread()
            finally:
                await response.aclose()

        with anyio.from_thread.start_blocking_portal() as portal:
            status, headers, content = portal.call(call)
        return httpx.Response(status, headers=headers, content=content)


def asgi_transport(app: Any, *, api_key: str | None = None) -> HTTPTransport:
    """A ``Sandbox`` transport over ``app``."""
    client = httpx.Client(transport=_BlockingASGI(app), base_url=_BASE,
                          headers=_headers(api_key))
    return HTTPTransport(client=client)
