"""Paths on the E2B surface: ``/home/user`` is the workspace.

E2B's SDKs and templates assume the user's home, ``/home/user``, is where work happens: commands
start there, relative file paths resolve from it. In every Corral sandbox ``/home/user`` is a
second mount of the workspace, so commands see the same files there and under ``/workspace``;
the file API reaches the same tree under either name and reports it as ``/home/user``.
"""

from __future__ import annotations

import posixpath

from ..errors import PathRefused

__all__ = ["HOME", "to_e2b", "to_workspace"]

HOME = "/home/user"
_WORKSPACE = "/workspace"


def to_workspace(path: str) -> str:
    """The file API's path (under ``/workspace``) for an E2B path: absolute under
    ``/home/user`` or ``/workspace``, or relative to ``/home/user``."""
    if not isinstance(path, str) or not path:
        raise PathRefused("path must be a non-empty string")
    if "\0" in path:
        raise PathRefused("path contains a NUL byte")
    absolute = path if path.startswith("/") else posixpath.join(HOME, path)
    normal = posixpath.normpath(absolute)
    if normal.startswith("//"):
        normal = "/" + normal.lstrip("/")
    for root in (HOME, _WORKSPACE):
        if normal == root:
            return _WORKSPACE
        if normal.startswith(root + "/"):
            return _WORKSPACE + normal[len(root):]
    raise PathRefused(f"{path!r} is outside {HOME}: a Corral sandbox's file API reaches only "
                      f"its workspace, which is {HOME} (also mounted at {_WORKSPACE})")


def to_e2b(path: str) -> str:
    """The path the SDK sees for a file API path (``/workspace/x`` → ``/home/user/x``)."""
    if path == _WORKSPACE:
        return HOME
    if path.startswith(_WORKSPACE + "/"):
        return HOME + path[len(_WORKSPACE):]
    return path
