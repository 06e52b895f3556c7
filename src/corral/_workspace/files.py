"""File operations from the host into a sandbox's ``/workspace``, safe against a hostile sandbox.

The sandbox can create symlinks and swap directories while the host works, so no path is ever
resolved as a string. Every lookup goes through ``openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS |
RESOLVE_NO_XDEV)`` from a descriptor of the workspace root: the kernel refuses any step that would
leave it (``..`` above the root, absolute or escaping symlinks, other mounts), at the moment of the
lookup, so a swap between a check and a use cannot win. The final component is then used through its
parent's descriptor with ``O_NOFOLLOW`` / ``follow_symlinks=False``.

Because the workspace is its own filesystem (see ``storage``), nothing in it can be a hard link to a
host file either.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import secrets
import stat as stat_mod
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

from .._core import linux
from .._guest import fsrules
from .._guest.fsrules import WORKSPACE, shown_name
from ..backends import TreeItem
from ..errors import CorralError, FileError, FileNotFound, PathRefused, QuotaExceeded
from ..models import FileEntry
from .inotify import InotifyWatch
from .removal import remove_tree

__all__ = ["MAX_FILE_BYTES", "MAX_WALK_DEPTH", "WORKSPACE", "TreeItem", "WorkspaceFiles",
           "shown_name", "to_relative"]

MAX_FILE_BYTES = 256 * 1024 * 1024
MAX_WALK_DEPTH = 256
_RESOLVE = linux.RESOLVE_BENEATH | linux.RESOLVE_NO_MAGICLINKS | linux.RESOLVE_NO_XDEV


def _openat2(dir_fd: int, path: str, flags: int) -> int:
    return linux.openat2(dir_fd, path, flags, 0, _RESOLVE)


def to_relative(path: str) -> str:
    """Map a sandbox path (``/workspace/a``, ``a``, ``./a``) to one relative to the workspace.

    Returns ``"."`` for the workspace itself. The rules are ``corral._guest.fsrules``'s, which
    the microVM guest agent applies too.

    Raises:
        PathRefused: absolute outside ``/workspace``, ``..`` escaping it, NUL bytes, not a string.
    """
    try:
        return fsrules.to_relative(path)
    except fsrules.FileRuleError as exc:
        raise PathRefused(exc.message) from None


def _temp_name() -> str:
    return f".corral-tmp-{secrets.token_hex(6)}"


@contextlib.contextmanager
def _staged(dir_fd: int, tmp: str) -> Iterator[None]:
    """Build an entry under a temporary name; if anything fails before it is renamed into
    place, remove it, so a failed write leaves the old content and no litter."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


_display = fsrules.display
# An error kind of the file rules as the Corral error the host raises (the rest: FileError).
_ERRORS: dict[str, type[FileError]] = {"not_found": FileNotFound, "refused": PathRefused}


def _host_error(error: fsrules.FileRuleError) -> CorralError:
    if error.kind == "no_space":
        return QuotaExceeded(error.message)
    return _ERRORS.get(error.kind, FileError)(error.message)


@contextlib.contextmanager
def _mapped(rel: str) -> Iterator[None]:
    """Turn OS errors and the file rules' refusals into Corral errors that name the sandbox
    path."""
    try:
        yield
    except OSError as exc:
        error = fsrules.os_error(rel, exc)
        raise _host_error(error) from (exc if error.unmapped else None)
    except fsrules.FileRuleError as exc:
        raise _host_error(exc) from None


def _entry(name: str, rel: str, st: os.stat_result) -> FileEntry:
    mode = st.st_mode
    kind: Literal["file", "dir", "symlink", "other"]
    if stat_mod.S_ISREG(mode):
        kind = "file"
    elif stat_mod.S_ISDIR(mode):
        kind = "dir"
    elif stat_mod.S_ISLNK(mode):
        kind = "symlink"
    else:
        kind = "other"
    return FileEntry(name=shown_name(name), path=_display(rel), type=kind, size=st.st_size,
                     mode=stat_mod.S_IMODE(mode), modified_at=st.st_mtime)


class WorkspaceFiles:
    """File operations on one workspace, owned by the sandbox's host ``uid``: the host tiers'
    ``WorkspaceFS`` (``openat2(RESOLVE_BENEATH)`` from the workspace's host directory)."""

    def __init__(self, root: Path, uid: int, *, max_file_bytes: int = MAX_FILE_BYTES) -> None:
        self._root = root
        self._uid = uid
        self._max = max_file_bytes
        self._at = fsrules.Beneath(str(root), uid, _openat2)

    # -- public operations -------------------------------------------------------------------

    def read(self, path: str) -> bytes:
        rel = to_relative(path)
        with _mapped(rel), self._at.root_fd() as root_fd:
            fd = self._at.open(root_fd, rel, os.O_RDONLY | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if stat_mod.S_ISDIR(st.st_mode):
                    raise FileError(f"{_display(rel)} is a directory; use list()")
                if not stat_mod.S_ISREG(st.st_mode):
                    raise FileError(f"{_display(rel)} is not a regular file")
                if st.st_size > self._max:
                    raise QuotaExceeded(
                        f"{_display(rel)} is {st.st_size} bytes; files over {self._max} bytes "
                        "cannot be read whole"
                    )
                chunks = []
                total = 0
                while chunk := os.read(fd, 1 << 20):
                    total += len(chunk)
                    if total > self._max:
                        raise QuotaExceeded(f"{_display(rel)} grew past {self._max} bytes")
                    chunks.append(chunk)
                return b"".join(chunks)
            finally:
                os.close(fd)

    def write(self, path: str, data: bytes, *, mode: int = 0o644) -> FileEntry:
        """Write atomically (temp file + rename), creating parent directories.

        A symlink at ``path`` is followed when it stays inside the workspace (like ``read``) and
        refused when it leads out. On any failure the previous content is left untouched.
        """
        if len(data) > self._max:
            raise QuotaExceeded(f"{len(data)} bytes is over the {self._max}-byte file limit")
        return self.write_stream(path, (data,), mode=mode)

    def write_stream(
        self, path: str, chunks: Iterable[bytes], *, mode: int = 0o644,
        mtime: float | None = None, follow_symlinks: bool = True,
    ) -> FileEntry:
        """Write ``chunks`` atomically (temp file + rename), creating parent directories.

        Like ``write`` but never holds more than one chunk in memory and has no size limit of
        its own: the caller bounds what ``chunks`` yields (an exception raised by the iterator
        removes the temp file and propagates unchanged).

        Args:
            path: the sandbox path of the file.
            chunks: the content, consumed once.
            mode: permission bits (masked to ``0o777``).
            mtime: modification time to set, or None for now.
            follow_symlinks: when ``path`` is a symlink, write where it leads (inside the
                workspace only) if True, or replace the link itself with the file if False.

        Raises:
            PathRefused: the path or a symlink on it leaves ``/workspace``.
            QuotaExceeded: the workspace filled up.
            FileError: a parent is not a directory, ``path`` is a directory, ...
        """
        rel = to_relative(path)
        for _ in range(8):  # symlink hops, like the kernel's own limit on nesting
            with _mapped(rel), self._at.parent(rel, create=True) as (dir_fd, leaf):
                target = self._at.symlink_target(dir_fd, leaf, rel) if follow_symlinks else None
                if target is None:
                    return self._replace(dir_fd, leaf, rel, chunks, mode, mtime)
            rel = target
        raise PathRefused(f"{_display(rel)}: too many levels of symlinks")

    def symlink(self, path: str, target: str) -> FileEntry:
        """Create (or atomically replace) the symlink ``path`` pointing at ``target``.

        ``target`` is stored as given and never resolved here: every host-side lookup refuses a
        link that leads out of ``/workspace``, so a link's text cannot make the host escape.
        Callers that want links to stay inside a subtree check ``target`` themselves.

        Raises:
            PathRefused: ``path`` leaves ``/workspace`` or ``target`` is not a usable link text.
            FileError: ``path`` is an existing directory, ...
        """
        rel = to_relative(path)
        if not target or "\x00" in target or len(target.encode("utf-8", "surrogateescape")) > 4095:
            raise PathRefused(f"symlink target {target!r} for {_display(rel)} is not usable")
        with _mapped(rel), self._at.parent(rel, create=True) as (dir_fd, leaf):
            tmp = _temp_name()
            os.symlink(target, tmp, dir_fd=dir_fd)
            with _staged(dir_fd, tmp):
                os.chown(tmp, self._uid, self._uid, dir_fd=dir_fd, follow_symlinks=False)
                os.rename(tmp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return _entry(leaf, rel, os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False))

    def _replace(self, dir_fd: int, leaf: str, rel: str, chunks: Iterable[bytes], mode: int,
                 mtime: float | None = None) -> FileEntry:
        tmp = _temp_name()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     mode & 0o777, dir_fd=dir_fd)
        with _staged(dir_fd, tmp):
            try:
                os.fchown(fd, self._uid, self._uid)
                for chunk in chunks:
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view):]
                if mtime is not None:
                    os.utime(fd, (mtime, mtime))
            finally:
                os.close(fd)
            os.rename(tmp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return _entry(leaf, rel, os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False))

    def walk(self, path: str = WORKSPACE) -> Iterator[TreeItem]:
        """Every entry under the directory ``path``, depth first, sorted, parents first.

        Never follows a symlink (links are reported as links), never leaves the tree: the top
        is opened with the usual ``RESOLVE_BENEATH`` lookup and every child is opened from its
        parent's descriptor with ``O_NOFOLLOW``, so the sandbox swapping entries meanwhile can
        only make entries vanish or change type (those are skipped), never redirect the walk.

        Raises:
            PathRefused: ``path`` leaves ``/workspace``.
            FileNotFound: ``path`` does not exist.
            FileError: ``path`` is not a directory, or the tree is over ``MAX_WALK_DEPTH`` deep.
        """
        rel = to_relative(path)
        with _mapped(rel), self._at.root_fd() as root_fd:
            top = self._at.open(root_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
        try:
            yield from self._walk_dir(top, "", rel, 0)
        finally:
            os.close(top)

    def _walk_dir(self, dir_fd: int, prefix: str, rel: str, depth: int) -> Iterator[TreeItem]:
        if depth >= MAX_WALK_DEPTH:
            raise FileError(f"{_display(rel)} is nested over {MAX_WALK_DEPTH} directories deep")
        with _mapped(rel), os.scandir(dir_fd) as it:
            names = sorted(entry.name for entry in it)
        for name in names:
            try:
                item, fd = self._walk_open(dir_fd, name, prefix + name)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EINVAL,
                                 errno.ENXIO, errno.EAGAIN):
                    continue  # vanished or swapped for another type meanwhile
                raise
            try:
                if item.kind == "dir":
                    yield item
                    assert fd is not None
                    yield from self._walk_dir(fd, item.path + "/", f"{rel}/{name}", depth + 1)
                elif item.kind != "other":
                    yield item
            finally:
                if fd is not None:
                    os.close(fd)

    def _walk_open(self, dir_fd: int, name: str, path: str) -> tuple[TreeItem, int | None]:
        # A single component from a held directory descriptor with O_NOFOLLOW cannot leave it.
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat_mod.S_ISLNK(st.st_mode):
            link = os.readlink(name, dir_fd=dir_fd)
            return TreeItem(path, "symlink", 0o777, 0, st.st_mtime, link_target=link), None
        if not (stat_mod.S_ISDIR(st.st_mode) or stat_mod.S_ISREG(st.st_mode)):
            return TreeItem(path, "other", 0, 0, st.st_mtime), None
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        entry = _entry(name, path, st)
        kind = entry.type if entry.type in ("file", "dir") else "other"
        return TreeItem(path, kind, entry.mode, st.st_size if kind == "file" else 0,
                        st.st_mtime, read=functools.partial(os.read, fd)), fd

    def list(self, path: str = WORKSPACE) -> list[FileEntry]:
        rel = to_relative(path)
        with _mapped(rel), self._at.root_fd() as root_fd:
            fd = self._at.open(root_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
            try:
                entries = []
                with os.scandir(fd) as it:
                    for item in it:
                        child = item.name if rel == "." else f"{rel}/{item.name}"
                        entries.append(_entry(item.name, child, item.stat(follow_symlinks=False)))
                return sorted(entries, key=lambda e: e.name)
            finally:
                os.close(fd)

    def stat(self, path: str) -> FileEntry:
        rel = to_relative(path)
        if rel == ".":
            with self._at.root_fd() as fd:
                return _entry("workspace", rel, os.fstat(fd))
        with _mapped(rel), self._at.parent(rel) as (dir_fd, leaf):
            return _entry(leaf, rel, os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except FileNotFound:
            return False
        except FileError as exc:
            if "not a directory" in exc.message:
                return False
            raise
        return True

    def remove(self, path: str) -> None:
        """Remove a file, symlink or directory tree."""
        rel = to_relative(path)
        with _mapped(rel), self._at.parent(rel) as (dir_fd, leaf):
            st = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
            if stat_mod.S_ISDIR(st.st_mode):
                # Not shutil.rmtree: it recurses, and a sandbox can nest deeper than the stack.
                remove_tree(dir_fd, leaf)
            else:
                os.unlink(leaf, dir_fd=dir_fd)

    def rename(self, src: str, dst: str) -> FileEntry:
        """Move ``src`` to ``dst`` (parents of ``dst`` are created); an existing file at ``dst``
        is replaced, a non-empty directory is not. Symlinks are moved, never followed."""
        rel_src, rel_dst = to_relative(src), to_relative(dst)
        with _mapped(rel_src), self._at.parent(rel_src) as (src_fd, src_leaf):
            os.stat(src_leaf, dir_fd=src_fd, follow_symlinks=False)  # a clear "does not exist"
            with _mapped(rel_dst), self._at.parent(rel_dst, create=True) as (dst_fd, dst_leaf):
                os.rename(src_leaf, dst_leaf, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
                return _entry(dst_leaf, rel_dst,
                              os.stat(dst_leaf, dir_fd=dst_fd, follow_symlinks=False))

    def make_dir(self, path: str) -> bool:
        """mkdir -p; True when the directory was created, False when it already existed."""
        rel = to_relative(path)
        if rel == ".":
            return False
        with _mapped(rel), self._at.root_fd() as root_fd:
            return self._at.make_dirs(root_fd, rel)

    def readlink(self, path: str) -> str:
        rel = to_relative(path)
        with _mapped(rel), self._at.parent(rel) as (dir_fd, leaf):
            try:
                return shown_name(os.readlink(leaf, dir_fd=dir_fd))
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    raise FileError(f"{_display(rel)} is not a symlink") from None
                raise

    def watch(self, path: str, *, recursive: bool = False) -> InotifyWatch:
        """Watch a directory with inotify from the host (see ``inotify``)."""
        return InotifyWatch(self._root, to_relative(path), recursive=recursive,
                            shown=_display)
