"""Workspace file operations with their audit events (path, size, sha256)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Iterable, Iterator
from typing import BinaryIO

from .._audit.auditor import Auditor
from .._core.resources import get_tier
from .._workspace.archive import ExtractReport, create_tar, extract_tar
from .._workspace.files import to_relative
from ..backends import DirWatch, WatchableFS, WorkspaceFS
from ..errors import CorralError, FileError, PathRefused
from ..models import FileEntry
from .sandboxes import Sandboxes
from .store import Store

__all__ = ["AuditedFiles", "Files"]


def _shown(path: str) -> str:
    rel = to_relative(path)
    return "/workspace" if rel == "." else f"/workspace/{rel}"


class AuditedFiles:
    """The same operations as the ``WorkspaceFS`` it wraps; reads, changes and refusals are
    recorded."""

    def __init__(self, files: WorkspaceFS, auditor: Auditor, sandbox_id: str) -> None:
        self._files = files
        self._auditor = auditor
        self._sandbox_id = sandbox_id

    @contextlib.contextmanager
    def _refusals(self, op: str, path: object, **paths: object) -> Iterator[None]:
        """A refused path goes into the trail (it is what a steered agent tried) and on up."""
        try:
            yield
        except PathRefused as exc:
            self._auditor.file_refused(self._sandbox_id, op, path, exc, **paths)
            raise

    def read(self, path: str) -> bytes:
        with self._refusals("read", path):
            data = self._files.read(path)
        self._auditor.file_event(self._sandbox_id, "read", _shown(path), data)
        return data

    def write(self, path: str, data: bytes) -> FileEntry:
        with self._refusals("write", path):
            entry = self._files.write(path, data)
        self._auditor.file_event(self._sandbox_id, "write", entry.path, data)
        return entry

    def write_stream(self, path: str, chunks: Iterable[bytes]) -> FileEntry:
        """Like ``write`` but never holds the whole content: the event's size and sha256 are
        computed as the chunks pass (the caller bounds how much ``chunks`` yields)."""
        digest = hashlib.sha256()
        size = 0

        def counted() -> Iterator[bytes]:
            nonlocal size
            for chunk in chunks:
                digest.update(chunk)
                size += len(chunk)
                yield chunk

        with self._refusals("write", path):
            entry = self._files.write_stream(path, counted())
        self._auditor.file_event(self._sandbox_id, "write", entry.path, size=size,
                                 sha256=digest.hexdigest())
        return entry

    def readlink(self, path: str) -> str:
        with self._refusals("stat", path):
            return self._files.readlink(path)

    def watch(self, path: str, *, recursive: bool = False) -> DirWatch:
        """Watch a directory (see ``WatchableFS``); ``FileError`` where the tier cannot."""
        if not isinstance(self._files, WatchableFS):
            raise FileError("this isolation tier cannot watch directories")
        with self._refusals("watch", path):
            return self._files.watch(path, recursive=recursive)

    def remove(self, path: str) -> None:
        with self._refusals("remove", path):
            self._files.remove(path)
        self._auditor.file_event(self._sandbox_id, "remove", _shown(path))

    def rename(self, src: str, dst: str) -> FileEntry:
        with self._refusals("rename", src, dst=dst):
            entry = self._files.rename(src, dst)
        self._auditor.file_event(self._sandbox_id, "rename", entry.path, source=_shown(src))
        return entry

    def make_dir(self, path: str) -> bool:
        with self._refusals("mkdir", path):
            created = self._files.make_dir(path)
        self._auditor.file_event(self._sandbox_id, "mkdir", _shown(path), created=created)
        return created

    def list(self, path: str = "/workspace") -> list[FileEntry]:
        with self._refusals("list", path):
            return self._files.list(path)

    def stat(self, path: str) -> FileEntry:
        with self._refusals("stat", path):
            return self._files.stat(path)

    def exists(self, path: str) -> bool:
        with self._refusals("exists", path):
            return self._files.exists(path)

    def upload(self, dest: str, stream: BinaryIO, *, max_bytes: int,
               max_entries: int = 100_000) -> ExtractReport:
        """Extract a tar stream under ``dest`` (see ``extract_tar``); one ``file.upload`` event.

        The event is recorded whether or not extraction succeeds, with the counts of what was
        written; a refusal adds ``error`` (the error code) and ``message``.
        """
        report = ExtractReport()
        shown = _shown(dest)
        try:
            with self._refusals("upload", dest):
                extract_tar(self._files, dest, stream, max_bytes=max_bytes,
                            max_entries=max_entries, report=report)
        except CorralError as exc:
            self._auditor.file_event(self._sandbox_id, "upload", shown, None, **_counts(report),
                                     error=exc.code, message=exc.message)
            raise
        self._auditor.file_event(self._sandbox_id, "upload", shown, None, **_counts(report))
        return report

    def download(self, src: str, *, max_bytes: int, max_entries: int = 100_000,
                 gzip: bool = False) -> Iterator[bytes]:
        """A tar stream of the tree under ``src`` (see ``create_tar``).

        Errors about ``src`` are raised now. One ``file.download`` event is recorded when the
        stream ends: ``complete`` says whether it was read to the end, and a limit reached on
        the way adds ``error`` and ``message``. (A stream that is never iterated records
        nothing, because nothing was read.)
        """
        report = ExtractReport()
        with self._refusals("download", src):
            chunks = create_tar(self._files, src, max_bytes=max_bytes, max_entries=max_entries,
                                gzip=gzip, report=report)
        return self._recorded_download(src, chunks, report, gzip=gzip)

    def _recorded_download(self, src: str, chunks: Iterator[bytes], report: ExtractReport,
                           *, gzip: bool) -> Iterator[bytes]:
        shown = _shown(src)
        complete = False
        failure: dict[str, str] = {}
        try:
            with self._refusals("download", src):
                yield from chunks
            complete = True
        except CorralError as exc:
            failure = {"error": exc.code, "message": exc.message}
            raise
        finally:
            self._auditor.file_event(self._sandbox_id, "download", shown, None, **_counts(report),
                                     gzip=gzip, complete=complete, **failure)


def _counts(report: ExtractReport) -> dict[str, int]:
    return {"entries": report.entries, "files": report.files, "dirs": report.dirs,
            "symlinks": report.symlinks, "bytes": report.bytes}


class Files:
    """File access to a sandbox's workspace; using it counts as activity (idle timeout)."""

    def __init__(self, *, store: Store, sandboxes: Sandboxes, auditor: Auditor) -> None:
        self._store = store
        self._sandboxes = sandboxes
        self._auditor = auditor

    def open(self, sandbox_id: str) -> AuditedFiles:
        # Files work on a paused sandbox too; one that resumes on calls is resumed first.
        info = self._sandboxes.awake(sandbox_id, doing=None)
        if info.idle_timeout is not None:
            self._store.touch(sandbox_id)
        files = self._sandboxes.backend(info).files(self._sandboxes.spec(info))
        return AuditedFiles(files, self._auditor, sandbox_id)

    def upload(self, sandbox_id: str, path: str, stream: BinaryIO) -> dict[str, int]:
        info = self._sandboxes.get(sandbox_id)
        report = self.open(sandbox_id).upload(
            path, stream, max_bytes=get_tier(info.resources).disk_bytes)
        return dataclasses.asdict(report)

    def download(self, sandbox_id: str, path: str, *, gzip: bool = False) -> Iterator[bytes]:
        info = self._sandboxes.get(sandbox_id)
        return self.open(sandbox_id).download(
            path, max_bytes=get_tier(info.resources).disk_bytes, gzip=gzip)
