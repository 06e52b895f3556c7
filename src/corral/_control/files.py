"""Workspace file operations with their audit events (path, size, sha256)."""

from __future__ import annotations

from .._audit.auditor import Auditor
from .._workspace.files import WorkspaceFiles, to_relative
from ..models import FileEntry

__all__ = ["AuditedFiles"]


def _shown(path: str) -> str:
    rel = to_relative(path)
    return "/workspace" if rel == "." else f"/workspace/{rel}"


class AuditedFiles:
    """The same operations as ``WorkspaceFiles``; reads and changes are recorded."""

    def __init__(self, files: WorkspaceFiles, auditor: Auditor, sandbox_id: str) -> None:
        self._files = files
        self._auditor = auditor
        self._sandbox_id = sandbox_id

    def read(self, path: str) -> bytes:
        data = self._files.read(path)
        self._auditor.file_event(self._sandbox_id, "read", _shown(path), data)
        return data

    def write(self, path: str, data: bytes) -> FileEntry:
        entry = self._files.write(path, data)
        self._auditor.file_event(self._sandbox_id, "write", entry.path, data)
        return entry

    def remove(self, path: str) -> None:
        self._files.remove(path)
        self._auditor.file_event(self._sandbox_id, "remove", _shown(path))

    def make_dir(self, path: str) -> bool:
        created = self._files.make_dir(path)
        self._auditor.file_event(self._sandbox_id, "mkdir", _shown(path), created=created)
        return created

    def list(self, path: str = "/workspace") -> list[FileEntry]:
        return self._files.list(path)

    def stat(self, path: str) -> FileEntry:
        return self._files.stat(path)

    def exists(self, path: str) -> bool:
        return self._files.exists(path)
