"""Workspace files: read, write, list, stat, remove, rename, mkdir; trees as tar."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..._core.resources import get_tier
from ..._http.bodies import MAX_FILE_BODY, read_body, write_some
from ..._http.deps import ManagerDep, TenantDep, owned
from ..schemas import _BINARY, _BINARY_BODY, _PathQuery

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/sandboxes/{sandbox_id}/files/content", response_class=Response,
            responses={200: {"content": {"application/octet-stream": _BINARY},
                             "description": "The file's bytes."}})
def read_file(sandbox_id: str, path: _PathQuery,
              who: TenantDep, manager: ManagerDep) -> Response:
    """A file's bytes (a path relative to /workspace, or absolute under it)."""
    owned(manager, sandbox_id, who)
    return Response(manager.files(sandbox_id).read(path),
                    media_type="application/octet-stream")


@router.put("/v1/sandboxes/{sandbox_id}/files/content", openapi_extra=_BINARY_BODY)
async def write_file(sandbox_id: str, path: Annotated[str, Query(min_length=1)],
                     request: Request, who: TenantDep, manager: ManagerDep
                     ) -> dict[str, Any]:
    """Write the request body to a file, creating its parent directories; the write is atomic."""
    # Whose it is before a byte of the body is read.
    await run_in_threadpool(owned, manager, sandbox_id, who)
    data = await read_body(request, MAX_FILE_BODY, "a file upload is limited to {} "
                           "bytes; upload large trees as a tar (PUT .../archive)")

    def write() -> dict[str, Any]:
        owned(manager, sandbox_id, who)  # again: it may have been deleted meanwhile
        return manager.files(sandbox_id).write(path, data).to_dict()

    return await run_in_threadpool(write)


@router.get("/v1/sandboxes/{sandbox_id}/files")
def list_files(sandbox_id: str, who: TenantDep, manager: ManagerDep, path: str = "/workspace"
               ) -> list[dict[str, Any]]:
    """The entries of a directory (name, type, size, mode, modification time)."""
    owned(manager, sandbox_id, who)
    return [e.to_dict() for e in manager.files(sandbox_id).list(path)]


@router.get("/v1/sandboxes/{sandbox_id}/files/stat")
def stat_file(sandbox_id: str, path: _PathQuery,
              who: TenantDep, manager: ManagerDep) -> dict[str, Any]:
    """One path's type, size, mode and modification time."""
    owned(manager, sandbox_id, who)
    return manager.files(sandbox_id).stat(path).to_dict()


@router.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204)
def remove_file(sandbox_id: str, path: _PathQuery,
              who: TenantDep, manager: ManagerDep) -> Response:
    """Remove a file, or a directory and everything in it."""
    owned(manager, sandbox_id, who)
    manager.files(sandbox_id).remove(path)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/files/rename")
def rename_file(sandbox_id: str, src: Annotated[str, Query(min_length=1)],
                dst: Annotated[str, Query(min_length=1)],
                                          who: TenantDep, manager: ManagerDep) -> dict[str, Any]:
    """Rename or move a path within the sandbox."""
    owned(manager, sandbox_id, who)
    return manager.files(sandbox_id).rename(src, dst).to_dict()


@router.put("/v1/sandboxes/{sandbox_id}/archive", openapi_extra={"requestBody": {"content": {
       "application/x-tar": _BINARY, "application/gzip": _BINARY}}})
async def upload_tar(sandbox_id: str, request: Request, who: TenantDep, manager: ManagerDep,
                     path: str = "/workspace") -> dict[str, Any]:
    """Extract a tar (or tar.gz) streamed in the body under ``path``."""
    info = await run_in_threadpool(owned, manager, sandbox_id, who)
    limit = get_tier(info.resources).disk_bytes
    files = await run_in_threadpool(manager.files, sandbox_id)
    read_end, write_end = os.pipe()
    reader = os.fdopen(read_end, "rb")

    def extract() -> dict[str, Any]:
        try:
            return dataclasses.asdict(files.upload(path, reader, max_bytes=limit))
        finally:
            reader.close()

    job = asyncio.ensure_future(run_in_threadpool(extract))
    try:
        async for chunk in request.stream():
            view = memoryview(chunk)
            while view and not job.done():
                written = await run_in_threadpool(write_some, write_end, view)
                view = view[written:]
    except BaseException:
        # The body was cut (over its limit) or the client left: the extractor sees the
        # end of its input; wait for it so its thread and error do not outlive the request.
        os.close(write_end)
        with contextlib.suppress(Exception):
            await job
        raise
    os.close(write_end)
    return await job


@router.get("/v1/sandboxes/{sandbox_id}/archive", response_class=StreamingResponse,
            responses={200: {"content": {"application/x-tar": _BINARY,
                                         "application/gzip": _BINARY},
                             "description": "The tree as tar (or tar.gz)."}})
def download_tar(sandbox_id: str, who: TenantDep, manager: ManagerDep, path: str = "/workspace",
                 gzip: bool = False) -> StreamingResponse:
    """The tree under ``path`` as a tar stream."""
    info = owned(manager, sandbox_id, who)
    chunks = manager.files(sandbox_id).download(
        path, max_bytes=get_tier(info.resources).disk_bytes, gzip=gzip)
    return StreamingResponse(chunks, media_type="application/gzip" if gzip
                             else "application/x-tar")


@router.post("/v1/sandboxes/{sandbox_id}/files/mkdir")
def make_dir(sandbox_id: str, path: _PathQuery,
              who: TenantDep, manager: ManagerDep) -> dict[str, bool]:
    """Create a directory and its parents (no error if it exists)."""
    owned(manager, sandbox_id, who)
    return {"created": manager.files(sandbox_id).make_dir(path)}
