"""What the gateway forwards of a request, per RFC 9112: its framing, its target, its headers.

The gateway never copies the client's framing: an upstream that frames a request differently
from the gateway (Content-Length against Transfer-Encoding) would read the rest of the body as a
second, smuggled request the gateway never vetted. So a request whose framing is ambiguous is
refused, and what is forwarded carries exactly one framing header, rebuilt from what h11 parsed.
Likewise the target: an upstream may route by the absolute-form URL's authority rather than by
``Host``, so an authority other than the connection's vetted one is refused and the target is
always forwarded in origin-form.
"""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit

import h11

from .policy import clip, normalize_host

__all__ = ["Refused", "body_framing", "default_port", "inner_target", "origin_form",
           "outbound_headers", "split_url"]

# Hop-by-hop headers (RFC 9110 §7.6.1) and the proxy's own; never forwarded.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection",
                         b"proxy-authorization", b"proxy-authenticate", b"te", b"trailer",
                         b"upgrade"})
# Rebuilt by ``outbound_headers``, never copied.
_REBUILT = frozenset({b"content-length", b"transfer-encoding", b"host"})


class Refused(Exception):
    """A request the gateway answers itself; ``rule`` names the check in the audit trail."""

    def __init__(self, status: int, rule: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.rule = rule
        self.reason = reason


def default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


def body_framing(request: h11.Request) -> tuple[bytes, bytes] | None:
    """The one framing header to forward for ``request``'s body, or None (no body).

    h11 has already refused conflicting Content-Lengths and any Transfer-Encoding other than
    ``chunked``; what it lets through with both headers it frames as chunked, which an upstream
    framing by Content-Length would not (RFC 9112 §6.3: such a request must not be forwarded).

    Raises:
        Refused: both headers, or Transfer-Encoding on HTTP/1.0 (RFC 9112 §6.1).
    """
    lengths = [v for n, v in request.headers if n == b"content-length"]
    encodings = [v for n, v in request.headers if n == b"transfer-encoding"]
    if lengths and encodings:
        raise Refused(400, "bad-framing", "the request has both Content-Length and "
                      "Transfer-Encoding (RFC 9112 §6.3); send exactly one of them")
    if encodings:
        if request.http_version != b"1.1":
            raise Refused(400, "bad-framing", "Transfer-Encoding on an HTTP/1.0 request "
                          "(RFC 9112 §6.1); send Content-Length instead")
        return b"transfer-encoding", b"chunked"
    if lengths:
        # h11 checked that every value is the same number; forward it once, as digits.
        return b"content-length", str(int(lengths[0].split(b",")[0])).encode()
    return None


def outbound_headers(request: h11.Request, host_value: str) -> list[tuple[bytes, bytes]]:
    """The headers to send upstream: our Host, the client's end-to-end headers, one framing
    header at most, ``Connection: close`` (one request per connection).

    Raises:
        Refused: ambiguous framing (see ``body_framing``).
    """
    framing = body_framing(request)
    kept = [(n, v) for n, v in request.headers if n not in _HOP_BY_HOP and n not in _REBUILT]
    return [(b"host", host_value.encode("ascii")), *kept, *([framing] if framing else []),
            (b"connection", b"close")]


def split_url(target: str) -> tuple[SplitResult, str, int]:
    """An absolute-form target: its parts, its host text as written, its port.

    Raises:
        Refused: user information, a bad port, no authority.
    """
    parts = urlsplit(target)
    if not parts.netloc:
        raise Refused(400, "bad-target", f"no authority in {clip(target)!r}")
    if "@" in parts.netloc:
        raise Refused(403, "userinfo", "URLs with user information are refused")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:  # port 0 would otherwise read as "no port", the scheme's default
        raise Refused(400, "bad-target", f"bad port in {clip(target)!r}; a port is 1-65535")
    port = port or default_port(parts.scheme)
    host_text = parts.hostname or ""
    if parts.netloc.startswith("["):
        host_text = parts.netloc.split("]")[0] + "]"
    return parts, host_text, port


def origin_form(parts: SplitResult) -> str:
    """``path?query`` to forward.

    Raises:
        Refused: a path starting with ``//``, which some servers and routers read as
            ``//authority/path`` (a network-path reference naming another host).
    """
    path = parts.path or "/"
    if path.startswith("//"):
        raise Refused(400, "authority-mismatch", f"the path {clip(path)!r} starts with '//', "
                      "which names a host to some servers; send a single leading '/'")
    return f"{path}?{parts.query}" if parts.query else path


def inner_target(request: h11.Request, *, scheme: str, host: str, port: int) -> bytes:
    """The origin-form target of a request inside a connection vetted for ``host:port``.

    Raises:
        Refused: an absolute-form target naming another scheme, host or port; authority-form.
    """
    target = request.target.decode("ascii", "replace")
    if target.startswith("//"):
        origin_form(urlsplit(f"https://{host}{target}"))  # refuses it, by the same rule
    if target.startswith("/"):
        return request.target
    if target == "*" and request.method == b"OPTIONS":
        return request.target
    if request.method == b"CONNECT" or "://" not in target:
        raise Refused(400, "bad-target", f"request target {clip(target)!r} inside a tunnel "
                      f"to {host}:{port}; send a path such as /index.html")
    parts, host_text, target_port = split_url(target)
    try:
        same = (parts.scheme.lower() == scheme and normalize_host(host_text) == host
                and target_port == port)
    except ValueError:
        same = False
    if not same:
        raise Refused(400, "authority-mismatch", f"request URL {clip(target)!r} names another "
                      f"authority than this connection's {scheme}://{host}:{port}; send a "
                      "path, or open a connection to that host")
    return origin_form(parts).encode("ascii")
