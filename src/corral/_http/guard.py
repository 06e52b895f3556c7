"""The service's edge: pure ASGI checks that run before any route, and look at headers only.

Order (outermost first), so nothing later trusts what an earlier check has not bounded:

1. :class:`HostGuard` — the ``Host`` must be one of the service's names (DNS rebinding: a page
   on ``evil.example`` that re-resolves to 127.0.0.1 still sends ``Host: evil.example``).
2. :class:`BodyLimit` — a declared ``Content-Length`` over the route's limit is refused before a
   byte of the body is read; a chunked body is counted as it arrives and cut at the limit.
3. :class:`Authenticate` — the tenant comes from the ``Authorization`` header, before any body
   is read; routes find it in the scope (:func:`scope_tenant`).
4. :class:`OriginGuard` — a browser ``Origin`` that is not one of the service's names may not
   open a WebSocket or send a state-changing request (no Origin: not a browser, fine).
5. :class:`OwnerFirst` — a body sent to a route inside a sandbox is read only once the sandbox
   is known to be the caller's (another tenant's answers 404 with the body unread).

Every refusal is ``{"error": code, "message": ...}`` with the error class's status; a WebSocket
is refused before it is accepted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._control.plane import Tenant
from ..errors import AuthError, CorralError, HostRefused, OriginRefused, TooLarge

__all__ = [
    "Authenticate",
    "BodyLimit",
    "BodyLimits",
    "HostGuard",
    "OriginGuard",
    "OwnerFirst",
    "ServiceNames",
    "scope_tenant",
]

_TENANT_KEY = "corral.tenant"
_IN_SANDBOX = re.compile(r"/v1/sandboxes/([^/]+)(?:/.*)?")
_STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# What a refusal quotes back of a caller's header: enough to recognise it, never all of it.
_QUOTE = 80


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _split_authority(authority: str) -> tuple[str, int | None] | None:
    """(lower-case host, port or None) of ``host[:port]``; None when it is not one."""
    if authority.startswith("["):
        host, bracket, rest = authority.partition("]")
        host += bracket
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
    else:
        host, colon, port_text_raw = authority.partition(":")
        port_text = port_text_raw if colon else None
    if not host or (port_text is not None and not port_text.isdigit()):
        return None
    port = int(port_text) if port_text is not None else None
    if port is not None and not 0 < port < 65536:
        return None
    return host.lower(), port


@dataclass(frozen=True, slots=True)
class ServiceNames:
    """The names the service answers to, each ``host`` or ``host:port``.

    A name without a port matches that host with no port or with the port the service itself
    listens on (``scope["server"]``); a name with a port matches exactly that.
    """

    names: tuple[str, ...]
    parsed: tuple[tuple[str, int | None], ...]

    @classmethod
    def of(cls, listen_host: str, extra: Iterable[str] = ()) -> ServiceNames:
        """The defaults (the listen address, ``localhost``, ``127.0.0.1``, ``[::1]``) and
        ``extra``. Raises ValueError naming a malformed extra name."""
        listen = f"[{listen_host}]" if ":" in listen_host else listen_host
        names = [listen, "localhost", "127.0.0.1", "[::1]"]
        for name in extra:
            name = name.strip()
            if not name:
                continue
            if _split_authority(name) is None or "/" in name:
                raise ValueError(f"{name!r} is not a host name: give host or host:port "
                                 "(an IPv6 address in brackets), without a scheme or path")
            names.append(name)
        unique = tuple(dict.fromkeys(n.lower() for n in names))
        return cls(unique, tuple(_split_authority(n) or ("", None) for n in unique))

    def allows(self, authority: str, own_port: int | None) -> bool:
        parsed = _split_authority(authority)
        if parsed is None:
            return False
        host, port = parsed
        for want_host, want_port in self.parsed:
            if host != want_host:
                continue
            if want_port is not None:
                if port == want_port:
                    return True
            elif port is None or port == own_port:
                return True
        return False

    def describe(self) -> str:
        return ", ".join(self.names)


class AnyName(ServiceNames):
    """Every name: for a cluster node's service, which only gateways reach (each call carries
    a caller token a gateway signed) and whose gateway judged the Host already; the node sees
    the client's Host, so the URLs it builds (exposed ports') are the gateway's."""

    def __init__(self) -> None:
        super().__init__(("*",), ())

    def allows(self, authority: str, own_port: int | None) -> bool:
        return _split_authority(authority) is not None


def _own_port(scope: Scope) -> int | None:
    server = scope.get("server")
    return int(server[1]) if server and server[1] is not None else None


Render = Callable[[CorralError], tuple[int, bytes]]


def _render(error: CorralError) -> tuple[int, bytes]:
    return error.status, json.dumps({"error": error.code, "message": error.message}).encode()


async def _refuse(scope: Scope, send: Send, error: CorralError,
                  render: Render = _render) -> None:
    """Answer ``error`` as JSON (``render`` gives status and body: another dialect's shape);
    a WebSocket is refused before it is accepted."""
    status, body = render(error)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if scope["type"] == "websocket":
        if "websocket.http.response" in scope.get("extensions", {}):
            await send({"type": "websocket.http.response.start", "status": status,
                        "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:  # the server cannot send a denial body: a close before accept is a 403
            await send({"type": "websocket.close", "code": 4000 + min(error.status, 999),
                        "reason": error.message[:120]})
        return
    # The body may still be on its way: close the connection rather than read it to the end.
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class HostGuard:
    """Refuse (421) any request whose ``Host`` is not one of the service's names."""

    def __init__(self, app: ASGIApp, *, names: ServiceNames) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = _header(scope, b"host")
            if host is None or not self.names.allows(host, _own_port(scope)):
                shown = "no Host header" if host is None else f"Host {host[:_QUOTE]!r}"
                await _refuse(scope, send, HostRefused(
                    f"{shown} is not a name of this service (it answers to "
                    f"{self.names.describe()}); if the name is yours, add it with "
                    "`corral serve --host-name NAME` or CORRAL_SERVER_HOST_NAMES"))
                return
        await self.app(scope, receive, send)


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """The most bytes a request body may carry: per route (method, path pattern), else
    ``default``. Each route entry carries the hint a refusal gives."""

    default: int
    routes: tuple[tuple[str, re.Pattern[str], int, str], ...] = ()
    default_hint: str = "JSON bodies are small; send data as a file (PUT .../files/content)"

    def limit_for(self, method: str, path: str) -> tuple[int, str]:
        for want_method, pattern, limit, hint in self.routes:
            if method == want_method and pattern.fullmatch(path):
                return limit, hint
        return self.default, self.default_hint


class _Cut(Exception):
    """The body went past its limit while a route was reading it."""


class BodyLimit:
    """Refuse (413) a body over its limit: a declared length before reading, a streamed one
    as soon as it passes the limit (the route never sees more than ``limit`` bytes)."""

    def __init__(self, app: ASGIApp, *, limits: BodyLimits, render: Render = _render) -> None:
        self.app = app
        self.limits = limits
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, hint = self.limits.limit_for(scope["method"], scope["path"])

        def error() -> TooLarge:
            return TooLarge(f"the body of {scope['method']} {scope['path'][:_QUOTE]} is "
                            f"limited to {limit} bytes; {hint}")

        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _refuse(scope, send, error(), self.render)
            return
        seen = 0
        cut = False
        started = False

        async def limited_receive() -> Message:
            nonlocal seen, cut
            if cut:
                raise _Cut
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    cut = True
                    raise _Cut
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if cut:
                # Whatever the route made of the cut (a parse error, say), the answer is 413.
                if not started:
                    started = True
                    await _refuse(scope, send, error(), self.render)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not cut:
                raise
            if not started:
                await _refuse(scope, send, error(), self.render)


class Authenticate:
    """Resolve the caller's tenant from its ``Authorization`` header before any body is read;
    refuse (401) a missing or bad key where one is required.

    ``authenticate(header)`` returns the tenant or raises AuthError; it runs in a worker thread
    (it reads the store). Paths ``protected`` says no to (health, the API's own schema) pass
    without a tenant.
    """

    def __init__(self, app: ASGIApp, *,
                 authenticate: Callable[[str | None], Awaitable[Tenant]],
                 protected: Callable[[str], bool],
                 session: Callable[[str], Awaitable[Tenant]] | None = None) -> None:
        self.app = app
        self.authenticate = authenticate
        self.protected = protected
        self.session = session

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self.protected(scope["path"]):
            header = _header(scope, b"authorization")
            cookies = session_cookies(scope) if header is None and self.session else []
            try:
                if cookies and self.session is not None:
                    _check_browser(scope, cookies)
                    tenant = await self.session(cookies[0])
                else:
                    tenant = await self.authenticate(header)
            except AuthError as exc:
                await _refuse(scope, send, exc)
                return
            scope[_TENANT_KEY] = tenant
        await self.app(scope, receive, send)


#: The dashboard's session cookie, and the header its requests carry (``_ui.session``).
SESSION_COOKIE = "corral_session"
#: Its name over https: a ``__Host-`` cookie is Secure, host-only and for ``/``, so no page of
#: another host of the site (a preview on a sibling domain) can set one the service would read.
SECURE_SESSION_COOKIE = "__Host-corral_session"
UI_HEADER = b"x-corral-ui"
# Where a request may come from to be signed in by the session (the Fetch Metadata a browser
# sends): the service's own pages, or the person typing the address. Not "same-site": a
# preview on another port or a sibling host name is same-site, and SameSite=Strict lets the
# cookie go with its requests.
_OWN_FETCH_SITES = frozenset({"same-origin", "none"})


def session_cookie_name(scope: Scope) -> str:
    secure = scope.get("scheme") in ("https", "wss")
    return SECURE_SESSION_COOKIE if secure else SESSION_COOKIE


def session_cookies(scope: Scope) -> list[str]:
    """The values of every session cookie the request carries (a browser sends two when a
    page of another host of the site tossed one beside the service's own)."""
    raw = _header(scope, b"cookie")
    if raw is None:
        return []
    want = session_cookie_name(scope)
    found = []
    for part in raw.split(";"):
        name, _, value = part.strip().partition("=")
        if name == want and value:
            found.append(value)
    return found


def _check_browser(scope: Scope, cookies: list[str]) -> None:
    """A session cookie is a browser's credential, and a browser can be driven by another
    site's page: its requests must show they come from the dashboard's own script (a header
    no form, image or cross-origin script can add, and a Fetch Metadata site that is the
    service's own), its WebSockets from the service's own Origin (judged by ``OriginGuard``;
    here only its presence). Two session cookies mean one was planted: neither is trusted."""
    if len(cookies) > 1:
        raise AuthError("this request carries more than one dashboard session cookie (a page "
                        "of another host of this site may have set one): sign out, clear this "
                        "site's cookies and sign in again")
    site = _header(scope, b"sec-fetch-site")
    if site is not None and site not in _OWN_FETCH_SITES:
        raise AuthError(f"a dashboard session is accepted only from the dashboard's own pages "
                        f"(this request's Sec-Fetch-Site is {site[:_QUOTE]!r}); programs send "
                        "`Authorization: Bearer ck_...` instead")
    if scope["type"] == "websocket":
        if _header(scope, b"origin") is None:
            raise AuthError("a WebSocket signed in with a dashboard session must come from a "
                            "page of this service (no Origin was sent)")
    elif _header(scope, UI_HEADER) != "1":
        raise AuthError("a request signed in with a dashboard session must carry "
                        "`X-Corral-UI: 1` (the dashboard's own requests do); programs send "
                        "`Authorization: Bearer ck_...` instead")


def scope_tenant(scope: Scope) -> Tenant:
    """The tenant :class:`Authenticate` put in the scope."""
    tenant: Any = scope.get(_TENANT_KEY)
    if not isinstance(tenant, Tenant):
        # Only reachable if a route is served without the middleware: fail closed.
        raise AuthError("this request was not authenticated; send `Authorization: Bearer "
                        "ck_...`")
    return tenant


def _origin_authority(origin: str) -> str | None:
    scheme, sep, rest = origin.partition("://")
    if not sep or scheme.lower() not in ("http", "https", "ws", "wss") or "/" in rest:
        return None
    return rest


class OriginGuard:
    """Refuse (403) a WebSocket or a state-changing request sent from a page that is not the
    service's own: browsers always send ``Origin`` there; other clients send none."""

    def __init__(self, app: ASGIApp, *, names: ServiceNames) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        checked = scope["type"] == "websocket" or (
            scope["type"] == "http" and scope["method"] in _STATE_CHANGING)
        origin = _header(scope, b"origin") if checked else None
        if origin is not None:
            authority = _origin_authority(origin)
            if authority is None or not self.names.allows(authority, _own_port(scope)):
                await _refuse(scope, send, OriginRefused(
                    f"a page from Origin {origin[:_QUOTE]!r} may not drive this service "
                    f"(only pages from {self.names.describe()} may); call it from a program "
                    "(no Origin header), or add the page's host with `corral serve "
                    "--host-name NAME` if it is yours"))
                return
        await self.app(scope, receive, send)


def _has_body(scope: Scope) -> bool:
    declared = _header(scope, b"content-length")
    return (declared is not None and declared != "0") or (
        _header(scope, b"transfer-encoding") is not None)


class OwnerFirst:
    """Refuse a body sent into a sandbox that is not the caller's before reading it.

    ``check(tenant, sandbox_id)`` raises a CorralError (SandboxNotFound) when the sandbox is
    not the tenant's; the route still does its own full check.
    """

    def __init__(self, app: ASGIApp, *,
                 check: Callable[[Tenant, str], Awaitable[None]]) -> None:
        self.app = app
        self.check = check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenant = scope.get(_TENANT_KEY)
        if scope["type"] == "http" and isinstance(tenant, Tenant) and _has_body(scope):
            match = _IN_SANDBOX.fullmatch(scope["path"])
            if match is not None:
                try:
                    await self.check(tenant, match.group(1))
                except CorralError as exc:
                    await _refuse(scope, send, exc)
                    return
        await self.app(scope, receive, send)
