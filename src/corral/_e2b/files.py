"""envd's ``/files``: read (``GET``) and write (``POST``) workspace files the way the E2B SDKs
do (E2B-COMPAT §5), through the control plane's audited file access, so every read and write
lands in the trail as the same ``file.read`` / ``file.write`` events as Corral's own API.

Writes stream: a multipart part or an octet-stream body goes to the workspace chunk by chunk
(gzip undone on the way), never held whole in memory or spooled elsewhere, and is bounded by
the sandbox tier's workspace size. A request without the sandbox's token must carry a valid,
unexpired signature (signed URLs, ``download_url``/``upload_url``).
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import hmac
import logging
import posixpath
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import anyio.from_thread
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from .._control.plane import AuditedFiles, Manager
from .._core.resources import get_tier
from .._http.errors import as_e2b_files, failure, refused
from .._workspace.files import MAX_FILE_BYTES
from ..errors import CorralError, QuotaExceeded
from ..models import FileEntry
from . import paths
from .target import target_of
from .tokens import SandboxTokens

__all__ = ["resolve_signed", "routes", "signature"]

logger = logging.getLogger(__name__)

_USERS = ("user", "")
_CHUNK = 64 * 1024
# How many chunks may wait between the request and the thread writing them (backpressure).
_QUEUED_CHUNKS = 4


class FilesRefused(Exception):
    """A ``/files`` refusal with envd's ``status`` (shaped by ``as_e2b_files``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# -- signatures ----------------------------------------------------------------------------------


def signature(path: str, operation: str, user: str | None, token: str,
              expiration: int | None) -> str:
    """E2B's URL signature (``e2b/sandbox/signature.py:get_signature``, checked by envd)."""
    raw = f"{path}:{operation}:{user or ''}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = base64.b64encode(hashlib.sha256(raw.encode("utf-8")).digest()).decode()
    return "v1_" + digest.rstrip("=")


def _signature_valid(path: str, operation: str, user: str | None, token: str,
                     presented: str, expiration: str | None, *, now: float) -> bool:
    exp: int | None = None
    if expiration:
        try:
            exp = int(expiration)
        except ValueError:
            return False
        if exp < now:
            return False
    expected = signature(path, operation, user, token, exp)
    return hmac.compare_digest(presented.encode(), expected.encode())


def _check_signature(request: Request, operation: str) -> None:
    target = target_of(request)
    if target.authenticated:
        return
    query = request.query_params
    presented = query.get("signature")
    if not presented:
        raise FilesRefused(401, "this request needs the sandbox's access token (X-Access-Token) "
                           "or a signed URL (signature and signature_expiration, from "
                           "download_url()/upload_url())")
    expiration = query.get("signature_expiration")
    if expiration:
        try:
            if int(expiration) < time.time():
                raise FilesRefused(401, "the signed URL has expired; ask for a new one")
        except ValueError:
            raise FilesRefused(401, "signature_expiration must be a unix time in "
                               "seconds") from None
    if not _signature_valid(query.get("path", ""), operation, query.get("username"),
                            target.envd_token, presented, expiration, now=time.time()):
        raise FilesRefused(401, f"the signature is not valid for {operation} of this path "
                           "(wrong sandbox, path, user or operation)")


def resolve_signed(manager: Manager, tokens: SandboxTokens, path: str, operation: str,
                   user: str | None, signature_: str, expiration: str | None) -> str | None:
    """The sandbox whose envd token made ``signature_`` (URL mode: a signed URL names no
    sandbox, E2B-COMPAT P3), among the live ones; None when none did or it has expired.

    One HMAC and one hash per live sandbox; the comparison is constant-time each.
    """
    if not signature_.startswith("v1_"):
        return None
    now = time.time()
    for info in manager.list():
        if _signature_valid(path, operation, user, tokens.envd(info.id), signature_,
                            expiration, now=now):
            return info.id
    return None


# -- common checks -------------------------------------------------------------------------------


def _check_user(request: Request) -> None:
    user = request.query_params.get("username")
    if user is None or user in _USERS:
        return
    if user == "root":
        raise FilesRefused(401, "Corral sandboxes have no root user: files belong to the "
                           "sandbox's one unprivileged user; omit username or send "
                           "username=user")
    raise FilesRefused(401, f"error looking up user {user[:64]!r}: the only user is 'user'")


def _workspace_path(raw: str | None) -> str:
    if raw is None or raw == "":
        raise FilesRefused(400, "the path query parameter is required (the file to read or "
                           "write, absolute or relative to /home/user)")
    return paths.to_workspace(raw)


async def _files(request: Request) -> tuple[AuditedFiles, int]:
    manager: Manager = request.app.state.manager
    sandbox_id = target_of(request).sandbox_id

    def open_files() -> tuple[AuditedFiles, int]:
        info = manager.get(sandbox_id)
        return manager.files(sandbox_id), min(get_tier(info.resources).disk_bytes,
                                              MAX_FILE_BYTES * 64)

    return await run_in_threadpool(open_files)


def _refusals(fn: Any) -> Any:
    async def endpoint(request: Request) -> Response:
        try:
            response: Response = await fn(request)
            return response
        except FilesRefused as exc:
            status, body = as_e2b_files(refused(exc.status, exc.message))
        except CorralError as exc:
            status, body = as_e2b_files(failure(exc))
        return JSONResponse(body, status_code=status)

    return endpoint


# -- GET -----------------------------------------------------------------------------------------


def _encoding(header: str | None) -> str | None:
    """``gzip`` or ``identity``, per ``Accept-Encoding``; None when neither is acceptable."""
    if not header or not header.strip():
        return "identity"
    accepted: dict[str, float] = {}
    for item in header.split(","):
        name, _, params = item.strip().partition(";")
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if name.strip():
            accepted[name.strip().lower()] = q
    star = accepted.get("*")
    if accepted.get("gzip", star or 0.0) > 0:
        return "gzip"
    if accepted.get("identity", star if star is not None else 1.0) > 0:
        return "identity"
    return None


@_refusals
async def read_file(request: Request) -> Response:
    _check_user(request)
    _check_signature(request, "read")
    path = _workspace_path(request.query_params.get("path"))
    encoding = _encoding(request.headers.get("accept-encoding"))
    if encoding is None:
        raise FilesRefused(406, "no acceptable encoding found, supported: [identity, gzip]")
    files, _ = await _files(request)

    def read() -> bytes:
        data = files.read(path)
        return gzip.compress(data, compresslevel=5) if encoding == "gzip" else data

    body = await run_in_threadpool(read)
    headers = {"Content-Encoding": "gzip", "Vary": "Accept-Encoding"} if encoding == "gzip" \
        else {"Vary": "Accept-Encoding"}
    name = posixpath.basename(path)
    headers["Content-Disposition"] = f"inline; filename*=UTF-8''{_quote(name)}"
    return Response(body, media_type="application/octet-stream", headers=headers)


def _quote(name: str) -> str:
    from urllib.parse import quote

    return quote(name, safe="")


# -- POST ----------------------------------------------------------------------------------------


class _Writer:
    """One file being written: chunks go from the event loop to a worker thread that writes
    them through ``AuditedFiles.write_stream``, at most ``_QUEUED_CHUNKS`` in flight."""

    def __init__(self, files: AuditedFiles, path: str, limit: int) -> None:
        self.path = path
        self._limit = limit
        self._size = 0
        self._send, self._receive = anyio.create_memory_object_stream[bytes](_QUEUED_CHUNKS)
        self._job = asyncio.ensure_future(run_in_threadpool(self._write, files))

    def _write(self, files: AuditedFiles) -> FileEntry:
        try:
            return files.write_stream(self.path, self._chunks())
        finally:
            # Wakes a ``feed`` waiting on a full queue when the write stopped early.
            anyio.from_thread.run_sync(self._receive.close)

    def _chunks(self) -> Iterator[bytes]:
        while True:
            try:
                chunk = anyio.from_thread.run(self._receive.receive)
            except anyio.EndOfStream:
                return
            self._size += len(chunk)
            if self._size > self._limit:
                raise QuotaExceeded(f"{paths.to_e2b(self.path)} is over {self._limit} bytes, "
                                    "the size of this sandbox's workspace; write less or use a "
                                    "larger resource tier")
            yield chunk

    async def feed(self, chunk: bytes) -> None:
        if self._job.done():
            return  # it failed: ``finish`` raises why
        try:
            await self._send.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

    async def finish(self) -> dict[str, str]:
        self._send.close()
        try:
            entry = await self._job
        finally:
            self._receive.close()
        return _write_info(entry.path)

    async def abort(self) -> None:
        self._receive.close()
        self._send.close()
        try:
            await self._job
        except Exception:  # the error that aborted it is raised by the caller
            pass


def _write_info(workspace_path: str) -> dict[str, str]:
    shown = paths.to_e2b(workspace_path)
    return {"path": shown, "name": posixpath.basename(shown), "type": "file"}


async def _body(request: Request) -> AsyncIterator[bytes]:
    """The request body, gzip undone when ``Content-Encoding`` says so."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        async for chunk in request.stream():
            if chunk:
                yield chunk
        return
    if encoding not in ("gzip", "x-gzip"):
        raise FilesRefused(415, f"Content-Encoding {encoding[:32]!r} is not supported; send "
                           "identity or gzip")
    inflate = zlib.decompressobj(wbits=31)
    async for chunk in request.stream():
        try:
            # Bounded output per step, so a small bomb cannot balloon in one call.
            data = inflate.decompress(chunk, _CHUNK)
            while data:
                yield data
                data = inflate.decompress(inflate.unconsumed_tail, _CHUNK)
        except zlib.error:
            raise FilesRefused(400, "the body is not valid gzip") from None
    tail = inflate.flush()
    if tail:
        yield tail
    if not inflate.eof:
        raise FilesRefused(400, "the gzip body ended early")


@_refusals
async def write_files(request: Request) -> Response:
    _check_user(request)
    _check_signature(request, "write")
    query_path = request.query_params.get("path")
    media, options = parse_options_header(request.headers.get("content-type", ""))
    files, limit = await _files(request)
    if media == b"multipart/form-data":
        boundary = options.get(b"boundary")
        if not boundary:
            raise FilesRefused(400, "a multipart body needs a boundary in its Content-Type")
        written = await _write_multipart(request, files, boundary, query_path, limit)
    elif media in (b"application/octet-stream", b""):
        path = _workspace_path(query_path)
        writer = _Writer(files, path, limit)
        try:
            async for chunk in _body(request):
                await writer.feed(chunk)
        except BaseException:
            await writer.abort()
            raise
        written = [await writer.finish()]
    else:
        raise FilesRefused(400, f"content type {media.decode('latin-1')[:64]!r} is not "
                           "supported; send multipart/form-data (one part per file, filename "
                           "= its path) or application/octet-stream with ?path=")
    if not written:
        raise FilesRefused(400, "the multipart body holds no file part (name=\"file\", "
                           "filename=\"<path>\")")
    return JSONResponse(written)


class _Parts:
    """What the multipart parser saw, queued for the async side to act on in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self._field = b""
        self._value = b""
        self._headers: dict[bytes, bytes] = {}

    def callbacks(self) -> Any:  # python_multipart's MultipartCallbacks (a TypedDict)
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda d, s, e: self._add("_field", d[s:e]),
            "on_header_value": lambda d, s, e: self._add("_value", d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": lambda: self.events.append(("headers", self._headers)),
            "on_part_data": lambda d, s, e: self.events.append(("data", bytes(d[s:e]))),
            "on_part_end": lambda: self.events.append(("end", None)),
        }

    def _add(self, name: str, data: bytes) -> None:
        setattr(self, name, getattr(self, name) + data)

    def _begin(self) -> None:
        self._headers = {}

    def _header_end(self) -> None:
        self._headers[self._field.strip().lower()] = self._value.strip()
        self._field = self._value = b""


def _part_path(headers: dict[bytes, bytes], query_path: str | None) -> str | None:
    _, options = parse_options_header(headers.get(b"content-disposition", b""))
    filename = options.get(b"filename")
    name = options.get(b"name")
    if filename is None and name != b"file":
        return None  # a form field, not a file: envd reads only "file" parts
    if query_path:
        return paths.to_workspace(query_path)
    if not filename:
        raise FilesRefused(400, "a file part needs filename=\"<path>\" (or send ?path= for a "
                           "single file)")
    return paths.to_workspace(filename.decode("utf-8", "surrogateescape"))


async def _write_multipart(request: Request, files: AuditedFiles, boundary: bytes,
                           query_path: str | None, limit: int) -> list[dict[str, str]]:
    parts = _Parts()
    parser = MultipartParser(boundary, parts.callbacks())
    written: list[dict[str, str]] = []
    writer: _Writer | None = None
    skipping = False
    try:
        async for chunk in _body(request):
            parser.write(chunk)
            events, parts.events = parts.events, []
            for kind, value in events:
                if kind == "headers":
                    path = _part_path(value, query_path)
                    skipping = path is None
                    if path is not None:
                        writer = _Writer(files, path, limit)
                elif kind == "data" and writer is not None and not skipping:
                    await writer.feed(value)
                elif kind == "end":
                    if writer is not None:
                        current, writer = writer, None
                        written.append(await current.finish())
                    skipping = False
        parser.finalize()
    except BaseException:
        if writer is not None:
            await writer.abort()
        raise
    if writer is not None:
        await writer.abort()
        raise FilesRefused(400, "the multipart body ended inside a part")
    return written


routes: list[BaseRoute] = [
    Route("/files", read_file, methods=["GET"]),
    Route("/files", write_files, methods=["POST"]),
]
