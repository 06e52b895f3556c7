"""The workspace file operations in the guest: the ``fs.*`` ops' work on ``/workspace``.

The same design as the host tiers' ``corral._workspace.files`` (whose path rules and messages
are ``fsrules``, shared): no path is ever resolved as a string. Every lookup goes through
``openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)`` from a descriptor of the
workspace root, and the final component is used through its parent's descriptor with
``O_NOFOLLOW``, so the sandbox's commands swapping symlinks meanwhile cannot make the agent (root)
leave the workspace. Why this is not the host's class: the host's raises Corral's errors and
builds its models (pydantic, not in the guest), streams writes from one call rather than over
handles, and lists or walks into its own types; the guest answers with plain JSON entries in
batches.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat as stat_mod
from collections.abc import Iterator
from dataclasses import dataclass

from .channel import Lane
from .config import USER_ID
from .fsrules import (
    WORKSPACE,
    Beneath,
    FileRuleError,
    display,
    os_error,
    shown_name,
    to_relative,
)
from .protocol import AgentError, Message, b64
from .system import openat2, syncfs_fd

__all__ = ["MAX_READ", "MAX_WALK_DEPTH", "MAX_WALK_ENTRIES", "Files", "WriteHandle"]

MAX_READ = 1 << 20
MAX_WALK_ENTRIES = 100_000
MAX_WALK_DEPTH = 256


def _relative(path: object) -> str:
    try:
        return to_relative(path)
    except FileRuleError as exc:
        raise AgentError(exc.kind, exc.message) from None


@contextlib.contextmanager
def _mapped(rel: str) -> Iterator[None]:
    """OS errors and the file rules' refusals as the protocol's error kinds, naming the
    sandbox path (``fsrules``)."""
    try:
        yield
    except OSError as exc:
        error = os_error(rel, exc)
        raise AgentError(error.kind, error.message) from None
    except FileRuleError as exc:
        raise AgentError(exc.kind, exc.message) from None


def _kind(mode: int) -> str:
    if stat_mod.S_ISREG(mode):
        return "file"
    if stat_mod.S_ISDIR(mode):
        return "dir"
    if stat_mod.S_ISLNK(mode):
        return "symlink"
    return "other"


def _entry(name: str, path: str, st: os.stat_result, link: str | None = None) -> Message:
    return {"name": shown_name(name), "path": path, "kind": _kind(st.st_mode),
            "size": st.st_size, "mode": stat_mod.S_IMODE(st.st_mode), "mtime": st.st_mtime,
            "link_target": None if link is None else shown_name(link)}


def _link_of(name: str, dir_fd: int, st: os.stat_result) -> str | None:
    if not stat_mod.S_ISLNK(st.st_mode):
        return None
    with contextlib.suppress(OSError):
        return os.readlink(name, dir_fd=dir_fd)
    return None


@dataclass
class WriteHandle:
    dir_fd: int
    leaf: str
    rel: str
    tmp: str
    fd: int
    lane: Lane


class _Root(Beneath):
    """The rules' lookups, with the guest's word for a workspace it cannot open at all."""

    def open_root(self) -> int:
        try:
            return super().open_root()
        except OSError as exc:
            raise AgentError("io", f"the workspace is not available: {exc.strerror}") from None


class Files:
    """The ``fs.*`` ops' work on the workspace at ``root`` (the real path: a symlink's target
    is compared with it)."""

    def __init__(self, root: str) -> None:
        self._at = _Root(os.path.realpath(root), USER_ID, openat2)

    def _stat_entry(self, dir_fd: int, leaf: str, rel: str) -> Message:
        st = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
        return _entry(leaf, display(rel), st, _link_of(leaf, dir_fd, st))

    def stat(self, path: object) -> Message:
        rel = _relative(path)
        if rel == ".":
            with self._at.root_fd() as fd:
                return _entry("workspace", WORKSPACE, os.fstat(fd))
        with _mapped(rel), self._at.parent(rel) as (dir_fd, leaf):
            return self._stat_entry(dir_fd, leaf, rel)

    def exists(self, path: object) -> bool:
        try:
            self.stat(path)
        except AgentError as exc:
            if exc.kind in ("not_found", "not_dir"):
                return False
            raise
        return True

    def readlink(self, path: object) -> str:
        rel = _relative(path)
        with _mapped(rel), self._at.parent(rel) as (dir_fd, leaf):
            try:
                return shown_name(os.readlink(leaf, dir_fd=dir_fd))
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    raise AgentError("io", f"{display(rel)} is not a symlink") from None
                raise

    def read(self, path: object, offset: object, length: object) -> Message:
        rel = _relative(path)
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise AgentError("protocol", "fs.read: offset must be an integer >= 0")
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise AgentError("protocol", "fs.read: length must be an integer >= 0")
        if length > MAX_READ:
            raise AgentError("too_large", f"fs.read reads at most {MAX_READ} bytes at a time; "
                             "read the file in chunks")
        with _mapped(rel), self._at.root_fd() as root_fd:
            fd = self._at.open(root_fd, rel, os.O_RDONLY | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if stat_mod.S_ISDIR(st.st_mode):
                    raise AgentError("is_dir", f"{display(rel)} is a directory; use list()")
                if not stat_mod.S_ISREG(st.st_mode):
                    raise AgentError("io", f"{display(rel)} is not a regular file")
                data = os.pread(fd, length, offset) if length else b""
                return {"data": b64(data), "size": st.st_size}
            finally:
                os.close(fd)

    def listing(self, path: object) -> Iterator[Message]:
        rel = _relative(path)
        with _mapped(rel), self._at.root_fd() as root_fd:
            fd = self._at.open(root_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
            try:
                with os.scandir(fd) as it:
                    names = sorted(item.name for item in it)
                if len(names) > MAX_WALK_ENTRIES:
                    raise AgentError("too_large", f"{display(rel)} has over "
                                     f"{MAX_WALK_ENTRIES} entries")
                for name in names:
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    child = name if rel == "." else f"{rel}/{name}"
                    yield _entry(name, display(child), st, _link_of(name, fd, st))
            finally:
                os.close(fd)

    def walk(self, path: object) -> Iterator[Message]:
        """Depth first, sorted, parents first; never follows a link, never leaves the tree."""
        rel = _relative(path)
        with _mapped(rel), self._at.root_fd() as root_fd:
            top = self._at.open(root_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
        count = 0
        # An explicit stack: a hostile tree may nest deeper than Python's recursion limit.
        stack: list[tuple[int, str, Iterator[str]]] = []
        try:
            stack.append((top, "", iter(self._names(top, rel))))
            while stack:
                dir_fd, prefix, names = stack[-1]
                name = next(names, None)
                if name is None:
                    stack.pop()
                    os.close(dir_fd)
                    continue
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    sub = None
                    if stat_mod.S_ISDIR(st.st_mode):
                        sub = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY
                                      | os.O_CLOEXEC, dir_fd=dir_fd)
                        st = os.fstat(sub)
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EINVAL,
                                     errno.ENXIO, errno.EAGAIN):
                        continue  # vanished or swapped for another type meanwhile
                    raise AgentError("io", f"{display(rel)}: {exc.strerror}") from None
                kind = _kind(st.st_mode)
                if kind == "other":
                    if sub is not None:
                        os.close(sub)
                    continue
                count += 1
                if count > MAX_WALK_ENTRIES:
                    if sub is not None:
                        os.close(sub)
                    raise AgentError("too_large", f"{display(rel)} has over "
                                     f"{MAX_WALK_ENTRIES} entries; walk a subdirectory")
                link = os.readlink(name, dir_fd=dir_fd) if kind == "symlink" else None
                entry = _entry(name, shown_name(prefix + name), st, link)
                if kind != "file":
                    entry["size"] = 0
                if kind == "symlink":
                    entry["mode"] = 0o777
                yield entry
                if sub is not None:
                    if len(stack) >= MAX_WALK_DEPTH:
                        os.close(sub)
                        raise AgentError("too_large", f"{display(rel)} is nested over "
                                         f"{MAX_WALK_DEPTH} directories deep")
                    stack.append((sub, prefix + name + "/", iter(self._names(sub, rel))))
        finally:
            for dir_fd, _, _ in stack:
                os.close(dir_fd)

    @staticmethod
    def _names(dir_fd: int, rel: str) -> list[str]:
        with _mapped(rel), os.scandir(dir_fd) as it:
            return sorted(entry.name for entry in it)

    def make_dir(self, path: object) -> bool:
        rel = _relative(path)
        if rel == ".":
            return False
        with _mapped(rel), self._at.root_fd() as root_fd:
            return self._at.make_dirs(root_fd, rel)

    def remove(self, path: object) -> None:
        rel = _relative(path)
        with _mapped(rel), self._at.parent(rel) as (dir_fd, leaf):
            st = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
            if stat_mod.S_ISDIR(st.st_mode):
                self._remove_tree(dir_fd, leaf)
            else:
                os.unlink(leaf, dir_fd=dir_fd)

    @staticmethod
    def _remove_tree(parent_fd: int, name: str) -> None:
        """rm -r without recursion (a sandbox can nest deeper than the stack), each level
        opened through its parent's descriptor with O_NOFOLLOW."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        stack: list[tuple[int, str]] = [(os.open(name, flags, dir_fd=parent_fd), name)]
        try:
            while stack:
                fd, own_name = stack[-1]
                with os.scandir(fd) as it:
                    entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
                sub = None
                for child, is_dir in entries:
                    if is_dir:
                        if len(stack) > 4096:
                            raise OSError(errno.ELOOP, "directory tree too deep to remove")
                        sub = (os.open(child, flags, dir_fd=fd), child)
                        break
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(child, dir_fd=fd)
                if sub is not None:
                    stack.append(sub)
                    continue
                stack.pop()
                os.close(fd)
                owner = stack[-1][0] if stack else parent_fd
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(own_name, dir_fd=owner)
        finally:
            for fd, _ in stack:
                os.close(fd)

    def rename(self, src: object, dst: object) -> Message:
        rel_src, rel_dst = _relative(src), _relative(dst)
        with _mapped(rel_src), self._at.parent(rel_src) as (src_fd, src_leaf):
            os.stat(src_leaf, dir_fd=src_fd, follow_symlinks=False)
            with _mapped(rel_dst), self._at.parent(rel_dst, create=True) as (dst_fd, dst_leaf):
                os.rename(src_leaf, dst_leaf, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
                return self._stat_entry(dst_fd, dst_leaf, rel_dst)

    def symlink(self, path: object, target: object) -> Message:
        rel = _relative(path)
        if (not isinstance(target, str) or not target or "\x00" in target
                or len(target.encode("utf-8", "surrogateescape")) > 4095):
            raise AgentError("refused", f"symlink target {target!r} for {display(rel)} is "
                             "not usable")
        with _mapped(rel), self._at.parent(rel, create=True) as (dir_fd, leaf):
            tmp = f".corral-tmp-{secrets.token_hex(6)}"
            os.symlink(target, tmp, dir_fd=dir_fd)
            try:
                os.chown(tmp, USER_ID, USER_ID, dir_fd=dir_fd, follow_symlinks=False)
                os.rename(tmp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
            return self._stat_entry(dir_fd, leaf, rel)

    def write_begin(self, path: object, mode: object, follow: bool, lane: Lane) -> WriteHandle:
        if not isinstance(mode, int) or isinstance(mode, bool):
            raise AgentError("protocol", "fs.write_begin: mode must be an integer")
        rel = _relative(path)
        for _ in range(8):  # symlink hops, like the kernel's own nesting limit
            with _mapped(rel), self._at.parent(rel, create=True) as (dir_fd, leaf):
                target = self._at.symlink_target(dir_fd, leaf, rel) if follow else None
                if target is None:
                    tmp = f".corral-tmp-{secrets.token_hex(6)}"
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, mode & 0o777, dir_fd=dir_fd)
                    try:
                        os.fchown(fd, USER_ID, USER_ID)
                        os.fchmod(fd, mode & 0o777)  # not the agent's umask
                    except BaseException:
                        os.close(fd)
                        os.unlink(tmp, dir_fd=dir_fd)
                        raise
                    return WriteHandle(os.dup(dir_fd), leaf, rel, tmp, fd, lane)
            rel = target
        raise AgentError("refused", f"{display(rel)}: too many levels of symlinks")

    @staticmethod
    def write_chunk(handle: WriteHandle, data: bytes) -> None:
        with _mapped(handle.rel):
            view = memoryview(data)
            while view:
                view = view[os.write(handle.fd, view):]

    def write_end(self, handle: WriteHandle, mtime: object) -> Message:
        with _mapped(handle.rel):
            if mtime is not None:
                if not isinstance(mtime, int | float) or isinstance(mtime, bool):
                    raise AgentError("protocol", "fs.write_end: mtime must be a number or null")
                os.utime(handle.fd, (mtime, mtime))
            os.close(handle.fd)
            handle.fd = -1
            os.rename(handle.tmp, handle.leaf, src_dir_fd=handle.dir_fd,
                      dst_dir_fd=handle.dir_fd)
            entry = self._stat_entry(handle.dir_fd, handle.leaf, handle.rel)
            syncfs_fd(handle.dir_fd)
            return entry

    @staticmethod
    def write_abort(handle: WriteHandle) -> None:
        if handle.fd >= 0:
            os.close(handle.fd)
            handle.fd = -1
        with contextlib.suppress(OSError):
            os.unlink(handle.tmp, dir_fd=handle.dir_fd)
