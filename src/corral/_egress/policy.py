"""Network policy: ``none`` (the default) or an allowlist with deny rules that win.

Rules are ``host``, ``*.domain`` (subdomains only, never the apex) or either with ``:port``; a rule
without a port matches ports 80 and 443. Hosts are compared after normalisation: lower case, no
trailing dot, IDNA (punycode) for non-ASCII names. IP literals are never matched by host rules:
the gateway refuses them outright.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import UsageError

__all__ = ["DEFAULT_PORTS", "NetworkPolicy", "Rule", "Verdict", "clip", "is_ip_literal",
           "normalize_host", "parse_port"]

DEFAULT_PORTS = (80, 443)
_LABEL_RE = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_MAX_RULES = 256
_CLIP = 200


def clip(text: str, limit: int = _CLIP) -> str:
    """``text`` cut to ``limit`` characters: caller-supplied names and URLs reach error
    messages, responses and the audit trail bounded."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"


def parse_port(text: str) -> int | None:
    """A TCP port written in ASCII digits (1-65535), else None.

    ``str.isdigit`` alone takes "²" and 100,000-digit strings, on which ``int`` raises.
    """
    if not (0 < len(text) <= 5 and text.isascii() and text.isdigit()):
        return None
    port = int(text)
    return port if 0 < port < 65536 else None


def normalize_host(host: str) -> str:
    """Lower-case, strip one trailing dot, IDNA-encode; raise ValueError when not a DNS name."""
    if not isinstance(host, str):
        raise ValueError("host must be a string")
    name = host.strip().rstrip(".") if host.endswith(".") else host.strip()
    if not name or len(name) > 253:
        raise ValueError(f"{clip(host)!r} is not a host name (at most 253 characters)")
    try:
        name = name.encode("idna").decode("ascii").lower()
    except UnicodeError as exc:
        raise ValueError(f"{clip(host)!r} is not a valid international host name") from exc
    labels = name.split(".")
    if not all(_LABEL_RE.match(label) for label in labels):
        raise ValueError(f"{clip(host)!r} is not a host name")
    return name


def is_ip_literal(host: str) -> bool:
    """True for any spelling the C library would take as an address: 127.0.0.1, [::1], 2130706433,
    0x7f.1, 127.1, 017700000001 — these never pass as names."""
    text = host.strip().strip("[]").rstrip(".")
    if not text:
        return False
    try:
        ipaddress.ip_address(text.split("%", 1)[0])
        return True
    except ValueError:
        pass
    try:
        socket.inet_aton(text)  # the permissive BSD forms
        return True
    except (OSError, ValueError):  # ValueError: a NUL in it, never an address
        return False


@dataclass(frozen=True, slots=True)
class Rule:
    """One allow or deny rule, already normalised."""

    host: str  # "example.com" or "*.example.com"
    port: int | None  # None: 80 and 443

    @classmethod
    def parse(cls, text: str) -> Rule:
        if not isinstance(text, str) or not text.strip():
            raise UsageError(f"empty network rule {clip(str(text))!r}")
        raw = text.strip()
        if any(ord(c) < 0x21 or c == "\x7f" for c in raw):
            raise UsageError(f"network rule {clip(text)!r}: spaces and control characters "
                             "cannot be in a host name")
        port: int | None = None
        host = raw
        if raw.count(":") == 1:
            host, port_text = raw.rsplit(":", 1)
            port = parse_port(port_text)
            if port is None:
                raise UsageError(f"bad port in network rule {clip(text)!r}; a port is "
                                 "1-65535")
        elif ":" in raw:
            raise UsageError(f"network rule {clip(text)!r}: IP literals cannot be allowed; "
                             "operators allow private ranges with CORRAL_EGRESS_ALLOW_CIDRS")
        wildcard = host.startswith("*.")
        base = host[2:] if wildcard else host
        if "*" in base or "/" in base or "@" in base:
            raise UsageError(f"network rule {clip(text)!r}: only a leading '*.' wildcard is "
                             "allowed")
        if is_ip_literal(base):
            raise UsageError(f"network rule {clip(text)!r}: IP literals cannot be allowed; "
                             "operators allow private ranges with CORRAL_EGRESS_ALLOW_CIDRS")
        try:
            name = normalize_host(base)
        except ValueError as exc:
            raise UsageError(f"network rule {clip(text)!r}: {exc}") from None
        if wildcard and "." not in name:
            raise UsageError(f"network rule {clip(text)!r} would match a whole top-level domain")
        return cls(host=f"*.{name}" if wildcard else name, port=port)

    def matches(self, host: str, port: int) -> bool:
        if self.port is None:
            if port not in DEFAULT_PORTS:
                return False
        elif port != self.port:
            return False
        if self.host.startswith("*."):
            # Subdomains only: "a.example.com" yes, "example.com" and "badexample.com" no.
            return host.endswith(self.host[1:])
        return host == self.host

    def __str__(self) -> str:
        return self.host if self.port is None else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    rule: str  # the matching rule, or why nothing matched
    reason: str


@dataclass(frozen=True, slots=True)
class NetworkPolicy:
    """``mode`` is ``none`` (no network at all) or ``allowlist``.

    ``presets`` names the package-index presets the allow rules were expanded from, and
    ``require_lock`` asks their clients to install only locked, hashed requirements; the
    gateway decides on the rules alone, the control plane derives client config from these.
    """

    mode: str = "none"
    allow: tuple[Rule, ...] = ()
    deny: tuple[Rule, ...] = ()
    presets: tuple[str, ...] = ()
    require_lock: bool = False

    @classmethod
    def none(cls) -> NetworkPolicy:
        return cls()

    @classmethod
    def build(cls, allow: Iterable[str] | None = None,
              deny: Iterable[str] | None = None, *, presets: Sequence[str] = (),
              require_lock: bool = False) -> NetworkPolicy:
        """An allowlist policy; with no allow rules it is the same as ``none``. Repeated allow
        rules are kept once (a preset's host may also be named by hand)."""
        if isinstance(allow, str) or isinstance(deny, str):
            raise UsageError("allow and deny take a list of rules, not a single string")
        allow_texts, deny_texts = list(allow or ()), list(deny or ())
        # Counted before any is parsed: a caller's list is bounded before work is done on it.
        if len(allow_texts) + len(deny_texts) > _MAX_RULES:
            raise UsageError(f"at most {_MAX_RULES} network rules per sandbox, got "
                             f"{len(allow_texts) + len(deny_texts)}; allow a wildcard such as "
                             "'*.example.com' instead of many names")
        allow_rules = tuple(dict.fromkeys(Rule.parse(r) for r in allow_texts))
        deny_rules = tuple(Rule.parse(r) for r in deny_texts)
        if not allow_rules:
            return cls(mode="none", deny=deny_rules)
        return cls(mode="allowlist", allow=allow_rules, deny=deny_rules,
                   presets=tuple(presets), require_lock=require_lock)

    def decide(self, host: str, port: int) -> Verdict:
        """Deny rules first, then an allow rule must match. ``host`` must be normalised."""
        if self.mode == "none":
            return Verdict(False, "network=none", "this sandbox has no network access")
        for rule in self.deny:
            if rule.matches(host, port):
                return Verdict(False, f"deny {rule}", f"{host}:{port} matches deny rule {rule}")
        for rule in self.allow:
            if rule.matches(host, port):
                return Verdict(True, f"allow {rule}", f"{host}:{port} matches allow rule {rule}")
        return Verdict(False, "no-match", f"{host}:{port} matches no allow rule")

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {"mode": self.mode, "allow": [str(r) for r in self.allow],
                                   "deny": [str(r) for r in self.deny]}
        if self.presets:  # only then: a policy without presets keeps its long-standing shape
            data.update(presets=list(self.presets), require_lock=self.require_lock)
        return data

    @classmethod
    def from_json(cls, data: dict[str, object] | None) -> NetworkPolicy:
        if not data or data.get("mode") == "none" and not data.get("deny"):
            return cls.none()
        allow = data.get("allow") or []
        deny = data.get("deny") or []
        presets = data.get("presets") or []
        assert isinstance(allow, Sequence) and isinstance(deny, Sequence)
        assert isinstance(presets, Sequence)
        return cls.build([str(r) for r in allow], [str(r) for r in deny],
                         presets=[str(p) for p in presets],
                         require_lock=data.get("require_lock") is True)
