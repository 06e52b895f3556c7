"""``corral serve --e2b-tls-local``'s certificate: a CA kept across restarts, a leaf for the
listening address (made again for another), a bundle for clients' SSL_CERT_FILE."""

from __future__ import annotations

import ipaddress
import ssl
import stat
from pathlib import Path

from cryptography import x509

from corral._e2b.localtls import ensure_local_tls


def _sans(path: Path) -> x509.SubjectAlternativeName:
    leaf = x509.load_pem_x509_certificate(path.read_bytes())
    return leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def test_the_ca_is_kept_and_the_leaf_follows_the_address(tmp_path: Path) -> None:
    first = ensure_local_tls(tmp_path / "tls", "127.0.0.1")
    ca, leaf = first.ca.read_bytes(), first.cert.read_bytes()
    again = ensure_local_tls(tmp_path / "tls", "127.0.0.1")
    assert (again.ca.read_bytes(), again.cert.read_bytes()) == (ca, leaf)  # nothing remade
    assert ensure_local_tls(tmp_path / "tls", "localhost").ca.read_bytes() == ca  # its names
    moved = ensure_local_tls(tmp_path / "tls", "10.1.2.3")
    assert moved.cert.read_bytes() != leaf
    assert ipaddress.ip_address("10.1.2.3") in _sans(moved.cert).get_values_for_type(
        x509.IPAddress)
    # The CA vouches for its listener's names only: another address, another CA.
    assert moved.ca.read_bytes() != ca
    constraints = x509.load_pem_x509_certificate(moved.ca.read_bytes()).extensions \
        .get_extension_for_class(x509.NameConstraints).value
    assert x509.IPAddress(ipaddress.ip_network("10.1.2.3/32")) in constraints.permitted_subtrees
    assert x509.DNSName("example.com") not in constraints.permitted_subtrees
    for secret in (moved.key, tmp_path / "tls" / "ca-key.pem"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_a_client_trusting_the_bundle_verifies_the_leaf_and_it_is_no_ca(tmp_path: Path) -> None:
    tls = ensure_local_tls(tmp_path, "127.0.0.1")
    assert tls.ca.read_bytes() in tls.bundle.read_bytes()
    leaf = x509.load_pem_x509_certificate(tls.cert.read_bytes())
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    # The server side loads the pair, the client side the bundle (what the SDKs' httpx does).
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tls.cert, tls.key)
    client = ssl.create_default_context(cafile=str(tls.bundle))
    assert any(c["subject"] == ((("commonName", "Corral local E2B CA"),),)
               for c in client.get_ca_certs())
