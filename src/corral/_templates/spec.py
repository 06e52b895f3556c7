"""What a template is made of: Debian packages, files and setup commands.

A spec is plain data, validated once when it is read (from a built-in table, a TOML or a JSON
file) so the builder never has to second-guess it. Its hash is taken over a normalised form:
package order and repeats, and the spec's name and description, do not change what gets built,
so they do not change the hash either.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import posixpath
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError

__all__ = [
    "BUILDER_VERSION",
    "DEBIAN_MIRROR",
    "DEBIAN_SUITE",
    "TemplateFile",
    "TemplateSpec",
    "check_name",
    "check_reference",
    "load_spec_file",
    "parse_spec",
]

# Bump when the builder's output changes for the same spec (options, scrubbing), so old builds
# are not mistaken for new ones.
BUILDER_VERSION = "1"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"

# Lower case so a name is one directory whatever the file system; no dots so "<name>-<hash>"
# and "<name>.current" cannot be confused.
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,39}")
RESERVED_NAMES = frozenset({"base"})
# Debian policy 5.6.1: lower case letters, digits, + - . ; at least two characters.
_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]+")
_KEYS = ("name", "description", "packages", "files", "setup", "image")
_FILE_KEYS = ("path", "content", "mode")
# Only these parts of a built root become part of a sandbox's root (see template.py); a file
# anywhere else would be built but never seen.
_FILE_ROOTS = ("/etc/", "/opt/", "/usr/", "/var/")
# Corral writes these for every sandbox; a spec's copy would be silently replaced.
_CORRAL_ETC = frozenset({
    "/etc/passwd", "/etc/group", "/etc/shadow", "/etc/gshadow", "/etc/hosts", "/etc/hostname",
    "/etc/resolv.conf",
})
_MAX_FILE_BYTES = 1024 * 1024
_MAX_PACKAGES = 500
_MAX_SETUP = 50


@dataclass(frozen=True, slots=True)
class TemplateFile:
    """A file written into the root after the packages are installed."""

    path: str
    content: str
    mode: int = 0o644


@dataclass(frozen=True, slots=True)
class TemplateSpec:
    """A template: Debian ``bookworm`` packages (no recommends), then files, then setup commands
    run as root in the new root (with network, at build time only)."""

    name: str
    packages: tuple[str, ...]
    files: tuple[TemplateFile, ...] = ()
    setup: tuple[str, ...] = ()
    description: str = ""
    # An image reference instead of packages: the template is that image, pulled
    # (corral._images); the builder never sees such a spec.
    image: str | None = None

    def normalised(self) -> dict[str, Any]:
        """What the hash covers: everything that changes the built root, nothing else."""
        return {
            "builder": BUILDER_VERSION,
            "suite": DEBIAN_SUITE,
            "mirror": DEBIAN_MIRROR,
            "packages": sorted(set(self.packages)),
            "files": [
                {"path": f.path, "content": f.content, "mode": f.mode}
                for f in sorted(self.files, key=lambda f: f.path)
            ],
            # Order matters for commands: they may depend on each other.
            "setup": list(self.setup),
        }

    @property
    def hash(self) -> str:
        blob = json.dumps(self.normalised(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "packages": sorted(set(self.packages)),
            "files": [{"path": f.path, "content": f.content, "mode": f"{f.mode:04o}"}
                      for f in self.files],
            "setup": list(self.setup),
        }


def check_reference(reference: object, *, where: str = "template") -> str:
    """Return ``reference`` (``name`` or ``name:tag``) if it can name a build, else raise
    ``UsageError``."""
    from .catalog import TAG

    if isinstance(reference, str) and ":" in reference:
        name, _, tag = reference.partition(":")
        check_name(name, where=f"{where} name")
        if not TAG.fullmatch(tag):
            raise UsageError(f"invalid tag {tag[:64]!r} in {where} {reference[:80]!r}: 1-64 "
                             "letters, digits, '_', '.', '-', not starting with '.' or '-'")
        return reference
    return check_name(reference, where=f"{where} name")


def check_name(name: object, *, where: str = "template name") -> str:
    """Return ``name`` if it can name a built template, else raise ``UsageError``."""
    if not isinstance(name, str):
        raise UsageError(f"{where} must be a string, not {type(name).__name__}")
    if not _NAME.fullmatch(name):
        raise UsageError(
            f"invalid {where} {name!r}: use 1-40 lower-case letters, digits, '-' or '_', "
            "starting with a letter")
    if name in RESERVED_NAMES:
        raise UsageError(f"{where} {name!r} is reserved (it is the host's own system); "
                         "choose another name")
    return name


def _unknown_key(key: str, allowed: tuple[str, ...], where: str) -> UsageError:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return UsageError(f"{where}: unknown key {key!r}{hint} (allowed: {', '.join(allowed)})")


def _string_list(value: object, what: str, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"{where}: {what} must be a list of strings")
    return list(value)


def _parse_package(raw: str, where: str) -> str:
    name = raw.strip()
    if not _PACKAGE.fullmatch(name):
        raise UsageError(
            f"{where}: {raw!r} is not a Debian package name (lower-case letters, digits, "
            "'+', '-', '.'; versions and architectures are not supported)")
    return name


def _parse_file(entry: object, index: int, where: str) -> TemplateFile:
    at = f"{where}: files[{index}]"
    if not isinstance(entry, Mapping):
        raise UsageError(f"{at} must be a table with 'path' and 'content'")
    for key in entry:
        if key not in _FILE_KEYS:
            raise _unknown_key(str(key), _FILE_KEYS, at)
    path, content, mode = entry.get("path"), entry.get("content"), entry.get("mode", "0644")
    if not isinstance(path, str) or not path:
        raise UsageError(f"{at}: 'path' must be a non-empty string")
    if not isinstance(content, str):
        raise UsageError(f"{at} ({path}): 'content' must be a string")
    if "\0" in path or not path.startswith("/") or posixpath.normpath(path) != path:
        raise UsageError(f"{at}: path {path!r} must be absolute and normalised (no '..', "
                         "'.', '//' or trailing '/')")
    if not path.startswith(_FILE_ROOTS):
        raise UsageError(f"{at}: path {path!r} is outside the parts of the root a sandbox "
                         f"sees; put it under {', '.join(r.rstrip('/') for r in _FILE_ROOTS)}")
    if path in _CORRAL_ETC:
        raise UsageError(f"{at}: {path} is written by Corral for every sandbox and cannot be "
                         "set by a template")
    if len(content.encode()) > _MAX_FILE_BYTES:
        raise UsageError(f"{at} ({path}): content is over {_MAX_FILE_BYTES} bytes; install "
                         "large files from a package or a setup command")
    if isinstance(mode, int) and not isinstance(mode, bool):
        mode_value = mode
    elif isinstance(mode, str) and re.fullmatch(r"0?[0-7]{3}", mode):
        mode_value = int(mode, 8)
    else:
        raise UsageError(f"{at} ({path}): mode {mode!r} must be an octal string like '0644'")
    if mode_value & ~0o777:
        raise UsageError(f"{at} ({path}): mode {mode_value:o} may only hold permission bits "
                         "(no setuid, setgid or sticky)")
    return TemplateFile(path=path, content=content, mode=mode_value)


def parse_spec(data: object, *, where: str = "template spec",
               name: str | None = None) -> TemplateSpec:
    """Validate ``data`` (a mapping, as read from TOML or JSON) into a spec.

    ``name`` overrides (or supplies) the spec's own name.

    Raises:
        UsageError: naming the key and what is wrong with it.
    """
    if not isinstance(data, Mapping):
        raise UsageError(f"{where}: must be a table (mapping) of keys, not "
                         f"{type(data).__name__}")
    for key in data:
        if key not in _KEYS:
            raise _unknown_key(str(key), _KEYS, where)
    chosen = name if name is not None else data.get("name")
    if chosen is None:
        raise UsageError(f"{where}: no 'name'; add name = \"...\" or pass a NAME")
    check_name(chosen, where=f"{where}: name")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise UsageError(f"{where}: description must be a string")
    if "image" in data:
        image = data["image"]
        if not isinstance(image, str) or not image:
            raise UsageError(f"{where}: image must be an image reference such as "
                             "\"registry.example/team/tools:1.4\"")
        extra = [k for k in ("packages", "files", "setup") if k in data]
        if extra:
            raise UsageError(f"{where}: an image template takes no {', '.join(extra)}; "
                             "describe changes to an image in a Dockerfile "
                             "(`corral templates build NAME --dockerfile PATH`)")
        return TemplateSpec(name=str(chosen), packages=(), description=description,
                            image=image)
    if "packages" not in data:
        raise UsageError(f"{where}: no 'packages'; list the Debian packages to install, e.g. "
                         "packages = [\"python3\"]")
    packages = [_parse_package(p, where)
                for p in _string_list(data["packages"], "packages", where)]
    if len(packages) > _MAX_PACKAGES:
        raise UsageError(f"{where}: more than {_MAX_PACKAGES} packages")
    raw_files = data.get("files", [])
    if not isinstance(raw_files, list):
        raise UsageError(f"{where}: files must be a list of tables ([[files]] in TOML)")
    files = [_parse_file(entry, i, where) for i, entry in enumerate(raw_files)]
    seen: set[str] = set()
    for f in files:
        if f.path in seen:
            raise UsageError(f"{where}: file {f.path} is listed twice")
        seen.add(f.path)
    setup = _string_list(data.get("setup", []), "setup", where)
    if len(setup) > _MAX_SETUP:
        raise UsageError(f"{where}: more than {_MAX_SETUP} setup commands")
    for i, command in enumerate(setup):
        if not command.strip():
            raise UsageError(f"{where}: setup[{i}] is empty")
        if "\0" in command:
            raise UsageError(f"{where}: setup[{i}] contains a NUL byte")
    return TemplateSpec(name=str(chosen), packages=tuple(sorted(set(packages))),
                        files=tuple(files), setup=tuple(setup), description=description)


def load_spec_file(path: Path, *, name: str | None = None) -> TemplateSpec:
    """Read a spec from a ``.toml`` or ``.json`` file.

    Raises:
        UsageError: unreadable file, unknown format, syntax error or invalid spec.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read template spec {path}: {exc}") from exc
    data: object
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"{path}: not valid TOML: {exc}") from exc
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}: not valid JSON: {exc}") from exc
    else:
        raise UsageError(f"{path}: a template spec must end in .toml or .json")
    return parse_spec(data, where=str(path), name=name)
