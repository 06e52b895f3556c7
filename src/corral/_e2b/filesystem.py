"""envd's ``filesystem.Filesystem`` Connect service, unary part: Stat, ListDir, MakeDir, Move,
Remove (E2B-COMPAT §6.4) over the control plane's audited file access; the watch RPCs are in
``watch.py``. Paths are E2B paths (``/home/user/...`` or relative to it), answered as such.
"""

from __future__ import annotations

import base64
import binascii
import posixpath
import stat as stat_mod
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.routing import BaseRoute

from .._control.plane import AuditedFiles, Manager
from ..errors import FileError, FileNotFound, PathRefused
from ..models import FileEntry
from . import paths
from .connect import ConnectError, route, unary
from .messages import ListDir, Move, PathRequest
from .target import target_of

__all__ = ["MAX_LIST_ENTRIES", "call", "check_user", "described", "entry_info",
           "open_files", "routes"]

#: A recursive ListDir answers at most this many entries (one unary message must stay small).
MAX_LIST_ENTRIES = 10_000
_FILE_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY",
               "symlink": "FILE_TYPE_SYMLINK"}
_TYPE_BITS = {"file": stat_mod.S_IFREG, "dir": stat_mod.S_IFDIR, "symlink": stat_mod.S_IFLNK}

T = TypeVar("T")


def check_user(request: Request) -> None:
    """A named user (Basic auth, E2B-COMPAT §3) must be ``user``: a sandbox has no other, and
    never a root."""
    header = request.headers.get("authorization", "")
    if not header.lower().startswith("basic "):
        return
    try:
        user = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise ConnectError("unauthenticated", "the Authorization header is not valid Basic "
                           "auth") from None
    if user in ("", "user"):
        return
    if user == "root":
        raise ConnectError("unauthenticated", "Corral sandboxes have no root user: file calls "
                           "run as the sandbox's one unprivileged user; pass user='user' or "
                           "no user")
    raise ConnectError("unauthenticated", f"error looking up user {user[:64]!r}: the only user "
                       "is 'user'")


def _timestamp(seconds: float) -> str:
    moment = datetime.fromtimestamp(seconds, UTC)
    text = moment.strftime("%Y-%m-%dT%H:%M:%S")
    if moment.microsecond:
        text += f".{moment.microsecond:06d}"
    return text + "Z"


def entry_info(entry: FileEntry, *, link_target: str | None = None) -> dict[str, Any]:
    """The proto3 JSON of envd's ``EntryInfo`` for ``entry`` (E2B-COMPAT §6.2)."""
    shown = paths.to_e2b(entry.path)
    info: dict[str, Any] = {
        "name": posixpath.basename(shown) or shown,
        "type": _FILE_TYPES.get(entry.type, "FILE_TYPE_UNSPECIFIED"),
        "path": shown,
        "size": str(entry.size),
        "mode": entry.mode,
        "permissions": stat_mod.filemode(_TYPE_BITS.get(entry.type, 0) | entry.mode),
        "owner": "user",
        "group": "user",
        "modifiedTime": _timestamp(entry.modified_at),
        "metadata": {},
        "isSymlink": entry.type == "symlink",
    }
    if link_target is not None:
        info["symlinkTarget"] = link_target
    return info


def described(files: AuditedFiles, entry: FileEntry) -> dict[str, Any]:
    target = None
    if entry.type == "symlink":
        try:
            target = files.readlink(entry.path)
        except (FileError, FileNotFound):
            target = None  # replaced meanwhile
    return entry_info(entry, link_target=target)


async def open_files(request: Request) -> AuditedFiles:
    check_user(request)
    manager: Manager = request.app.state.manager
    return await run_in_threadpool(manager.files, target_of(request).sandbox_id)


async def call(fn: Callable[[], T]) -> T:
    try:
        return await run_in_threadpool(fn)
    except PathRefused as exc:
        raise ConnectError("permission_denied", _shown(exc.message)) from None
    except FileNotFound as exc:
        raise ConnectError("not_found", _shown(exc.message)) from None
    except FileError as exc:
        raise ConnectError("invalid_argument", _shown(exc.message)) from None


def _shown(message: str) -> str:
    return message.replace("/workspace", paths.HOME)


# -- RPCs ----------------------------------------------------------------------------------------


async def stat(message: dict[str, Any], request: Request) -> dict[str, Any]:
    path = PathRequest.read(message).path
    files = await open_files(request)
    return {"entry": await call(lambda: described(files, files.stat(path)))}


def _list(files: AuditedFiles, path: str, depth: int) -> list[dict[str, Any]]:
    top = files.stat(path)
    if top.type != "dir":
        raise FileError(f"{path} is not a directory")
    found: list[dict[str, Any]] = []
    level = [path]
    for _ in range(depth):
        below: list[str] = []
        for directory in level:
            try:
                entries = files.list(directory)
            except (FileNotFound, FileError):
                continue  # removed or replaced meanwhile
            for entry in entries:
                if len(found) >= MAX_LIST_ENTRIES:
                    raise ConnectError("resource_exhausted", f"{_shown(path)} holds over "
                                       f"{MAX_LIST_ENTRIES} entries within depth {depth}; "
                                       "list a smaller depth or a subdirectory")
                if entry.type == "other":
                    continue  # sockets and fifos: the SDK drops unknown types anyway
                found.append(described(files, entry))
                if entry.type == "dir":  # never through a symlink
                    below.append(entry.path)
        level = below
        if not level:
            break
    return found


async def list_dir(message: dict[str, Any], request: Request) -> dict[str, Any]:
    listing = ListDir.read(message)
    files = await open_files(request)
    return {"entries": await call(lambda: _list(files, listing.path, listing.depth))}


async def make_dir(message: dict[str, Any], request: Request) -> dict[str, Any]:
    path = PathRequest.read(message).path
    files = await open_files(request)

    def make() -> dict[str, Any]:
        if files.exists(path):
            entry = files.stat(path)
            if entry.type == "dir":
                raise ConnectError("already_exists", f"directory {paths.to_e2b(path)} already "
                                   "exists")
            raise FileError(f"{path} already exists and is not a directory")
        files.make_dir(path)
        return {"entry": described(files, files.stat(path))}

    return await call(make)


async def move(message: dict[str, Any], request: Request) -> dict[str, Any]:
    moving = Move.read(message)
    files = await open_files(request)
    return {"entry": await call(lambda: described(files, files.rename(moving.source,
                                                                      moving.destination)))}


async def remove(message: dict[str, Any], request: Request) -> dict[str, Any]:
    path = PathRequest.read(message).path
    if path == "/workspace":
        raise ConnectError("permission_denied", f"{paths.HOME} itself cannot be removed (it "
                           "is the sandbox's workspace); remove what is in it")
    files = await open_files(request)

    def rm() -> None:
        try:
            files.remove(path)
        except FileNotFound:
            pass  # envd removes with RemoveAll: a missing path is success

    await call(rm)
    return {}


routes: list[BaseRoute] = [
    route("filesystem.Filesystem/Stat", unary(stat)),
    route("filesystem.Filesystem/ListDir", unary(list_dir)),
    route("filesystem.Filesystem/MakeDir", unary(make_dir)),
    route("filesystem.Filesystem/Move", unary(move)),
    route("filesystem.Filesystem/Remove", unary(remove)),
]
