"""The workspace file rules, one copy for the host and the guest: which sandbox paths are
refused (and in what words), how an entry's name is shown, which OS errors become which error
kind, and how a path is resolved beneath the workspace root (``Beneath``). The host tiers'
``corral._workspace.files`` (also the microVM host side's check before it sends a request) and
the guest agent's ``workspace`` both use it; each turns a ``FileRuleError`` into its own error
(``PathRefused``, ``FileNotFound``... on the host, a ``{"kind", "message"}`` reply in the
guest) by its ``kind``.

What stays apart, and why: the operations built on these rules. The host's return Corral's
models (pydantic, which the guest has not), read a file whole under a size cap, write from one
iterable, and walk into ``TreeItem``s with open descriptors; the guest's answer JSON, read in
ranges, write over handles that live across requests, and list and walk in bounded batches.

Standard library only: the guest runs it on the template's python3.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat as stat_mod
from collections.abc import Callable, Iterator

__all__ = ["WORKSPACE", "Beneath", "FileRuleError", "display", "os_error", "shown_name",
           "to_relative"]

WORKSPACE = "/workspace"


class FileRuleError(Exception):
    """A file rule refused a path, or an OS error in the workspace, as an error kind:
    ``refused``, ``not_found``, ``no_space``, ``not_dir``, ``is_dir``, ``exists`` or ``io``.
    ``unmapped`` is true for an OS error no rule names (its ``strerror`` is the message)."""

    def __init__(self, kind: str, message: str, *, unmapped: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.unmapped = unmapped


def shown_name(name: str) -> str:
    """``name`` as Corral reports it: valid UTF-8 always, so it survives JSON and terminals.

    The OS hands names over decoded with ``surrogateescape``; a byte that is not UTF-8 (which
    the sandbox can put in any name) is shown as ``\\xNN`` instead of a lone surrogate that
    no UTF-8 encoder (the API's JSON among them) accepts.
    """
    try:
        raw = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no decoder made: the caller typed it
        return name.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def to_relative(path: object) -> str:
    """Map a sandbox path (``/workspace/a``, ``a``, ``./a``) to one relative to the workspace.

    Returns ``"."`` for the workspace itself.

    Raises:
        FileRuleError: (``refused``) absolute outside ``/workspace``, ``..`` escaping it, NUL
            bytes, not UTF-8, over 4096 bytes, not a string.
    """
    if not isinstance(path, str) or not path:
        raise FileRuleError("refused", f"path must be a non-empty string, got {path!r}")
    if "\x00" in path:
        raise FileRuleError("refused", "path contains a NUL byte")
    try:
        encoded = path.encode()
    except UnicodeEncodeError:
        raise FileRuleError(
            "refused",
            f"path '{shown_name(path)}' is not valid UTF-8; file calls take UTF-8 paths (a "
            r"listing shows other bytes escaped as \xNN): rename the entry with a command in "
            "the sandbox, or remove its parent directory") from None
    if len(encoded) > 4096:
        raise FileRuleError("refused", "path is longer than 4096 bytes")
    if path.startswith("/"):
        normal = posixpath.normpath(path)
        if normal == WORKSPACE:
            return "."
        if not normal.startswith(WORKSPACE + "/"):
            raise FileRuleError("refused", f"{path!r} is outside {WORKSPACE}; only {WORKSPACE} "
                                "is reachable")
        rel = normal[len(WORKSPACE) + 1:]
    else:
        rel = posixpath.normpath(path)
    if rel == ".." or rel.startswith("../"):
        raise FileRuleError("refused", f"{path!r} climbs out of {WORKSPACE} with '..'")
    return rel


def display(rel: str) -> str:
    """The sandbox path of ``rel`` (a ``to_relative`` result), as messages and entries show it."""
    return WORKSPACE if rel == "." else f"{WORKSPACE}/{shown_name(rel)}"


def os_error(rel: str, exc: OSError) -> FileRuleError:
    """What an OS error on ``rel`` means to the sandbox, naming the sandbox path."""
    shown = display(rel)
    code = exc.errno
    if code == errno.ENOENT:
        return FileRuleError("not_found", f"{shown} does not exist")
    if code in (errno.EXDEV, errno.ELOOP):
        return FileRuleError("refused", f"{shown} goes through a symlink that leaves {WORKSPACE}"
                             " (or is a symlink where a file or directory is needed); refused")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return FileRuleError("no_space", f"the workspace is full while writing {shown}; delete "
                             "files or use a larger resource tier")
    if code == errno.ENOTDIR:
        return FileRuleError("not_dir", f"a component of {shown} is not a directory")
    if code == errno.EISDIR:
        return FileRuleError("is_dir", f"{shown} is a directory")
    if code == errno.EEXIST:
        return FileRuleError("exists", f"{shown} already exists and is not a directory")
    if code == errno.ENOTEMPTY:
        return FileRuleError("io", f"{shown} is not empty")
    if code == errno.ENAMETOOLONG:
        return FileRuleError("refused", f"a name in {shown} is too long")
    return FileRuleError("io", f"{shown}: {exc.strerror}", unmapped=True)


class Beneath:
    """Lookups beneath one workspace root, safe against the sandbox changing the tree meanwhile.

    No path is resolved as a string: every lookup is ``openat2`` (with ``RESOLVE_BENEATH |
    RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV``: the caller's ``openat2``) from a descriptor of
    the root, so the kernel refuses any step that would leave it, at the moment of the lookup.
    Rule refusals raise ``FileRuleError``; OS errors propagate as ``OSError`` (``os_error``
    names them), so each side turns both into its own errors in one place.
    """

    def __init__(self, root: str, uid: int, openat2: Callable[[int, str, int], int]) -> None:
        self.root = root
        self.uid = uid  # the owner of what is made: the sandbox's user
        self._openat2 = openat2

    def open_root(self) -> int:
        return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    @contextlib.contextmanager
    def root_fd(self) -> Iterator[int]:
        fd = self.open_root()
        try:
            yield fd
        finally:
            os.close(fd)

    def open(self, root_fd: int, rel: str, flags: int) -> int:
        for _ in range(16):
            try:
                return self._openat2(root_fd, rel, flags)
            except OSError as exc:
                if exc.errno != errno.EAGAIN:  # a concurrent rename; the kernel asks to retry
                    raise
        raise FileRuleError("io", f"{display(rel)} kept changing while being opened; try again")

    @contextlib.contextmanager
    def parent(self, rel: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
        """(descriptor of the parent directory, final component) of ``rel``; the parents are
        made first with ``create``."""
        if rel == ".":
            raise FileRuleError("refused", f"this operation needs a path inside {WORKSPACE}, "
                                f"not {WORKSPACE}")
        parent, leaf = posixpath.split(rel)
        with self.root_fd() as root_fd:
            if create and parent:
                self.make_dirs(root_fd, parent)
            fd = self.open(root_fd, parent or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            yield fd, leaf
        finally:
            os.close(fd)

    def make_dirs(self, root_fd: int, rel: str) -> bool:
        """mkdir -p, one component at a time; True if anything was made.

        Each prefix is opened from the root with the same ``RESOLVE_BENEATH`` rules as any other
        lookup, so a symlink on the way is followed when it stays inside and refused (EXDEV)
        when it leads out.
        """
        made = False
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        fd = os.dup(root_fd)
        try:
            for i, part in enumerate(parts):
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    os.chown(part, self.uid, self.uid, dir_fd=fd, follow_symlinks=False)
                    made = True
                except FileExistsError:
                    pass
                nxt = self.open(root_fd, "/".join(parts[: i + 1]), os.O_RDONLY | os.O_DIRECTORY)
                os.close(fd)
                fd = nxt
        finally:
            os.close(fd)
        return made

    def symlink_target(self, dir_fd: int, leaf: str, rel: str) -> str | None:
        """If ``leaf`` is a symlink, where it leads (relative to the root); else None.

        Refused (``FileRuleError``) when it leads out. Only a hint for where to write: if the
        sandbox swaps the link afterwards, the rename replaces the link itself and writes
        through nothing.
        """
        try:
            st = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat_mod.S_ISLNK(st.st_mode):
            return None
        with self.root_fd() as root_fd:
            try:
                fd = self.open(root_fd, rel, os.O_PATH)
            except FileNotFoundError:
                # Dangling: it resolves inside (else EXDEV) but names nothing yet; follow the
                # text of the link, which must itself stay inside.
                link = os.readlink(leaf, dir_fd=dir_fd)
                base = posixpath.dirname(rel)
                joined = link if link.startswith("/") else posixpath.join(base, link)
                if joined.startswith("/"):
                    raise FileRuleError(
                        "refused", f"{display(rel)} is an absolute symlink; refused") from None
                return to_relative(joined)
            try:
                real = os.readlink(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
        inside = os.path.relpath(real, self.root)
        if inside.startswith(".."):
            raise FileRuleError("refused", f"{display(rel)} is a symlink that leaves {WORKSPACE}")
        return inside
