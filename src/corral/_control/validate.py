"""Pure validators of what callers hand the control plane: one function, and one message, per
rule. No I/O and no state: every surface (SDK, HTTP, MCP, CLI) reaches these through the
control plane, so a rule is written, and worded, exactly once.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._backends import BACKENDS
from .._workspace.files import to_relative
from ..errors import CommandError, CommandNotFound, PathRefused, SandboxNotFound, UsageError
from ..models import ResourceTier

__all__ = [
    "MAX_FORKS",
    "SNAPSHOT_NAME_PATTERN",
    "Command",
    "command",
    "command_argv",
    "command_cwd",
    "command_env",
    "command_id",
    "command_stdin",
    "command_timeout",
    "context",
    "fork_count",
    "isolation",
    "labels",
    "positive_seconds",
    "sandbox_id",
    "secret_names",
    "snapshot_name",
    "snapshot_ref",
    "template",
    "ttl",
]

MAX_FORKS = 64
MAX_ENV_BYTES = 256 * 1024
MAX_ARGV_BYTES = 1024 * 1024
MAX_STDIN_BYTES = 64 * 1024 * 1024
SNAPSHOT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}$"

_ID_RE = re.compile(r"^sbx_[0-9a-z]{12}$")
_COMMAND_ID_RE = re.compile(r"^cmd_[0-9a-f]{12}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}$")
_SNAPSHOT_NAME_RE = re.compile(SNAPSHOT_NAME_PATTERN)
_SNAPSHOT_ID_RE = re.compile(r"^snap_[0-9a-z]{12}$")
_EMPTY_COMMAND = "the command is empty; pass a shell string or an argv list"


@dataclass(frozen=True, slots=True)
class Command:
    """A command as the backend runs it: argv, a cwd inside /workspace, env and stdin bytes."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    stdin: bytes | None


def command(cmd: str | Sequence[str], cwd: str | None, envs: Mapping[str, str] | None,
            stdin: str | bytes | None) -> Command:
    """The command to run, or ``CommandError`` (``PathRefused`` for a cwd outside)."""
    return Command(argv=command_argv(cmd), cwd=command_cwd(cwd), env=command_env(envs),
                   stdin=command_stdin(stdin))


def command_argv(cmd: str | Sequence[str]) -> list[str]:
    """A command's argv: a shell string runs under ``/bin/bash -c``; or ``CommandError``."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise CommandError(_EMPTY_COMMAND)
        argv = ["/bin/bash", "-c", cmd]
    elif isinstance(cmd, Sequence) and not isinstance(cmd, bytes | bytearray):
        argv = list(cmd)
        if not argv:
            raise CommandError(_EMPTY_COMMAND)
        for i, arg in enumerate(argv):
            if not isinstance(arg, str):
                raise CommandError(f"argv[{i}] is {type(arg).__name__}, not str")
        if not argv[0]:
            raise CommandError("argv[0] (the program) is empty")
    else:
        raise CommandError(
            f"command must be a string or a list of strings, not {type(cmd).__name__}"
        )
    if any("\x00" in a for a in argv):
        raise CommandError("the command contains a NUL byte")
    try:
        for a in argv:
            a.encode()
    except UnicodeEncodeError:
        raise CommandError("the command is not valid Unicode text (a lone surrogate); pass "
                           "UTF-8 text") from None
    if sum(len(a.encode()) + 1 for a in argv) > MAX_ARGV_BYTES:
        raise CommandError(f"the command is longer than {MAX_ARGV_BYTES} bytes; pass data "
                           "through stdin or a file instead")
    return argv


def command_env(envs: Mapping[str, str] | None) -> dict[str, str]:
    """A command's extra environment, or ``CommandError``."""
    env: dict[str, str] = {}
    total = 0
    for key, value in (envs or {}).items():
        if not isinstance(key, str) or not _ENV_NAME_RE.match(key):
            # Empty, '=' or NUL cannot be one environment entry (NAME=value).
            shown = key[:64] + "..." if isinstance(key, str) and len(key) > 64 else key
            raise CommandError(f"invalid environment variable name {shown!r}; names are "
                               "letters, digits and '_', not starting with a digit")
        if not isinstance(value, str):
            raise CommandError(f"environment variable {key} must be a string")
        if "\x00" in value:
            raise CommandError(f"environment variable {key} contains a NUL byte, which no "
                               "environment entry can hold; remove it")
        try:
            value.encode()
        except UnicodeEncodeError:
            raise CommandError(f"environment variable {key} is not valid Unicode text (a lone "
                               "surrogate); pass UTF-8 text") from None
        total += len(key) + len(value.encode()) + 2
        env[key] = value
    if total > MAX_ENV_BYTES:
        raise CommandError(
            f"the environment is {total} bytes, over the {MAX_ENV_BYTES}-byte limit; pass "
            "large data through files or stdin"
        )
    return env


def command_cwd(cwd: str | None) -> str:
    """Where the command starts: a relative path is under the workspace; an absolute one is
    taken as it is (normalised), since whether it exists and may be entered is the sandbox's
    own answer (the tier's chdir, inside the sandbox), not the host-side workspace's.
    ``PathRefused`` for a path that cannot be one."""
    if cwd is None:
        return "/workspace"
    if not isinstance(cwd, str) or not cwd.startswith("/"):
        rel = to_relative(cwd)  # refuses what is not a path, and ".." out of the workspace
        return "/workspace" if rel == "." else f"/workspace/{rel}"
    if "\x00" in cwd:
        raise PathRefused("the working directory contains a NUL byte")
    try:
        size = len(cwd.encode())
    except UnicodeEncodeError:
        raise PathRefused("the working directory is not valid UTF-8") from None
    if size > 4096:
        raise PathRefused("the working directory is longer than 4096 bytes")
    normal = posixpath.normpath(cwd)
    # POSIX lets "//x" mean something else than "/x"; Linux does not
    return "/" + normal.lstrip("/")


def command_stdin(stdin: str | bytes | None) -> bytes | None:
    """A command's stdin as bytes (text is UTF-8), or ``CommandError``."""
    data: bytes | None
    if stdin is None:
        data = None
    elif isinstance(stdin, str):
        data = stdin.encode()
    elif isinstance(stdin, bytes | bytearray | memoryview):
        data = bytes(stdin)
    else:
        raise CommandError(f"stdin must be str or bytes, not {type(stdin).__name__}")
    if data is not None and len(data) > MAX_STDIN_BYTES:
        raise CommandError(f"stdin is over {MAX_STDIN_BYTES} bytes; write a file instead")
    return data


def context(value: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    if value is not None and not isinstance(value, Mapping):
        raise UsageError(f"context must be a mapping, not {type(value).__name__}")
    return value


def positive_seconds(value: object, name: str = "timeout") -> float:
    """A duration: a positive number of seconds (not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        # 0 and 0.0 read the same: surfaces that parse JSON numbers as floats say it alike.
        shown = f"{value:g}" if isinstance(value, int | float) and not isinstance(
            value, bool) else repr(value)
        raise UsageError(f"{name} must be a positive number of seconds, got {shown}")
    return float(value)


def command_timeout(timeout: float | None, tier: ResourceTier) -> float:
    """A command's time limit: the tier's default, or ``timeout`` within the tier's maximum."""
    if timeout is None:
        return tier.command_timeout_s
    positive_seconds(timeout)
    if timeout > tier.command_timeout_s:
        raise UsageError(
            f"timeout {timeout:g} s is over the {tier.name} tier's limit of "
            f"{tier.command_timeout_s:g} s; use resources='large' for longer commands"
        )
    return float(timeout)


def ttl(timeout: float, max_ttl: float, *, name: str = "timeout") -> float:
    """A lifetime (``timeout``, ``idle_timeout``) in seconds, within ``max_ttl``."""
    seconds = positive_seconds(timeout, name)  # the request models' rule, and its words
    if seconds > max_ttl:
        raise UsageError(f"{name} must be at most {max_ttl:g} seconds, got {seconds:g}")
    return seconds


def labels(values: Mapping[str, str] | None) -> dict[str, str]:
    clean: dict[str, str] = {}
    for key, value in (values or {}).items():
        if not isinstance(key, str) or not _LABEL_RE.match(key):
            raise UsageError(f"invalid label name {key!r}: letters, digits, _ . - / only")
        if not isinstance(value, str) or len(value) > 256:
            raise UsageError(f"label {key} must be a string of at most 256 characters")
        clean[key] = value
    if len(clean) > 64:
        raise UsageError("at most 64 labels per sandbox")
    return clean


def isolation(name: object) -> str:
    if not isinstance(name, str):
        raise UsageError(f"isolation must be a string, not {type(name).__name__}")
    if name not in BACKENDS:
        raise UsageError(f"unknown isolation tier {name!r}; choose one of: "
                         f"{', '.join(BACKENDS)}")
    return name


def template(name: object) -> str:
    if not isinstance(name, str):
        raise UsageError(f"template must be a string, not {type(name).__name__}")
    return name


def secret_names(names: Sequence[str] | None) -> list[str]:
    if isinstance(names, str):
        raise UsageError("secrets takes a list of secret names, not a single string")
    return list(names or [])


def sandbox_id(value: object) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise SandboxNotFound(
            f"{value!r} is not a sandbox id (they look like sbx_0123456789ab); "
            "`corral ls` lists them"
        )
    return value


def command_id(value: object) -> str:
    if not isinstance(value, str) or not _COMMAND_ID_RE.match(value):
        raise CommandNotFound(f"{value!r} is not a command id")
    return value


def snapshot_name(name: str | None) -> str | None:
    if name is None:
        return None
    if not isinstance(name, str) or not _SNAPSHOT_NAME_RE.fullmatch(name) \
            or _SNAPSHOT_ID_RE.match(name):
        raise UsageError(
            f"invalid snapshot name {name!r}: 1-63 letters, digits, _ . - (starting with a "
            "letter or digit), and not shaped like a snapshot id")
    return name


def snapshot_ref(ref: object) -> str:
    if not isinstance(ref, str) or not ref:
        raise UsageError(f"a snapshot is named by its id or name, not {ref!r}")
    return ref


def fork_count(count: object) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORKS:
        raise UsageError(f"count must be an integer from 1 to {MAX_FORKS}, not {count!r}")
    return count
