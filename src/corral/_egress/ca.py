"""The per-deployment certificate authority used to intercept TLS to secret-bound hosts only.

Made on first use under ``<home>/egress/``; the key is readable by root only and never enters a
sandbox. Sandboxes trust the certificate (system bundle, ``SSL_CERT_FILE``, ...). Leaf certificates
are made per host on demand and kept in memory, the most recently used few only: under a wildcard
binding the sandbox chooses the names, so the cache must not grow with them.
"""

from __future__ import annotations

import datetime as dt
import os
import ssl
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CertificateAuthority"]

_CA_DAYS = 3650
_LEAF_DAYS = 30
_MAX_LEAVES = 128
# X.509 caps a common name at 64 characters (RFC 5280 ub-common-name); DNS names go to 253. The
# subjectAltName carries the full name and is what clients check.
_MAX_CN = 64


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:_MAX_CN]),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Corral egress gateway")])


class CertificateAuthority:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.cert_path = directory / "ca.pem"
        self._key_path = directory / "ca.key"
        self._lock = threading.Lock()
        self._contexts: OrderedDict[str, ssl.SSLContext] = OrderedDict()
        self._load_or_create()

    def _load_or_create(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o711)
        if self.cert_path.exists() and self._key_path.exists():
            self._cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
            key = serialization.load_pem_private_key(self._key_path.read_bytes(), None)
            assert isinstance(key, ec.EllipticCurvePrivateKey)
            self._key = key
            return
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        name = _name(f"Corral egress CA {os.urandom(4).hex()}")
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=_CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        key_pem = self._key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())
        fd = os.open(self._key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key_pem)
        self.cert_path.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        self.cert_path.chmod(0o644)

    @property
    def pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a leaf certificate for ``host``."""
        with self._lock:
            context = self._contexts.get(host)
            if context is not None:
                self._contexts.move_to_end(host)
                return context
            key = ec.generate_private_key(ec.SECP256R1())
            now = dt.datetime.now(dt.UTC)
            cert = (
                x509.CertificateBuilder()
                .subject_name(_name(host)).issuer_name(self._cert.subject)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=_LEAF_DAYS))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                               critical=False)
                .sign(self._key, hashes.SHA256())
            )
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            # ssl loads chains from files only; a private temp dir, removed at once.
            with tempfile.TemporaryDirectory() as tmp:
                chain = Path(tmp) / "leaf.pem"
                chain.write_bytes(
                    cert.public_bytes(serialization.Encoding.PEM)
                    + key.private_bytes(serialization.Encoding.PEM,
                                        serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()))
                context.load_cert_chain(chain)
            self._contexts[host] = context
            while len(self._contexts) > _MAX_LEAVES:
                self._contexts.popitem(last=False)
            return context
