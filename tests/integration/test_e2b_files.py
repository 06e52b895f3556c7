"""envd's ``/files`` and ``filesystem.Filesystem`` on the E2B surface, driven in-process with the
exact request shapes the E2B SDKs send (E2B-COMPAT §5, §6.4), against real sandboxes: statuses,
field names, bytes, signed URLs, watches of changes made by commands inside, and the audit
trail. Each test drives its coroutine with ``asyncio.run`` (no pytest plugin)."""

from __future__ import annotations

import asyncio
import gzip
import json
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from corral._control.manager import Manager
from corral._e2b.app import E2BApp, create_e2b_app
from corral._e2b.connect import envelope
from corral._e2b.files import signature
from corral._ids import to_e2b
from corral.models import SandboxInfo

pytestmark = pytest.mark.needs_root

BASE = "http://127.0.0.1"


@pytest.fixture(scope="module")
def app(manager: Manager) -> E2BApp:
    return create_e2b_app(manager)


@pytest.fixture
def sandbox(manager: Manager) -> Iterator[SandboxInfo]:
    info = manager.create()
    yield info
    manager.destroy(info.id)


def _headers(app: E2BApp, info: SandboxInfo, *, token: bool = True) -> dict[str, str]:
    headers = {"E2b-Sandbox-Id": to_e2b(info.id), "E2b-Sandbox-Port": "49983"}
    if token:
        headers["X-Access-Token"] = app.tokens.envd(info.id)
    return headers


def _client(app: E2BApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE)


def _multipart(*files: tuple[str, bytes]) -> tuple[bytes, str]:
    boundary = "e2bboundary7MA4YWxkTrZu0gW"
    body = b""
    for path, data in files:
        body += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                 f"filename=\"{path}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
                 ).encode() + data + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


async def _rpc(client: httpx.AsyncClient, headers: dict[str, str], method: str,
               body: dict[str, Any]) -> httpx.Response:
    return await client.post(f"/filesystem.Filesystem/{method}", headers={
        **headers, "Content-Type": "application/json", "Connect-Protocol-Version": "1"},
        content=json.dumps(body))


def _frames(data: bytes) -> list[tuple[int, dict[str, Any]]]:
    frames = []
    while data:
        flags, length = struct.unpack(">BI", data[:5])
        frames.append((flags, json.loads(data[5:5 + length])))
        data = data[5 + length:]
    return frames


def _audit(manager: Manager, sandbox_id: str) -> list[dict[str, Any]]:
    path = manager.settings.home / "audit" / f"{sandbox_id}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- /files --------------------------------------------------------------------------------------


def test_write_and_read_text_and_binary_with_their_audit_events(
        app: E2BApp, manager: Manager, sandbox: SandboxInfo) -> None:
    binary = bytes(range(256)) * 300

    async def scenario() -> None:
        async with _client(app) as client:
            h = _headers(app, sandbox)
            body, ctype = _multipart(("/home/user/notes/a.txt", "héllo\n".encode()))
            r = await client.post("/files", params={"path": "/home/user/notes/a.txt"},
                                  headers={**h, "Content-Type": ctype}, content=body)
            assert r.status_code == 200, r.text
            assert r.json() == [{"path": "/home/user/notes/a.txt", "name": "a.txt",
                                 "type": "file"}]
            # octet-stream (envd >= 0.5.7), relative path from /home/user, chunked body
            async def chunks() -> Any:
                for i in range(0, len(binary), 10_000):
                    yield binary[i:i + 10_000]

            r = await client.post("/files", params={"path": "data.bin"}, headers={
                **h, "Content-Type": "application/octet-stream"}, content=chunks())
            assert r.status_code == 200, r.text
            assert r.json() == [{"path": "/home/user/data.bin", "name": "data.bin",
                                 "type": "file"}]
            r = await client.get("/files", params={"path": "/home/user/notes/a.txt"}, headers=h)
            assert r.status_code == 200 and r.content == "héllo\n".encode()
            assert r.headers["content-type"] == "application/octet-stream"
            r = await client.get("/files", params={"path": "data.bin", "username": "user"},
                                 headers=h)
            assert r.status_code == 200 and r.content == binary

    asyncio.run(scenario())
    # Commands see the same files under /home/user and /workspace.
    assert manager.run(sandbox.id, "cat /home/user/notes/a.txt").stdout == "héllo\n"
    events = _audit(manager, sandbox.id)
    writes = {e["data"]["path"]: e["data"] for e in events if e["type"] == "file.write"}
    assert writes["/workspace/data.bin"]["size"] == len(binary)
    import hashlib
    assert writes["/workspace/data.bin"]["sha256"] == hashlib.sha256(binary).hexdigest()
    reads = [e["data"]["path"] for e in events if e["type"] == "file.read"]
    assert "/workspace/notes/a.txt" in reads and "/workspace/data.bin" in reads


def test_gzip_both_ways_and_an_unsupported_encoding(app: E2BApp, sandbox: SandboxInfo) -> None:
    data = b"compress me " * 5000

    async def scenario() -> None:
        async with _client(app) as client:
            h = _headers(app, sandbox)
            r = await client.post("/files", params={"path": "/home/user/z.txt"}, headers={
                **h, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
                content=gzip.compress(data))
            assert r.status_code == 200, r.text
            r = await client.get("/files", params={"path": "/home/user/z.txt"},
                                 headers={**h, "Accept-Encoding": "gzip"})
            assert r.status_code == 200 and r.headers["content-encoding"] == "gzip"
            assert r.content == data  # httpx undid the gzip
            assert int(r.headers["content-length"]) < len(data) // 10
            r = await client.get("/files", params={"path": "/home/user/z.txt"},
                                 headers={**h, "Accept-Encoding": "br, identity;q=0"})
            assert r.status_code == 406
            assert r.json() == {"message": "no acceptable encoding found, supported: "
                                "[identity, gzip]", "code": 406}
            r = await client.post("/files", params={"path": "/home/user/bad"}, headers={
                **h, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
                content=b"not gzip at all")
            assert r.status_code == 400 and r.json()["code"] == 400

    asyncio.run(scenario())


def test_multi_file_write_one_part_per_file(app: E2BApp, manager: Manager,
                                            sandbox: SandboxInfo) -> None:
    async def scenario() -> None:
        async with _client(app) as client:
            body, ctype = _multipart(("/home/user/m/one.txt", b"1"), ("m/sub/two.txt", b"22"))
            r = await client.post("/files", headers={**_headers(app, sandbox),
                                                     "Content-Type": ctype}, content=body)
            assert r.status_code == 200, r.text
            assert r.json() == [
                {"path": "/home/user/m/one.txt", "name": "one.txt", "type": "file"},
                {"path": "/home/user/m/sub/two.txt", "name": "two.txt", "type": "file"}]

    asyncio.run(scenario())
    files = manager.files(sandbox.id)
    assert files.read("/workspace/m/one.txt") == b"1"
    assert files.read("/workspace/m/sub/two.txt") == b"22"


def test_file_errors_are_e2b_shaped(app: E2BApp, manager: Manager,
                                    sandbox: SandboxInfo) -> None:
    manager.files(sandbox.id).make_dir("/workspace/docs")

    async def scenario() -> None:
        async with _client(app) as client:
            h = _headers(app, sandbox)
            r = await client.get("/files", params={"path": "/home/user/nope.txt"}, headers=h)
            assert r.status_code == 404
            assert r.json() == {"message": "/home/user/nope.txt does not exist", "code": 404}
            r = await client.get("/files", params={"path": "/home/user/docs"}, headers=h)
            assert r.status_code == 400 and "directory" in r.json()["message"]
            r = await client.get("/files", params={"path": "/etc/passwd"}, headers=h)
            assert r.status_code == 403 and "/home/user" in r.json()["message"]
            r = await client.post("/files", params={"path": "../../etc/x"}, headers={
                **h, "Content-Type": "application/octet-stream"}, content=b"x")
            assert r.status_code == 403
            r = await client.get("/files", params={"path": "/home/user/docs",
                                                    "username": "root"}, headers=h)
            assert r.status_code == 401 and "no root user" in r.json()["message"]
            r = await client.get("/files", params={"username": "user"}, headers=h)
            assert r.status_code == 400 and "path" in r.json()["message"]

    asyncio.run(scenario())
    refused = [e for e in _audit(manager, sandbox.id) if e["type"] == "file.refused"]
    assert refused == [] or all(e["data"]["op"] in ("read", "write") for e in refused)


def test_signed_urls_good_bad_expired_and_wrong_operation(
        app: E2BApp, manager: Manager, sandbox: SandboxInfo) -> None:
    token = app.tokens.envd(sandbox.id)
    path = "/home/user/signed.txt"
    manager.files(sandbox.id).write("/workspace/signed.txt", b"signed content")
    exp = int(time.time()) + 60

    async def scenario() -> None:
        async with _client(app) as client:
            h = _headers(app, sandbox, token=False)
            good = {"path": path, "signature": signature(path, "read", None, token, exp),
                    "signature_expiration": str(exp)}
            r = await client.get("/files", params=good, headers=h)
            assert r.status_code == 200 and r.content == b"signed content"
            # URL mode, P3: no sandbox header at all; the signature finds the sandbox.
            r = await client.get("/files", params=good)
            assert r.status_code == 200 and r.content == b"signed content"
            r = await client.get("/files", params={**good, "signature": "v1_" + "A" * 43},
                                 headers=h)
            assert r.status_code == 401 and r.json()["code"] == 401
            old = int(time.time()) - 5
            r = await client.get("/files", params={
                "path": path, "signature": signature(path, "read", None, token, old),
                "signature_expiration": str(old)}, headers=h)
            assert r.status_code == 401 and "expired" in r.json()["message"]
            write_sig = signature(path, "write", None, token, exp)
            r = await client.get("/files", params={**good, "signature": write_sig}, headers=h)
            assert r.status_code == 401
            r = await client.get("/files", params={"path": path}, headers=h)  # no signature
            assert r.status_code == 401
            # A signed upload (no expiration, user named) writes.
            up = {"path": path, "username": "user",
                  "signature": signature(path, "write", "user", token, None)}
            body, ctype = _multipart((path, b"uploaded"))
            r = await client.post("/files", params=up, headers={**h, "Content-Type": ctype},
                                  content=body)
            assert r.status_code == 200, r.text
            r = await client.post("/files", params={**up, "signature": good["signature"]},
                                  headers={**h, "Content-Type": ctype}, content=body)
            assert r.status_code == 401

    asyncio.run(scenario())
    assert manager.files(sandbox.id).read("/workspace/signed.txt") == b"uploaded"


# -- filesystem.Filesystem -----------------------------------------------------------------------


def test_filesystem_rpcs(app: E2BApp, manager: Manager, sandbox: SandboxInfo) -> None:
    files = manager.files(sandbox.id)
    files.write("/workspace/d/a.txt", b"123")
    files.write("/workspace/d/sub/b.txt", b"4567")
    manager.run(sandbox.id, "ln -s a.txt /workspace/d/link")

    async def scenario() -> None:
        async with _client(app) as client:
            h = _headers(app, sandbox)
            r = await _rpc(client, h, "Stat", {"path": "/home/user/d/a.txt"})
            assert r.status_code == 200, r.text
            entry = r.json()["entry"]
            assert {k: entry[k] for k in ("name", "type", "path", "size", "mode",
                                           "permissions", "owner", "group", "isSymlink")} == {
                "name": "a.txt", "type": "FILE_TYPE_FILE", "path": "/home/user/d/a.txt",
                "size": "3", "mode": 0o644, "permissions": "-rw-r--r--", "owner": "user",
                "group": "user", "isSymlink": False}
            assert entry["modifiedTime"].endswith("Z") and "T" in entry["modifiedTime"]
            r = await _rpc(client, h, "Stat", {"path": "/home/user/missing"})
            assert r.status_code == 404 and r.json()["code"] == "not_found"
            r = await _rpc(client, h, "ListDir", {"path": "d", "depth": 1})
            names = {e["name"]: e for e in r.json()["entries"]}
            assert set(names) == {"a.txt", "sub", "link"}
            assert names["sub"]["type"] == "FILE_TYPE_DIRECTORY"
            assert names["link"]["type"] == "FILE_TYPE_SYMLINK"
            assert names["link"]["isSymlink"] and names["link"]["symlinkTarget"] == "a.txt"
            r = await _rpc(client, h, "ListDir", {"path": "/home/user/d", "depth": 2})
            paths = {e["path"] for e in r.json()["entries"]}
            assert "/home/user/d/sub/b.txt" in paths and len(paths) == 4
            r = await _rpc(client, h, "MakeDir", {"path": "/home/user/new/deep"})
            assert r.status_code == 200 and r.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
            r = await _rpc(client, h, "MakeDir", {"path": "/home/user/new/deep"})
            assert r.status_code == 409 and r.json()["code"] == "already_exists"
            r = await _rpc(client, h, "MakeDir", {"path": "/home/user/d/a.txt"})
            assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
            r = await _rpc(client, h, "Move", {"source": "/home/user/d/a.txt",
                                                "destination": "/home/user/d/renamed.txt"})
            assert r.status_code == 200 and r.json()["entry"]["path"] == \
                "/home/user/d/renamed.txt"
            r = await _rpc(client, h, "Move", {"source": "/home/user/gone",
                                                "destination": "/home/user/x"})
            assert r.status_code == 404 and r.json()["code"] == "not_found"
            r = await _rpc(client, h, "Remove", {"path": "/home/user/d/sub"})
            assert r.status_code == 200 and r.json() == {}
            r = await _rpc(client, h, "Remove", {"path": "/home/user/never-was"})
            assert r.status_code == 200 and r.json() == {}
            r = await _rpc(client, h, "Stat", {"path": "/etc"})
            assert r.status_code == 403 and r.json()["code"] == "permission_denied"
            r = await _rpc(client, {**h, "Authorization": "Basic cm9vdDo="}, "Stat",
                           {"path": "/home/user"})
            assert r.status_code == 401 and "no root user" in r.json()["message"]

    asyncio.run(scenario())
    assert not files.exists("/workspace/d/sub")
    events = [e["type"] for e in _audit(manager, sandbox.id)]
    assert "file.rename" in events and "file.remove" in events and "file.mkdir" in events


# -- watching ------------------------------------------------------------------------------------


@pytest.fixture
def tier_sandbox(manager: Manager, isolation: str) -> Iterator[SandboxInfo]:
    info = manager.create(isolation=isolation)
    yield info
    manager.destroy(info.id)


_CHANGES = ("mkdir -p /home/user/w && cd /home/user/w && echo one > f.txt && "
            "echo two >> f.txt && mv f.txt g.txt && rm g.txt && mkdir sub && echo x > sub/y")


def _ops(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["name"], e["type"].removeprefix("EVENT_TYPE_")) for e in events]


def test_watch_dir_streams_what_a_command_does(app: E2BApp, manager: Manager,
                                               tier_sandbox: SandboxInfo) -> None:
    manager.files(tier_sandbox.id).make_dir("/workspace/w")

    async def scenario() -> list[tuple[int, dict[str, Any]]]:
        async with _client(app) as client:
            h = {**_headers(app, tier_sandbox), "Content-Type": "application/connect+json",
                 "Connect-Protocol-Version": "1", "Keepalive-Ping-Interval": "1",
                 "Connect-Timeout-Ms": "4000"}
            stream = asyncio.ensure_future(client.post(
                "/filesystem.Filesystem/WatchDir", headers=h,
                content=envelope({"path": "/home/user/w", "recursive": True})))
            await asyncio.sleep(0.5)
            await asyncio.to_thread(manager.run, tier_sandbox.id, _CHANGES)
            r = await stream
            assert r.status_code == 200
            assert r.headers["content-type"] == "application/connect+json"
            return _frames(r.content)

    frames = asyncio.run(scenario())
    assert frames[0] == (0, {"start": {}})
    assert frames[-1] == (2, {})
    events = [m["filesystem"] for flags, m in frames[1:-1] if "filesystem" in m]
    assert {"keepalive": {}} in [m for _, m in frames]
    ops = _ops(events)
    for expected in [("f.txt", "CREATE"), ("f.txt", "WRITE"), ("f.txt", "RENAME"),
                     ("g.txt", "CREATE"), ("g.txt", "REMOVE"), ("sub", "CREATE"),
                     ("sub/y", "CREATE")]:
        assert expected in ops, (expected, ops)
    assert ops.index(("f.txt", "CREATE")) < ops.index(("g.txt", "REMOVE"))


def test_watch_dir_refuses_a_missing_dir_and_a_file(app: E2BApp, manager: Manager,
                                                    sandbox: SandboxInfo) -> None:
    manager.files(sandbox.id).write("/workspace/plain.txt", b"x")
    manager.run(sandbox.id, "ln -s /etc /workspace/etc-link && ln -s . /workspace/self")

    async def scenario() -> None:
        async with _client(app) as client:
            h = {**_headers(app, sandbox), "Content-Type": "application/connect+json"}
            r = await client.post("/filesystem.Filesystem/WatchDir", headers=h,
                                  content=envelope({"path": "/home/user/nope"}))
            assert r.status_code == 404 and r.json()["code"] == "not_found"
            r = await client.post("/filesystem.Filesystem/WatchDir", headers=h,
                                  content=envelope({"path": "/home/user/plain.txt"}))
            assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
            r = await _rpc(client, _headers(app, sandbox), "CreateWatcher",
                           {"path": "/home/user/nope"})
            assert r.status_code == 404 and r.json()["code"] == "not_found"
            # A link never carries a watch: not out of the workspace, not even inside it.
            for link in ("/home/user/etc-link", "/home/user/self"):
                r = await client.post("/filesystem.Filesystem/WatchDir", headers=h,
                                      content=envelope({"path": link}))
                assert r.status_code in (400, 403), r.text
                assert r.json()["code"] in ("permission_denied", "invalid_argument")

    asyncio.run(scenario())


def test_polling_watcher_collects_events_between_polls(app: E2BApp, manager: Manager,
                                                       tier_sandbox: SandboxInfo) -> None:
    manager.files(tier_sandbox.id).make_dir("/workspace/w")

    async def scenario() -> None:
        async with _client(app) as client:
            h = _headers(app, tier_sandbox)
            r = await _rpc(client, h, "CreateWatcher", {"path": "/home/user/w",
                                                        "recursive": False})
            assert r.status_code == 200, r.text
            watcher = r.json()["watcherId"]
            await asyncio.to_thread(manager.run, tier_sandbox.id,
                                    "cd /home/user/w && echo a > new.txt && rm new.txt")
            # The SDK's own write goes through /files: reported as create + write.
            r = await client.post("/files", params={"path": "/home/user/w/api.txt"},
                                  headers={**h, "Content-Type": "application/octet-stream"},
                                  content=b"via api")
            assert r.status_code == 200
            await asyncio.sleep(0.2)
            r = await _rpc(client, h, "GetWatcherEvents", {"watcherId": watcher})
            ops = _ops(r.json()["events"])
            assert ("new.txt", "CREATE") in ops and ("new.txt", "REMOVE") in ops, ops
            assert ("api.txt", "CREATE") in ops and ("api.txt", "WRITE") in ops, ops
            assert not any(name.startswith(".corral-tmp") for name, _ in ops)
            r = await _rpc(client, h, "GetWatcherEvents", {"watcherId": watcher})
            assert r.json() == {"events": []}
            # Another sandbox's token and id cannot see this watcher.
            other = manager.create()
            try:
                r = await _rpc(client, _headers(app, other), "GetWatcherEvents",
                               {"watcherId": watcher})
                assert r.status_code == 404 and r.json()["code"] == "not_found"
            finally:
                await asyncio.to_thread(manager.destroy, other.id)
            r = await _rpc(client, h, "RemoveWatcher", {"watcherId": watcher})
            assert r.status_code == 200 and r.json() == {}
            r = await _rpc(client, h, "GetWatcherEvents", {"watcherId": watcher})
            assert r.status_code == 404 and r.json()["code"] == "not_found"

    asyncio.run(scenario())
