"""The messages of envd's process and filesystem services that Corral reads, one frozen model
each.

A field's rule and its refusal are written once, on the model; handlers get typed values and
never look into the raw JSON. Proto3's JSON mapping is followed where clients rely on it:
unknown fields are ignored, a missing message field is its default, a uint32 may come as a
number or its decimal string. A refusal is the ``invalid_argument`` ConnectError envd answers,
in the words this surface has always used (the SDKs show them to the user): a rule raises it
from its validator, and ``read`` words the shape problems pydantic finds itself.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AliasChoices,
    BeforeValidator,
    Field,
)

from .._control.plane import MAX_PTY_SIZE
from ..errors import PathRefused
from . import paths
from .connect import ConnectError
from .wiremodel import ABSENT, WireModel

__all__ = ["MAX_LIST_DEPTH", "CloseStdin", "ConnectProcess", "InputChunk", "ListDir", "Move",
           "PathRequest", "ProcessConfig", "PtySize", "Selector", "SendInput", "SendSignal",
           "SignalNumber", "Start", "StreamInputMessage", "Update", "WatchDir",
           "WatcherRequest"]

_UINT32 = 2**32 - 1
MAX_TAG = 256
MAX_LIST_DEPTH = 64
#: envd's Signal enum, by name or number: both end the whole process tree (the cgroup's kill).
_SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}
SignalNumber = Literal[9, 15]


_ABSENT = ABSENT


def _refuse(message: str) -> ConnectError:
    return ConnectError("invalid_argument", message)


def _object(key: str, *, required: bool = False) -> BeforeValidator:
    """A message field: an object, or absent (its default, or refused when ``required``)."""

    def check(value: Any) -> Any:
        if value is None:
            if required:
                raise _refuse(f"the request needs {key!r}")
            return {}
        if not isinstance(value, Mapping):
            raise _refuse(f"{key!r} must be an object")
        return value

    return BeforeValidator(check)


def _uint32(name: str, *, optional: bool = False) -> BeforeValidator:
    def check(value: Any) -> int | None:
        if value is None and optional:
            return None
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _UINT32:
            raise _refuse(f"{name} must be a uint32, got {value!r}")
        return value

    return BeforeValidator(check)


def _rule(check: Callable[[Any], Any]) -> BeforeValidator:
    return BeforeValidator(check)


class _Message(WireModel):
    @classmethod
    def refuse(cls, message: str) -> Exception:
        return _refuse(message)


# -- what a process is --------------------------------------------------------------------------


def _cmd(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _refuse("process.cmd must be a non-empty string (the program, e.g. /bin/bash)")
    return value


def _args(value: Any) -> list[str]:
    value = value or []
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise _refuse("process.args must be a list of strings")
    return value


def _envs(value: Any) -> dict[str, str]:
    value = value or {}
    if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _refuse("process.envs must map strings to strings")
    return dict(value)


def _cwd(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _refuse("process.cwd must be a string")
    return value or None


class ProcessConfig(_Message):
    cmd: Annotated[str, _rule(_cmd)] = ""
    args: Annotated[list[str], _rule(_args)] = Field(default_factory=list)
    envs: Annotated[dict[str, str], _rule(_envs)] = Field(default_factory=dict)
    cwd: Annotated[str | None, _rule(_cwd)] = None

    @property
    def argv(self) -> list[str]:
        return [self.cmd, *self.args]


class PtySize(_Message):
    rows: Annotated[int, _uint32("pty.size.rows")] = 0
    cols: Annotated[int, _uint32("pty.size.cols")] = 0

    @property
    def pair(self) -> tuple[int, int]:
        return self.rows, self.cols

    def model_post_init(self, context: Any) -> None:
        if not (0 < self.rows <= MAX_PTY_SIZE and 0 < self.cols <= MAX_PTY_SIZE):
            raise _refuse(f"pty.size rows and cols must be 1..{MAX_PTY_SIZE}, got "
                          f"{self.rows}x{self.cols}")


def _pty(value: Any) -> PtySize | None:
    """``pty``: absent or empty is no terminal; else its ``size`` is required."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _refuse("'pty' must be an object")
    if not value:
        return None
    size = value.get("size")
    if size is None:
        raise _refuse("the request needs 'size'")
    if not isinstance(size, Mapping):
        raise _refuse("'size' must be an object")
    return PtySize.read(size)


def _tag(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or len(value) > MAX_TAG):
        raise _refuse(f"tag must be a string of at most {MAX_TAG} characters")
    return value or None


def _stdin(value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise _refuse("stdin must be true or false")
    return value


class Start(_Message):
    """``Process/Start``: what to run, on a terminal or not, its tag, and whether its stdin
    stays open (envd closes it when ``stdin`` is false, unless on a terminal)."""

    process: Annotated[ProcessConfig, _object("process", required=True)] = _ABSENT
    pty: Annotated[PtySize | None, _rule(_pty)] = None
    tag: Annotated[str | None, _rule(_tag)] = None
    stdin: Annotated[bool | None, _rule(_stdin)] = None


# -- which process ------------------------------------------------------------------------------


class Selector(_Message):
    pid: Annotated[int | None, _uint32("process.pid", optional=True)] = None
    tag: Annotated[str | None, _rule(lambda value: value if isinstance(value, str) and value
                                     else None)] = None

    def model_post_init(self, context: Any) -> None:
        if self.pid is None and self.tag is None:
            raise _refuse('process must select a pid or a tag: {"process": {"pid": N}} or '
                          '{"process": {"tag": "..."}}')


class _Selected(_Message):
    process: Annotated[Selector, _object("process", required=True)] = _ABSENT


class ConnectProcess(_Selected):
    """``Process/Connect``: follow a running process's output from now on."""


class CloseStdin(_Selected):
    """``Process/CloseStdin``."""


class Update(_Selected):
    """``Process/Update``: a terminal's new size (none: nothing to change)."""

    pty: Annotated[PtySize | None, _rule(_pty)] = None


def _signal(value: Any) -> int:
    signal = "SIGNAL_UNSPECIFIED" if value is None else value
    if isinstance(signal, bool) or signal not in _SIGNALS:
        raise _refuse(f"signal {signal!r} is not supported; send SIGNAL_SIGKILL or "
                      "SIGNAL_SIGTERM")
    return _SIGNALS[signal]


class SendSignal(_Message):
    """``Process/SendSignal``: the signal is read first, then which process."""

    signal: Annotated[SignalNumber, _rule(_signal)] = _ABSENT
    process: Annotated[Selector, _object("process", required=True)] = _ABSENT


# -- input ----------------------------------------------------------------------------------------


class InputChunk(_Message):
    """``ProcessInput``: bytes for the process's stdin or its terminal."""

    kind: Literal["stdin", "pty"]
    data: bytes

    @classmethod
    def read(cls, message: Mapping[str, Any]) -> Self:
        for kind in ("stdin", "pty"):
            if kind in message:
                raw = message[kind]
                if not isinstance(raw, str):
                    raise _refuse(f"input.{kind} must be base64 text")
                try:
                    return cls(kind=kind, data=base64.b64decode(raw, validate=False))
                except binascii.Error:
                    raise _refuse(f"input.{kind} is not valid base64") from None
        raise _refuse('input must hold "stdin" or "pty" (base64)')


def _input(value: Any) -> InputChunk:
    if value is None:
        raise _refuse("the request needs 'input'")
    if not isinstance(value, Mapping):
        raise _refuse("'input' must be an object")
    return InputChunk.read(value)


class SendInput(_Selected):
    """``Process/SendInput``."""

    input: Annotated[InputChunk, _rule(_input)] = _ABSENT


class _InputData(_Message):
    input: Annotated[InputChunk, _rule(_input)] = _ABSENT


class StreamInputMessage(_Message):
    """One message of ``Process/StreamInput``: a ``start`` (first, once), ``data`` or a
    ``keepalive``."""

    start: Annotated[ConnectProcess | None, _rule(
        lambda value: None if value is None else ConnectProcess.read(_as_object("start", value))
    )] = None
    data: Annotated[InputChunk | None, _rule(
        lambda value: None if value is None else _InputData.read(_as_object("data", value)).input
    )] = None
    keepalive: Annotated[bool, _rule(lambda value: value is not None)] = _ABSENT

    def model_post_init(self, context: Any) -> None:
        if self.start is None and self.data is None and not self.keepalive:
            raise _refuse("a StreamInput message is start, data or keepalive")


def _as_object(key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _refuse(f"{key!r} must be an object")
    return value


# -- the filesystem service -----------------------------------------------------------------------


def _workspace_path(key: str) -> BeforeValidator:
    """A path the SDK gives (absolute, or relative to the home), as the workspace's path;
    one that leaves the workspace is ``permission_denied``, as envd's own refusal is."""

    def check(value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise _refuse(f"{key} is required (absolute, or relative to {paths.HOME})")
        try:
            return paths.to_workspace(value)
        except PathRefused as exc:
            raise ConnectError("permission_denied", exc.message) from None

    return BeforeValidator(check)


class PathRequest(_Message):
    """``Filesystem/Stat``, ``MakeDir`` and ``Remove``: one path."""

    path: Annotated[str, _workspace_path("path")] = _ABSENT


def _depth(value: Any) -> int:
    depth = 1 if value is None else value
    if isinstance(depth, str) and depth.isdigit():
        depth = int(depth)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
        raise _refuse("depth must be a non-negative integer")
    if depth > MAX_LIST_DEPTH:
        raise _refuse(f"depth is at most {MAX_LIST_DEPTH}")
    return max(depth, 1)  # proto3's default, 0, lists one level as envd does


class ListDir(_Message):
    path: Annotated[str, _workspace_path("path")] = _ABSENT
    depth: Annotated[int, _rule(_depth)] = _ABSENT


class Move(_Message):
    source: Annotated[str, _workspace_path("source")] = _ABSENT
    destination: Annotated[str, _workspace_path("destination")] = _ABSENT


def _flag(name: str) -> BeforeValidator:
    def check(value: Any) -> bool:
        if value is not None and not isinstance(value, bool):
            raise _refuse(f"{name} must be true or false")
        return bool(value)

    return BeforeValidator(check)


class WatchDir(_Message):
    """``Filesystem/WatchDir`` and ``CreateWatcher``. Older SDKs send ``include_entry``."""

    path: Annotated[str, _workspace_path("path")] = _ABSENT
    recursive: Annotated[bool, _flag("recursive")] = _ABSENT
    include_entry: Annotated[bool, _flag("includeEntry")] = Field(
        default=_ABSENT, validation_alias=AliasChoices("includeEntry", "include_entry"))


def _watcher_id(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _refuse("watcherId is required (from CreateWatcher)")
    return value


class WatcherRequest(_Message):
    """``Filesystem/GetWatcherEvents`` and ``RemoveWatcher``."""

    watcher_id: Annotated[str, _rule(_watcher_id)] = Field(
        default=_ABSENT, validation_alias=AliasChoices("watcherId", "watcher_id"))
