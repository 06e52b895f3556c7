"""``/workspace`` of a microVM sandbox, through its guest agent.

The workspace is an ext4 filesystem on a virtio-blk disk the guest owns, so the host never
mounts it (two kernels on one filesystem corrupt it); every file operation is a request to the
agent, which resolves paths the way ``corral._workspace.files`` does on the host tiers
(``openat2`` beneath the workspace root). Paths are checked here first with the same
``to_relative``, so a lexically bad path is refused with the same words on every tier before
any request is made. What comes back is data from an untrusted guest: sizes are bounded and
types checked before anything is built from it.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, cast

from ..._workspace.files import MAX_FILE_BYTES, WORKSPACE, to_relative
from ...backends import TreeItem
from ...errors import BackendError, QuotaExceeded
from ...models import FileEntry
from .client import KeeperClient
from .wire import ProtocolError, b64, unb64

__all__ = ["VmFiles"]

_CHUNK = 1 << 20
_KINDS = ("file", "dir", "symlink", "other")


def _guest_path(path: str) -> str:
    rel = to_relative(path)
    return WORKSPACE if rel == "." else f"{WORKSPACE}/{rel}"


def _entry(raw: Any) -> FileEntry:
    try:
        kind = raw["kind"]
        if kind not in _KINDS:
            raise ValueError(kind)
        return FileEntry(name=str(raw["name"]), path=str(raw["path"]),
                         type=cast(Literal["file", "dir", "symlink", "other"], kind),
                         size=int(raw["size"]), mode=int(raw["mode"]),
                         modified_at=float(raw["mtime"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise BackendError(f"the microVM agent sent a malformed file entry: {exc}") from None


class VmFiles:
    """A ``WorkspaceFS`` over a keeper connection (``client`` is fetched per call, so a VM that
    was restarted between calls is reached through its new keeper)."""

    def __init__(self, client: Callable[[], KeeperClient],
                 *, max_file_bytes: int = MAX_FILE_BYTES) -> None:
        self._client = client
        self._max = max_file_bytes

    def _call(self, op: str, **fields: Any) -> Any:
        return self._client().call(op, **fields)

    def _read_range(self, guest: str, offset: int, length: int) -> tuple[bytes, int]:
        answer = self._call("fs.read", path=guest, offset=offset, length=length)
        try:
            data, size = unb64(answer["data"]), int(answer["size"])
        except (KeyError, TypeError, ValueError, ProtocolError) as exc:
            raise BackendError(f"the microVM agent sent a malformed read: {exc}") from None
        if len(data) > length:
            raise BackendError("the microVM agent sent more than was asked for")
        return data, size

    def read(self, path: str) -> bytes:
        guest = _guest_path(path)
        chunks: list[bytes] = []
        total = 0
        while True:
            data, size = self._read_range(guest, total, _CHUNK)
            if size > self._max:
                raise QuotaExceeded(f"{path} is {size} bytes; files over {self._max} bytes "
                                    "cannot be read whole")
            chunks.append(data)
            total += len(data)
            if not data or total >= size:
                return b"".join(chunks)

    def write(self, path: str, data: bytes, *, mode: int = 0o644) -> FileEntry:
        if len(data) > self._max:
            raise QuotaExceeded(f"{len(data)} bytes is over the {self._max}-byte file limit")
        return self.write_stream(path, (data,), mode=mode)

    def write_stream(self, path: str, chunks: Iterable[bytes], *, mode: int = 0o644,
                     mtime: float | None = None, follow_symlinks: bool = True) -> FileEntry:
        guest = _guest_path(path)
        client = self._client()
        begun = client.call("fs.write_begin", path=guest, mode=mode & 0o777,
                            follow_symlinks=follow_symlinks)
        try:
            handle = begun["handle"]
        except (KeyError, TypeError):
            raise BackendError("the microVM agent sent no write handle") from None
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    client.call("fs.write_chunk", handle=handle, data=b64(bytes(view[:_CHUNK])))
                    view = view[_CHUNK:]
            return _entry(client.call("fs.write_end", handle=handle, mtime=mtime))
        except BaseException:
            try:
                client.call("fs.write_abort", handle=handle, timeout=10)
            except Exception:  # noqa: BLE001 - the original failure is what the caller needs
                pass
            raise

    def symlink(self, path: str, target: str) -> FileEntry:
        return _entry(self._call("fs.symlink", path=_guest_path(path), target=target))

    def walk(self, path: str = WORKSPACE) -> Iterator[TreeItem]:
        guest = _guest_path(path)
        listed = self._call("fs.walk", path=guest)
        if not isinstance(listed, list):
            raise BackendError("the microVM agent sent a malformed walk")
        for raw in listed:
            entry = _entry(raw)
            rel = str(raw["path"])
            reader = None
            if entry.type == "file":
                reader = self._reader(posixpath.join(guest, rel))
            link = raw.get("link_target")
            yield TreeItem(path=rel, kind=entry.type, mode=entry.mode, size=entry.size,
                           mtime=entry.modified_at,
                           link_target=str(link) if link is not None else None, read=reader)

    def _reader(self, guest: str) -> Callable[[int], bytes]:
        offset = 0

        def read(n: int) -> bytes:
            nonlocal offset
            data, _ = self._read_range(guest, offset, max(1, min(n, _CHUNK)))
            offset += len(data)
            return data

        return read

    def list(self, path: str = WORKSPACE) -> list[FileEntry]:
        listed = self._call("fs.list", path=_guest_path(path))
        if not isinstance(listed, list):
            raise BackendError("the microVM agent sent a malformed listing")
        return [_entry(raw) for raw in listed]

    def stat(self, path: str) -> FileEntry:
        return _entry(self._call("fs.stat", path=_guest_path(path)))

    def exists(self, path: str) -> bool:
        return bool(self._call("fs.exists", path=_guest_path(path)))

    def remove(self, path: str) -> None:
        self._call("fs.remove", path=_guest_path(path))

    def rename(self, src: str, dst: str) -> FileEntry:
        return _entry(self._call("fs.rename", src=_guest_path(src), dst=_guest_path(dst)))

    def make_dir(self, path: str) -> bool:
        return bool(self._call("fs.mkdir", path=_guest_path(path)))

    def readlink(self, path: str) -> str:
        return str(self._call("fs.readlink", path=_guest_path(path)))
