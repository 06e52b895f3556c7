"""Tenants, API keys (stored hashed) and per-tenant quotas for the HTTP service."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass

from .._control.store import Store
from .._core.resources import TIERS
from ..errors import AuthError, QuotaExceeded, UsageError

__all__ = ["LOCAL_TENANT", "Tenant", "TenantDirectory", "new_key"]

LOCAL_TENANT = "local"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_KEY_RE = re.compile(r"^ck_([0-9a-f]{12})_([A-Za-z0-9_-]{20,100})$")


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    max_sandboxes: int
    tiers: tuple[str, ...]
    commands_per_minute: int


_UNLIMITED = Tenant(LOCAL_TENANT, max_sandboxes=10_000, tiers=tuple(TIERS),
                    commands_per_minute=1_000_000)


def _digest(secret: str) -> str:
    # Keys are 192 random bits: a plain SHA-256 is enough (no password-style stretching needed).
    return hashlib.sha256(secret.encode()).hexdigest()


def new_key() -> tuple[str, str, str]:
    """(key id, full key to hand out once, digest to store)."""
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(24)
    return key_id, f"ck_{key_id}_{secret}", _digest(secret)


class TenantDirectory:
    """Looks keys up, checks quotas, keeps the per-minute command windows."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._windows: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    # -- administration (CLI) -----------------------------------------------------------------

    def add_tenant(self, name: str, *, max_sandboxes: int = 10, tiers: list[str] | None = None,
                   commands_per_minute: int = 600) -> Tenant:
        if not _NAME_RE.match(name or "") or name == LOCAL_TENANT:
            raise UsageError(f"invalid tenant name {name!r}: lower-case letters, digits, - and _"
                             f" (and not {LOCAL_TENANT!r}, which is reserved)")
        chosen = tiers or ["small"]
        unknown = [t for t in chosen if t not in TIERS]
        if unknown:
            raise UsageError(f"unknown tiers {unknown}; choose from {sorted(TIERS)}")
        if max_sandboxes < 1 or commands_per_minute < 1:
            raise UsageError("quotas must be at least 1")
        self._store.add_tenant(name, max_sandboxes=max_sandboxes, tiers=chosen,
                               commands_per_minute=commands_per_minute)
        return Tenant(name, max_sandboxes, tuple(chosen), commands_per_minute)

    def create_key(self, tenant: str) -> tuple[str, str]:
        """(key id, the key itself). The key is shown once; only its hash is kept."""
        if self._store.tenant(tenant) is None:
            raise UsageError(f"no tenant named {tenant!r}; add it with `corral tenants add`")
        key_id, key, digest = new_key()
        self._store.add_key(key_id, tenant, digest)
        return key_id, key

    # -- requests -----------------------------------------------------------------------------

    def authenticate(self, header: str | None, *, auth_required: bool) -> Tenant:
        """The tenant of a ``Bearer`` key; the unlimited local tenant when auth is off."""
        if not header:
            if not auth_required:
                return _UNLIMITED
            raise AuthError("an API key is required: send `Authorization: Bearer ck_...` "
                            "(create one with `corral keys create TENANT`)")
        scheme, _, token = header.partition(" ")
        match = _KEY_RE.match(token.strip()) if scheme.lower() == "bearer" else None
        if match is None:
            raise AuthError("malformed Authorization header; expected `Bearer ck_<id>_<secret>`")
        found = self._store.key(match.group(1))
        if found is None or not hmac.compare_digest(found[1], _digest(match.group(2))):
            raise AuthError("unknown or revoked API key")
        row = self._store.tenant(found[0])
        if row is None:
            raise AuthError("the key's tenant no longer exists")
        return Tenant(row["name"], row["max_sandboxes"], tuple(row["tiers"]),
                      row["commands_per_minute"])

    def check_tier(self, tenant: Tenant, resources: str) -> None:
        if resources not in tenant.tiers:
            raise QuotaExceeded(f"tenant {tenant.name!r} may not use the {resources!r} tier "
                                f"(allowed: {', '.join(tenant.tiers)})")

    def count_command(self, tenant: Tenant) -> None:
        """Sliding one-minute window; refuse past the tenant's rate."""
        now = time.monotonic()
        with self._lock:
            window = self._windows.setdefault(tenant.name, deque())
            while window and window[0] < now - 60:
                window.popleft()
            if len(window) >= tenant.commands_per_minute:
                wait = 60 - (now - window[0])
                raise QuotaExceeded(
                    f"tenant {tenant.name!r} reached {tenant.commands_per_minute} commands per "
                    f"minute; retry in {wait:.0f} s")
            window.append(now)
