"""Gateway framing per RFC 9112, against the real gateway with real sockets and TLS.

The upstream here is the one request smuggling needs: it frames by Content-Length whenever that
header is present (chunked only without it), keeps every connection alive, and counts each request
it parsed. A forwarded request whose framing the gateway and this upstream read differently
shows up as a second request the gateway never vetted. Everything runs on loopback (the operator
allows 127.0.0.0/8 for this gateway only); sizes and loops are capped.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from corral._egress.addresses import parse_cidrs
from corral._egress.ca import CertificateAuthority
from corral._egress.gateway import BoundSecret, Decision, EgressContext, Gateway
from corral._egress.policy import NetworkPolicy, Rule

from .upstream import _certificates

PLACEHOLDER = "CORRAL_PLACEHOLDER_TOKEN_0123456789abcdef"
REAL = "real-SECRET-value-9f8e7d"
_MAX_HEAD = 65536
_MAX_BODY = 1 << 20
_MAX_REQUESTS = 8


@dataclass
class CountingUpstream:
    """HTTP/1.1 on 127.0.0.1 (plain or TLS) that records every request it parsed."""

    tls: ssl.SSLContext | None = None
    seen: list[dict[str, Any]] = field(default_factory=list)
    _active: int = 0
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def start(self) -> int:
        self._sock = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()
        return int(self._sock.getsockname()[1])

    def close(self) -> None:
        self._sock.close()

    def wait_idle(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._active == 0, timeout)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._cond:
                self._active += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        conn = raw
        try:
            raw.settimeout(5)
            if self.tls is not None:
                conn = self.tls.wrap_socket(raw, server_side=True)
            buf = b""
            for _ in range(_MAX_REQUESTS):
                while b"\r\n\r\n" not in buf and len(buf) < _MAX_HEAD:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, sep, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                parts = lines[0].split(" ")
                if not sep or len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                    return  # not a request: stop parsing this connection
                headers: list[tuple[str, str]] = []
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    headers.append((name.strip().lower(), value.strip()))
                names = dict(headers)
                body, buf = self._body(conn, names, buf)
                self.seen.append({"method": parts[0], "target": parts[1], "headers": headers,
                                  "body": body})
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
        except (OSError, ValueError):
            return
        finally:
            conn.close()
            raw.close()
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @staticmethod
    def _body(conn: socket.socket, names: dict[str, str], buf: bytes) -> tuple[bytes, bytes]:
        def fill(done: Any) -> None:
            nonlocal buf
            while not done() and len(buf) < _MAX_BODY:
                data = conn.recv(65536)
                if not data:
                    raise ValueError("closed mid-body")
                buf += data

        if "content-length" in names:  # Content-Length wins here: the smuggling victim
            length = min(int(names["content-length"]), _MAX_BODY)
            fill(lambda: len(buf) >= length)
            return buf[:length], buf[length:]
        if names.get("transfer-encoding", "").lower() != "chunked":
            return b"", buf
        body = b""
        for _ in range(64):
            fill(lambda: b"\r\n" in buf)  # noqa: B023 - reads the live buffer
            size_line, _, buf = buf.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            fill(lambda: len(buf) >= size + 2)  # noqa: B023 - called at once
            body, buf = body + buf[:size], buf[size + 2:]
            if size == 0:
                break
        return body, buf


@dataclass
class Harness:
    gateway: Gateway
    proxy_port: int
    plain: CountingUpstream
    plain_port: int
    secure: CountingUpstream
    tls_port: int
    ca_pem: Path
    decisions: list[Decision]

    def settle(self, count: int = 1) -> list[Decision]:
        """The decisions reported so far, once ``count`` have arrived (reported at close)."""
        deadline = time.monotonic() + 5
        while len(self.decisions) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        self.plain.wait_idle()
        self.secure.wait_idle()
        return list(self.decisions)

    def send_plain(self, raw: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", self.proxy_port), timeout=10) as s:
            s.sendall(raw)
            return _read_all(s)

    def send_intercepted(self, raw: bytes) -> bytes:
        """``raw`` inside a tunnel the gateway intercepts (CONNECT to the secret's host)."""
        with socket.create_connection(("127.0.0.1", self.proxy_port), timeout=10) as s:
            s.sendall(f"CONNECT api.test:{self.tls_port} HTTP/1.1\r\n"
                      f"Host: api.test:{self.tls_port}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                data = s.recv(1)
                assert data, head
                head += data
            assert head.startswith(b"HTTP/1.1 200"), head
            context = ssl.create_default_context(cafile=str(self.ca_pem))
            with context.wrap_socket(s, server_hostname="api.test") as t:
                t.sendall(raw)
                return _read_all(t)


def _read_all(s: socket.socket) -> bytes:
    data = b""
    try:
        while len(data) < _MAX_BODY and (chunk := s.recv(65536)):
            data += chunk
    except (ConnectionResetError, ssl.SSLError):
        pass
    return data


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    tmp = Path(tempfile.mkdtemp(prefix="corral-test-framing-"))
    ca_file, server_tls = _certificates(tmp)
    plain, secure = CountingUpstream(), CountingUpstream(tls=server_tls)
    plain_port, tls_port = plain.start(), secure.start()
    policy = NetworkPolicy.build([f"api.test:{plain_port}", f"api.test:{tls_port}",
                                  f"other.test:{plain_port}", f"other.test:{tls_port}"])
    secret = BoundSecret("TOKEN", PLACEHOLDER, REAL, (Rule.parse(f"api.test:{tls_port}"),))
    decisions: list[Decision] = []
    ca = CertificateAuthority(tmp / "ca")
    gateway = Gateway(lookup=lambda _: EgressContext(policy=policy, secrets=(secret,)),
                      report=decisions.append, ca=ca, operator_cidrs=parse_cidrs(["127.0.0.0/8"]),
                      pinned_hosts={n: ["127.0.0.1"] for n in ("api.test", "other.test",
                                                               "denied.test")},
                      upstream_ca_file=str(ca_file))
    listener = socket.create_server(("127.0.0.1", 0))
    handle = gateway.serve(listener, sandbox_id="sb-framing", command_id="cmd-framing")
    try:
        yield Harness(gateway, handle.port, plain, plain_port, secure, tls_port, ca.cert_path,
                      decisions)
    finally:
        handle.close()
        gateway.close()
        listener.close()
        plain.close()
        secure.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def h(harness: Harness) -> Harness:
    """The module's harness with this test's records only."""
    harness.settle(0)
    harness.decisions.clear()
    harness.plain.seen.clear()
    harness.secure.seen.clear()
    return harness


def _status(response: bytes) -> int:
    line = response.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 and line[0].startswith(b"HTTP/") else 0


def _smuggling(framing: str, *, request_line: str, host: str) -> bytes:
    """A chunked body that, re-chunked by the gateway and read by Content-Length upstream,
    leaves a second request for denied.test behind."""
    smuggled = (b"GET /smuggled HTTP/1.1\r\nHost: denied.test\r\nContent-Length: 7\r\n\r\n")
    chunk = f"{len(smuggled):x}\r\n".encode() + smuggled + b"\r\n0\r\n\r\n"
    cl = len(f"{len(smuggled):x}\r\n")
    head = framing.format(cl=cl)
    return (f"{request_line}\r\nHost: {host}\r\n{head}\r\n").encode() + chunk


FRAMINGS = {
    "cl-then-te": "Content-Length: {cl}\r\nTransfer-Encoding: chunked\r\n",
    "te-then-cl": "Transfer-Encoding: chunked\r\nContent-Length: {cl}\r\n",
    "te-odd-case-and-space": "Content-Length: {cl}\r\nTransfer-Encoding:   ChUnKeD  \r\n",
    "te-twice": "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
    "te-not-only-chunked": "Transfer-Encoding: gzip, chunked\r\n",
    "cl-conflicting": "Content-Length: {cl}\r\nContent-Length: 70\r\n",
    "cl-conflicting-list": "Content-Length: {cl}, 70\r\n",
}


@pytest.mark.parametrize("framing", list(FRAMINGS))
@pytest.mark.parametrize("where", ["plain", "intercepted"])
def test_ambiguous_framing_is_refused_and_nothing_is_forwarded(h: Harness, framing: str,
                                                               where: str) -> None:
    if where == "plain":
        raw = _smuggling(FRAMINGS[framing], request_line=(
            f"POST http://api.test:{h.plain_port}/a HTTP/1.1"), host=f"api.test:{h.plain_port}")
        response = h.send_plain(raw)
    else:
        raw = _smuggling(FRAMINGS[framing], request_line="POST /a HTTP/1.1",
                         host=f"api.test:{h.tls_port}")
        response = h.send_intercepted(raw)
    decisions = h.settle()
    # Nothing reached the upstream: neither the request nor the one smuggled in its body.
    assert [r["target"] for r in h.plain.seen + h.secure.seen] == []
    assert _status(response) == 400, response[:300]
    assert b"connection: close" in response.lower()
    assert [(d.verdict, d.rule) for d in decisions] == [("denied", "bad-framing")], decisions
    assert decisions[0].reason


def test_transfer_encoding_on_http10_is_refused(h: Harness) -> None:
    response = h.send_plain(f"POST http://api.test:{h.plain_port}/a HTTP/1.0\r\n"
                            f"Host: api.test:{h.plain_port}\r\nTransfer-Encoding: chunked\r\n\r\n"
                            "3\r\nabc\r\n0\r\n\r\n".encode())
    assert _status(response) == 400
    assert [d.rule for d in h.settle()] == ["bad-framing"] and h.plain.seen == []


@pytest.mark.parametrize("where", ["plain", "intercepted"])
def test_bodies_are_reframed_with_exactly_one_framing_header(h: Harness, where: str) -> None:
    port = h.plain_port if where == "plain" else h.tls_port
    line = f"POST http://api.test:{port}/c HTTP/1.1" if where == "plain" else "POST /c HTTP/1.1"
    send = h.send_plain if where == "plain" else h.send_intercepted
    chunked = f"{line}\r\nHost: api.test:{port}\r\nTransfer-Encoding: chunked\r\n\r\n" \
              "5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    same_twice = f"{line}\r\nHost: api.test:{port}\r\nContent-Length: 5\r\n" \
                 "Content-Length: 5\r\n\r\nhello"
    for raw in (chunked, same_twice):
        assert _status(send(raw.encode())) == 200
    h.settle(2)
    seen = (h.plain if where == "plain" else h.secure).seen
    assert [r["body"] for r in seen] == [b"hello world", b"hello"]
    framing = [[(n, v) for n, v in r["headers"] if n in ("content-length", "transfer-encoding")]
               for r in seen]
    assert framing == [[("transfer-encoding", "chunked")], [("content-length", "5")]]


# -- absolute-form and the connection's vetted host -------------------------------------------


@pytest.mark.parametrize("target", [
    "https://denied.test/x?tok={placeholder}",
    "https://other.test:{port}/x?tok={placeholder}",  # allowed host, but not this connection's
    "https://api.test/x?tok={placeholder}",  # the default port is another authority
    "http://api.test:{port}/x?tok={placeholder}",  # so is another scheme
    "https://api.test:{port}@denied.test/x?tok={placeholder}",
    "https://denied.test:{port}#@api.test:{port}/x?tok={placeholder}",
])
def test_intercepted_absolute_form_to_another_authority_is_refused(h: Harness,
                                                                   target: str) -> None:
    url = target.format(port=h.tls_port, placeholder=PLACEHOLDER)
    response = h.send_intercepted(f"GET {url} HTTP/1.1\r\nHost: api.test:{h.tls_port}\r\n"
                                  f"Authorization: Bearer {PLACEHOLDER}\r\n\r\n".encode())
    decisions = h.settle()
    assert _status(response) in (400, 403), response[:300]
    assert h.secure.seen == [] and h.plain.seen == []
    assert [(d.verdict, d.rule) for d in decisions] in (
        [("denied", "authority-mismatch")], [("denied", "userinfo")]), decisions
    assert decisions[0].substituted == ()
    assert REAL not in json.dumps(decisions[0].to_dict()) and REAL.encode() not in response


@pytest.mark.parametrize("where", ["plain", "intercepted"])
def test_a_path_starting_with_two_slashes_is_refused(h: Harness, where: str) -> None:
    """``//denied.test/x`` reads as a network-path reference (another authority) to some
    servers and routers."""
    if where == "plain":
        response = h.send_plain(f"GET http://api.test:{h.plain_port}//denied.test/x HTTP/1.1\r\n"
                                f"Host: api.test:{h.plain_port}\r\n\r\n".encode())
    else:
        response = h.send_intercepted(f"GET //denied.test/x?tok={PLACEHOLDER} HTTP/1.1\r\n"
                                      f"Host: api.test:{h.tls_port}\r\n\r\n".encode())
    assert _status(response) == 400
    assert [(d.verdict, d.rule) for d in h.settle()] == [("denied", "authority-mismatch")]
    assert h.plain.seen == [] and h.secure.seen == []


def test_intercepted_request_is_forwarded_in_origin_form_with_its_port(h: Harness) -> None:
    url = f"https://API.test:{h.tls_port}/x?tok={PLACEHOLDER}"
    response = h.send_intercepted(f"GET {url} HTTP/1.1\r\nHost: api.test:{h.tls_port}\r\n\r\n"
                                  f"GET /second HTTP/1.1\r\nHost: api.test:{h.tls_port}\r\n\r\n"
                                  .encode())
    decisions = h.settle()
    assert _status(response) == 200
    assert [(r["target"], dict(r["headers"])["host"]) for r in h.secure.seen] == [
        (f"/x?tok={REAL}", f"api.test:{h.tls_port}")]
    assert [(d.verdict, d.mode, d.substituted) for d in decisions] == [
        ("allowed", "intercept", ("TOKEN",))]


def test_connect_inside_an_intercepted_tunnel_is_refused(h: Harness) -> None:
    response = h.send_intercepted(b"CONNECT denied.test:443 HTTP/1.1\r\n"
                                  b"Host: denied.test:443\r\n\r\n")
    assert _status(response) == 400
    assert [d.rule for d in h.settle()] == ["host-mismatch"] and h.secure.seen == []


@pytest.mark.parametrize("second", ["denied.test", "other.test"])
def test_plain_keep_alive_forwards_only_the_vetted_request(h: Harness, second: str) -> None:
    """A second request on one client connection is never forwarded: one request per
    connection, each its own decision (a new connection is vetted again)."""
    port = h.plain_port
    response = h.send_plain(
        f"GET http://api.test:{port}/one HTTP/1.1\r\nHost: api.test:{port}\r\n\r\n"
        f"GET http://{second}:{port}/two HTTP/1.1\r\nHost: {second}:{port}\r\n\r\n".encode())
    decisions = h.settle()
    assert _status(response) == 200 and response.count(b"HTTP/1.1 ") == 1
    assert [r["target"] for r in h.plain.seen] == ["/one"]
    assert [(d.host, d.verdict) for d in decisions] == [("api.test", "allowed")]


def test_plain_absolute_form_with_another_host_header_is_refused(h: Harness) -> None:
    port = h.plain_port
    response = h.send_plain(f"GET http://api.test:{port}/x HTTP/1.1\r\n"
                            f"Host: denied.test:{port}\r\n\r\n".encode())
    assert _status(response) == 400 and h.plain.seen == []
    assert [(d.verdict, d.rule) for d in h.settle()] == [("denied", "host-mismatch")]


def test_plain_request_keeps_a_non_default_port_in_host(h: Harness) -> None:
    port = h.plain_port
    assert _status(h.send_plain(f"GET http://api.test:{port}/p HTTP/1.1\r\n"
                                f"Host: api.test:{port}\r\n\r\n".encode())) == 200
    h.settle()
    assert [dict(r["headers"])["host"] for r in h.plain.seen] == [f"api.test:{port}"]


def test_malformed_heads_and_long_names_are_audited_bounded(h: Harness) -> None:
    long_host = "a" * 5000 + ".test"
    for raw in (b"GET http://api.test/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
                f"GET http://{long_host}/ HTTP/1.1\r\nHost: {long_host}\r\n\r\n".encode(),
                f"CONNECT {long_host}:443 HTTP/1.1\r\nHost: {long_host}:443\r\n\r\n".encode()):
        assert _status(h.send_plain(raw)) == 400
    decisions = h.settle(3)
    assert [d.rule for d in decisions] == ["bad-request", "bad-host", "bad-host"]
    for d in decisions:
        assert len(json.dumps(d.to_dict())) < 1500, d


def test_connect_port_of_many_digits_is_refused(h: Harness) -> None:
    # int() refuses strings over 4300 digits with ValueError; it must be a refusal, not a crash.
    port = "4" * 5000
    response = h.send_plain(f"CONNECT api.test:{port} HTTP/1.1\r\nHost: api.test:{port}\r\n\r\n"
                            .encode())
    assert _status(response) == 400
    [decision] = h.settle()
    assert decision.rule == "bad-target" and len(json.dumps(decision.to_dict())) < 1500


def test_a_failing_control_plane_still_ends_in_a_decision(tmp_path: Path) -> None:
    """The lookup (the control plane's store) raising: a 502 and a denied decision, not an
    unaudited dropped connection."""
    decisions: list[Decision] = []

    def lookup(_: str) -> EgressContext:
        raise RuntimeError("store unavailable " + "x" * 10_000)

    gateway = Gateway(lookup=lookup, report=decisions.append, ca=CertificateAuthority(tmp_path))
    listener = socket.create_server(("127.0.0.1", 0))
    handle = gateway.serve(listener, sandbox_id="sb-fail", command_id="cmd-fail")
    try:
        with socket.create_connection(("127.0.0.1", handle.port), timeout=10) as s:
            s.sendall(b"GET http://api.test/ HTTP/1.1\r\nHost: api.test\r\n\r\n")
            response = _read_all(s)
        deadline = time.monotonic() + 5
        while not decisions and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        handle.close()
        gateway.close()
        listener.close()
    assert _status(response) == 502
    assert [(d.verdict, d.rule) for d in decisions] == [("denied", "internal-error")]


@pytest.mark.parametrize("port", ["0", "00", "99999", "8" * 5000])
def test_plain_url_with_a_bad_port_is_refused(h: Harness, port: str) -> None:
    response = h.send_plain(f"GET http://api.test:{port}/ HTTP/1.1\r\nHost: api.test:{port}\r\n"
                            "\r\n".encode())
    assert _status(response) == 400 and h.plain.seen == []
    assert [d.rule for d in h.settle()] == ["bad-target"]
