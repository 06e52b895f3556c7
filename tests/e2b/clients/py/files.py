"""Scenario 3, files, through the official Python SDK (any set from 2.7.0 on; the parts an older
SDK lacks are reported as ``{"error": "Unsupported"}``).

Usage: python files.py
"""

from __future__ import annotations

import io
import urllib.error
import urllib.parse
import urllib.request

from _steps import done, step
from e2b import Sandbox

sb = step("create", lambda: Sandbox.create(timeout=180))
step("id", lambda: sb.sandbox_id)
BLOB = bytes(range(256)) * 8  # every byte value: no text codec may touch it


class Unsupported(Exception):
    """This SDK version has no such API."""


def info(w: object) -> dict[str, object]:
    return {"path": getattr(w, "path", None), "name": getattr(w, "name", None),
            "type": str(getattr(getattr(w, "type", None), "value", getattr(w, "type", None)))}


step("write_text", lambda: info(sb.files.write("/home/user/hello.txt", "hello, files\n")))
step("write_relative", lambda: info(sb.files.write("relative.txt", "relative\n")))
step("write_bytes", lambda: info(sb.files.write("/home/user/blob.bin", BLOB)))
step("write_stream", lambda: info(sb.files.write("/home/user/stream.bin", io.BytesIO(BLOB))))


def write_gzip() -> dict[str, object]:
    try:
        return info(sb.files.write("/home/user/gz.txt", "zipped text\n", gzip=True))
    except TypeError as exc:
        raise Unsupported(str(exc)) from exc


step("write_gzip", write_gzip)
step("write_files", lambda: [info(w) for w in sb.files.write_files([
    {"path": "/home/user/multi/a.txt", "data": "A"},
    {"path": "/home/user/multi/b.txt", "data": "B"}])])
step("read_text", lambda: sb.files.read("/home/user/hello.txt"))
step("read_relative", lambda: sb.files.read("/home/user/relative.txt"))
step("read_bytes", lambda: bytes(sb.files.read("/home/user/blob.bin", format="bytes")) == BLOB)
step("read_stream", lambda: b"".join(sb.files.read("/home/user/stream.bin", format="stream"))
     == BLOB)
step("read_gzip_written", lambda: sb.files.read("/home/user/gz.txt"))


def read_gzip() -> str:
    try:
        return sb.files.read("/home/user/hello.txt", gzip=True)
    except TypeError as exc:
        raise Unsupported(str(exc)) from exc


step("read_gzip", read_gzip)
step("read_multi", lambda: [sb.files.read(f"/home/user/multi/{n}.txt") for n in "ab"])
step("seen_by_commands", lambda: sb.commands.run("cat /home/user/hello.txt /home/user/multi/a.txt"
                                                 " && sha256sum blob.bin").stdout)
step("read_missing", lambda: sb.files.read("/home/user/nope.txt"))
step("read_directory", lambda: sb.files.read("/home/user/multi"))


def listing(depth: int | None) -> list[dict[str, object]]:
    entries = (sb.files.list("/home/user/multi") if depth is None
               else sb.files.list("/home/user", depth=depth))
    return sorted(({"name": e.name, "path": e.path, **info(e)} for e in entries),
                  key=lambda e: str(e["path"]))


step("list", lambda: listing(None))
step("list_depth1", lambda: listing(1))
step("list_depth2", lambda: listing(2))
step("exists_yes", lambda: sb.files.exists("/home/user/hello.txt"))
step("exists_no", lambda: sb.files.exists("/home/user/nope.txt"))


def get_info() -> dict[str, object]:
    e = sb.files.get_info("/home/user/blob.bin")
    return {**info(e), "size": e.size, "permissions": getattr(e, "permissions", None),
            "modified": str(getattr(e, "modified_time", ""))}


step("get_info", get_info)
step("get_info_missing", lambda: sb.files.get_info("/home/user/nope.txt"))
step("make_dir", lambda: sb.files.make_dir("/home/user/newdir/deeper"))
step("make_dir_again", lambda: sb.files.make_dir("/home/user/newdir/deeper"))
step("rename", lambda: info(sb.files.rename("/home/user/hello.txt", "/home/user/renamed.txt")))
step("renamed_read", lambda: sb.files.read("/home/user/renamed.txt"))
step("renamed_old_gone", lambda: sb.files.exists("/home/user/hello.txt"))
step("rename_missing", lambda: sb.files.rename("/home/user/nope.txt", "/home/user/nope2.txt"))
step("remove", lambda: sb.files.remove("/home/user/renamed.txt"))
step("removed_gone", lambda: sb.files.exists("/home/user/renamed.txt"))
step("remove_missing", lambda: sb.files.remove("/home/user/never-was.txt"))
step("outside_root", lambda: sb.files.write("/etc/corral-e2b-test", "no"))


# -- signed URLs, through plain HTTP (urllib: no SDK, no token header) --------------------------

def fetch(url: str, data: bytes | None = None) -> dict[str, object]:
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    if data is not None:
        req.add_header("Content-Type", "application/octet-stream")
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return {"status": resp.status, "body": resp.read().decode(errors="replace")[:200]}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read().decode(errors="replace")[:200]}


def signed(op: str) -> str:
    if not hasattr(sb, "download_url"):
        raise Unsupported("no download_url in this SDK")
    sb.files.write("/home/user/signed.txt", "signed content")
    if op == "read":
        return sb.download_url("/home/user/signed.txt", use_signature_expiration=120)
    return sb.upload_url("/home/user/uploaded.txt", use_signature_expiration=120)


def tampered(url: str, **replace: str) -> str:
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    query.update(replace)
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


def expired_url() -> str:
    from e2b.sandbox.signature import get_signature  # the SDK's own signer

    sig = get_signature("/home/user/signed.txt", "read", None, sb._envd_access_token, -60)
    base = sb.download_url("/home/user/signed.txt")
    return tampered(base, signature=sig["signature"],
                    signature_expiration=str(sig["expiration"]))


step("signed_read", lambda: fetch(signed("read")))
step("signed_read_bad", lambda: fetch(tampered(signed("read"), signature="v1_" + "A" * 43)))
step("signed_read_other_path", lambda: fetch(tampered(signed("read"),
                                                      path="/home/user/blob.bin")))
step("signed_read_expired", lambda: fetch(expired_url()))
step("signed_read_unsigned", lambda: fetch(tampered(signed("read"), signature="",
                                                    signature_expiration="")))
step("signed_write", lambda: fetch(signed("write"), data=b"uploaded through a signed url"))
step("signed_written", lambda: sb.files.read("/home/user/uploaded.txt"))
step("signed_write_bad", lambda: fetch(tampered(signed("write"), signature="v1_" + "B" * 43),
                                       data=b"must not land"))
step("kill_sandbox", lambda: sb.kill())
done()
