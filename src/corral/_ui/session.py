"""Dashboard sign-in: an API key exchanged for a session cookie.

The browser never keeps the key: signing in sends it once, and the service answers with a
cookie that names the key (its public id, never its secret) and an expiry, signed with this
data directory's session secret (``ui-session.key``, 0600, made on first use, so sessions
survive a restart and one service's cookies mean nothing to another). Each request with the
cookie checks the signature, the expiry and that the key is still live: revoking the key ends
its sessions at once.

The cookie is ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no other site's page
sends it), and over https ``Secure`` and named ``__Host-corral_session`` (no other host of the
site can set it). Requests it authenticates must also carry ``X-Corral-UI: 1`` (a header no
cross-site form or image can add, and no cross-origin script either without a CORS preflight
this service never grants) and, from a browser that says, ``Sec-Fetch-Site: same-origin``
(``guard._check_browser``: SameSite treats another port or a sibling host as the same site,
where previews live); WebSockets, which cannot carry the header, must come from the
service's own Origin (``guard.OriginGuard``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from .._control.plane import Tenant, TenantDirectory
from .._http.guard import session_cookie_name
from ..errors import AuthError

__all__ = ["SESSION_S", "UISessions", "session_cookie_name"]

SESSION_S = 12 * 3600
_PREFIX = "us1"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class UISessions:
    """Issues and checks session cookies for one data directory's keys."""

    def __init__(self, home: Callable[[], Path], tenants: TenantDirectory) -> None:
        self._tenants = tenants
        self._home = home
        self._key: bytes | None = None

    @property
    def _secret(self) -> bytes:
        # Read (or made) on first use, not when the app is assembled.
        if self._key is None:
            self._key = _secret(self._home() / "ui-session.key")
        return self._key

    def sign_in(self, key: str) -> tuple[str, Tenant]:
        """(the cookie's value, the key's tenant) for a live ``ck_`` key; AuthError else."""
        key_id, tenant = self._tenants.sign_in(key)
        claims = _b64(json.dumps({"k": key_id, "exp": int(time.time()) + SESSION_S},
                                 separators=(",", ":")).encode())
        return f"{_PREFIX}.{claims}.{self._mac(claims)}", tenant

    def tenant(self, cookie: str) -> Tenant:
        """The tenant of a session cookie; AuthError when it is forged, expired or its key
        was revoked."""
        prefix, _, rest = cookie.partition(".")
        claims, _, mac = rest.partition(".")
        if prefix != _PREFIX or not hmac.compare_digest(mac, self._mac(claims)):
            raise AuthError("this dashboard session is not valid here: sign in again")
        try:
            data = json.loads(_unb64(claims))
            key_id, expires = str(data["k"]), int(data["exp"])
        except (ValueError, KeyError, TypeError):
            raise AuthError("this dashboard session is not valid here: sign in again") from None
        if expires < time.time():
            raise AuthError("the dashboard session expired: sign in again")
        return self._tenants.tenant_of_key_id(key_id)

    def _mac(self, claims: str) -> str:
        return _b64(hmac.new(self._secret, claims.encode(), hashlib.sha256).digest())


def _secret(path: Path) -> bytes:
    """The session secret, made once: written whole to a temporary file, then linked into
    place (a second process racing here keeps the first one's)."""
    with contextlib.suppress(FileNotFoundError):
        return path.read_bytes()
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(secrets.token_bytes(32))
    try:
        os.link(temp, path)
    except FileExistsError:
        pass
    finally:
        temp.unlink()
    return path.read_bytes()
