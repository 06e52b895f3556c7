"""envd's process.Process service on the wire, as the E2B SDKs speak it (E2B-COMPAT §6, §7,
§9): Connect-JSON envelopes over real HTTP/1.1 (the E2B app under uvicorn on loopback, so
streams stream), against real sandboxes. No SDK here: the requests are the SDKs' exact shapes,
and the framing is checked byte for byte where the SDKs depend on it."""

from __future__ import annotations

import base64
import json
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from corral import _ids as ids
from corral import read_audit
from corral._control.manager import Manager
from corral._control.tenants import TenantDirectory
from corral._e2b.app import create_e2b_app
from corral._e2b.target import ENVD_PORT

from .servers import Server

pytestmark = pytest.mark.needs_root

STREAM = "application/connect+json"
KEEPALIVE_FRAME = b"\x00\x00\x00\x00\x1a" + b'{"event":{"keepalive":{}}}'
END_STREAM_OK = b"\x02\x00\x00\x00\x02{}"


class _Envd(Server):
    """The E2B app (``corral serve --e2b-port``'s) under uvicorn in a thread, on loopback."""

    def __init__(self, manager: Manager) -> None:
        self.app = create_e2b_app(manager)
        super().__init__(manager, self.app)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.app.e2b.close()


@pytest.fixture(scope="module")
def envd(manager: Manager) -> Iterator[_Envd]:
    with _Envd(manager) as server:
        yield server


@pytest.fixture
def sbx(manager: Manager, isolation: str) -> Iterator[str]:
    """A sandbox of each tier in turn: /home/user, PTYs and kills are each tier's own."""
    info = manager.create(timeout=300, isolation=isolation)
    yield info.id
    try:
        manager.destroy(info.id)
    except Exception:
        pass  # the test destroyed it


@pytest.fixture
def client(envd: _Envd, sbx: str) -> Iterator[httpx.Client]:
    headers = {"E2b-Sandbox-Id": ids.to_e2b(sbx), "E2b-Sandbox-Port": str(ENVD_PORT),
               "X-Access-Token": envd.app.tokens.envd(sbx), "connect-protocol-version": "1"}
    with httpx.Client(base_url=envd.url, headers=headers, timeout=30) as c:
        yield c


# -- wire helpers -------------------------------------------------------------------------------


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    # The SDK's own spacing (json.dumps defaults): servers must not care.
    payload = json.dumps(message).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


def frames(data: bytes) -> list[tuple[int, bytes]]:
    out = []
    while data:
        flags, length = struct.unpack(">BI", data[:5])
        out.append((flags, data[5:5 + length]))
        assert len(data) >= 5 + length, "a truncated envelope"
        data = data[5 + length:]
    return out


def events(data: bytes) -> list[dict[str, Any]]:
    """The messages of a finished stream; checks the end-stream frame is last and clean."""
    parsed = frames(data)
    assert parsed[-1] == (2, b"{}"), parsed[-1]
    assert all(flags == 0 for flags, _ in parsed[:-1])
    return [json.loads(payload)["event"] for _, payload in parsed[:-1]]


def start(client: httpx.Client, cmd: str, *, stdin: bool | None = False,
          headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}}
    if stdin is not None:
        body["stdin"] = stdin
    body.update(extra)
    return client.post("/process.Process/Start", content=envelope(body),
                       headers={"content-type": STREAM, "connect-accept-encoding": "identity",
                                "Keepalive-Ping-Interval": "50", **(headers or {})})


def unary(client: httpx.Client, method: str, body: dict[str, Any]) -> httpx.Response:
    return client.post(f"/process.Process/{method}", json=body)


def output(evts: list[dict[str, Any]], kind: str = "stdout") -> bytes:
    return b"".join(base64.b64decode(e["data"][kind]) for e in evts
                    if "data" in e and kind in e["data"])


class Stream:
    """A Start/Connect stream read as it arrives (a thread collects the frames)."""

    def __init__(self, client: httpx.Client, method: str, body: dict[str, Any],
                 headers: dict[str, str] | None = None) -> None:
        self._cm = client.stream("POST", f"/process.Process/{method}", content=envelope(body),
                                 headers={"content-type": STREAM, **(headers or {})})
        self.response = self._cm.__enter__()
        assert self.response.status_code == 200, self.response.read()
        self.raw = bytearray()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for chunk in self.response.iter_raw():
                self.raw += chunk
        except httpx.HTTPError:
            pass
        finally:
            self.done.set()

    def events(self) -> list[dict[str, Any]]:
        complete, data = [], bytes(self.raw)
        while len(data) >= 5:
            flags, length = struct.unpack(">BI", data[:5])
            if len(data) < 5 + length:
                break
            if flags == 0:
                complete.append(json.loads(data[5:5 + length])["event"])
            data = data[5 + length:]
        return complete

    def wait_for(self, predicate: Any, timeout: float = 20) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            evts = self.events()
            if predicate(evts):
                return evts
            time.sleep(0.02)
        raise AssertionError(f"not seen in {timeout} s: {self.events()}")

    def finish(self, timeout: float = 20) -> bytes:
        assert self.done.wait(timeout), f"the stream did not end: {self.events()}"
        return bytes(self.raw)

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


# -- Start ----------------------------------------------------------------------------------------


def test_start_streams_start_data_end_and_the_end_stream_frame(client: httpx.Client) -> None:
    response = start(client, "echo hi; echo warn >&2")
    assert response.status_code == 200
    assert response.headers["content-type"] == STREAM
    parsed = frames(response.content)
    first = json.loads(parsed[0][1])
    pid = first["event"]["start"]["pid"]
    assert isinstance(pid, int) and 0 < pid < 2**32
    # The exact bytes: flags 0, a big-endian length, compact JSON.
    assert response.content.startswith(envelope_compact({"event": {"start": {"pid": pid}}}))
    assert response.content.endswith(END_STREAM_OK)
    evts = events(response.content)
    assert output(evts) == b"hi\n" and output(evts, "stderr") == b"warn\n"
    ends = [e for e in evts if "end" in e]
    assert ends == [{"end": {"exitCode": 0, "exited": True, "status": "exit status 0"}}]
    assert "end" in evts[-1]


def test_output_is_byte_exact(client: httpx.Client) -> None:
    every_byte = bytes(range(256))
    script = "".join(f"\\x{b:02x}" for b in every_byte)
    response = start(client, f"printf '{script}'")
    assert response.status_code == 200
    assert output(events(response.content)) == every_byte


def envelope_compact(message: dict[str, Any]) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", 0, len(payload)) + payload


def test_the_sdks_observed_request_bytes_work(client: httpx.Client) -> None:
    # E2B-COMPAT §9: Python e2b 2.63's chunked Start of `echo hi`, its payload byte for byte
    # (the note's length byte, 0x4a, does not match that payload's 82 bytes: 0x52 here).
    payload = (b'{"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"]}, '
               b'"stdin": false}')
    body = b"\x00\x00\x00\x00\x52" + payload
    assert len(payload) == 0x52

    def chunked() -> Iterator[bytes]:
        yield body[:3]
        yield body[3:]

    response = client.post("/process.Process/Start", content=chunked(),
                           headers={"content-type": STREAM})
    evts = events(response.content)
    assert "start" in evts[0] and output(evts) == b"hi\n"
    assert evts[-1]["end"]["exitCode"] == 0


def test_exit_code_and_a_signal_kill_are_told_apart(client: httpx.Client) -> None:
    evts = events(start(client, "exit 3").content)
    assert evts[-1] == {"end": {"exitCode": 3, "exited": True, "status": "exit status 3"}}
    # A command's own 137 is an exit, not a kill.
    evts = events(start(client, "exit 137").content)
    assert evts[-1] == {"end": {"exitCode": 137, "exited": True, "status": "exit status 137"}}

    stream = Stream(client, "Start", {"process": {"cmd": "/bin/bash",
                                                  "args": ["-l", "-c", "sleep 60"]}})
    try:
        pid = stream.wait_for(lambda e: bool(e))[0]["start"]["pid"]
        reply = unary(client, "SendSignal", {"process": {"pid": pid},
                                             "signal": "SIGNAL_SIGKILL"})
        assert reply.status_code == 200 and reply.json() == {}
        evts = events(stream.finish())
    finally:
        stream.close()
    assert [e for e in evts if "end" in e] == [
        {"end": {"exitCode": -1, "exited": False, "status": "signal: killed"}}]


def test_keepalives_flow_while_a_command_is_silent(client: httpx.Client) -> None:
    response = start(client, "sleep 2.5; echo late", headers={"Keepalive-Ping-Interval": "1"})
    data = response.content
    assert data.count(KEEPALIVE_FRAME) >= 2
    evts = events(data)
    assert "start" in evts[0] and "end" in evts[-1] and output(evts) == b"late\n"
    assert sum("end" in e for e in evts) == 1


def test_connect_timeout_ms_kills_the_process_at_its_deadline(client: httpx.Client) -> None:
    began = time.monotonic()
    response = start(client, "sleep 30", headers={"connect-timeout-ms": "1000"})
    assert time.monotonic() - began < 10
    # As envd: no end event, the stream ends with deadline_exceeded (older SDKs raise their
    # TimeoutException from it).
    parsed = frames(response.content)
    flags, payload = parsed[-1]
    assert flags == 2
    assert json.loads(payload)["error"]["code"] == "deadline_exceeded"
    assert all("end" not in json.loads(p)["event"] for _, p in parsed[:-1])


def test_cwd_home_user_and_envs(client: httpx.Client, manager: Manager, sbx: str) -> None:
    body: dict[str, Any] = {
        "process": {"cmd": "/bin/bash", "args": ["-l", "-c", 'pwd; echo "$HOME $USER $ANSWER"'],
                    "envs": {"ANSWER": "42"}}, "stdin": False}
    response = client.post("/process.Process/Start", content=envelope(body),
                           headers={"content-type": STREAM})
    assert output(events(response.content)) == b"/home/user\n/home/user user 42\n"
    manager.files(sbx).make_dir("/workspace/sub")
    body = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "pwd; ls .."],
                        "cwd": "/home/user/sub"}, "stdin": False}
    response = client.post("/process.Process/Start", content=envelope(body),
                           headers={"content-type": STREAM})
    assert output(events(response.content)) == b"/home/user/sub\nsub\n"
    body["process"]["cwd"] = "/home/user/nope"
    response = client.post("/process.Process/Start", content=envelope(body),
                           headers={"content-type": STREAM})
    assert response.status_code == 400
    assert response.json() == {"code": "invalid_argument",
                               "message": "cwd '/home/user/nope' does not exist"}


def test_root_is_refused_and_user_is_the_sandbox_user(client: httpx.Client) -> None:
    response = start(client, "id -u", headers={"Authorization": "Basic cm9vdDo="})
    assert response.status_code == 403
    body = response.json()
    assert body["code"] == "permission_denied" and "never runs commands as root" in \
        body["message"]
    evts = events(start(client, "id -un; id -u",
                        headers={"Authorization": "Basic dXNlcjo="}).content)
    assert output(evts).split()[1] != b"0"  # never real root


def test_json_only_application_proto_is_415(client: httpx.Client) -> None:
    for method, kind in (("Start", "application/connect+proto"), ("List", "application/proto")):
        response = client.post(f"/process.Process/{method}", content=b"\x00",
                               headers={"content-type": kind})
        assert response.status_code == 415, method


# -- background processes ---------------------------------------------------------------------


def test_background_cat_survives_disconnect_and_takes_input(
        client: httpx.Client, manager: Manager, sbx: str) -> None:
    body = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "cat"]}, "tag": "pet"}
    # Read on this thread only: a socket closed while another thread reads it is not closed
    # until that read returns, and the server would never see the disconnect.
    with client.stream("POST", "/process.Process/Start", content=envelope(body),
                       headers={"content-type": STREAM}) as response:
        first = next(response.iter_raw())
    # Leaving the block closed the connection: the SDK's disconnect(). The process lives on.
    pid = json.loads(frames(first)[0][1])["event"]["start"]["pid"]
    table_entry = manager.processes.find(sbx, pid=pid)
    deadline = time.monotonic() + 10
    while table_entry._watchers and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not table_entry._watchers, "the server kept following a stream nobody reads"
    assert table_entry.state == "running"

    listed = unary(client, "List", {}).json()["processes"]
    mine = [p for p in listed if p["pid"] == pid]
    assert mine and mine[0]["tag"] == "pet"
    assert mine[0]["config"]["cmd"] == "/bin/bash"
    assert mine[0]["config"]["args"] == ["-l", "-c", "cat"]

    follower = Stream(client, "Connect", {"process": {"tag": "pet"}})
    try:
        assert follower.wait_for(lambda e: bool(e))[0] == {"start": {"pid": pid}}
        reply = unary(client, "SendInput", {"process": {"pid": pid},
                                            "input": {"stdin": _b64(b"hello\n")}})
        assert reply.status_code == 200 and reply.json() == {}
        follower.wait_for(lambda e: output(e) == b"hello\n")

        # StreamInput: a chunked body of envelopes, ended by the end of the body.
        def body() -> Iterator[bytes]:
            yield envelope({"start": {"process": {"pid": pid}}})
            yield envelope({"data": {"input": {"stdin": _b64(b"more ")}}})
            yield envelope({"keepalive": {}})
            yield envelope({"data": {"input": {"stdin": _b64(b"input\n")}}})

        reply = client.post("/process.Process/StreamInput", content=body(),
                            headers={"content-type": STREAM})
        assert reply.status_code == 200 and reply.content == envelope_compact({}) + \
            END_STREAM_OK
        follower.wait_for(lambda e: output(e) == b"hello\nmore input\n")

        assert unary(client, "CloseStdin", {"process": {"pid": pid}}).json() == {}
        evts = events(follower.finish())
    finally:
        follower.close()
    assert evts[-1] == {"end": {"exitCode": 0, "exited": True, "status": "exit status 0"}}
    assert pid not in [p["pid"] for p in unary(client, "List", {}).json()["processes"]]

    # Connect to an exited process: start, then its retained end.
    late = client.post("/process.Process/Connect", content=envelope({"process": {"pid": pid}}),
                       headers={"content-type": STREAM})
    assert events(late.content) == [{"start": {"pid": pid}}, evts[-1]]


def test_unknown_pids_are_not_found(client: httpx.Client) -> None:
    for method, body in (
            ("SendSignal", {"process": {"pid": 4_000_000_000}, "signal": "SIGNAL_SIGKILL"}),
            ("SendInput", {"process": {"pid": 4_000_000_000}, "input": {"stdin": "eA=="}}),
            ("CloseStdin", {"process": {"pid": 4_000_000_000}})):
        response = unary(client, method, body)
        assert response.status_code == 404, method
        assert response.json()["code"] == "not_found"
    response = client.post("/process.Process/Connect",
                           content=envelope({"process": {"pid": 4_000_000_000}}),
                           headers={"content-type": STREAM})
    assert response.status_code == 404 and response.json()["code"] == "not_found"


def test_pids_are_small_and_distinct_per_sandbox(client: httpx.Client) -> None:
    pids = [events(start(client, "true").content)[0]["start"]["pid"] for _ in range(3)]
    assert len(set(pids)) == 3 and all(0 < p < 1000 for p in pids)


def test_a_sandbox_gone_mid_stream_ends_unavailable(client: httpx.Client, manager: Manager,
                                                    sbx: str) -> None:
    stream = Stream(client, "Start", {"process": {"cmd": "/bin/bash",
                                                  "args": ["-l", "-c", "sleep 60"]}})
    try:
        stream.wait_for(lambda e: bool(e))
        manager.destroy(sbx)
        parsed = frames(stream.finish())
    finally:
        stream.close()
    flags, payload = parsed[-1]
    error = json.loads(payload)["error"]
    assert flags == 2 and error["code"] == "unavailable" and "was not found" in error["message"]
    assert not any("end" in json.loads(p).get("event", {}) for f, p in parsed if f == 0)


def test_starts_are_audited_as_commands_with_the_e2b_context(
        client: httpx.Client, home: str, sbx: str) -> None:
    events(start(client, "echo audited").content)
    trail = read_audit(sbx, home=home, types=["command.started"])
    started = [e for e in trail.events if e.data["argv"] == ["/bin/bash", "-l", "-c",
                                                             "echo audited"]]
    assert len(started) == 1
    assert started[0].data["context"] == {"surface": "e2b"}
    assert started[0].data["cwd"] == "/home/user"


# -- PTY ------------------------------------------------------------------------------------------


def test_pty_echo_resize_and_ctrl_d(client: httpx.Client) -> None:
    body = {"process": {"cmd": "/bin/bash", "args": ["-i", "-l"],
                        "envs": {"TERM": "xterm-256color", "LANG": "C.UTF-8"}},
            "pty": {"size": {"cols": 80, "rows": 24}}}
    stream = Stream(client, "Start", body)
    try:
        pid = stream.wait_for(lambda e: bool(e))[0]["start"]["pid"]

        def send(data: bytes) -> None:
            reply = unary(client, "SendInput", {"process": {"pid": pid},
                                                "input": {"pty": _b64(data)}})
            assert reply.status_code == 200, reply.text

        send(b"PS1='RE''ADY> '; echo hi-$((6*7))\n")  # a prompt to wait for
        stream.wait_for(lambda e: b"hi-42" in output(e, "pty"))
        send(b"stty size\n")
        stream.wait_for(lambda e: b"24 80" in output(e, "pty"))
        reply = unary(client, "Update", {"process": {"pid": pid},
                                         "pty": {"size": {"cols": 100, "rows": 30}}})
        assert reply.status_code == 200 and reply.json() == {}
        send(b"stty size\n")
        stream.wait_for(lambda e: b"READY> " in output(e, "pty").rpartition(b"30 100")[2])
        assert unary(client, "CloseStdin", {"process": {"pid": pid}}).status_code == 400
        # Ctrl-D ends the shell. A terminal may turn it into a NUL byte that bash ignores when
        # it arrives as readline switches the line discipline (seen on a loaded host, with bare
        # bash too, and in gVisor even after the prompt): a few tries, each one Ctrl-D only.
        for _ in range(3):
            send(b"\x04")
            if stream.done.wait(3):
                break
        evts = events(stream.finish())
    finally:
        stream.close()
    assert not any("stdout" in e.get("data", {}) for e in evts)  # a terminal's output is pty
    assert evts[-1]["end"]["exited"] is True


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_another_sandboxs_token_opens_no_process(client: httpx.Client, envd: _Envd,
                                                  manager: Manager) -> None:
    other = manager.create(timeout=60).id
    try:
        response = client.post("/process.Process/List", json={},
                               headers={"X-Access-Token": envd.app.tokens.envd(other)})
    finally:
        manager.destroy(other)
    assert response.status_code == 401 and response.json()["code"] == "unauthenticated"


def test_starts_count_against_the_owners_commands_per_minute(envd: _Envd,
                                                             manager: Manager) -> None:
    tenant = TenantDirectory(manager.store).add_tenant(
        "e2bquota", max_sandboxes=2, tiers=["small"], commands_per_minute=2)
    sandbox_id = manager.create(timeout=60, tenant=tenant.name, caller=tenant).id
    headers = {"E2b-Sandbox-Id": ids.to_e2b(sandbox_id),
               "X-Access-Token": envd.app.tokens.envd(sandbox_id)}
    try:
        with httpx.Client(base_url=envd.url, headers=headers, timeout=30) as owner:
            assert [start(owner, "true").status_code for _ in range(2)] == [200, 200]
            refused = start(owner, "true")
    finally:
        manager.destroy(sandbox_id)
    assert refused.status_code == 429
    assert refused.json()["code"] == "resource_exhausted"
