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
import time
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


def _loopback_cert(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and its certificate for 127.0.0.1 and localhost: (ca, cert, key). A leaf
    apart from its CA, since rustls (pyqwest, SDK 2.40+) refuses a CA as the server's own."""
    now = dt.datetime.now(dt.UTC)

    def build(subject: str, issuer: str, public: ec.EllipticCurvePublicKey,
              signer: ec.EllipticCurvePrivateKey, *, ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(public).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5))
                   .not_valid_after(now + dt.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build("corral e2b test CA", "corral e2b test CA", ca_key.public_key(), ca_key, ca=True)
    leaf = build("127.0.0.1", "corral e2b test CA", key.public_key(), ca_key, ca=False)
    paths = directory / "e2b-ca.pem", directory / "e2b-cert.pem", directory / "e2b-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


@pytest.fixture(scope="module")
def tls_url_served() -> Iterator[tuple[Served, Path]]:
    scratch = Path(tempfile.mkdtemp(prefix="corral-test-e2b-client-"))
    ca, cert, key = _loopback_cert(scratch)
    with corral_serve("--e2b-tls-cert", str(cert), "--e2b-tls-key", str(key),
                      scratch=scratch) as served:
        yield served, ca


def _fetch(url: str, *extra: str) -> tuple[str, str]:
    """(status, body) of ``curl URL``, retried while the sandbox's server starts."""
    status, body = "", ""
    for _ in range(50):
        out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", *extra, url],
                             capture_output=True, text=True, timeout=30)
        body, _, status = out.stdout.rpartition("\n")
        if status not in ("000", "502"):
            break
        time.sleep(0.2)
    return status, body


# latest (code interpreter 2.11.5) follows E2B_SANDBOX_URL; it is here for the same TLS listener.
@pytest.mark.parametrize("kind", ["crewai-pins", "agents-pins", "latest"])
def test_pinned_sdks_run_code_in_url_mode(tls_url_served: tuple[Served, Path],
                                          kind: str) -> None:
    served, ca = tls_url_served
    url = f"https://127.0.0.1:{served.e2b_port}"
    run = run_client(served, kind, "pinned.py", env={
        "E2B_API_URL": url, "E2B_SANDBOX_URL": url, "SSL_CERT_FILE": str(ca)})
    run.value("create")
    sid = run.value("id")
    if kind != "latest":
        assert run.value("jupyter_url") == (
            f"https://49999-{sid}.corral@127.0.0.1:{served.e2b_port}")
    assert run.value("run_code") == "2"
    assert run.value("stdout") == ["from the kernel\n"]
    assert run.value("command") == "pinned\n"
    assert run.value("write") == "/home/user/pinned.txt"
    assert run.value("read") == "kept"
    # get_host over TLS: the port named in the URL's user part, opened by the traffic token.
    run.value("serve")
    host = run.value("host")
    assert host == f"8000-{sid}.corral@127.0.0.1:{served.e2b_port}"
    token = run.value("traffic_token")
    assert _fetch(f"https://{host}/index.html", "--cacert", str(ca), "-H",
                  f"e2b-traffic-access-token: {token}") == ("200", "over tls\n")
    assert _fetch(f"https://{host}/index.html", "--cacert", str(ca))[0] == "404"


def test_honest_surface(served: Served) -> None:
    run = run_client(served, "latest", "honest.py")
    sid = run.value("id")
    run.value("serve")
    # get_host opens: the port's own host under localhost, on the E2B listener.
    host = run.value("host")
    assert host == f"8000-{sid}.localhost:{served.e2b_port}"
    token = run.value("traffic_token")
    assert _fetch(f"http://{host}/index.html", "-H", f"e2b-traffic-access-token: {token}") \
        == ("200", "served in the sandbox\n")
    # No token: Corral's own rules for exposed ports apply, and it was never exposed.
    assert _fetch(f"http://{host}/index.html")[0] == "404"
    # Metrics: real samples of the sandbox's cgroup and workspace.
    metrics = run.value("metrics")
    assert metrics, "no samples"
    sample = metrics[-1]  # the one this call took
    assert sample["cpu_count"] >= 1 and 0 < sample["cpu_used_pct"] <= 100
    assert 0 < sample["mem_used"] < sample["mem_total"]
    assert 0 < sample["disk_used"] < sample["disk_total"]
    # Each call takes a sample (a 5 s tick may add one more in between).
    again, until_now = run.value("metrics_again"), run.value("metrics_until_now")
    assert again > len(metrics) and until_now > again  # a window ending now has this call's
    assert run.value("metrics_an_hour_ago") == 0
    # At least one of the 5 s ticks in the 11 s between (two on a quiet host), and the call's.
    assert run.value("metrics_later") >= until_now + 2
    # What Corral does on timeout. A pause it cannot do yet is taken (frameworks ask for it by
    # default) but never reported as kept: the lifecycle says kill, the answer's notice why.
    assert run.value("lifecycle") == {"on_timeout": "kill", "auto_resume": False}
    assert run.value("pause_on_timeout") == {"on_timeout": "kill", "auto_resume": False}
    status, notice = run.value("connect_auto_pause")  # E2B's connect/resume body too
    assert status == 200 and "not available yet" in notice and "killed at its timeout" in notice
    # A refusal for a Corral reason says what to do.
    missing = raised(run, "missing_template", "SandboxException", "NotFoundException")
    assert "corral templates" in missing["message"], missing


def test_refusals_for_a_corral_reason_say_what_to_do() -> None:
    from corral._e2b.connect import hinted
    from corral.errors import BackendUnavailable, CeilingExceeded, QuotaExceeded

    assert hinted(BackendUnavailable("gVisor is not installed")).endswith(
        "; run `corral doctor` on the server: it says what this host lacks")
    assert "`corral tenants set TENANT`" in hinted(QuotaExceeded("12 sandboxes already"))
    said = CeilingExceeded("not allowed; the operator can raise it with `corral tenants set`")
    assert hinted(said) == said.message  # a message that says what to do is kept as it is
