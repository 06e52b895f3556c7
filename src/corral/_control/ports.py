"""Exposed ports: which of a sandbox's ports the proxy serves, who may reach them, and the
connections to them.

A port is private unless its owner makes it public. Credentials are derived, not stored: a
port's token and its signed links are HMACs of (sandbox, port, the exposure's nonce) under a
secret of the data directory, so they survive restarts, a token of one port never opens
another, and unexposing a port (which forgets its nonce) revokes every credential of it at
once. The proxy itself (``corral._http.portproxy``) is a surface; what it may reach and what
is recorded is decided here, below every surface.
"""

from __future__ import annotations

import builtins
import hashlib
import hmac
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

from .._audit.auditor import Auditor
from .._core.secretfile import load_or_create_secret
from .._ids import to_e2b
from .._settings import Settings
from ..errors import BackendError, PortNotExposed, UsageError
from ..models import PortInfo
from .records import ASLEEP, SandboxRecord
from .sandboxes import Sandboxes
from .store import Store

__all__ = ["PortURLs", "Ports", "Who"]

_SECRET_FILE = "ports.secret"
_TOKEN_PREFIX = "cpt_"
# Signed links: an hour unless asked; never longer than a week (a link is a bearer credential).
_LINK_TTL_S = 3600.0
_MAX_LINK_TTL_S = 7 * 24 * 3600.0
_CONNECT_TIMEOUT_S = 5.0
_TOUCH_EVERY_S = 1.0
MAX_PORTS = 32  # per sandbox: each is a URL to keep track of, not a resource of its own


@dataclass(frozen=True, slots=True)
class PortURLs:
    """Where ``corral serve`` answers for exposed ports: ``base`` (``http://host:port``) for
    path URLs ``<base>/ports/<sandbox>/<port>/``, and ``domain`` (optional) for host URLs
    ``<scheme>://<port>-<sandbox>.<domain>[:<listen port>]/``, E2B's ``get_host`` form."""

    base: str | None = None
    domain: str | None = None

    def path_url(self, sandbox_id: str, port: int) -> str | None:
        return None if self.base is None else f"{self.base.rstrip('/')}/ports/{sandbox_id}/{port}/"

    def host_url(self, sandbox_id: str, port: int) -> str | None:
        if self.domain is None or self.base is None:
            return None
        scheme, _, rest = self.base.partition("://")
        listen_port = rest.rstrip("/").rpartition(":")[2] if "]:" in rest or (
            ":" in rest and not rest.startswith("[")) else ""
        suffix = f":{listen_port}" if listen_port.isdigit() else ""
        return f"{scheme}://{port}-{to_e2b(sandbox_id)}.{self.domain}{suffix}/"


@dataclass(frozen=True, slots=True)
class Who:
    """Who a proxied connection is for, as the audit trail names it: ``public``, ``token``,
    ``link`` (a signed link or the cookie it set), ``key`` (an API key; ``tenant`` says
    whose) or ``e2b`` (E2B's traffic or envd token)."""

    how: str
    tenant: str | None = None


class Ports:
    def __init__(self, *, settings: Settings, store: Store, sandboxes: Sandboxes,
                 auditor: Auditor) -> None:
        self._store = store
        self._sandboxes = sandboxes
        self._auditor = auditor
        self._secret = load_or_create_secret(settings.home / _SECRET_FILE)
        self.urls = PortURLs(base=settings.ports_url, domain=settings.ports_domain)
        self._touched: dict[str, float] = {}

    def configure(self, urls: PortURLs) -> None:
        """Where the proxy answers (``corral serve`` sets it from its listener)."""
        self.urls = urls

    # -- the owner's side ---------------------------------------------------------------------

    def expose(self, sandbox_id: str, port: object, *, public: bool = False,
               link_ttl_s: float | None = None, tenant: str | None = None,
               urls: PortURLs | None = None) -> PortInfo:
        """Expose ``port`` of the sandbox through the proxy (idempotent; ``public`` may be
        changed by exposing again) and return its URLs and credentials."""
        number = _port(port)
        _link_ttl(link_ttl_s)  # before anything changes: a refused call exposes nothing
        info = self._sandboxes.get(sandbox_id, tenant=tenant)
        self._store.expose_port(info.id, number, public=bool(public),
                                nonce=secrets.token_hex(16), max_ports=MAX_PORTS)
        self._auditor.event(info.id, "port.exposed", {"port": number, "public": bool(public)})
        return self._describe(info.id, number, link_ttl_s=link_ttl_s, urls=urls)

    def unexpose(self, sandbox_id: str, port: object, *, tenant: str | None = None) -> None:
        """Stop serving ``port``; its tokens and links stop working at once. Idempotent."""
        number = _port(port)
        info = self._sandboxes.get(sandbox_id, tenant=tenant)
        if self._store.unexpose_port(info.id, number):
            self._auditor.event(info.id, "port.unexposed", {"port": number})

    def list(self, sandbox_id: str, *, tenant: str | None = None,
             link_ttl_s: float | None = None,
             urls: PortURLs | None = None) -> builtins.list[PortInfo]:
        info = self._sandboxes.get(sandbox_id, tenant=tenant)
        return [self._describe(info.id, row["port"], link_ttl_s=link_ttl_s, urls=urls)
                for row in self._store.ports(info.id)]

    def _describe(self, sandbox_id: str, port: int, *, link_ttl_s: float | None,
                  urls: PortURLs | None) -> PortInfo:
        urls = urls or self.urls
        row = self._store.port(sandbox_id, port)
        if row is None:
            raise PortNotExposed(f"port {port} of sandbox {sandbox_id} is not exposed")
        ttl = _link_ttl(link_ttl_s)
        expires = int(time.time() + ttl)
        path_url = urls.path_url(sandbox_id, port)
        signed = None
        if path_url is not None:
            signed = (f"{path_url}?corral_expires={expires}"
                      f"&corral_sig={self._sign(row, expires)}")
        return PortInfo(sandbox_id=sandbox_id, port=port, public=bool(row["public"]),
                        url=path_url, host_url=urls.host_url(sandbox_id, port),
                        token=self._token(row), signed_url=signed,
                        signed_expires_at=float(expires) if signed else None)

    # -- the proxy's side ---------------------------------------------------------------------

    def exposure(self, sandbox_id: str, port: int) -> dict[str, Any] | None:
        """The exposure row of a live sandbox's port, or None."""
        return self._store.port(sandbox_id, port)

    def check_token(self, exposure: dict[str, Any], presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(
            presented.encode(), self._token(exposure).encode())

    def check_link(self, exposure: dict[str, Any], expires: str | None,
                   signature: str | None) -> bool:
        """A signed link's parameters: a signature of this exposure, not yet expired."""
        if not expires or not signature or not expires.isdigit() or len(expires) > 12:
            return False
        if int(expires) < time.time():
            return False
        return hmac.compare_digest(signature.encode(),
                                   self._sign(exposure, int(expires)).encode())

    def token_for(self, exposure: dict[str, Any]) -> str:
        """The port's token: what the cookie set from a signed link holds."""
        return self._token(exposure)

    def open(self, record: SandboxRecord, port: int) -> socket.socket:
        """A connected socket to the sandbox's port, for the proxy to relay.

        Raises:
            SandboxBusy: the sandbox is paused (its processes are frozen).
            PortClosed: nothing accepts connections on the port.
        """
        if record.state in ASLEEP:  # woken first when its lifecycle says so
            record = self._sandboxes.awake(record.id, doing=f"reach port {port}")
        backend = self._sandboxes.backend(record)
        sock = backend.open_port(self._sandboxes.spec(record), port, _CONNECT_TIMEOUT_S)
        if not isinstance(sock, socket.socket):  # the relay runs on asyncio's socket loop
            sock.close()
            raise BackendError(f"the {backend.name} tier gave no socket for port {port}")
        self._touch(record.id)
        return sock

    def _touch(self, sandbox_id: str) -> None:
        """A served port is activity (the idle timeout), recorded at most once a second per
        sandbox: a page's dozens of requests need not be dozens of store writes."""
        now = time.monotonic()
        if now - self._touched.get(sandbox_id, -_TOUCH_EVERY_S) < _TOUCH_EVERY_S:
            return
        if len(self._touched) > 4096:  # bounded: old entries only save a write
            self._touched.clear()
        self._touched[sandbox_id] = now
        self._store.touch(sandbox_id)

    def record(self, sandbox_id: str, port: int, who: Who, *, kind: str, status: int,
               bytes_in: int, bytes_out: int, seconds: float, method: str = "",
               path: str = "") -> None:
        """One proxied request or WebSocket, once it ended: who, which port, how much."""
        data: dict[str, Any] = {
            "port": port, "kind": kind, "who": who.how, "status": status,
            "bytes_in": bytes_in, "bytes_out": bytes_out,
            "duration_ms": round(seconds * 1000, 2)}
        if who.tenant is not None:
            data["tenant"] = who.tenant
        if method:
            data["method"] = method
        if path:
            data["path"] = path[:200]
        if who.how == "public":
            # Anyone may send these as fast as they like: aggregated per port (the key is
            # the port, never the path asked for); authenticated ones are written in full.
            self._auditor.repeated(sandbox_id, "port.connection", {"port": port}, data)
        else:
            self._auditor.event(sandbox_id, "port.connection", data)
        self._auditor.metrics.inc("corral_port_connections", labels={"kind": kind})

    # -- credentials --------------------------------------------------------------------------

    def _mac(self, *parts: object) -> str:
        message = "\0".join(str(part) for part in parts).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:40]

    def _token(self, exposure: dict[str, Any]) -> str:
        return _TOKEN_PREFIX + self._mac("token", exposure["sandbox_id"], exposure["port"],
                                         exposure["nonce"])

    def _sign(self, exposure: dict[str, Any], expires: int) -> str:
        return self._mac("link", exposure["sandbox_id"], exposure["port"], exposure["nonce"],
                         expires)


def _link_ttl(value: float | None) -> float:
    ttl = _LINK_TTL_S if value is None else float(value)
    if not 0 < ttl <= _MAX_LINK_TTL_S:
        raise UsageError(f"link_ttl must be more than 0 and at most {_MAX_LINK_TTL_S:.0f} "
                         f"seconds (a week), not {ttl:g}")
    return ttl


def _port(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise UsageError(f"port must be a TCP port number (1-65535), not {value!r}")
    return value
