"""What E2B's Template SDK sends, made into a Corral Dockerfile build (``corral._images.build``).

The SDK describes a template as a base (``fromImage``) and steps (``RUN``, ``COPY``, ``ENV``,
``WORKDIR``, ``USER``); ``COPY`` sources arrive first as tar archives, uploaded by content hash.
Here every field is checked, the steps become a one-stage Dockerfile whose line ``n + 1`` is step
``n`` (so the builder's "Dockerfile:7: ..." names the SDK's step 6, which its stack traces use),
each archive is unpacked into the build context under a directory of its step, refusing any
member that would land outside it, and the build's progress becomes E2B's log entries.

What Corral's builder cannot do is refused with a message saying so (``fromTemplate``, registry
credentials, start and ready commands), never accepted and ignored.
"""

from __future__ import annotations

import json
import posixpath
import re
import shutil
import tarfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    pass

__all__ = ["BuildLog", "LogEntry", "Plan", "TarRefused", "check_archive",
           "plan_build", "unpack_archive"]

Level = Literal["debug", "info", "warn", "error"]
LEVELS: tuple[Level, ...] = ("debug", "info", "warn", "error")

MAX_STEPS = 400
MAX_ARG = 64 * 1024  # one step argument (a RUN script)
MAX_ARCHIVE_ENTRIES = 100_000
MAX_ARCHIVE_BYTES = 4 * 1024 * 1024 * 1024  # what one archive may unpack to
_MAX_LOG_ENTRIES = 20_000
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}(:[a-z_0-9][a-z0-9_-]{0,31})?")
_HASH = re.compile(r"[0-9a-f]{64}")
# Registry references only: a host-side path (``oci:``, ``docker-archive:``) is the operator's.
_IMAGE = re.compile(r"[a-z0-9][a-z0-9._:/@-]{0,254}(:[A-Za-z0-9_.-]{1,128})?")
_LINE = re.compile(r"^Dockerfile:(\d+): ")


class PlanError(ValueError):
    """A template the builder cannot build as sent; ``step`` is the SDK's step name."""

    def __init__(self, message: str, step: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.step = step


class TarRefused(ValueError):
    """An uploaded archive that is refused whole (the message names the member)."""


# -- the plan ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    """A checked template: its Dockerfile, the archives its COPY steps need, and notes."""

    image: str
    dockerfile: str
    copies: Mapping[int, str]  # step number (1-based) -> files hash
    steps: Mapping[int, str]  # Dockerfile line -> the SDK's step ("base", "1", ...)
    notes: tuple[str, ...] = ()

    def step_of(self, message: str) -> str | None:
        """The SDK's step a builder message names (``Dockerfile:N: ...``), if it names one."""
        match = _LINE.match(message)
        return None if match is None else self.steps.get(int(match.group(1)))


def _text(value: object, what: str, step: str, *, allow_newline: bool = False) -> str:
    if not isinstance(value, str):
        raise PlanError(f"{what} must be a string", step)
    if len(value) > MAX_ARG:
        raise PlanError(f"{what} is over {MAX_ARG} bytes", step)
    if "\x00" in value or (not allow_newline and ("\n" in value or "\r" in value)):
        raise PlanError(f"{what} may not contain NUL" + ("" if allow_newline else
                                                         " or line breaks"), step)
    return value


def _path(value: object, what: str, step: str) -> str:
    path = _text(value, what, step)
    if not path or "$" in path or any(ord(c) < 0x20 for c in path):
        raise PlanError(f"{what} {path[:80]!r} must be a path without '$' or control "
                        "characters", step)
    return path


def _context_source(value: object, step: str) -> str:
    src = _path(value, "COPY source", step)
    rel = posixpath.normpath(src)
    if src.startswith("/") or rel == ".." or rel.startswith("../"):
        raise PlanError(f"COPY source {src[:80]!r} must be a path inside the template's "
                        "directory", step)
    return rel


def plan_build(body: Mapping[str, Any], *, nonce: str) -> Plan:
    """Check the SDK's ``TemplateBuildStartV2`` body and make it a Dockerfile.

    ``force`` (the template's, or a step's from ``skip_cache()``): the builder caches a step by
    its inputs, so an ``ARG`` of ``nonce`` (unique per build) goes before the first forced
    step; every later step's key changes with it, and they run again, as E2B's do.

    Raises:
        PlanError: a field is malformed or asks for what Corral's builder does not do.
    """
    known = {"fromImage", "fromTemplate", "fromImageRegistry", "force", "steps", "startCmd",
             "readyCmd"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise PlanError(f"unknown field {unknown[0][:40]!r} in the template")
    if body.get("fromTemplate") is not None:
        raise PlanError("fromTemplate: Corral builds E2B templates from images only; use "
                        "from_image(...) with a registry the operator allows", "base")
    if body.get("fromImageRegistry") is not None:
        raise PlanError("fromImageRegistry: registry credentials are the operator's "
                        "(CORRAL_REGISTRY_AUTH_FILE), never a template's", "base")
    for key in ("startCmd", "readyCmd"):
        if body.get(key) is not None:
            raise PlanError(f"{key}: Corral does not run a command when a sandbox starts; "
                            "start it from the SDK (commands.run(..., background=True))",
                            "finalize")
    if not isinstance(body.get("force", False), bool):
        raise PlanError("force must be true or false")
    image = _text(body.get("fromImage"), "fromImage", "base")
    if not _IMAGE.fullmatch(image) or image.startswith(("oci:", "docker-archive:")):
        raise PlanError(f"fromImage {image[:80]!r} is not a registry image reference "
                        "(e.g. registry.example/team/tools:1.4)", "base")
    steps = body.get("steps") or []
    if not isinstance(steps, list):
        raise PlanError("steps must be a list")
    if len(steps) > MAX_STEPS:
        raise PlanError(f"a template has at most {MAX_STEPS} steps")
    if not re.fullmatch(r"[0-9a-z]{1,64}", nonce):
        raise ValueError("nonce: 1-64 lower-case letters or digits")
    lines = [f"FROM {image}"]
    line_steps = {1: "base"}
    forced = False
    if body.get("force") is True:
        lines.append(f"ARG CORRAL_SKIP_CACHE={nonce}")
        line_steps[len(lines)] = "base"
        forced = True
    copies: dict[int, str] = {}
    notes: list[str] = []
    for number, raw in enumerate(steps, start=1):
        step = str(number)
        if not isinstance(raw, dict):
            raise PlanError(f"step {number} must be an object", step)
        extra = sorted(set(raw) - {"type", "args", "force", "filesHash", "forceUpload"})
        if extra:
            raise PlanError(f"step {number}: unknown field {extra[0][:40]!r}", step)
        kind = raw.get("type")
        args = raw.get("args") or []
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise PlanError(f"step {number}: args must be a list of strings", step)
        line = _line(kind, args, raw, number, copies, notes)
        if raw.get("force") is True and not forced:
            lines.append(f"ARG CORRAL_SKIP_CACHE={nonce}")
            line_steps[len(lines)] = step
            forced = True
        lines.append(line)
        line_steps[len(lines)] = step
    return Plan(image=image, dockerfile="\n".join(lines) + "\n", copies=copies,
                steps=line_steps, notes=tuple(notes))


def _line(kind: object, args: list[str], raw: Mapping[str, Any], number: int,
          copies: dict[int, str], notes: list[str]) -> str:
    step = str(number)
    if kind == "RUN":
        if len(args) not in (1, 2):
            raise PlanError(f"step {number}: RUN takes a command and an optional user", step)
        command = _text(args[0], "RUN command", step, allow_newline=True)
        if len(args) == 2 and args[1] not in ("", "root"):
            user = _text(args[1], "RUN user", step)
            if not _USER.fullmatch(user):
                raise PlanError(f"step {number}: {user[:40]!r} is not a user name", step)
            notes.append(f"step {number} asks to run as {user!r}: Corral runs build steps as "
                         "root inside the build's user namespace")
        # The JSON form keeps a script's line breaks and quotes exactly (one Dockerfile line).
        return "RUN " + json.dumps(["/bin/sh", "-c", command])
    if kind == "COPY":
        if len(args) not in (2, 3, 4):
            raise PlanError(f"step {number}: COPY takes a source, a destination, an "
                            "optional user and mode", step)
        files_hash = raw.get("filesHash")
        if not isinstance(files_hash, str) or not _HASH.fullmatch(files_hash):
            raise PlanError(f"step {number}: COPY needs filesHash (64 hex digits)", step)
        src = _context_source(args[0], step)
        dest = _path(args[1], "COPY destination", step)
        if any(args[2:]):
            notes.append(f"step {number}: user and mode of copied files are not applied "
                         "(files are root's, with their uploaded permissions)")
        copies[number] = files_hash
        source = f"s{number}" if src == "." else f"s{number}/{src}"
        return "COPY " + json.dumps([source, dest])
    if kind == "ENV":
        if not args or len(args) % 2:
            raise PlanError(f"step {number}: ENV takes name, value pairs", step)
        pairs = []
        for name, value in zip(args[::2], args[1::2], strict=True):
            if not _ENV_NAME.fullmatch(name):
                raise PlanError(f"step {number}: {name[:40]!r} is not a variable name", step)
            pairs.append(f"{name}={_quote(_text(value, f'ENV {name}', step))}")
        return "ENV " + " ".join(pairs)
    if kind == "WORKDIR":
        if len(args) != 1:
            raise PlanError(f"step {number}: WORKDIR takes one path", step)
        return "WORKDIR " + _path(args[0], "WORKDIR", step)
    if kind == "USER":
        if len(args) != 1 or not _USER.fullmatch(args[0]):
            raise PlanError(f"step {number}: USER takes one user name", step)
        return "USER " + args[0]
    raise PlanError(f"step {number}: unknown step type {str(kind)[:20]!r} (Corral builds "
                    "RUN, COPY, ENV, WORKDIR and USER)", step)


def _quote(value: str) -> str:
    # ENV values are split with shlex (a single-quoted word keeps everything but "'" itself),
    # then expanded like Docker's; the SDK gives values, so "$" stays a "$" (the builder's "\$").
    return "'" + value.replace("$", "\\$").replace("'", "'\"'\"'") + "'"



# -- the build's network -------------------------------------------------------------------------


# -- archives ------------------------------------------------------------------------------------


def check_archive(fileobj: IO[bytes]) -> int:
    """Check an uploaded COPY archive (tar, gzipped or not) without unpacking it; returns
    its entry count.

    Refused whole: an absolute name, a ``..`` component, a member under a symlink of the
    archive, a hard or symbolic link leaving the archive's root, a device or FIFO, more than
    ``MAX_ARCHIVE_ENTRIES`` entries or ``MAX_ARCHIVE_BYTES`` of content.
    """
    try:
        with tarfile.open(fileobj=fileobj, mode="r:*") as tar:
            links: set[str] = set()
            total = count = 0
            for member in tar:
                count += 1
                if count > MAX_ARCHIVE_ENTRIES:
                    raise TarRefused(f"the archive has more than {MAX_ARCHIVE_ENTRIES} entries")
                name = _member_name(member.name)
                parts = name.split("/")
                for i in range(1, len(parts)):
                    if "/".join(parts[:i]) in links:
                        raise TarRefused(f"member {member.name[:120]!r} goes through the "
                                         f"link {'/'.join(parts[:i])[:120]!r}")
                if member.issym() or member.islnk():
                    target = member.linkname
                    base = posixpath.dirname(name) if member.issym() else ""
                    resolved = posixpath.normpath(posixpath.join(base, target))
                    if target.startswith("/") or resolved == ".." or resolved.startswith(
                            "../"):
                        raise TarRefused(f"link {member.name[:120]!r} points outside the "
                                         f"archive ({target[:120]!r})")
                    # Lexically inside is not enough when the way goes through another link.
                    walked = posixpath.join(base, target).split("/")
                    for i in range(1, len(walked)):
                        if posixpath.normpath("/".join(walked[:i])) in links:
                            raise TarRefused(f"link {member.name[:120]!r} points through "
                                             f"the link {'/'.join(walked[:i])[:120]!r}")
                    links.add(name)
                elif not (member.isdir() or member.isreg()):
                    raise TarRefused(f"member {member.name[:120]!r} is a device, FIFO or "
                                     "other special file")
                total += max(member.size, 0)
                if total > MAX_ARCHIVE_BYTES:
                    raise TarRefused(f"the archive unpacks to more than {MAX_ARCHIVE_BYTES} "
                                     "bytes")
            return count
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise TarRefused(f"not a readable tar archive: {exc}") from None


def _member_name(raw: str) -> str:
    if "\x00" in raw or not raw:
        raise TarRefused("a member has an empty name or a NUL in it")
    if raw.startswith("/"):
        raise TarRefused(f"member {raw[:120]!r} has an absolute path")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise TarRefused(f"member {raw[:120]!r} has a '..' component")
    return "/".join(parts) or "."


def unpack_archive(archive: Path, dest: Path) -> None:
    """Unpack a checked archive into ``dest`` (made here). Python's ``data`` filter refuses
    again what :func:`check_archive` refuses, and drops owners and setuid bits."""
    dest.mkdir(mode=0o755, parents=True)
    with archive.open("rb") as f:
        check_archive(f)
        f.seek(0)
        with tarfile.open(fileobj=f, mode="r:*") as tar:
            try:
                tar.extractall(dest, filter="data")
            except tarfile.FilterError as exc:
                shutil.rmtree(dest, ignore_errors=True)
                raise TarRefused(str(exc)) from None


# -- the log -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LogEntry:
    timestamp: datetime
    level: Level
    message: str
    step: str | None = None

    def to_e2b(self) -> dict[str, Any]:
        """``BuildLogEntry`` as the SDKs parse it."""
        out: dict[str, Any] = {"timestamp": self.timestamp.isoformat(), "level": self.level,
                               "message": self.message}
        if self.step is not None:
            out["step"] = self.step
        return out


@dataclass
class BuildLog:
    """A build's entries, appended by its thread and read by status polls (offset-based)."""

    entries: list[LogEntry] = field(default_factory=list)
    step: str = "base"  # the step the builder is on (its messages carry no step after a line)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, message: str, level: Level = "info", step: str | None = None) -> None:
        with self._lock:
            if len(self.entries) >= _MAX_LOG_ENTRIES:
                return
            if len(self.entries) == _MAX_LOG_ENTRIES - 1:
                message, level = "(the build log is cut here: too many lines)", "warn"
            self.entries.append(LogEntry(datetime.now(UTC), level, message[:4096], step))

    def progress(self, plan: Plan) -> Callable[[str], None]:
        """The builder's ``on_progress``: a line naming a step moves the log to that step."""
        def on_progress(line: str) -> None:
            found = plan.step_of(line)
            if found is not None:
                self.step = found
            self.add(line, "info", self.step)

        return on_progress

    def page(self, offset: int, limit: int, level: Level | None) -> Sequence[LogEntry]:
        """Entries at ``level`` or above, from ``offset`` in that filtered list (the SDKs
        advance their offset by what they were given)."""
        with self._lock:
            entries = list(self.entries)
        if level is not None:
            floor = LEVELS.index(level)
            entries = [e for e in entries if LEVELS.index(e.level) >= floor]
        return entries[offset:offset + limit]
