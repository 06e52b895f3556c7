"""Image references as users write them, and the operator's policy on where images may come from.

Three forms:

* a registry reference, ``[host[:port]/]path[:tag][@sha256:<64 hex>]`` (optionally written
  ``docker://...``), normalised as Docker does: no host means Docker Hub (``docker.io``), and a
  one-part Hub path is an official image under ``library/``;
* ``oci:PATH[:TAG]``, an OCI image layout directory on this host;
* ``docker-archive:PATH``, a ``docker save`` tarball on this host.

The two local forms read host paths, so only the host's own operator may use them (the CLI and
the embedded SDK); a caller of the HTTP API can name registry references only.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import ImageRefused, UsageError

__all__ = ["ImagePolicy", "ImageRef", "parse_reference"]

Transport = Literal["registry", "oci", "docker-archive"]

_HUB = "docker.io"
# Names the Hub answers to; an allowlist entry "docker.io" covers them all.
_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
# distribution/reference's grammar: lower-case components joined by one separator.
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
                   r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*|\[[0-9a-fA-F:]+\])"
                   r"(?::[0-9]{1,5})?")
_TAG = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_MAX_REFERENCE = 1024


@dataclass(frozen=True, slots=True)
class ImageRef:
    """A parsed reference. ``source`` is what skopeo is given."""

    transport: Transport
    # Registry form: host ("docker.io", "127.0.0.1:5000"), repository path, tag and digest.
    registry: str = ""
    repository: str = ""
    tag: str | None = None
    digest: str | None = None
    # Local forms: the path on this host (and the tag inside an OCI layout).
    path: Path | None = None

    @property
    def local(self) -> bool:
        return self.transport != "registry"

    @property
    def source(self) -> str:
        if self.transport == "oci":
            return f"oci:{self.path}" + (f":{self.tag}" if self.tag else "")
        if self.transport == "docker-archive":
            return f"docker-archive:{self.path}"
        return f"docker://{self.canonical}"

    @property
    def canonical(self) -> str:
        """The reference in full: host, path, tag and digest as given."""
        if self.local:
            return self.source
        name = f"{self.registry}/{self.repository}"
        if self.tag:
            name += f":{self.tag}"
        if self.digest:
            name += f"@{self.digest}"
        return name

    @property
    def plain_http(self) -> bool:
        """A registry on this host's loopback speaks plain HTTP (Docker's rule as well); every
        other registry is reached over verified TLS."""
        host = self.registry.rsplit(":", 1)[0] if not self.registry.endswith("]") else \
            self.registry
        host = host.strip("[]")
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def __str__(self) -> str:
        return self.canonical


def _clip(text: str) -> str:
    # The reference is the caller's: echo at most 80 characters of it.
    return text if len(text) <= 80 else text[:80] + "..."


def parse_reference(text: object) -> ImageRef:
    """Parse an image reference (see the module doc).

    Raises:
        UsageError: not a reference, naming the part that is wrong.
    """
    if not isinstance(text, str):
        raise UsageError(f"an image reference must be a string, not {type(text).__name__}")
    if not text or len(text) > _MAX_REFERENCE or any(c.isspace() or c == "\0" for c in text):
        raise UsageError(f"invalid image reference {_clip(text)!r}: it must be 1-"
                         f"{_MAX_REFERENCE} characters without spaces")
    if text.startswith("oci:"):
        rest = text[len("oci:"):]
        path_text, _, tag = rest.partition(":")
        if tag and not _TAG.fullmatch(tag):
            raise UsageError(f"invalid tag {_clip(tag)!r} in {_clip(text)!r}")
        return ImageRef("oci", path=_local_path(path_text, text), tag=tag or None)
    if text.startswith("docker-archive:"):
        return ImageRef("docker-archive", path=_local_path(text[len("docker-archive:"):], text))
    return _parse_registry(text.removeprefix("docker://"), text)


def _local_path(path_text: str, text: str) -> Path:
    if not path_text.startswith("/"):
        raise UsageError(f"{_clip(text)!r}: give the local image's absolute path")
    return Path(path_text)


def _parse_registry(name: str, text: str) -> ImageRef:
    digest = None
    if "@" in name:
        name, digest = name.split("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise UsageError(f"invalid digest in {_clip(text)!r}: use @sha256: and 64 lower-case "
                             "hex digits")
    tag = None
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = name.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise UsageError(f"invalid tag {_clip(tag)!r} in {_clip(text)!r}: letters, digits, "
                             "'_', '.', '-', at most 128, not starting with '.' or '-'")
    parts = name.split("/")
    registry = _HUB
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"
                           or parts[0].startswith("[")):
        registry = parts.pop(0)
        if not _HOST.fullmatch(registry):
            raise UsageError(f"invalid registry host {_clip(registry)!r} in {_clip(text)!r}")
    if registry in _HUB_ALIASES:
        registry = _HUB
        if len(parts) == 1:
            parts = ["library", *parts]
    if not parts or not all(_COMPONENT.fullmatch(p) for p in parts):
        raise UsageError(f"invalid repository {_clip('/'.join(parts))!r} in {_clip(text)!r}: "
                         "lower-case letters and digits, separated by '.', '_', '-' or '/'")
    if tag is None and digest is None:
        tag = "latest"
    return ImageRef("registry", registry=registry, repository="/".join(parts), tag=tag,
                    digest=digest)


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    """Where images may come from: the operator's settings, never a caller's."""

    registries: tuple[str, ...]  # hosts ("docker.io", "127.0.0.1:5000"); "*" allows any
    require_digest: bool = False

    @classmethod
    def from_setting(cls, registries: str, *, require_digest: bool = False) -> ImagePolicy:
        hosts = tuple(h.strip().lower() for h in registries.split(",") if h.strip())
        return cls(registries=tuple(_HUB if h in _HUB_ALIASES else h for h in hosts),
                   require_digest=require_digest)

    def check(self, ref: ImageRef, *, allow_local: bool) -> None:
        """Raise ``ImageRefused`` unless ``ref`` may be pulled.

        ``allow_local``: the caller is this host's operator (CLI, embedded SDK), who may
        name paths on the host; a remote caller may not.
        """
        if ref.local:
            if not allow_local:
                raise ImageRefused(
                    f"{ref.transport}: images are read from paths on the Corral host, which "
                    "only its operator may name (with `corral templates pull`); name an image "
                    "in a registry instead")
            return
        if "*" not in self.registries and ref.registry.lower() not in self.registries:
            allowed = ", ".join(self.registries) or "none"
            raise ImageRefused(
                f"registry {ref.registry} is not on the operator's allowlist (allowed: "
                f"{allowed}); the operator adds it to CORRAL_REGISTRIES (Settings.registries)")
        if self.require_digest and ref.digest is None:
            raise ImageRefused(
                f"{ref.canonical}: this host takes only digest-pinned images "
                "(CORRAL_REGISTRIES_REQUIRE_DIGEST); add @sha256:... to the reference "
                "(`skopeo inspect` prints it)")
