"""Domain mode (E2B-COMPAT.md §2.5, Recipe B): the SDK gets only ``E2B_DOMAIN`` and reaches
``https://api.<domain>`` and ``https://<port>-<id>.<domain>`` with a test CA.

The server listens on a loopback address of its own (127.x.y.z, port 443: the SDKs cannot be
told another port, and the address keeps two runs from colliding). Each client runs in a private
mount namespace whose /etc/hosts is a fresh temp file bind-mounted over it (``unshare -m`` +
``mount --bind``): the host's own /etc/hosts is never touched, and the mount ends with the
client."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import ClientRun, Served, corral_serve, events_of, run_client
from .test_py_core import raised
from .tlsca import Pki, free_loopback_443, make_pki

pytestmark = [pytest.mark.e2b, pytest.mark.needs_root]

DOMAIN = "corral-e2b.test"


@pytest.fixture(scope="module")
def tls_served() -> Iterator[tuple[Served, Pki]]:
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is missing: it gives each client a private /etc/hosts")
    scratch = Path(tempfile.mkdtemp(prefix="corral-test-e2b-client-"))
    pki = make_pki(scratch, DOMAIN)
    address = free_loopback_443()
    with corral_serve("--e2b-domain", DOMAIN, "--e2b-tls-cert", str(pki.cert),
                      "--e2b-tls-key", str(pki.key), host=address, e2b_port=443,
                      domain=DOMAIN, scratch=scratch) as served:
        yield served, pki


def _run_domain(served: Served, pki: Pki, kind: str, *extra: str
                ) -> tuple[ClientRun, ClientRun]:
    """``domain.py create``, then the sandbox's names into the hosts file, then ``use``."""
    hosts = served.scratch / f"hosts-{kind}"  # a fresh file per client, removed with scratch
    hosts.write_text(f"127.0.0.1 localhost\n{served.host} api.{DOMAIN}\n")
    wrap = ["unshare", "-m", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts)]
    env = {"SSL_CERT_FILE": str(pki.ca), "NODE_EXTRA_CA_CERTS": str(pki.ca)}
    script = "domain_v1.py" if kind == "v1" else "domain.py"
    created = run_client(served, kind, script, "create", wrap=wrap, env=env)
    sid = created.value("id")
    with hosts.open("a") as f:
        f.write(f"{served.host} 49983-{sid}.{DOMAIN} 49999-{sid}.{DOMAIN} "
                f"8000-{sid}.{DOMAIN}\n")
    return created, run_client(served, kind, script, "use", sid, *extra, wrap=wrap, env=env)


# v1 (e2b 1.11.1) knows only E2B_DOMAIN; bundled (2.20.3) and latest are given only it.
@pytest.mark.parametrize("kind", ["v1", "bundled", "latest"])
def test_domain_mode(tls_served: tuple[Served, Pki], kind: str) -> None:
    served, pki = tls_served
    created, run = _run_domain(served, pki, kind, *(() if kind == "v1" else ("ports",)))
    sid = created.value("id")
    assert sid.startswith("sbx-") and "_" not in sid
    run.value("connect")
    assert run.value("run") == "over tls\n"
    assert raised(run, "exit3", "CommandExitException")["attrs"]["exit_code"] == 3
    assert run.value("write") == "/home/user/tls.txt"
    assert run.value("read") == "through the domain"
    assert sid in run.value("list")
    if kind != "v1":
        # get_host: an app's port in the sandbox, through the same proxy as Corral's own
        # exposed ports, opened by E2B's traffic token; without it, Corral's own rules
        # apply, and the port was never exposed with them (404).
        port = run.value("port")
        assert port["host"] == f"8000-{sid}.{DOMAIN}"
        assert (port["status"], port["listing"], port["without_token"]) == (200, True, 404)
        connections = events_of(served, sid, "port.connection")
        assert any(e["data"]["who"] == "e2b" and e["data"]["status"] == 200
                   for e in connections), connections
    # 1.11.1's instance kill() drops _cls_kill's answer (returns None); the trail shows it.
    assert run.value("kill") is (None if kind == "v1" else True)
    assert events_of(served, sid, "command.started")
    assert events_of(served, sid, "sandbox.destroyed")


def test_host_file_is_private(tls_served: tuple[Served, Pki]) -> None:
    """The clients' names never reach the host's resolver."""
    assert DOMAIN not in Path("/etc/hosts").read_text()
