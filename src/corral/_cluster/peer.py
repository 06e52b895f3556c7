"""How a gateway tells a node who is calling: a short-lived caller token, signed with the
cluster's peer secret.

The gateway authenticates the client's key against its own tenant directory, then sends the
node, in place of the key, ``cp1.<tenant as JSON>.<HMAC-SHA256>``: the tenant's name, quotas,
tiers and ceiling, and an expiry. The node verifies the signature and applies that tenant
exactly as if it had looked the key up itself: ownership, the ceiling, the tier list and the
per-node quotas are re-checked there, below the gateway. Keys therefore live in one place
(the gateway's data directory), and a node holds no key a thief could use at another node.

The secret is created once per cluster in Ray's GCS key-value store, which only holders of
the cluster's Ray token can read (see ``auth``); sandboxes have no route to the GCS or to a
node's service (their network namespace holds only its own ``lo``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from typing import Any

from .._control.plane import Ceiling, Store, Tenant, TenantDirectory
from ..errors import AuthError, UsageError

__all__ = ["PEER_PREFIX", "PeerTenants", "new_secret", "sign_caller", "verify_caller"]

PEER_PREFIX = "cp1."
# Long enough for a slow create behind a busy gateway; short enough that a token read off a
# node's socket is of little use. Every request gets a fresh one.
_LIFETIME_S = 300
_CONTEXT = b"corral-peer-caller\0"


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def _mac(secret: bytes, body: bytes) -> str:
    return hmac.new(secret, _CONTEXT + body, hashlib.sha256).hexdigest()


def sign_caller(tenant: Tenant, secret: bytes, *, now: float | None = None) -> str:
    """The token that names ``tenant`` to a node."""
    payload = {"name": tenant.name, "max_sandboxes": tenant.max_sandboxes,
               "tiers": list(tenant.tiers), "commands_per_minute": tenant.commands_per_minute,
               "ceiling": tenant.ceiling.to_json(),
               "exp": int((time.time() if now is None else now) + _LIFETIME_S)}
    body = base64.urlsafe_b64encode(json.dumps(payload, separators=(",", ":")).encode())
    return f"{PEER_PREFIX}{body.decode().rstrip('=')}.{_mac(secret, body.rstrip(b'='))}"


def verify_caller(token: str, secret: bytes, *, now: float | None = None) -> Tenant:
    """The tenant a gateway signed for; AuthError for anything else."""
    if not token.startswith(PEER_PREFIX) or token.count(".") != 2:
        raise AuthError("this node serves Corral gateways only: send a gateway's caller token")
    _, body, mac = token.split(".")
    if not hmac.compare_digest(_mac(secret, body.encode()), mac):
        raise AuthError("the caller token is not signed with this cluster's peer secret")
    try:
        data: dict[str, Any] = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        if data["exp"] < (time.time() if now is None else now):
            raise AuthError("the caller token has expired")
        return Tenant(str(data["name"]), int(data["max_sandboxes"]), tuple(data["tiers"]),
                      int(data["commands_per_minute"]), Ceiling.from_json(data["ceiling"]))
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise AuthError(f"malformed caller token ({exc.__class__.__name__})") from None


class PeerTenants(TenantDirectory):
    """A node's tenant directory: callers are whom a gateway signed for, never keys. A
    tenant's latest signed terms are remembered for the calls that carry a sandbox's own
    token instead of a caller's (E2B's envd): those act as the sandbox's owner."""

    def __init__(self, store: Store, secret: bytes) -> None:
        super().__init__(store)
        self._secret = secret
        self._seen: dict[str, Tenant] = {}

    def _verified(self, token: str) -> Tenant:
        tenant = verify_caller(token, self._secret)
        self._seen[tenant.name] = tenant
        return tenant

    def authenticate(self, header: str | None, *, auth_required: bool) -> Tenant:
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer":
            raise AuthError("this node serves Corral gateways only: send a gateway's caller "
                            "token as `Authorization: Bearer cp1...`")
        return self._verified(token.strip())

    def authenticate_key(self, key: str | None) -> Tenant:
        return self._verified((key or "").strip())

    def get(self, name: str) -> Tenant:
        known = self._seen.get(name)
        if known is None:
            raise UsageError(f"tenant {name!r} has not called this node through a gateway "
                             "since it started")
        return known
