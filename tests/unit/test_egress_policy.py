from __future__ import annotations

import ipaddress

import pytest

from corral import UsageError
from corral._egress.addresses import forbidden_reason, parse_cidrs
from corral._egress.policy import NetworkPolicy, Rule, is_ip_literal, normalize_host

POLICY = NetworkPolicy.build(["pypi.org", "*.github.com", "api.example.com:8443", "bücher.de"],
                             ["evil.github.com"])


@pytest.mark.parametrize(("host", "port", "allowed"), [
    ("pypi.org", 443, True), ("pypi.org", 80, True), ("pypi.org", 22, False),
    ("files.pypi.org", 443, False),            # exact rule: no subdomains
    ("a.github.com", 443, True), ("x.y.github.com", 80, True),
    ("github.com", 443, False),                # wildcard: not the apex
    ("evilgithub.com", 443, False), ("github.com.evil.com", 443, False),
    ("evil.github.com", 443, False),           # deny wins
    ("api.example.com", 8443, True), ("api.example.com", 443, False),
    ("xn--bcher-kva.de", 443, True),
])
def test_matching(host: str, port: int, allowed: bool) -> None:
    assert POLICY.decide(normalize_host(host), port).allowed is allowed


def test_normalisation() -> None:
    assert normalize_host("PyPI.ORG.") == "pypi.org"
    assert normalize_host("Bücher.de") == "xn--bcher-kva.de"
    for bad in ("", "a..b", "-a.com", "a b.com", "x" * 300, "ex ample.com"):
        with pytest.raises(ValueError):
            normalize_host(bad)


def test_none_denies_everything_and_deny_names_the_rule() -> None:
    assert NetworkPolicy.none().decide("pypi.org", 443).rule == "network=none"
    assert NetworkPolicy.build([], ["x.com"]).mode == "none"
    assert POLICY.decide("evil.github.com", 443).rule == "deny evil.github.com"


@pytest.mark.parametrize("text", ["10.0.0.1", "*", "*.com", "a/b", "a@b.com", "x.com:0",
                                  "x.com:70000", "::1", "", "x.*.com"])
def test_bad_rules(text: str) -> None:
    with pytest.raises(UsageError):
        Rule.parse(text)


def test_round_trip_through_json() -> None:
    assert NetworkPolicy.from_json(POLICY.to_json()) == POLICY
    assert NetworkPolicy.from_json({}) == NetworkPolicy.none()


@pytest.mark.parametrize("text", ["127.0.0.1", "2130706433", "0x7f.1", "127.1", "017700000001",
                                  "[::1]", "::ffff:127.0.0.1", "fe80::1%eth0"])
def test_ip_literals(text: str) -> None:
    assert is_ip_literal(text)


@pytest.mark.parametrize("text", ["example.com", "1e100.net", "localhost", "a1.b2"])
def test_names_are_not_ip_literals(text: str) -> None:
    assert not is_ip_literal(text)


@pytest.mark.parametrize("address", [
    "127.0.0.1", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.169.254", "100.64.0.1",
    "0.0.0.0", "224.0.0.1", "255.255.255.255", "198.18.0.1", "::1", "::", "fd00::1", "fe80::1",
    "ff02::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "64:ff9b::a00:1", "2002:a00:1::1",
    "2001:0:4136:e378:8000:63bf:f5ff:fffe",  # Teredo wrapping 10.0.0.1
])
def test_forbidden_addresses(address: str) -> None:
    assert forbidden_reason(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", ["8.8.8.8", "151.101.0.223", "2606:4700::6810:84e5",
                                     "203.0.113.7"])
def test_public_addresses(address: str) -> None:
    assert forbidden_reason(ipaddress.ip_address(address)) is None


def test_operator_cidrs_open_exactly_their_range() -> None:
    cidrs = parse_cidrs(["10.1.0.0/16"])
    assert forbidden_reason(ipaddress.ip_address("10.1.2.3"), cidrs) is None
    assert forbidden_reason(ipaddress.ip_address("::ffff:10.1.2.3"), cidrs) is None
    assert forbidden_reason(ipaddress.ip_address("10.2.0.1"), cidrs) == "private"


@pytest.mark.parametrize("text", ["exa\x00mple.com", "\x00", "a b.com", "x.com\r\ny", "\x7f.io",
                                  "\udb9f\udcd0b.com"])
def test_a_rule_with_control_characters_or_garbage_is_refused_not_a_crash(text: str) -> None:
    # Found by the schema fuzzer: a NUL reached socket.inet_aton, which raised ValueError (500).
    with pytest.raises(UsageError):
        Rule.parse(text)
    assert not is_ip_literal("127.0.0\x001")
