"""The workspace file rules, one copy for the host and the guest: which sandbox paths are
refused (and in what words), how an entry's name is shown, and which OS errors become which
error kind. ``corral._workspace.files`` (the host tiers, and the microVM host side's own check
before it sends a request) and the guest agent's ``workspace`` both use it; each turns a
``FileRuleError`` into its own error (``PathRefused``, ``FileNotFound``... on the host, a
``{"kind", "message"}`` reply in the guest) by its ``kind``.

Standard library only: the guest runs it on the template's python3.
"""

from __future__ import annotations

import errno
import posixpath

__all__ = ["WORKSPACE", "FileRuleError", "display", "os_error", "shown_name", "to_relative"]

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
