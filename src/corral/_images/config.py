"""The parts of an image's config a sandbox honours: environment, working directory, user,
entrypoint and command. Read from the image (untrusted), so checked and bounded here."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

from ..errors import ImageError

__all__ = ["ImageConfig", "parse_config"]

_MAX_ENV = 256
_MAX_TEXT = 32 * 1024
_MAX_ARGS = 256


@dataclass(frozen=True, slots=True)
class ImageConfig:
    env: dict[str, str] = field(default_factory=dict)
    working_dir: str | None = None
    # The image's user, kept for the record: every command runs as the sandbox user (uid 1000,
    # never root on the host), whatever the image asks for.
    user: str | None = None
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    # What runs a command given as one string: bash, or sh in an image without bash (set when
    # the image is unpacked).
    shell: str = "/bin/bash"

    @property
    def argv(self) -> list[str]:
        """What ``corral run`` runs when given no command (Docker's rule: entrypoint + cmd)."""
        return [*self.entrypoint, *self.cmd]

    def to_dict(self) -> dict[str, Any]:
        return {"env": self.env, "working_dir": self.working_dir, "user": self.user,
                "entrypoint": list(self.entrypoint), "cmd": list(self.cmd), "shell": self.shell}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ImageConfig:
        return cls(env=dict(data.get("env") or {}), working_dir=data.get("working_dir"),
                   user=data.get("user"), entrypoint=tuple(data.get("entrypoint") or ()),
                   cmd=tuple(data.get("cmd") or ()), shell=str(data.get("shell") or "/bin/bash"))


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or "\0" in value or len(value) > _MAX_TEXT:
        raise ImageError(f"the image config's {what} is not a text under {_MAX_TEXT} bytes")
    return value


def _args(value: object, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > _MAX_ARGS:
        raise ImageError(f"the image config's {what} is not a list of at most {_MAX_ARGS} "
                         "strings")
    return tuple(_text(v, what) for v in value)


def parse_config(blob: dict[str, Any]) -> ImageConfig:
    """The runtime part (``config``) of an OCI or Docker image config.

    Raises:
        ImageError: a malformed field.
    """
    config = blob.get("config") or {}
    if not isinstance(config, dict):
        raise ImageError("the image config's 'config' is not an object")
    env: dict[str, str] = {}
    raw_env = config.get("Env") or []
    if not isinstance(raw_env, list) or len(raw_env) > _MAX_ENV:
        raise ImageError(f"the image config's Env is not a list of at most {_MAX_ENV} entries")
    for item in raw_env:
        name, sep, value = _text(item, "Env").partition("=")
        if not sep or not name or not name.replace("_", "a").isalnum() or name[0].isdigit():
            raise ImageError(f"the image config's Env has an invalid entry {item[:80]!r}")
        env[name] = value
    working_dir = config.get("WorkingDir") or None
    if working_dir is not None:
        working_dir = _text(working_dir, "WorkingDir")
        if not working_dir.startswith("/") or ".." in working_dir.split("/"):
            raise ImageError(f"the image config's WorkingDir {working_dir[:80]!r} must be an "
                             "absolute path without '..'")
        working_dir = posixpath.normpath(working_dir)
        if working_dir == "/":
            working_dir = None
    user = config.get("User") or None
    return ImageConfig(env=env, working_dir=working_dir,
                       user=None if user is None else _text(user, "User"),
                       entrypoint=_args(config.get("Entrypoint"), "Entrypoint"),
                       cmd=_args(config.get("Cmd"), "Cmd"))
