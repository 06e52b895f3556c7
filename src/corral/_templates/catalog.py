"""Built templates on disk, and the locks that keep concurrent builds and removals apart.

Layout of ``$CORRAL_HOME/templates``::

    base/etc.<stamp>/               the base template's curated /etc (namespace/template.py)
    <name>-<hash>/root/             a built root filesystem; never changed after its rename
    <name>-<hash>/template.json     what was built, when, how big (written before the rename)
    <name>-<hash>/etc.<stamp>/      the curated /etc sandboxes see (namespace/template.py)
    <name>.current -> <name>-<hash> the build a sandbox of template <name> gets
    <name>.tag.<tag> -> <name>-<hash> the build a sandbox of template <name>:<tag> gets
    .locks/                         flock files: one per build, one per name
    .build-*/  .trash-*/            builds in progress, removals in progress

A build directory appears by one ``rename`` with its metadata already inside, so a reader sees a
whole build or none. ``<name>.current`` is replaced by ``rename`` too.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = [
    "BuiltTemplate",
    "build_dir",
    "current_build",
    "list_builds",
    "locked",
    "name_lock",
    "read_build",
    "remove_builds",
    "set_current",
]

METADATA = "template.json"
_BUILD_DIR = re.compile(r"(?P<name>[a-z][a-z0-9_-]*)-(?P<hash>[0-9a-f]{16})")
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_TAG_POINTER = ".tag."


@dataclass(frozen=True, slots=True)
class BuiltTemplate:
    """One build of a template."""

    name: str
    hash: str
    path: Path
    built_at: float
    build_s: float
    size_bytes: int
    packages: tuple[str, ...]
    installed_packages: int
    spec: dict[str, Any]
    current: bool = False
    tags: tuple[str, ...] = ()  # the tags naming this build (``name:tag``)
    # A pulled image: its reference, manifest digest, layers and config (corral._images).
    image: dict[str, Any] | None = None

    @property
    def root(self) -> Path:
        return self.path / "root"

    @property
    def version(self) -> str:
        """What names this exact build: an image's manifest digest, else the spec hash."""
        return str(self.image["digest"]) if self.image else self.hash

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "hash": self.hash, "path": str(self.path),
            "built_at": self.built_at, "build_s": round(self.build_s, 3),
            "size_bytes": self.size_bytes, "packages": list(self.packages),
            "installed_packages": self.installed_packages, "current": self.current,
            "version": self.version, "tags": list(self.tags),
            "image": None if self.image is None else {
                "reference": self.image.get("reference"), "digest": self.image.get("digest"),
                "layers": len(self.image.get("layers", ())),
                "config": self.image.get("config")},
        }


def build_dir(templates_dir: Path, name: str, spec_hash: str) -> Path:
    return templates_dir / f"{name}-{spec_hash}"


def read_build(path: Path) -> BuiltTemplate | None:
    """The build in ``path``, or None if there is none (or only a damaged one)."""
    match = _BUILD_DIR.fullmatch(path.name)
    if match is None or not (path / "root").is_dir():
        return None
    try:
        meta = json.loads((path / METADATA).read_text())
        return BuiltTemplate(
            name=match["name"], hash=match["hash"], path=path,
            built_at=float(meta["built_at"]), build_s=float(meta["build_s"]),
            size_bytes=int(meta["size_bytes"]), packages=tuple(meta["spec"]["packages"]),
            installed_packages=int(meta.get("installed_packages", 0)), spec=meta["spec"],
            image=meta.get("image") if isinstance(meta.get("image"), dict) else None,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def split_reference(reference: str) -> tuple[str, str | None]:
    """``name`` or ``name:tag``, split (not validated)."""
    name, sep, tag = reference.partition(":")
    return name, (tag if sep else None)


def pointer(templates_dir: Path, reference: str) -> Path:
    """The symlink naming the build ``reference`` (``name`` or ``name:tag``) gets."""
    name, tag = split_reference(reference)
    return templates_dir / (f"{name}.current" if tag is None else f"{name}{_TAG_POINTER}{tag}")


def _pointer(templates_dir: Path, name: str) -> Path:
    return templates_dir / f"{name}.current"


def current_build(templates_dir: Path, name: str) -> BuiltTemplate | None:
    """The build sandboxes of template ``name`` (or ``name:tag``) get, or None if there is
    none."""
    try:
        target = os.readlink(pointer(templates_dir, name))
    except OSError:
        return None
    match = _BUILD_DIR.fullmatch(target)
    if match is None or match["name"] != split_reference(name)[0]:
        return None
    build = read_build(templates_dir / target)
    return None if build is None else replace(build, current=True)


def set_current(templates_dir: Path, name: str, spec_hash: str,
                tag: str | None = None) -> None:
    """Point ``name`` (``name:tag`` with ``tag``) at one of its builds. Call with ``name_lock``
    held."""
    target = pointer(templates_dir, name if tag is None else f"{name}:{tag}")
    tmp = templates_dir / f".{name}.pointer.{secrets.token_hex(4)}"
    os.symlink(f"{name}-{spec_hash}", tmp)
    try:
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _tags(templates_dir: Path, entries: list[Path]) -> dict[str, list[str]]:
    """Build directory name -> the tags pointing at it."""
    found: dict[str, list[str]] = {}
    for entry in entries:
        name, sep, tag = entry.name.partition(_TAG_POINTER)
        if not sep or not TAG.fullmatch(tag):
            continue
        with contextlib.suppress(OSError):
            found.setdefault(os.readlink(entry), []).append(tag)
    return found


def list_builds(templates_dir: Path) -> list[BuiltTemplate]:
    """Every complete build, by name then newest first."""
    try:
        entries = list(templates_dir.iterdir())
    except FileNotFoundError:
        return []
    current: dict[str, str | None] = {}
    tags = _tags(templates_dir, entries)
    builds = []
    for entry in entries:
        build = read_build(entry)
        if build is None:
            continue
        if entry.name in tags:
            build = replace(build, tags=tuple(sorted(tags[entry.name])))
        if build.name not in current:
            with contextlib.suppress(OSError):
                current[build.name] = os.readlink(_pointer(templates_dir, build.name))
        if current.get(build.name) == entry.name:
            build = replace(build, current=True)
        builds.append(build)
    return sorted(builds, key=lambda b: (b.name, -b.built_at))


def remove_builds(templates_dir: Path, name: str) -> list[BuiltTemplate]:
    """Remove every build of ``name``; returns what was removed. Takes ``name_lock``.

    Each build is renamed out of the way first, so nobody finds a half-removed one.
    """
    with name_lock(templates_dir, name):
        builds = [b for b in list_builds(templates_dir) if b.name == name]
        _pointer(templates_dir, name).unlink(missing_ok=True)
        for build in builds:
            for tag in build.tags:
                pointer(templates_dir, f"{name}:{tag}").unlink(missing_ok=True)
        for build in builds:
            trash = templates_dir / f".trash-{build.path.name}-{secrets.token_hex(4)}"
            os.rename(build.path, trash)
            shutil.rmtree(trash, ignore_errors=True)
    return builds


@contextlib.contextmanager
def locked(path: Path, on_wait: Callable[[], None] | None = None, *,
           shared: bool = False) -> Iterator[None]:
    """Hold an exclusive (or ``shared``) ``flock`` on ``path`` (released if the process
    dies)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)


def name_lock(templates_dir: Path, name: str) -> contextlib.AbstractContextManager[None]:
    """Serialises changes to which builds of ``name`` exist and which one is current."""
    return locked(templates_dir / ".locks" / f"{name}.lock")
