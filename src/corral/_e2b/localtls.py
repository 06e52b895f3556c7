"""A TLS certificate Corral makes for its own E2B listener (``corral serve --e2b-tls-local``).

The code-interpreter clients that agent frameworks pin (e2b-code-interpreter < 2.9: crewAI's
2.6.2, OpenAI Agents' 2.8.1) dial ``https://49999-<id>.<domain>`` whatever E2B_SANDBOX_URL says;
over TLS the listener answers a domain that makes that URL reach it (``corral@HOST:PORT``), so
what they lack is only a certificate they trust. This makes one: a CA of the data directory's own
(kept, so a client's trust outlives a restart; name-constrained to the listener's own names) and
a server certificate for the listening address signed by it (a leaf apart from the CA: rustls,
in SDKs from 2.40, refuses a CA as a server's certificate). ``bundle.pem`` holds the host's
trusted roots and that CA, for ``SSL_CERT_FILE``, which replaces a client's roots rather than
adding to them.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["LocalTls", "ensure_local_tls"]

# Debian's (ca-certificates) roots, the ones the host's own clients trust.
_SYSTEM_ROOTS = Path("/etc/ssl/certs/ca-certificates.crt")
_CA_DAYS, _LEAF_DAYS = 3650, 397


@dataclass(frozen=True)
class LocalTls:
    ca: Path  # the CA's certificate
    cert: Path  # the listener's certificate (leaf)
    key: Path  # its private key (root-only)
    bundle: Path  # the host's roots and the CA: SSL_CERT_FILE for clients


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes, mode: int) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(temporary, path)


def _names(host: str) -> list[x509.GeneralName]:
    """What the leaf is for: the listening address, and loopback by name and number."""
    names: list[x509.GeneralName] = [x509.DNSName("localhost"),
                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                     x509.IPAddress(ipaddress.ip_address("::1"))]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if host and host != "localhost":
            names.append(x509.DNSName(host))
    else:
        if not address.is_unspecified and x509.IPAddress(address) not in names:
            names.append(x509.IPAddress(address))
    return names


def _permitted(host: str) -> list[x509.GeneralName]:
    """The CA's name constraints: the leaf's names only, so a client that trusts the bundle
    trusts this CA for nothing else (were its key ever to leave the data directory)."""
    permitted: list[x509.GeneralName] = []
    for name in _names(host):
        if isinstance(name, x509.IPAddress):
            address = name.value
            assert isinstance(address, ipaddress.IPv4Address | ipaddress.IPv6Address)
            permitted.append(x509.IPAddress(ipaddress.ip_network(address)))
        else:
            permitted.append(name)
    return permitted


def _ca_fits(ca: x509.Certificate, host: str) -> bool:
    try:
        constraints = ca.extensions.get_extension_for_class(x509.NameConstraints).value
    except x509.ExtensionNotFound:
        return False
    return all(name in (constraints.permitted_subtrees or ()) for name in _permitted(host))


def ensure_local_tls(directory: Path, host: str) -> LocalTls:
    """The CA (made once; again only for an address its constraints leave out) and a leaf for
    ``host`` in ``directory``, made again when missing, for another address, or within a
    month of expiring."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    tls = LocalTls(directory / "ca.pem", directory / "server.pem", directory / "server-key.pem",
                   directory / "bundle.pem")
    ca_key_path = directory / "ca-key.pem"
    now = dt.datetime.now(dt.UTC)
    kept = None
    if tls.ca.exists() and ca_key_path.exists():
        kept = x509.load_pem_x509_certificate(tls.ca.read_bytes())
        if not _ca_fits(kept, host):
            kept = None  # made for another address: clients must trust the new one
    if kept is not None:
        ca = kept
        loaded = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        assert isinstance(loaded, ec.EllipticCurvePrivateKey)
        ca_key = loaded
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = (x509.CertificateBuilder()
              .subject_name(_name("Corral local E2B CA")).issuer_name(_name("Corral local E2B CA"))
              .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - dt.timedelta(minutes=5))
              .not_valid_after(now + dt.timedelta(days=_CA_DAYS))
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .add_extension(x509.NameConstraints(permitted_subtrees=_permitted(host),
                                                  excluded_subtrees=None), critical=True)
              .add_extension(x509.KeyUsage(
                  digital_signature=True, key_cert_sign=True, crl_sign=True,
                  content_commitment=False, key_encipherment=False, data_encipherment=False,
                  key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
              .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                             critical=False)
              .sign(ca_key, hashes.SHA256()))
        _write(ca_key_path, ca_key.private_bytes(serialization.Encoding.PEM,
                                                 serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()), 0o600)
        _write(tls.ca, ca.public_bytes(serialization.Encoding.PEM), 0o644)
        tls.cert.unlink(missing_ok=True)  # signed by a CA that is gone
    if not _leaf_fits(tls, ca, host, now):
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = (x509.CertificateBuilder()
                .subject_name(_name(host or "localhost")).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=_LEAF_DAYS))
                .add_extension(x509.SubjectAlternativeName(_names(host)), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                               critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                    ca_key.public_key()), critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write(tls.key, key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()), 0o600)
        _write(tls.cert, leaf.public_bytes(serialization.Encoding.PEM), 0o644)
    roots = _SYSTEM_ROOTS.read_bytes() if _SYSTEM_ROOTS.is_file() else b""
    _write(tls.bundle, roots.rstrip(b"\n") + b"\n" + tls.ca.read_bytes(), 0o644)
    return tls


def _leaf_fits(tls: LocalTls, ca: x509.Certificate, host: str, now: dt.datetime) -> bool:
    if not (tls.cert.exists() and tls.key.exists()):
        return False
    leaf = x509.load_pem_x509_certificate(tls.cert.read_bytes())
    if leaf.issuer != ca.subject or leaf.not_valid_after_utc - now < dt.timedelta(days=30):
        return False
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return all(name in names for name in _names(host))
