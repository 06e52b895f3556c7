"""The SDK versions agent frameworks pin, and what the E2B surface says it does.

crewAI pins e2b 2.20.3 + e2b-code-interpreter 2.6.2 and the OpenAI Agents SDK 2.31.0 + 2.8.1
(sets ``crewai-pins`` and ``agents-pins``). Their code interpreters ignore ``E2B_SANDBOX_URL``
and dial ``https://49999-<id>.<domain>``: in URL mode over TLS the create answer's domain is
``corral@HOST:PORT``, so that URL reaches the listener itself with no DNS (the sandbox in its
user part); the client trusts the listener's certificate, which ``--e2b-tls-local`` makes
(``SSL_CERT_FILE`` = the bundle it writes). On a plain
listener ``get_host`` is ``<port>-<id>.localhost:PORT``, which curl and browsers send to
loopback.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Served, corral_serve, run_client
from .test_py_core import raised

pytestmark = [pytest.mark.e2b, pytest.mark.needs_root]


@pytest.fixture(scope="module")
def tls_url_served() -> Iterator[tuple[Served, Path]]:
    """``corral serve --e2b-tls-local``: the listener's certificate is Corral's own making,
    and the clients trust it through the bundle it writes (one flag, no PKI of the test's)."""
    with corral_serve("--e2b-tls-local") as served:
        yield served, served.home / "e2b-tls" / "bundle.pem"


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
    # What Corral does on timeout: what the create asked, reported as kept (issue 40). A
    # resume asking for another lifecycle goes on, and its answer's notice says why that part
    # is not taken: the lifecycle is the create's.
    assert run.value("lifecycle") == {"on_timeout": "kill", "auto_resume": False}
    assert run.value("pause_on_timeout") == {"on_timeout": "pause", "auto_resume": True}
    status, notice = run.value("connect_auto_pause")  # E2B's connect/resume body too
    assert status == 200 and "set when the sandbox is created" in notice
    # A refusal for a Corral reason says what to do.
    missing = raised(run, "missing_template", "SandboxException", "NotFoundException")
    assert "corral templates" in missing["message"], missing


def test_refusals_for_a_corral_reason_say_what_to_do() -> None:
    from corral._http.errors import hinted
    from corral.errors import BackendUnavailable, CeilingExceeded, QuotaExceeded

    assert hinted(BackendUnavailable("gVisor is not installed")).endswith(
        "; run `corral doctor` on the server: it says what this host lacks")
    assert "`corral tenants set TENANT`" in hinted(QuotaExceeded("12 sandboxes already"))
    said = CeilingExceeded("not allowed; the operator can raise it with `corral tenants set`")
    assert hinted(said) == said.message  # a message that says what to do is kept as it is
