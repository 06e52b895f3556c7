"""The service's edge, tried as a hostile caller and as a browser: bodies are bounded before they
are trusted (size, key, ownership), the service answers only to its own names, a cross-site
Origin cannot drive it, and revoking the last key does not reopen it.

The memory cases run ``corral serve`` in a process of its own (its own CORRAL_HOME) so its RSS
can be read from /proc; bodies come from a generator (never held by the test), on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from corral import Sandbox
from corral._control.plane import TenantDirectory
from corral._control.store import Store
from corral._server.app import MAX_COMMAND_BODY, MAX_FILE_BODY, MAX_JSON_BODY
from corral._settings import Settings

from ..conftest import managed
from .servers import Server as _Server
from .servers import free_port

pytestmark = pytest.mark.needs_root

_MiB = 1024 * 1024
_HUGE = 500 * _MiB
_RSS_BUDGET = 20 * _MiB


# -- a service in its own process --------------------------------------------------------------


@dataclass
class _Served:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    home: Path


def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
        time.sleep(0.1)


@contextlib.contextmanager
def _corral_serve(settings: Settings, *args: str, **env_extra: str) -> Iterator[_Served]:
    env = {**os.environ, **env_extra, "CORRAL_HOME": str(settings.home),
           "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "corral", "serve", "--port", str(port), *args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield _Served(url, port, proc, settings.home)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _own_settings(prefix: str) -> Settings:
    home = Path(tempfile.mkdtemp(prefix=prefix))
    return Settings(home=home, uid_start=2_146_000_000 + random.randrange(900) * 1000,
                    uid_count=1000)


@dataclass
class _Tenanted:
    served: _Served
    alpha: str
    beta: str
    sandbox: str  # alpha's
    process: str  # a background process in it


@pytest.fixture(scope="module")
def tenanted() -> Iterator[_Tenanted]:
    """A separate `corral serve` with two tenants; alpha owns a sandbox running a process."""
    settings = _own_settings("corral-test-edge-")
    store = Store(settings.home / "corral.db")
    directory = TenantDirectory(store)
    for name in ("alpha", "beta"):
        directory.add_tenant(name, max_sandboxes=3)
    alpha, beta = (directory.create_key(name)[1] for name in ("alpha", "beta"))
    store.close()
    try:
        with _corral_serve(settings, CORRAL_SERVER_HOST_NAMES="corral.test") as served:
            sb = Sandbox.create(url=served.url, api_key=alpha)
            try:
                process = sb.processes.start("cat > /dev/null")
                yield _Tenanted(served, alpha, beta, sb.id, process.id)
            finally:
                sb.kill()
    finally:
        with managed(settings):
            pass
        shutil.rmtree(settings.home, ignore_errors=True)


# -- measuring ---------------------------------------------------------------------------------


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@contextlib.contextmanager
def _rss_growth(pid: int) -> Iterator[list[int]]:
    """Samples the server's RSS while the block runs; yields [growth in bytes] at the end."""
    base = _rss(pid)
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.01):
            with contextlib.suppress(OSError):
                peak[0] = max(peak[0], _rss(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    growth = [0]
    try:
        yield growth
    finally:
        stop.set()
        sampler.join()
        growth[0] = peak[0] - base


def _zeros(total: int, chunk: int = _MiB) -> Iterator[bytes]:
    block = bytes(chunk)
    sent = 0
    while sent < total:
        piece = block[: min(chunk, total - sent)]
        sent += len(piece)
        yield piece


def _send_huge(url: str, method: str, path: str, *, declared: bool, key: str | None = None,
               params: dict[str, str] | None = None) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if declared:
        headers["content-length"] = str(_HUGE)  # httpx then sends it as is, not chunked
    if key:
        headers["authorization"] = f"Bearer {key}"
    with httpx.Client(base_url=url, timeout=120) as client:
        return client.request(method, path, content=_zeros(_HUGE), headers=headers,
                              params=params)


def _raw_answer(port: int, head: str, *, body: bytes = b"", timeout: float = 5) -> str:
    """Send a request head (and ``body``, maybe less than it declares); the status line the
    server answers with before the rest is sent, or '' if it waits for it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(head.encode() + b"\r\n" + body)
        try:
            answer = conn.recv(4096).decode(errors="replace")
        except TimeoutError:
            return ""
    return answer.partition("\r\n")[0]


# -- bounded before trusted --------------------------------------------------------------------


def test_a_huge_unauthenticated_body_is_refused_without_growing_the_server(
    tenanted: _Tenanted
) -> None:
    served = tenanted.served
    for declared in (True, False):
        with _rss_growth(served.proc.pid) as growth:
            response = _send_huge(served.url, "POST", "/v1/sandboxes", declared=declared)
        # Declared too large: 413 before the key is even looked at; chunked: 401 before a byte.
        assert response.status_code == (413 if declared else 401), response.text
        assert response.json()["error"] == ("too_large" if declared else "unauthorized")
        assert growth[0] < _RSS_BUDGET, (declared, growth[0] / _MiB)
    assert httpx.get(f"{served.url}/healthz").status_code == 200


def test_a_huge_authenticated_json_body_is_cut_at_its_limit(tenanted: _Tenanted) -> None:
    served = tenanted.served
    # A command's body may carry its stdin, so it is read up to that route's own limit.
    for path, limit in [("/v1/sandboxes", MAX_JSON_BODY),
                        (f"/v1/sandboxes/{tenanted.sandbox}/commands", MAX_COMMAND_BODY)]:
        for declared in (True, False):
            with _rss_growth(served.proc.pid) as growth:
                response = _send_huge(served.url, "POST", path, declared=declared,
                                      key=tenanted.alpha)
            assert response.status_code == 413, (path, declared, response.text)
            body = response.json()
            assert body["error"] == "too_large" and f"limited to {limit} bytes" in body["message"]
            budget = _RSS_BUDGET if declared else limit + _RSS_BUDGET
            assert growth[0] < budget, (path, declared, growth[0] / _MiB)


def test_huge_bodies_to_another_tenants_sandbox_are_refused_unread(tenanted: _Tenanted) -> None:
    served, base = tenanted.served, f"/v1/sandboxes/{tenanted.sandbox}"
    targets = [
        ("POST", f"{base}/commands", None),
        ("POST", f"{base}/processes/{tenanted.process}/input", None),
        ("PUT", f"{base}/files/content", {"path": "big.bin"}),
        ("PUT", f"{base}/archive", None),
    ]
    for method, path, params in targets:
        for declared in (True, False):
            with _rss_growth(served.proc.pid) as growth:
                response = _send_huge(served.url, method, path, declared=declared,
                                      key=tenanted.beta, params=params)
            assert response.status_code in (404, 413), (path, declared, response.text)
            assert growth[0] < _RSS_BUDGET, (path, declared, growth[0] / _MiB)
    # Nothing reached alpha's sandbox.
    sb = Sandbox.connect(tenanted.sandbox, url=served.url, api_key=tenanted.alpha)
    assert "big.bin" not in {e.name for e in sb.files.list()}


def test_huge_bodies_to_the_callers_own_sandbox_are_refused_by_their_length(
    tenanted: _Tenanted
) -> None:
    served, base = tenanted.served, f"/v1/sandboxes/{tenanted.sandbox}"
    for method, path, params in [
        ("POST", f"{base}/processes/{tenanted.process}/input", None),
        ("PUT", f"{base}/files/content", {"path": "big.bin"}),
    ]:
        with _rss_growth(served.proc.pid) as growth:
            response = _send_huge(served.url, method, path, declared=True,
                                  key=tenanted.alpha, params=params)
        assert response.status_code == 413, (path, response.text)
        assert response.json()["error"] == "too_large"
        assert growth[0] < _RSS_BUDGET, (path, growth[0] / _MiB)
        # Streamed without a length: cut at the route's limit, never more held than that.
        with _rss_growth(served.proc.pid) as growth:
            response = _send_huge(served.url, method, path, declared=False,
                                  key=tenanted.alpha, params=params)
        assert response.status_code == 413, (path, response.text)
        assert f"limited to {MAX_FILE_BODY} bytes" in response.json()["message"]
        assert growth[0] < MAX_FILE_BODY + _RSS_BUDGET, (path, growth[0] / _MiB)
    sb = Sandbox.connect(tenanted.sandbox, url=served.url, api_key=tenanted.alpha)
    assert "big.bin" not in {e.name for e in sb.files.list()}
    assert sb.processes.get(tenanted.process).info()["state"] == "running"


def test_keys_and_ownership_are_checked_before_the_body_is_sent(tenanted: _Tenanted) -> None:
    """The client gets its answer while the body it declared is still unsent."""
    port, base = tenanted.served.port, f"/v1/sandboxes/{tenanted.sandbox}"
    host = f"Host: 127.0.0.1:{port}\r\n"
    no_key = (f"POST /v1/sandboxes HTTP/1.1\r\n{host}content-type: application/json\r\n"
              "content-length: 1000\r\n")
    assert " 401 " in _raw_answer(port, no_key, body=b"{"), "the server waited for the body"
    bad_key = no_key.replace("content-type", "authorization: Bearer ck_000000000000_"
                             + "x" * 32 + "\r\ncontent-type")
    assert " 401 " in _raw_answer(port, bad_key)
    beta = f"authorization: Bearer {tenanted.beta}\r\n"
    for method, path in [("POST", f"{base}/processes/{tenanted.process}/input"),
                         ("PUT", f"{base}/files/content?path=x"),
                         ("PUT", f"{base}/archive")]:
        head = f"{method} {path} HTTP/1.1\r\n{host}{beta}content-length: {32 * _MiB}\r\n"
        assert " 404 " in _raw_answer(port, head), path


# -- the browser is not trusted: Host ----------------------------------------------------------


def test_the_service_answers_only_to_its_names(server: _Server, tenanted: _Tenanted) -> None:
    port = server.port
    with httpx.Client(base_url=server.url) as client:
        for host in ("127.0.0.1", f"127.0.0.1:{port}", "localhost", f"localhost:{port}",
                     f"LOCALHOST:{port}", f"[::1]:{port}", "[::1]"):
            response = client.get("/v1/sandboxes", headers={"host": host})
            assert response.status_code == 200, (host, response.text)
        for host in ("evil.example", f"evil.example:{port}", "localhost:1",
                     f"127.0.0.1.nip.io:{port}", "localhost.", f"127.0.0.2:{port}", "",
                     f"localhost:{port}@evil.example"):
            response = client.get("/v1/sandboxes", headers={"host": host})
            assert response.status_code == 421, (host, response.text)
            body = response.json()
            assert body["error"] == "host_refused" and "--host-name" in body["message"]
        # Even the health check: a rebinding page learns nothing.
        assert client.get("/healthz", headers={"host": "evil.example"}).status_code == 421
    # CORRAL_SERVER_HOST_NAMES adds a name (so does --host-name); others are still refused.
    with httpx.Client(base_url=tenanted.served.url) as client:
        assert client.get("/healthz", headers={"host": "corral.test"}).status_code == 200
        assert client.get("/healthz", headers={"host": "other.test"}).status_code == 421


def test_a_rebinding_websocket_is_refused_by_host(server: _Server) -> None:
    handshake = ("GET /v1/sandboxes/sbx_000000000000/pty HTTP/1.1\r\nHost: {}\r\n"
                 "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                 "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")
    assert " 421 " in _raw_answer(server.port, handshake.format("evil.example"))
    # The same handshake with the service's own name gets through the Host check.
    assert " 421 " not in _raw_answer(server.port,
                                      handshake.format(f"127.0.0.1:{server.port}"))


# -- the browser is not trusted: Origin --------------------------------------------------------


async def _ws_status(url: str, path: str, headers: dict[str, str]) -> int:
    """The HTTP status a WebSocket handshake is refused with (101 if it was accepted)."""
    import websockets

    try:
        async with websockets.connect(url.replace("http", "ws") + path,
                                      additional_headers=headers, open_timeout=10) as ws:
            # Accepted: end the shell the way a user would, and wait for it to go.
            await ws.send('{"type": "input", "data": "exit 0\\n"}')
            with contextlib.suppress(websockets.exceptions.ConnectionClosed):
                async with asyncio.timeout(20):
                    while not isinstance(await ws.recv(), str):
                        pass
            return 101
    except websockets.exceptions.InvalidStatus as exc:
        return int(exc.response.status_code)
    except websockets.exceptions.ConnectionClosed as exc:
        return exc.rcvd.code if exc.rcvd else 0


def test_a_cross_site_origin_cannot_change_anything(server: _Server) -> None:
    port = server.port
    with httpx.Client(base_url=server.url, timeout=60) as client:
        before = {s["id"] for s in client.get("/v1/sandboxes").json()}
        for origin in ("http://evil.example", f"http://evil.example:{port}", "null",
                       "http://localhost:1", f"http://127.0.0.1.nip.io:{port}", "file://",
                       f"http://127.0.0.1:{port}.evil.example"):
            for method, path in [("POST", "/v1/sandboxes"),
                                 ("DELETE", "/v1/sandboxes/sbx_000000000000"),
                                 ("PUT", "/v1/sandboxes/sbx_000000000000/network"),
                                 ("POST", "/v1/sandboxes/sbx_000000000000/commands")]:
                response = client.request(method, path, json={}, headers={"origin": origin})
                assert response.status_code == 403, (origin, method, path, response.text)
                body = response.json()
                assert body["error"] == "origin_refused" and "Origin" in body["message"]
        assert {s["id"] for s in client.get("/v1/sandboxes").json()} == before
        # Reading is not state-changing (and a cross-site page cannot read the answer anyway).
        assert client.get("/v1/sandboxes", headers={"origin": "http://evil.example"}
                          ).status_code == 200
        # The service's own pages may; non-browser clients send no Origin at all.
        created = client.post("/v1/sandboxes", json={},
                              headers={"origin": f"http://127.0.0.1:{port}"})
        assert created.status_code == 201, created.text
        sandbox_id = created.json()["id"]
        assert client.delete(f"/v1/sandboxes/{sandbox_id}",
                             headers={"origin": f"http://localhost:{port}"}).status_code == 204


def test_a_cross_site_websocket_is_refused_before_accept(server: _Server) -> None:
    with Sandbox.create(url=server.url) as sb:
        path = f"/v1/sandboxes/{sb.id}/pty"
        for origin in ("http://evil.example", "null", "http://localhost:1"):
            status = asyncio.run(_ws_status(server.url, path, {"Origin": origin}))
            assert status in (403, 4403), (origin, status)
        # No terminal ran: nothing was started in the sandbox.
        started = sb.audit.events(types=["command.started"])
        assert started == [], started
        same_site = asyncio.run(_ws_status(server.url, path,
                                           {"Origin": f"http://127.0.0.1:{server.port}"}))
        assert same_site == 101


# -- revoking the last key ---------------------------------------------------------------------


def test_revoking_the_last_key_leaves_the_service_refusing() -> None:
    settings = _own_settings("corral-test-edge-keys-")
    try:
        with _corral_serve(settings) as served:
            assert httpx.get(f"{served.url}/v1/sandboxes").status_code == 200  # never had keys
            store = Store(settings.home / "corral.db")
            directory = TenantDirectory(store)
            directory.add_tenant("gamma")
            key_id, key = directory.create_key("gamma")
            assert httpx.get(f"{served.url}/v1/sandboxes").status_code == 401
            assert store.revoke_key(key_id) and store.live_key_count() == 0
            store.close()
            refused = httpx.get(f"{served.url}/v1/sandboxes")
            assert refused.status_code == 401, refused.text
            assert "--allow-keyless" in refused.json()["message"]
            assert httpx.get(f"{served.url}/v1/sandboxes",
                             headers={"authorization": f"Bearer {key}"}).status_code == 401
        with _corral_serve(settings) as served:  # the store remembers across restarts
            assert httpx.get(f"{served.url}/v1/sandboxes").status_code == 401
        with _corral_serve(settings, "--allow-keyless", "--host-name", "corral.test:80",
                           "--host-name", "corral2.test") as served:
            assert httpx.get(f"{served.url}/v1/sandboxes").status_code == 200
            for host, status in [("corral.test:80", 200), ("corral.test", 421),
                                 (f"corral2.test:{served.port}", 200), ("corral3.test", 421)]:
                assert httpx.get(f"{served.url}/healthz", headers={"host": host}
                                 ).status_code == status, host
            assert httpx.get(f"{served.url}/v1/sandboxes",
                             headers={"authorization": f"Bearer {key}"}).status_code == 401
    finally:
        with managed(settings):
            pass
        shutil.rmtree(settings.home, ignore_errors=True)


def test_serve_help_says_why_keyless_is_dangerous() -> None:
    out = subprocess.run([sys.executable, "-m", "corral", "serve", "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "--allow-keyless" in out and "Dangerous" in out and "--host-name" in out


def test_service_names_match_host_and_port_exactly() -> None:
    from corral._http.guard import ServiceNames

    names = ServiceNames.of("127.0.0.1", ["corral.test", "proxy.test:8443", " "])
    own = 8080
    for authority, allowed in [
        ("127.0.0.1", True), ("127.0.0.1:8080", True), ("127.0.0.1:8081", False),
        ("LocalHost:8080", True), ("[::1]:8080", True), ("[::1]", True), ("::1", False),
        ("corral.test", True), ("corral.test:8080", True), ("corral.test:443", False),
        ("proxy.test:8443", True), ("proxy.test", False), ("proxy.test:8080", False),
        ("127.0.0.1:", False), ("127.0.0.1:99999", False), ("[::1]x", False), ("", False),
        ("user@127.0.0.1", False), ("127.0.0.1:8080@evil.test", False),
    ]:
        assert names.allows(authority, own) is allowed, authority
    with pytest.raises(ValueError, match="not a host name"):
        ServiceNames.of("127.0.0.1", ["https://corral.test"])
    assert ServiceNames.of("::1").names[0] == "[::1]"
