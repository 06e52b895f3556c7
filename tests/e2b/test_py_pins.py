"""The SDK versions agent frameworks pin, and what the E2B surface says it does.

crewAI pins e2b 2.20.3 + e2b-code-interpreter 2.6.2 and the OpenAI Agents SDK 2.31.0 + 2.8.1
(sets ``crewai-pins`` and ``agents-pins``). Their code interpreters ignore ``E2B_SANDBOX_URL``
and dial ``https://49999-<id>.<domain>``: in URL mode over TLS the create answer's domain is
``corral@HOST:PORT``, so that URL reaches the listener itself with no DNS (the sandbox in its
user part); the client trusts the listener's certificate (``SSL_CERT_FILE``). On a plain
listener ``get_host`` is ``<port>-<id>.localhost:PORT``, which curl and browsers send to
loopback.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from .conftest import Served, corral_serve, run_client
from .test_py_core import raised

pytestmark = [pytest.mark.e2b, pytest.mark.needs_root]


def _loopback_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost: (cert, key); the cert is its
    own CA (SSL_CERT_FILE)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "corral e2b test")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "e2b-cert.pem", directory / "e2b-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_url_served() -> Iterator[tuple[Served, Path]]:
    scratch = Path(tempfile.mkdtemp(prefix="corral-test-e2b-client-"))
    cert, key = _loopback_cert(scratch)
    with corral_serve("--e2b-tls-cert", str(cert), "--e2b-tls-key", str(key),
                      scratch=scratch) as served:
        yield served, cert


@pytest.mark.parametrize("kind", ["crewai-pins", "agents-pins"])
def test_pinned_sdks_run_code_in_url_mode(tls_url_served: tuple[Served, Path],
                                          kind: str) -> None:
    served, cert = tls_url_served
    url = f"https://127.0.0.1:{served.e2b_port}"
    run = run_client(served, kind, "pinned.py", env={
        "E2B_API_URL": url, "E2B_SANDBOX_URL": url, "SSL_CERT_FILE": str(cert)})
    sid = run.value("id")
    assert run.value("jupyter_url") == f"https://49999-{sid}.corral@127.0.0.1:{served.e2b_port}"
    assert run.value("run_code") == "2"
    assert run.value("stdout") == ["from the kernel\n"]
    assert run.value("command") == "pinned\n"
    assert run.value("write") == "/home/user/pinned.txt"
    assert run.value("read") == "kept"
    run.value("kill")


def test_honest_surface(served: Served) -> None:
    run = run_client(served, "latest", "honest.py")
    sid = run.value("id")
    run.value("serve")
    # get_host opens: the port's own host under localhost, on the E2B listener.
    host = run.value("host")
    assert host == f"8000-{sid}.localhost:{served.e2b_port}"
    token = run.value("traffic_token")
    page = ""
    for _ in range(50):  # the server in the sandbox takes a moment to listen
        out = subprocess.run(["curl", "-s", "-H", f"e2b-traffic-access-token: {token}",
                              f"http://{host}/index.html"], capture_output=True, text=True,
                             timeout=30)
        page = out.stdout
        if "served in the sandbox" in page:
            break
        subprocess.run(["sleep", "0.2"], check=True)
    assert page == "served in the sandbox\n"
    without = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                              f"http://{host}/index.html"], capture_output=True, text=True,
                             timeout=30)
    assert without.stdout == "404"  # no token: Corral's own rules, and it was never exposed
    # Metrics: real samples of the sandbox's cgroup and workspace.
    metrics = run.value("metrics")
    assert len(metrics) == 1, metrics
    sample = metrics[0]
    assert sample["cpu_count"] >= 1 and 0 < sample["cpu_used_pct"] <= 100
    assert 0 < sample["mem_used"] < sample["mem_total"]
    assert 0 < sample["disk_used"] < sample["disk_total"]
    assert run.value("metrics_again") == 2
    # What Corral does on timeout, and a pause it cannot do refused, saying so.
    assert run.value("lifecycle") == {"on_timeout": "kill", "auto_resume": False}
    refused = raised(run, "pause_on_timeout", "SandboxException")
    assert "hibernation is not available" in refused["message"]
    # A refusal for a Corral reason says what to do.
    missing = raised(run, "missing_template", "SandboxException", "NotFoundException")
    assert "corral templates" in missing["message"], missing
