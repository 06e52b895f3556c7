"""Which template a sandbox may be made from, questions of the catalog a backend, the control plane
and a surface all ask: the names that need no spec file, whether a name is built here and which
build a sandbox gets, and whether a path is an executable inside a root (an image's, a build's).
Making a root into a sandbox's (its curated ``/etc``) is a backend's: ``_backends/_linux/template``.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from ..errors import UsageError
from .builtin import BUILTIN_SPECS
from .catalog import BuiltTemplate, current_build, list_builds
from .spec import check_reference

__all__ = ["TEMPLATES", "current_template", "executable_in_root", "not_built",
           "require_template", "template_version"]

# The names a sandbox may ask for without a spec file: the host system and the built-in specs
# (these still have to be built once, see require_template). Any built name works too.
TEMPLATES = ("base", *BUILTIN_SPECS)


def not_built(name: str, templates_dir: Path) -> UsageError:
    """The error for a template name a sandbox cannot be made from here: what to build."""
    # The name is the caller's: echoed (and logged) at most 64 characters of it.
    name = name if len(name) <= 64 else name[:64] + "..."
    if name in BUILTIN_SPECS:
        return UsageError(
            f"template {name!r} is not built on this host yet; build it once with "
            f"`corral templates build {name}`, then create the sandbox again")
    built: list[str] = []
    with contextlib.suppress(OSError):
        built = sorted({b.name for b in list_builds(templates_dir)})
    available = ", ".join(["base", *built]) if built else "base"
    return UsageError(
        f"unknown template {name!r}; available here: {available}. Build one with "
        f"`corral templates build {' | '.join(BUILTIN_SPECS)}` or from a spec with "
        "`corral templates build --file SPEC.toml`")


def current_template(name: str, templates_dir: Path) -> BuiltTemplate:
    """The build a sandbox of built template ``name`` gets now; UsageError if there is none."""
    try:
        check_reference(name)
    except UsageError:
        raise not_built(name, templates_dir) from None
    build = current_build(templates_dir, name)
    if build is None:
        raise not_built(name, templates_dir)
    return build


def require_template(name: str, templates_dir: Path) -> None:
    """Raise ``UsageError`` unless a sandbox can be created from template ``name`` now."""
    if name != "base":
        current_template(name, templates_dir)


def template_version(name: str, templates_dir: Path) -> str | None:
    """The version of ``name`` a sandbox created now gets (``BuiltTemplate.version``; None for
    ``base``, the host's own). Raises ``UsageError`` like ``require_template``."""
    return None if name == "base" else current_template(name, templates_dir).version


def executable_in_root(root: Path, path: str, hops: int = 40) -> bool:
    """Is ``path`` an executable file inside ``root``, its symlinks resolved within ``root``
    (as they resolve inside the sandbox), never on the host?"""
    parts = [p for p in path.split("/") if p]
    resolved: list[str] = []
    while parts and hops > 0:
        part = parts.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        if part == ".":
            continue
        here = root.joinpath(*resolved, part)
        try:
            st = os.lstat(here)
        except OSError:
            return False
        if stat.S_ISLNK(st.st_mode):
            hops -= 1
            target = os.readlink(here)
            if target.startswith("/"):
                resolved = []
            parts = [p for p in target.split("/") if p] + parts
            continue
        resolved.append(part)
        if parts and not stat.S_ISDIR(st.st_mode):
            return False
    if parts:
        return False
    try:
        st = os.lstat(root.joinpath(*resolved))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and bool(st.st_mode & 0o111)
