"""The egress gateway with real sockets: sandboxes reach a test 'internet' in a namespace of its own
only through the gateway, and only where the policy says."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Sandbox, UsageError
from corral._control.manager import Manager
from corral._settings import Settings

from ..conftest import managed
from .upstream import UPSTREAM_ADDR, Upstream, fake_internet, pinned_hosts

pytestmark = pytest.mark.needs_root

TOKEN_VALUE = "tok-REAL-7f3a9c1e55d04b2a"


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    with fake_internet() as up:
        yield up


@pytest.fixture(scope="module")
def egress_home(upstream: Upstream) -> Iterator[str]:
    home = Path(tempfile.mkdtemp(prefix="corral-test-egress-"))
    settings = Settings(home=home, uid_start=2_120_000_000 + random.randrange(1000) * 1000,
                        uid_count=1000, egress_hosts=pinned_hosts(),
                        egress_upstream_ca=upstream.ca_file)
    with managed(settings) as mgr:
        mgr.secrets.add("TEST_TOKEN", TOKEN_VALUE, ["api.test"])
        yield str(home)
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def egress_manager(egress_home: str) -> Manager:
    from corral._control.manager import _managers

    return _managers[Path(egress_home)]


def run_ok(sb: Sandbox, script: str, **kwargs: object) -> str:
    result = sb.commands.run(script, timeout=60, **kwargs)  # type: ignore[arg-type]
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result.stdout


def _ca_in(sb: Sandbox, upstream: Upstream) -> str:
    """The upstream's test CA, for tunnelled TLS (the gateway does not touch those)."""
    sb.files.write("upstream-ca.pem", upstream.ca_file.read_bytes())
    return "/workspace/upstream-ca.pem"


# -- reachability ------------------------------------------------------------------------------


def test_allowed_hosts_over_http_and_https_from_common_clients(
    egress_home: str, upstream: Upstream
) -> None:
    with Sandbox.create(home=egress_home,
                        network={"allow": ["api.test", "pypi.test"]}) as sb:
        ca = _ca_in(sb, upstream)
        sb.files.write("clients.py", textwrap.dedent(f"""
            import urllib.request, requests
            print(urllib.request.urlopen("http://api.test/urllib").read().decode(), end="")
            print(requests.get("https://api.test/requests", verify="{ca}").text, end="")
        """))
        out = run_ok(sb, f"""
            curl -sS -m 10 http://api.test/curl-http
            curl -sS -m 10 --cacert {ca} https://api.test/curl-https
            python3 clients.py
        """)
        assert out == "ok\n" * 4
        paths = {r["path"] for r in upstream.requests_to("api.test")}
        assert {"/curl-http", "/curl-https", "/urllib", "/requests"} <= paths
        pip = sb.commands.run(
            "python3 -m pip download --no-deps --no-cache-dir --disable-pip-version-check "
            "--trusted-host pypi.test --index-url http://pypi.test/simple/ -d dl corraldemo",
            timeout=60)
        assert pip.exit_code == 0, pip.stdout + pip.stderr
        assert [e.name for e in sb.files.list("dl")] == ["corraldemo-1.0-py3-none-any.whl"]


def _status(sb: Sandbox, url: str, *extra: str) -> tuple[int, str]:
    """HTTP status and the gateway's verdict header as curl sees them through the proxy."""
    # --noproxy '': through the gateway even for names NO_PROXY lists (localhost).
    out = sb.commands.run(["curl", "-sS", "-m", "10", "--noproxy", "", "-o", "/dev/null", "-D",
                           "-", *extra, url], timeout=30)
    lines = out.stdout.replace("\r", "").splitlines()
    status = int(lines[0].split()[1]) if lines and lines[0].startswith("HTTP/") else 0
    verdict = next((ln.split(":", 1)[1].strip() for ln in lines
                    if ln.lower().startswith("x-corral-egress:")), "")
    return status, verdict + out.stderr


def test_denied_hosts_get_403_naming_the_rule(egress_home: str) -> None:
    with Sandbox.create(home=egress_home, network={"allow": ["api.test", "other.test"],
                                                   "deny": ["other.test"]}) as sb:
        assert _status(sb, "http://api.test/")[0] == 200
        status, verdict = _status(sb, "http://other.test/")
        assert status == 403 and "deny other.test" in verdict
    with Sandbox.create(home=egress_home, network={"allow": ["api.test"]}) as sb:
        status, verdict = _status(sb, "http://pypi.test/")
        assert status == 403 and "no-match" in verdict
        # HTTPS to a denied host: the CONNECT itself is refused.
        https = sb.commands.run("curl -sS -m 10 https://pypi.test/", timeout=30)
        assert https.exit_code != 0 and "403" in https.stderr


@pytest.mark.parametrize("url", [
    f"http://{UPSTREAM_ADDR}/", "http://2130706433/", "http://0x7f.1/", "http://[::1]/",
    f"https://{UPSTREAM_ADDR}/",
])
def test_ip_literals_are_refused(egress_home: str, url: str) -> None:
    with Sandbox.create(home=egress_home, network={"allow": ["api.test"]}) as sb:
        out = sb.commands.run(["curl", "-sS", "-m", "10", "--noproxy", "", "-i", url],
                              timeout=30)
        assert out.exit_code != 0 or "403 Forbidden" in out.stdout
        # Refused by the gateway, by name: curl shows the 403 (or, for CONNECT, its status).
        assert "ip-literal" in out.stdout or "403" in out.stderr, out.stdout + out.stderr


@pytest.mark.parametrize("name", ["loop.test", "ten.test", "meta.test", "mapped.test",
                                  "mixed.test", "localhost"])
def test_names_resolving_to_forbidden_addresses_are_refused(egress_home: str, name: str) -> None:
    with Sandbox.create(home=egress_home, network={"allow": [name]}) as sb:
        status, verdict = _status(sb, f"http://{name}/")
        assert status == 403 and "forbidden-address" in verdict


def test_without_the_proxy_variables_nothing_is_reachable(egress_home: str) -> None:
    with Sandbox.create(home=egress_home, network={"allow": ["api.test"]}) as sb:
        out = sb.commands.run(
            "env -u HTTP_PROXY -u http_proxy -u HTTPS_PROXY -u https_proxy -u ALL_PROXY "
            f"-u all_proxy curl -sS -m 5 http://api.test/ ; echo rc=$?; "
            f"curl -sS -m 5 --noproxy '*' http://{UPSTREAM_ADDR}/; echo rc=$?", timeout=30)
        assert "rc=0" not in out.stdout, out.stdout + out.stderr
        # Nor is a port from an earlier command still open: listeners live as long as a command.
        port = run_ok(sb, "echo ${HTTP_PROXY##*:}").strip()
        again = sb.commands.run(f"curl -sS -m 5 -x http://127.0.0.1:{port} http://api.test/",
                                timeout=30)
        assert again.exit_code != 0


# -- matching tricks ---------------------------------------------------------------------------

RAW = textwrap.dedent("""
    import os, socket, sys
    port = int(os.environ["HTTP_PROXY"].rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(sys.argv[1].encode().decode("unicode_escape").encode())
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    print(data.decode(errors="replace").split("\\r\\n")[0])
    lines = data.decode(errors="replace").split("\\r\\n")
    print([ln for ln in lines if ln.lower().startswith("x-corral-egress:")])
""")


@pytest.mark.parametrize(("request_text", "expected"), [
    ("GET http://api.test.evil.test/ HTTP/1.1\\r\\nHost: api.test.evil.test\\r\\n\\r\\n", "403"),
    ("GET http://evil.test#@api.test/ HTTP/1.1\\r\\nHost: evil.test\\r\\n\\r\\n", "403"),
    ("GET http://api.test@evil.test/ HTTP/1.1\\r\\nHost: evil.test\\r\\n\\r\\n", "403"),
    ("GET http://evil.test@api.test/ HTTP/1.1\\r\\nHost: api.test\\r\\n\\r\\n", "userinfo"),
    ("GET http://api.test/ HTTP/1.1\\r\\nHost: evil.test\\r\\n\\r\\n", "host-mismatch"),
    ("CONNECT api.test:443 HTTP/1.1\\r\\nHost: evil.test:443\\r\\n\\r\\n", "host-mismatch"),
    ("CONNECT api.test:22 HTTP/1.1\\r\\nHost: api.test:22\\r\\n\\r\\n", "403"),
    ("GET http://API.TEST./ HTTP/1.1\\r\\nHost: API.TEST.\\r\\n\\r\\n", "200"),
    ("GET https://api.test/ HTTP/1.1\\r\\nHost: api.test\\r\\n\\r\\n", "400"),
    ("GET /relative HTTP/1.1\\r\\nHost: api.test\\r\\n\\r\\n", "400"),
])
def test_matching_tricks(egress_home: str, request_text: str, expected: str) -> None:
    with Sandbox.create(home=egress_home, network={"allow": ["api.test"]}) as sb:
        out = sb.commands.run(["python3", "-c", RAW, request_text], timeout=30)
        assert out.exit_code == 0, out.stderr
        assert expected in out.stdout, out.stdout


def test_international_names_match_their_punycode(egress_home: str) -> None:
    with Sandbox.create(home=egress_home, network={"allow": ["bücher.test"]}) as sb:
        assert _status(sb, "http://xn--bcher-kva.test/")[0] == 200


def test_policy_update_applies_to_the_next_connection(egress_home: str) -> None:
    sb = Sandbox.create(home=egress_home, network={"allow": ["api.test"]})
    try:
        def tighten() -> None:
            time.sleep(1.0)
            sb.network.update(allow=["pypi.test"])

        thread = threading.Thread(target=tighten)
        thread.start()
        out = sb.commands.run(
            "curl -s -o /dev/null -w '%{http_code}\\n' http://api.test/; sleep 2.5; "
            "curl -s -o /dev/null -w '%{http_code}\\n' http://api.test/; "
            "curl -s -o /dev/null -w '%{http_code}\\n' http://pypi.test/", timeout=30)
        thread.join()
        assert out.stdout.split() == ["200", "403", "200"]
        assert sb.network.get()["allow"] == ["pypi.test"]
        sb.network.block()
        # Only a refusing listener now, saying so (see the refusal tests below).
        status, verdict = _status(sb, "http://pypi.test/")
        assert status == 403 and "network=none" in verdict
    finally:
        sb.kill()


def test_bad_policies_are_refused(egress_home: str) -> None:
    for network in ({"allow": ["10.0.0.1"]}, {"allow": ["*"]}, {"allow": ["a/b"]},
                    {"allow": "pypi.org"}, {"allow": ["x.com:99999"]}, {"permit": ["x.com"]},
                    "all"):
        with pytest.raises(UsageError):
            Sandbox.create(home=egress_home, network=network)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="no secret named"):
        Sandbox.create(home=egress_home, secrets=["NOPE"])


# -- brokered secrets --------------------------------------------------------------------------


def test_secrets_are_swapped_only_for_their_bound_host(
    egress_home: str, upstream: Upstream
) -> None:
    with Sandbox.create(home=egress_home, secrets=["TEST_TOKEN"],
                        network={"allow": ["api.test", "other.test"]}) as sb:
        placeholder = run_ok(sb, "printf %s \"$TEST_TOKEN\"")
        assert placeholder.startswith("CORRAL_PLACEHOLDER_TEST_TOKEN_")
        assert TOKEN_VALUE not in run_ok(sb, "env; cat /proc/self/environ | tr '\\0' '\\n'")
        ca = _ca_in(sb, upstream)
        before = len(upstream.seen)
        run_ok(sb, f"""
            curl -sS -m 10 -H "Authorization: Bearer $TEST_TOKEN" https://api.test/bound
            curl -sS -m 10 --cacert {ca} -H "Authorization: Bearer $TEST_TOKEN" https://other.test/unbound
            curl -sS -m 10 -H "Authorization: Bearer $TEST_TOKEN" http://api.test/plain
        """)
        got = {r["path"]: r for r in upstream.seen[before:]}
        assert got["/bound"]["headers"]["authorization"] == f"Bearer {TOKEN_VALUE}"
        assert got["/bound"]["tls"] is True
        assert got["/unbound"]["headers"]["authorization"] == f"Bearer {placeholder}"
        # Over plain HTTP the value would cross the network in clear: the placeholder goes.
        assert got["/plain"]["headers"]["authorization"] == f"Bearer {placeholder}"
        decisions = sb.audit.events(types=["egress.decision"])
        modes = {(e.data["host"], e.data["mode"]) for e in decisions}
        assert {("api.test", "intercept"), ("other.test", "tunnel"), ("api.test", "http")} <= modes
        assert [e.data["secrets_substituted"] for e in decisions
                if e.data["mode"] == "intercept"] == [["TEST_TOKEN"]]
    found = subprocess.run(["grep", "-rlF", "--exclude=secrets.db*", "--", TOKEN_VALUE,
                            egress_home], capture_output=True, text=True, timeout=60)
    assert found.returncode == 1 and found.stdout == "", found.stdout


# -- audit and metrics -------------------------------------------------------------------------


def test_every_decision_is_audited_and_counted(egress_home: str, egress_manager: Manager) -> None:
    from corral._audit.metrics import render

    before = render(egress_manager.store)
    with Sandbox.create(home=egress_home, network={"allow": ["api.test"]}) as sb:
        first = sb.commands.run("curl -s -o /dev/null http://api.test/big")
        second = sb.commands.run("curl -s -o /dev/null http://pypi.test/")
        events = sb.audit.events(types=["egress.decision"])
        assert [e.command for e in events] == [first.command_id, second.command_id]
        allowed, denied = events[0].data, events[1].data
        assert allowed["verdict"] == "allowed" and allowed["rule"] == "allow api.test"
        assert allowed["method"] == "GET" and allowed["port"] == 80
        assert allowed["bytes_down"] == 5_000_000 and allowed["bytes_up"] == 0
        assert allowed["address"] == UPSTREAM_ADDR and allowed["duration_s"] > 0
        assert denied["verdict"] == "denied" and denied["rule"] == "no-match"
        cli = subprocess.run([sys.executable, "-m", "corral", "--home", egress_home, "egress",
                              sb.id, "--json"], capture_output=True, text=True, timeout=60)
        assert [json.loads(line)["data"]["verdict"] for line in cli.stdout.splitlines()] == [
            "allowed", "denied"]
    after = render(egress_manager.store)

    def count(text: str, verdict: str) -> float:
        needle = f'corral_egress_decisions_total{{verdict="{verdict}"}} '
        line = next((ln for ln in text.splitlines() if ln.startswith(needle)), needle + "0")
        return float(line.split()[-1])

    assert count(after, "allowed") - count(before, "allowed") == 1
    assert count(after, "denied") - count(before, "denied") == 1


# -- framing per RFC 9112 (issue 11); the gateway-level cases are in test_gateway_framing.py ---

SMUGGLED = "GET /smuggled HTTP/1.1\\r\\nHost: denied.test\\r\\nContent-Length: 7\\r\\n\\r\\n"


def test_cl_te_smuggling_is_refused_and_audited(egress_home: str, upstream: Upstream) -> None:
    # The fake internet's server frames by Content-Length: forwarded with both headers, the
    # chunk below would leave a second request for denied.test behind.
    inner = SMUGGLED.replace("\\r\\n", "\r\n")
    size = f"{len(inner):x}"
    request = (f"POST http://api.test/smuggle-a HTTP/1.1\\r\\nHost: api.test\\r\\n"
               f"Content-Length: {len(size) + 2}\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n"
               f"{size}\\r\\n{SMUGGLED}\\r\\n0\\r\\n\\r\\n")
    with Sandbox.create(home=egress_home, network={"allow": ["api.test"]}) as sb:
        before = len(upstream.seen)
        out = sb.commands.run(["python3", "-c", RAW, request], timeout=30)
        assert out.exit_code == 0, out.stderr
        assert "400" in out.stdout.splitlines()[0] and "bad-framing" in out.stdout, out.stdout
        time.sleep(0.2)
        assert upstream.seen[before:] == []
        [event] = sb.audit.events(types=["egress.decision"])
        assert (event.data["verdict"], event.data["rule"], event.data["host"]) == (
            "denied", "bad-framing", "api.test")
        assert "Content-Length and Transfer-Encoding" in event.data["reason"]


INTERCEPT = textwrap.dedent("""
    import os, socket, ssl, sys
    port = int(os.environ["HTTPS_PROXY"].rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"CONNECT api.test:443 HTTP/1.1\\r\\nHost: api.test:443\\r\\n\\r\\n")
    head = b""
    while not head.endswith(b"\\r\\n\\r\\n"):
        head += s.recv(1)
    t = ssl.create_default_context().wrap_socket(s, server_hostname="api.test")
    target = sys.argv[1].replace("TOKEN", os.environ["TEST_TOKEN"])
    t.sendall(f"GET {target} HTTP/1.1\\r\\nHost: api.test\\r\\n\\r\\n".encode())
    data = b""
    while chunk := t.recv(65536):
        data += chunk
    print(data.decode(errors="replace").split("\\r\\n")[0])
""")


def test_absolute_form_in_an_intercepted_tunnel_is_refused_before_substitution(
    egress_home: str, upstream: Upstream
) -> None:
    with Sandbox.create(home=egress_home, secrets=["TEST_TOKEN"],
                        network={"allow": ["api.test", "other.test"]}) as sb:
        before = len(upstream.seen)
        refused = sb.commands.run(["python3", "-c", INTERCEPT,
                                   "https://other.test/abs?tok=TOKEN"], timeout=30)
        assert refused.exit_code == 0, refused.stderr
        assert "400" in refused.stdout, refused.stdout
        time.sleep(0.2)
        assert upstream.seen[before:] == []
        allowed = sb.commands.run(["python3", "-c", INTERCEPT,
                                   "https://api.test/abs-ok?tok=TOKEN"], timeout=30)
        assert "200" in allowed.stdout, allowed.stdout + allowed.stderr
        [seen] = upstream.seen[before:]
        # Forwarded in origin-form, with the value swapped in, to the vetted host only.
        assert (seen["path"], seen["host"]) == (f"/abs-ok?tok={TOKEN_VALUE}", "api.test")
        first, second = sb.audit.events(types=["egress.decision"])
        assert (first.data["verdict"], first.data["rule"], first.data["host"],
                first.data["secrets_substituted"]) == ("denied", "authority-mismatch",
                                                       "api.test", [])
        assert (second.data["verdict"], second.data["secrets_substituted"]) == (
            "allowed", ["TEST_TOKEN"])


# -- refusals a model can act on (issue 37) ------------------------------------------------------

REQUESTS_TRY = textwrap.dedent("""
    import sys, requests
    try:
        r = requests.get(sys.argv[1], timeout=10)
        print(r.status_code, r.reason)
        r.raise_for_status()
    except requests.RequestException as e:
        print("error", e)
""")

LOOKUP_TIME = textwrap.dedent("""
    import socket, time
    t = time.monotonic()
    try:
        socket.getaddrinfo("pypi.test", 443)
        print("resolved")
    except socket.gaierror as e:
        print("gaierror", e.errno)
    print(f"{time.monotonic() - t:.4f}")
""")


def test_a_sandbox_without_network_says_it_was_the_policy_and_how_to_allow(
    egress_home: str,
) -> None:
    with Sandbox.create(home=egress_home) as sb:  # network "none"
        # A name lookup fails at once (no nameserver: 127.0.0.1:53 refuses), and resolv.conf
        # says why to whoever looks.
        out = run_ok(sb, ["python3", "-c", LOOKUP_TIME]).split()
        assert out[0] == "gaierror" and float(out[-1]) < 0.5, out
        assert "corral network $CORRAL_SANDBOX_ID --allow" in run_ok(sb, "cat /etc/resolv.conf")
        # curl over plain HTTP prints the body; curl -i shows the status line of a CONNECT.
        body = run_ok(sb, "curl -sS -m 10 http://pypi.test/simple/")
        assert "refused by Corral's network policy" in body
        assert "network='none'" in body and 'network={"allow": ["pypi.test"]}' in body
        assert f"corral network {sb.id} --allow pypi.test" in body
        assert "corral create --allow pypi.test" in body
        head = sb.commands.run("curl -sSi -m 10 https://pypi.test/simple/", timeout=30)
        assert head.exit_code == 56 and "response 403" in head.stderr
        status = head.stdout.splitlines()[0]
        assert "Forbidden by Corral network policy" in status and "--allow pypi.test" in status
        assert "x-corral-refused: policy; host=pypi.test; port=443; method=CONNECT; " \
               "rule=network=none; setting=network.allow" in head.stdout
        # Python: requests (http.client) shows the reason phrase of a refused CONNECT.
        said = run_ok(sb, ["python3", "-c", REQUESTS_TRY, "https://pypi.test/simple/"])
        assert "Tunnel connection failed: 403 Forbidden by Corral network policy" in said
        assert "network={'allow': ['pypi.test']}" in said
        # pip prints it in its retry warnings (its final line stays "from versions: none").
        pip = sb.commands.run(
            "python3 -m pip download --no-deps --no-cache-dir --disable-pip-version-check "
            "--retries 1 --index-url https://pypi.test/simple/ -d dl corraldemo", timeout=60)
        assert pip.exit_code != 0
        assert "Forbidden by Corral network policy" in pip.stderr, pip.stderr
        assert "--allow pypi.test" in pip.stderr
        # And the audit trail says what was refused, and why.
        events = sb.audit.events(types=["egress.decision"])
        assert events and {(e.data["verdict"], e.data["rule"], e.data["host"])
                           for e in events} == {("denied", "network=none", "pypi.test")}


def test_allowlist_refusals_name_the_rule_and_the_setting(egress_home: str) -> None:
    with Sandbox.create(home=egress_home, network={"allow": ["api.test", "other.test"],
                                                   "deny": ["other.test"]}) as sb:
        body = run_ok(sb, "curl -sS -m 10 http://pypi.test/")
        assert "no rule of the sandbox's allow list matches it" in body
        assert "policy field network.allow" in body
        denied = run_ok(sb, "curl -sS -m 10 http://other.test/")
        assert "deny rule 'other.test'" in denied and "network.deny" in denied
        literal = run_ok(sb, f"curl -sS -m 10 http://{UPSTREAM_ADDR}/")
        assert "only host names can be allowed" in literal
        said = run_ok(sb, ["python3", "-c", REQUESTS_TRY, "http://pypi.test/x"])
        assert said.startswith("403 Forbidden by Corral network policy: pypi.test is not in "
                               "this sandbox's network allow list"), said
        assert "403 Client Error: Forbidden by Corral network policy" in said


def test_a_refusal_echoes_no_request_bytes_and_stays_bounded(egress_home: str) -> None:
    """Only what the gateway checked reaches the answer: a long name, markup and bytes past
    ASCII in the request come back as short printable text, never as they were sent."""
    long_name = ".".join(["a" * 63] * 3) + ".test"
    raw = textwrap.dedent("""
        import os, socket, sys
        port = int(os.environ["HTTP_PROXY"].rsplit(":", 1)[1])
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(sys.argv[1].encode("latin-1"))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        sys.stdout.buffer.write(data)
    """)
    with Sandbox.create(home=egress_home, network={"allow": ["api.test"]}) as sb:
        for request in (
            f"GET http://{long_name}/<script>alert(1)</script> HTTP/1.1\r\n"
            f"Host: {long_name}\r\nX-Evil: \xff\xfe<b>\r\n\r\n",
            "GET http://b\xfccher.test/ HTTP/1.1\r\nHost: b\xfccher.test\r\n\r\n",
            "CONNECT <b>.test:443 HTTP/1.1\r\nHost: <b>.test:443\r\n\r\n",
        ):
            result = sb.commands.run(["python3", "-c", raw, request], timeout=30)
            answer = result.stdout.encode("utf-8", "surrogateescape")
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith((b"HTTP/1.1 403", b"HTTP/1.1 400")), answer[:200]
            assert b"content-type: text/plain; charset=utf-8" in head
            assert len(answer) < 4096
            assert all(32 <= c < 127 or c in b"\r\n" for c in answer), answer
            assert b"<script>" not in answer


def test_refusals_in_a_loop_stay_bounded_in_the_audit_trail(egress_home: str) -> None:
    with Sandbox.create(home=egress_home) as sb:
        looped = sb.commands.run("for i in $(seq 200); do curl -s -o /dev/null "
                                 "http://pypi$i.test/; done", timeout=60)
        assert looped.exit_code == 0
        full = [e for e in sb.audit.events(types=["egress.decision"])
                if e.command == looped.command_id]
        # The first of a window in full (the rest are counted into one summary).
        assert 1 <= len(full) <= 5, len(full)


def test_every_tier_refuses_without_network_fast_and_says_why(
    egress_home: str, isolation_all: str
) -> None:
    """The same on every tier: the lookup fails in well under a second (the resolver is the
    same file everywhere), and the refusing gateway answers through each tier's own path."""
    with Sandbox.create(home=egress_home, isolation=isolation_all) as sb:
        out = run_ok(sb, ["python3", "-c", LOOKUP_TIME]).split()
        assert out[0] == "gaierror" and float(out[-1]) < 1.0, out
        body = run_ok(sb, "curl -sS -m 20 http://pypi.test/simple/")
        assert "refused by Corral's network policy" in body and "network='none'" in body
        [event] = sb.audit.events(types=["egress.decision"])
        assert (event.data["verdict"], event.data["rule"], event.data["host"]) == (
            "denied", "network=none", "pypi.test")



def test_a_sandbox_without_network_has_one_refusing_listener_gone_with_it(
        egress_home: str, egress_manager: Manager) -> None:
    """The refusing listener is the sandbox's, made on its first command and kept (no listener
    per command on the hot path), closed by its destroy here, and by the next recovery pass
    when another process destroyed it: a socket left open would keep its network namespace."""
    held = egress_manager.egress._refusers  # white-box: which sandboxes hold one
    sb = Sandbox.create(home=egress_home)
    ports = set()
    for _ in range(3):
        body = run_ok(sb, "curl -sS -m 20 http://pypi.test/simple/; echo; echo $HTTP_PROXY")
        assert "refused by Corral's network policy" in body
        ports.add(body.strip().splitlines()[-1])
    assert len(ports) == 1 and sb.id in held  # one listener for the three commands
    # The refusals name the command they came from (one command ran at a time).
    refused = sb.audit.events(types=["egress.decision"])
    assert refused and all(e.command for e in refused)
    listener = held[sb.id][0]
    sb.kill()
    assert sb.id not in held and listener._closed
    # Destroyed by another process: the store row goes, this process's listener with the
    # next recovery pass.
    other = Sandbox.create(home=egress_home)
    run_ok(other, "curl -sS -m 20 http://pypi.test/ || true")
    assert other.id in held
    record = egress_manager.sandboxes.get(other.id)
    egress_manager.backend_for(record.isolation).destroy(egress_manager.sandboxes.spec(record))
    egress_manager.store.delete(other.id)
    egress_manager.recover()
    assert other.id not in held
