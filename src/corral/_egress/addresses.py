"""Which resolved addresses the gateway may connect to.

Refused unless an operator CIDR allows them: loopback, private, link-local (cloud metadata at
169.254.169.254), CGNAT, multicast, unspecified, reserved, benchmarking, ULA, and the IPv6 forms
that carry an IPv4 address inside (IPv4-mapped, IPv4-compatible, NAT64, 6to4, Teredo), judged by
the address they carry.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from ..errors import ConfigError

__all__ = ["Network", "forbidden_reason", "parse_cidrs"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

_V4_FORBIDDEN: tuple[tuple[str, str], ...] = (
    ("0.0.0.0/8", "unspecified"), ("10.0.0.0/8", "private"), ("100.64.0.0/10", "CGNAT"),
    ("127.0.0.0/8", "loopback"), ("169.254.0.0/16", "link-local"), ("172.16.0.0/12", "private"),
    ("192.0.0.0/24", "IETF protocol assignments"), ("192.168.0.0/16", "private"),
    ("198.18.0.0/15", "benchmarking"), ("224.0.0.0/4", "multicast"), ("240.0.0.0/4", "reserved"),
)
_V6_FORBIDDEN: tuple[tuple[str, str], ...] = (
    ("::/128", "unspecified"), ("::1/128", "loopback"), ("fc00::/7", "ULA (private)"),
    ("fe80::/10", "link-local"), ("fec0::/10", "site-local"), ("ff00::/8", "multicast"),
    ("100::/64", "discard"), ("2001:db8::/32", "documentation"),
)
_V4 = [(ipaddress.ip_network(n), why) for n, why in _V4_FORBIDDEN]
_V6 = [(ipaddress.ip_network(n), why) for n, why in _V6_FORBIDDEN]
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SIX_TO_FOUR = ipaddress.ip_network("2002::/16")
_TEREDO = ipaddress.ip_network("2001::/32")
_V4_COMPAT = ipaddress.ip_network("::/96")


def parse_cidrs(values: Iterable[str]) -> tuple[Network, ...]:
    """Operator CIDR rules (``CORRAL_EGRESS_ALLOW_CIDRS``)."""
    networks = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError as exc:
            raise ConfigError(f"invalid CIDR {value!r} in the egress allow list: {exc}") from None
    return tuple(networks)


def _embedded_v4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64 or (address in _V4_COMPAT and int(address) > 1):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    return None


def forbidden_reason(address: Address, operator_allowed: Sequence[Network] = ()) -> str | None:
    """Why the gateway must not connect to ``address``, or None when it may."""
    if any(address.version == net.version and address in net for net in operator_allowed):
        return None
    if isinstance(address, ipaddress.IPv6Address):
        inner = _embedded_v4(address)
        if inner is not None:
            why = forbidden_reason(inner, operator_allowed)
            return f"{why} (inside {address})" if why else None
        for net, why in _V6:
            if address in net:
                return why
        return None
    for net, why in _V4:
        if address in net:
            return why
    if address == ipaddress.IPv4Address("255.255.255.255"):
        return "broadcast"
    return None
