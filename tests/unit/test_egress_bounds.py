"""Caller-supplied names reach errors, the audit trail and the CA's memory bounded."""

from __future__ import annotations

import socket
import ssl
import threading
from pathlib import Path

import pytest

from corral import UsageError
from corral._egress import ca as ca_mod
from corral._egress.ca import CertificateAuthority
from corral._egress.policy import NetworkPolicy, Rule, normalize_host


@pytest.mark.parametrize("text", ["a" * 100_000, "x.com:" + "9" * 100_000, "x.com:²",
                                  "*." + "*" * 100_000, "1" * 50_000 + ":1:2", "a/" * 50_000])
def test_rule_errors_are_bounded(text: str) -> None:
    with pytest.raises(UsageError) as caught:
        Rule.parse(text)
    assert len(str(caught.value)) < 500


def test_host_name_errors_are_bounded() -> None:
    for host in ("a" * 1_000_000, "a." * 100 + "-bad-", "é" * 100):
        with pytest.raises(ValueError) as caught:
            normalize_host(host)
        assert len(str(caught.value)) < 400


def test_too_many_rules_are_refused_before_any_is_parsed() -> None:
    # Invalid rules: had they been parsed first, the error would name the first of them.
    with pytest.raises(UsageError, match="at most 256 network rules per sandbox, got 10000"):
        NetworkPolicy.build(["not a rule!"] * 10_000)


def _handshake(ca: CertificateAuthority, host: str) -> str:
    """A real TLS handshake against the leaf for ``host``, verified by name; its subject CN."""
    server_side, client_side = socket.socketpair()
    result: list[str] = []

    def serve() -> None:
        with ca.server_context(host).wrap_socket(server_side, server_side=True) as s:
            s.recv(1)

    thread = threading.Thread(target=serve)
    thread.start()
    client = ssl.create_default_context(cafile=str(ca.cert_path))
    with client.wrap_socket(client_side, server_hostname=host) as c:
        cert = c.getpeercert()
        result += [v for rdn in cert["subject"] for k, v in rdn if k == "commonName"]
        c.sendall(b"x")
    thread.join(10)
    return result[0]


def test_leaves_for_long_names_verify(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path)
    long_name = "a" * 63 + "." + "b" * 63 + ".example.test"  # 140 characters, a valid DNS name
    assert _handshake(ca, long_name) == long_name[:64]


def test_leaf_cache_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ca_mod, "_MAX_LEAVES", 4)
    ca = CertificateAuthority(tmp_path)
    first = ca.server_context("h0.example.test")
    for i in range(1, 10):
        ca.server_context(f"h{i}.example.test")
    assert len(ca._contexts) == 4
    assert ca.server_context("h9.example.test") is ca.server_context("h9.example.test")
    assert ca.server_context("h0.example.test") is not first  # evicted, made again
