"""A test 'internet': HTTP and HTTPS servers in a network namespace of our own, reached from the
host over a veth pair with a TEST-NET-3 /30 (in 203.0.113.0/24) chosen per run. Traffic never
leaves the machine.

The servers record what they received (method, path, headers) so tests can check what the egress
gateway forwarded; responses never echo request headers back (a secret must not return to the
sandbox that way).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import os
import secrets
import ssl
import subprocess
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from corral._backends._linux.netns import Spawner

# A /30 of TEST-NET-3 of this test run's own, so two runs on one machine (two checkouts, CI
# beside a developer) never route into each other's upstream.
_NET = 4 * secrets.randbelow(64)
HOST_ADDR = f"203.0.113.{_NET + 1}"
UPSTREAM_ADDR = f"203.0.113.{_NET + 2}"
NAMES = ("api.test", "other.test", "pypi.test", "xn--bcher-kva.test")
PACKAGE = "corraldemo"


@dataclass
class Upstream:
    ca_file: Path
    seen: list[dict[str, Any]] = field(default_factory=list)

    def requests_to(self, host: str) -> list[dict[str, Any]]:
        return [r for r in self.seen if r["host"].split(":")[0] == host]


def _wheel() -> tuple[str, bytes]:
    name = f"{PACKAGE}-1.0-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"{PACKAGE}/__init__.py", "VALUE = 42\n")
        z.writestr(f"{PACKAGE}-1.0.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 1.0\n")
        z.writestr(f"{PACKAGE}-1.0.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr(f"{PACKAGE}-1.0.dist-info/RECORD", "")
    return name, buf.getvalue()


def _handler(upstream: Upstream, wheel: tuple[str, bytes]) -> type[BaseHTTPRequestHandler]:
    wheel_name, wheel_bytes = wheel
    digest = hashlib.sha256(wheel_bytes).hexdigest()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: bytes, ctype: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _record(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            upstream.seen.append({
                "method": self.command, "path": self.path, "host": self.headers.get("Host", ""),
                "headers": {k.lower(): v for k, v in self.headers.items()},
                "body": body.decode(errors="replace"),
                "tls": isinstance(self.connection, ssl.SSLSocket),
            })

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._record()
            if self.path.startswith("/simple/"):
                page = (f'<html><body><a href="/files/{wheel_name}#sha256={digest}">'
                        f"{wheel_name}</a></body></html>").encode()
                self._reply(200, page, "text/html")
            elif self.path.startswith("/files/"):
                self._reply(200, wheel_bytes, "application/octet-stream")
            elif self.path.startswith("/big"):
                self._reply(200, b"x" * 5_000_000)
            else:
                self._reply(200, b"ok\n")

        do_HEAD = do_GET

        def do_POST(self) -> None:  # noqa: N802
            self._record()
            self._reply(200, b"posted\n")

    return Handler


def _certificates(directory: Path) -> tuple[Path, ssl.SSLContext]:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "corral test upstream CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(hours=1))
          .not_valid_after(now + dt.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "api.test")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in NAMES]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_file = directory / "upstream-ca.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    chain = directory / "leaf.pem"
    chain.write_bytes(leaf.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(chain)
    return ca_file, context


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextmanager
def fake_internet() -> Iterator[Upstream]:
    """Start the namespace, the veth pair and the servers; remove all of it afterwards."""
    tag = secrets.token_hex(3)
    ns, host_if, ns_if = f"corral-test-up-{tag}", f"ctu{tag}a", f"ctu{tag}b"
    tmp = Path(tempfile.mkdtemp(prefix="corral-upstream-"))
    servers: list[ThreadingHTTPServer] = []
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{HOST_ADDR}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{UPSTREAM_ADDR}/30", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        ca_file, tls = _certificates(tmp)
        upstream = Upstream(ca_file=ca_file)
        handler = _handler(upstream, _wheel())
        spawner = Spawner()
        for port, context in ((80, None), (443, tls), (8080, None)):
            def bind(port: int = port) -> ThreadingHTTPServer:
                return ThreadingHTTPServer((UPSTREAM_ADDR, port), handler)

            server = spawner.run(Path("/run/netns") / ns, bind)
            if context is not None:
                server.socket = context.wrap_socket(server.socket, server_side=True)
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True).start()
            servers.append(server)
        yield upstream
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        for f in tmp.iterdir():
            f.unlink()
        os.rmdir(tmp)


def pinned_hosts() -> dict[str, list[str]]:
    """Operator-pinned names the tests use; the forbidden ones must be refused."""
    return {
        **{name: [UPSTREAM_ADDR] for name in NAMES},
        "loop.test": ["127.0.0.1"],
        "ten.test": ["10.0.0.1"],
        "meta.test": ["169.254.169.254"],
        "mapped.test": ["::ffff:127.0.0.1"],
        "mixed.test": [UPSTREAM_ADDR, "10.0.0.1"],
    }


def dumps(value: Any) -> str:
    return json.dumps(value)
