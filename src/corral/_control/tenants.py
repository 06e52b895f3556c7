"""Tenants: who the caller is, what it may ask for (its ceiling) and how much (its quotas,
applied by ``admission``).

The control plane enforces all of it, so the HTTP service, MCP, the SDK and the CLI get the
same rules. A *ceiling* is the operator's bound on the policy a caller may give a sandbox: the
hosts its allowlist may name, its template, isolation and resource tiers, the secrets it may
bind and its longest lifetime. The caller is untrusted too (a steered model writes the create
call as easily as the code), so a ceiling is checked on every way a policy comes into being:
create, create-from-snapshot, fork, restore and a policy change after create.

A field that is ``None`` sets no bound of its own; the server default (``CORRAL_CEILING_*``)
then applies (see ``Ceiling.over``). ``()`` allows nothing: ``hosts=()`` means no network.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._core.resources import TIERS
from .._egress.policy import DEFAULT_PORTS, NetworkPolicy, Rule
from .._settings import Settings
from ..errors import AuthError, CeilingExceeded, UsageError
from .store import Store

__all__ = ["LOCAL_TENANT", "Ceiling", "Tenant", "TenantDirectory", "check", "covers",
           "local_tenant", "new_key"]

LOCAL_TENANT = "local"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_KEY_RE = re.compile(r"^ck_([0-9a-f]{12})_([A-Za-z0-9_-]{20,100})$")
# The E2B SDKs check a key's format before sending it (``^e2b_[0-9a-f]+$``, E2B-COMPAT §3), so
# keys for the E2B surface are 48 hex digits: the first 12 name the key, the rest is the secret.
_E2B_KEY_RE = re.compile(r"^e2b_([0-9a-f]{12})([0-9a-f]{36})$")
_FIELDS = ("hosts", "templates", "isolation", "resources", "secrets", "max_lifetime_s",
           "max_asleep_s", "max_hibernated")


@dataclass(frozen=True, slots=True)
class Ceiling:
    """The most a caller may ask for; ``None`` = no bound here, ``()`` = nothing allowed."""

    hosts: tuple[str, ...] | None = None  # allow-rule patterns (exact or *.suffix, :port)
    templates: tuple[str, ...] | None = None
    isolation: tuple[str, ...] | None = None  # "namespace", "gvisor"
    resources: tuple[str, ...] | None = None  # "small", "large"
    secrets: tuple[str, ...] | None = None
    max_lifetime_s: int | None = None
    # The longest a sandbox may stay asleep (paused or hibernated) before it is destroyed.
    max_asleep_s: int | None = None
    # How many of its sandboxes may be hibernated at once (each holds its workspace image and
    # its /tmp's archive on disk, both bounded by its resource tier: this bounds their sum).
    max_hibernated: int | None = None

    @classmethod
    def build(cls, *, hosts: Iterable[str] | None = None,
              templates: Iterable[str] | None = None, isolation: Iterable[str] | None = None,
              resources: Iterable[str] | None = None, secrets: Iterable[str] | None = None,
              max_lifetime_s: int | None = None, max_asleep_s: int | None = None,
              max_hibernated: int | None = None) -> Ceiling:
        """A validated ceiling: host patterns parse as allow rules (normalised), tiers exist."""

        def names(what: str, values: Iterable[str] | None) -> tuple[str, ...] | None:
            if values is None:
                return None
            if isinstance(values, str):
                raise UsageError(f"the {what} ceiling takes a list of names, not a string")
            out = tuple(dict.fromkeys(v.strip() for v in values if v.strip()))
            return out

        rules = names("hosts", hosts)
        if rules is not None:
            rules = tuple(str(Rule.parse(r)) for r in rules)
        tiers = names("resources", resources)
        unknown = [t for t in tiers or () if t not in TIERS]
        if unknown:
            raise UsageError(f"unknown resource tiers {unknown} in the ceiling; choose from "
                             f"{sorted(TIERS)}")
        for what, seconds in (("max lifetime", max_lifetime_s), ("max asleep", max_asleep_s)):
            if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int)
                                        or seconds < 1):
                raise UsageError(f"the {what} ceiling must be a positive number of seconds, "
                                 f"not {seconds!r}")
        if max_hibernated is not None and (isinstance(max_hibernated, bool)
                                           or not isinstance(max_hibernated, int)
                                           or max_hibernated < 0):
            raise UsageError("the max hibernated ceiling must be a number of sandboxes (0: "
                             f"none may hibernate), not {max_hibernated!r}")
        return cls(hosts=rules, templates=names("templates", templates),
                   isolation=names("isolation", isolation), resources=tiers,
                   secrets=names("secrets", secrets), max_lifetime_s=max_lifetime_s,
                   max_asleep_s=max_asleep_s, max_hibernated=max_hibernated)

    @classmethod
    def from_settings(cls, settings: Settings) -> Ceiling:
        """The server default: ``CORRAL_CEILING_*`` (comma-separated; unset = no bound)."""

        def split(text: str | None) -> list[str] | None:
            return None if text is None else [p for p in text.split(",") if p.strip()]

        return cls.build(hosts=split(settings.ceiling_hosts),
                         templates=split(settings.ceiling_templates),
                         isolation=split(settings.ceiling_isolation),
                         resources=split(settings.ceiling_resources),
                         secrets=split(settings.ceiling_secrets),
                         max_lifetime_s=settings.ceiling_max_lifetime_s,
                         max_asleep_s=settings.ceiling_max_asleep_s,
                         max_hibernated=settings.ceiling_max_hibernated)

    def over(self, default: Ceiling) -> Ceiling:
        """This ceiling, with ``default``'s bound wherever this one sets none."""
        return Ceiling(**{name: getattr(default, name) if getattr(self, name) is None
                          else getattr(self, name) for name in _FIELDS})

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, name) is None for name in _FIELDS)

    def to_json(self) -> dict[str, Any]:
        """Only the fields that bound something (stable keys for ``corral tenants ls --json``)."""
        out: dict[str, Any] = {}
        for name in _FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Ceiling:
        data = data or {}
        return cls.build(**{name: data.get(name) for name in _FIELDS})


@dataclass(frozen=True, slots=True)
class Tenant:
    """A caller: its sandbox and command quotas, its tiers, its ceiling and its audit byte
    budgets (None: the server's default, ``CORRAL_AUDIT_TENANT_MAX_BYTES`` and
    ``CORRAL_AUDIT_SANDBOX_MAX_BYTES``; 0: none)."""

    name: str
    max_sandboxes: int
    tiers: tuple[str, ...]
    commands_per_minute: int
    ceiling: Ceiling = field(default_factory=Ceiling)
    audit_max_bytes: int | None = None  # all its live sandboxes' trails together
    audit_sandbox_max_bytes: int | None = None  # each sandbox's trail

    @property
    def is_local(self) -> bool:
        """The operator on this host (keyless service, embedded SDK, CLI): no quotas."""
        return self.name == LOCAL_TENANT

    @property
    def scope(self) -> str | None:
        """The tenant whose sandboxes this caller may reach; None (all of them) for the
        operator."""
        return None if self.is_local else self.name


def local_tenant(ceiling: Ceiling | None = None) -> Tenant:
    """The operator's tenant; the server default ceiling applies unless ``ceiling`` is given."""
    return Tenant(LOCAL_TENANT, max_sandboxes=10_000, tiers=tuple(TIERS),
                  commands_per_minute=1_000_000, ceiling=ceiling or Ceiling())


def covers(pattern: Rule, requested: Rule) -> bool:
    """True when every (host, port) ``requested`` allows, ``pattern`` allows too.

    ``*.example.com`` covers ``a.example.com`` and ``*.a.example.com`` (never the apex); an
    exact name covers only itself; a pattern's port restricts the port (no port = 80 and 443).
    """
    if pattern.port is None:
        if requested.port is not None and requested.port not in DEFAULT_PORTS:
            return False
    elif requested.port != pattern.port:
        return False
    if pattern.host.startswith("*."):
        return requested.host.endswith(pattern.host[1:])
    return requested.host == pattern.host


def _refuse(kind: str, asked: str, allowed: Sequence[str], who: str) -> CeilingExceeded:
    shown = ", ".join(allowed) if allowed else "none"
    return CeilingExceeded(
        f"the {kind} ceiling of tenant {who!r} does not allow {asked} (allowed: {shown}); "
        "the operator can raise it with `corral tenants set` or CORRAL_CEILING_*")


def check(ceiling: Ceiling, *, tenant: str = LOCAL_TENANT, template: str | None = None,
          isolation: str | None = None, resources: str | None = None,
          network: NetworkPolicy | None = None, secrets: Iterable[str] | None = None,
          lifetime_s: float | None = None) -> None:
    """Raise ``CeilingExceeded`` (naming the ceiling) for anything asked beyond ``ceiling``."""
    if template is not None and ceiling.templates is not None \
            and template not in ceiling.templates:
        raise _refuse("template", f"template {template!r}", ceiling.templates, tenant)
    if isolation is not None and ceiling.isolation is not None \
            and isolation not in ceiling.isolation:
        raise _refuse("isolation", f"the {isolation!r} isolation tier", ceiling.isolation,
                      tenant)
    if resources is not None and ceiling.resources is not None \
            and resources not in ceiling.resources:
        raise _refuse("resources", f"the {resources!r} resource tier", ceiling.resources,
                      tenant)
    if network is not None and ceiling.hosts is not None:
        patterns = [Rule.parse(p) for p in ceiling.hosts]
        for rule in network.allow:
            if not any(covers(p, rule) for p in patterns):
                raise _refuse("hosts", f"allow rule {str(rule)!r}", ceiling.hosts, tenant)
    if ceiling.secrets is not None:
        for name in secrets or ():
            if name not in ceiling.secrets:
                raise _refuse("secrets", f"secret {name!r}", ceiling.secrets, tenant)
    if lifetime_s is not None and ceiling.max_lifetime_s is not None \
            and lifetime_s > ceiling.max_lifetime_s + 1e-6:
        raise CeilingExceeded(
            f"the max lifetime ceiling of tenant {tenant!r} is {ceiling.max_lifetime_s} s; "
            f"a lifetime of {lifetime_s:.0f} s is over it (pass a shorter timeout, or the "
            "operator raises it with `corral tenants set --max-lifetime` or "
            "CORRAL_CEILING_MAX_LIFETIME_S)")


def _digest(secret: str) -> str:
    # Keys are 192 random bits: a plain SHA-256 is enough (no password-style stretching needed).
    return hashlib.sha256(secret.encode()).hexdigest()


def new_key(*, e2b: bool = False) -> tuple[str, str, str]:
    """(key id, full key to hand out once, digest to store). ``e2b``: in the E2B SDKs' format
    (its id is ``e2b_<12 hex>``, so it cannot collide with a Corral key's)."""
    key_id = secrets.token_hex(6)
    if e2b:
        secret = secrets.token_hex(18)
        return f"e2b_{key_id}", f"e2b_{key_id}{secret}", _digest(secret)
    secret = secrets.token_urlsafe(24)
    return key_id, f"ck_{key_id}_{secret}", _digest(secret)


def _tenant_of(row: Mapping[str, Any]) -> Tenant:
    return Tenant(row["name"], row["max_sandboxes"], tuple(row["tiers"]),
                  row["commands_per_minute"], Ceiling.from_json(row.get("ceiling")),
                  audit_max_bytes=row.get("audit_max_bytes"),
                  audit_sandbox_max_bytes=row.get("audit_sandbox_max_bytes"))


def _audit_bytes(what: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
        raise UsageError(f"the {what} audit budget is a number of bytes (0: none), not "
                         f"{value!r}")
    return value


class TenantDirectory:
    """Tenants and their keys in the store; looks a request's key up."""

    def __init__(self, store: Store) -> None:
        self._store = store

    # -- administration (CLI) -----------------------------------------------------------------

    def add_tenant(self, name: str, *, max_sandboxes: int = 10, tiers: list[str] | None = None,
                   commands_per_minute: int = 600, ceiling: Ceiling | None = None,
                   audit_max_bytes: int | None = None,
                   audit_sandbox_max_bytes: int | None = None) -> Tenant:
        """Add or replace a tenant (its keys stay valid). Audit budgets left None follow the
        server's default."""
        if not _NAME_RE.match(name or "") or name == LOCAL_TENANT:
            raise UsageError(f"invalid tenant name {name!r}: lower-case letters, digits, - and _"
                             f" (and not {LOCAL_TENANT!r}, which is reserved)")
        chosen = tiers or ["small"]
        unknown = [t for t in chosen if t not in TIERS]
        if unknown:
            raise UsageError(f"unknown tiers {unknown}; choose from {sorted(TIERS)}")
        if max_sandboxes < 1 or commands_per_minute < 1:
            raise UsageError("quotas must be at least 1")
        ceiling = ceiling or Ceiling()
        _audit_bytes("tenant", audit_max_bytes)
        _audit_bytes("per-sandbox", audit_sandbox_max_bytes)
        self._store.add_tenant(name, max_sandboxes=max_sandboxes, tiers=chosen,
                               commands_per_minute=commands_per_minute,
                               ceiling=ceiling.to_json(), audit_max_bytes=audit_max_bytes,
                               audit_sandbox_max_bytes=audit_sandbox_max_bytes)
        return Tenant(name, max_sandboxes, tuple(chosen), commands_per_minute, ceiling,
                      audit_max_bytes=audit_max_bytes,
                      audit_sandbox_max_bytes=audit_sandbox_max_bytes)

    def get(self, name: str) -> Tenant:
        row = self._store.tenant(name)
        if row is None:
            raise UsageError(f"no tenant named {name!r}; `corral tenants ls` lists them")
        return _tenant_of(row)

    def set_tenant(self, name: str, *, max_sandboxes: int | None = None,
                   tiers: list[str] | None = None, commands_per_minute: int | None = None,
                   ceiling: Mapping[str, Any] | None = None,
                   audit_max_bytes: int | None = None,
                   audit_sandbox_max_bytes: int | None = None,
                   clear_audit: bool = False) -> Tenant:
        """Change some of a tenant's settings; ``ceiling`` holds only the fields to change.
        ``clear_audit`` returns its audit budgets to the server's default first."""
        old = self.get(name)
        merged = dataclasses.replace(old.ceiling, **dict(ceiling or {}))
        kept_total = None if clear_audit else old.audit_max_bytes
        kept_each = None if clear_audit else old.audit_sandbox_max_bytes
        return self.add_tenant(
            name, max_sandboxes=old.max_sandboxes if max_sandboxes is None else max_sandboxes,
            tiers=list(old.tiers) if tiers is None else tiers,
            commands_per_minute=(old.commands_per_minute if commands_per_minute is None
                                 else commands_per_minute),
            ceiling=Ceiling.from_json(merged.to_json()),
            audit_max_bytes=kept_total if audit_max_bytes is None else audit_max_bytes,
            audit_sandbox_max_bytes=(kept_each if audit_sandbox_max_bytes is None
                                     else audit_sandbox_max_bytes))

    def tenants(self) -> list[Tenant]:
        return [_tenant_of(row) for row in self._store.tenants()]

    def keys(self) -> list[dict[str, Any]]:
        """Every key's id, tenant, creation time and whether it is revoked (never a secret)."""
        return self._store.keys()

    def create_key(self, tenant: str, *, e2b: bool = False) -> tuple[str, str]:
        """(key id, the key itself). The key is shown once; only its hash is kept. ``e2b``:
        a key for the E2B surface (``X-API-KEY: e2b_...``), with the same tenant and limits."""
        if self._store.tenant(tenant) is None:
            raise UsageError(f"no tenant named {tenant!r}; add it with `corral tenants add`")
        key_id, key, digest = new_key(e2b=e2b)
        self._store.add_key(key_id, tenant, digest)
        return key_id, key

    def create_operator_key(self) -> tuple[str, str]:
        """(key id, the key itself) for the operator: every tenant's sandboxes, no quotas,
        the server's default ceiling, as the keyless local service has. For the dashboard's
        operator pages and administration over HTTP; guard it like root's password."""
        key_id, key, digest = new_key()
        self._store.add_key(key_id, LOCAL_TENANT, digest)
        return key_id, key

    # -- requests -----------------------------------------------------------------------------

    def authenticate(self, header: str | None, *, auth_required: bool) -> Tenant:
        """The tenant of a ``Bearer`` key; the local tenant (no quotas) when auth is off."""
        if not header:
            if not auth_required:
                return local_tenant()
            raise AuthError("an API key is required: send `Authorization: Bearer ck_...` "
                            "(create one with `corral keys create TENANT`)")
        scheme, _, token = header.partition(" ")
        match = _KEY_RE.match(token.strip()) if scheme.lower() == "bearer" else None
        if match is None:
            raise AuthError("malformed Authorization header; expected `Bearer ck_<id>_<secret>`")
        return self._tenant_of_key(match.group(1), match.group(2))

    def authenticate_key(self, key: str | None) -> Tenant:
        """The tenant of a bare key (the E2B surface's ``X-API-KEY``): an ``e2b_`` key, or a
        Corral ``ck_`` key. Always required: the E2B surface has no keyless mode."""
        if not key:
            raise AuthError("an API key is required: send `X-API-KEY: e2b_...` (set "
                            "E2B_API_KEY to a key from `corral keys create TENANT --e2b`)")
        key = key.strip()
        e2b = _E2B_KEY_RE.match(key)
        if e2b is not None:
            return self._tenant_of_key(f"e2b_{e2b.group(1)}", e2b.group(2))
        corral = _KEY_RE.match(key)
        if corral is not None:
            return self._tenant_of_key(corral.group(1), corral.group(2))
        raise AuthError("malformed API key; expected e2b_<48 hex digits> (`corral keys create "
                        "TENANT --e2b`)")

    def sign_in(self, key: str) -> tuple[str, Tenant]:
        """(key id, tenant) of a live ``ck_`` key (the dashboard's sign-in)."""
        match = _KEY_RE.match(key.strip()) if isinstance(key, str) else None
        if match is None:
            raise AuthError("that is not a Corral API key (ck_<id>_<secret>, from `corral "
                            "keys create TENANT`)")
        return match.group(1), self._tenant_of_key(match.group(1), match.group(2))

    def tenant_of_key_id(self, key_id: str) -> Tenant:
        """The tenant of a key that is still live, by its id alone (a session made with it)."""
        found = self._store.key(key_id)
        if found is None:
            raise AuthError("the API key this session was made with was revoked: sign in "
                            "with a live key")
        return self._tenant_named(found[0])

    def _tenant_named(self, name: str) -> Tenant:
        if name == LOCAL_TENANT:  # an operator key (create_operator_key)
            return local_tenant()
        row = self._store.tenant(name)
        if row is None:
            raise AuthError("the key's tenant no longer exists")
        return _tenant_of(row)

    def _tenant_of_key(self, key_id: str, secret: str) -> Tenant:
        found = self._store.key(key_id)
        if found is None or not hmac.compare_digest(found[1], _digest(secret)):
            raise AuthError("unknown or revoked API key")
        return self._tenant_named(found[0])
