"""The request bodies of the HTTP API and the parts of its OpenAPI document the routes share.

Responses are the public models of ``corral.models`` (one wire schema). Requests are strict:
unknown fields are refused and JSON values of the wrong type are never coerced. Their
constraints document the control plane's rules; a value one refuses is answered with the
control plane's own error (see ``app._control_plane_error``).
"""

from __future__ import annotations

import importlib.util
from typing import Annotated, Any, Literal

from fastapi import Query
from pydantic import BaseModel, ConfigDict, Field

from .._backends import BACKENDS
from .._control.validate import MAX_FORKS as _MAX_FORKS
from .._control.validate import SNAPSHOT_NAME_PATTERN
from .._core.resources import TIERS

__all__ = ["ISOLATION_TIERS", "CreateCodeContext", "CreateSandbox", "ErrorOut", "Fork",
           "NetworkBody", "Restore", "RunCode", "RunCommand", "SetTimeout", "StartProcess",
           "TakeSnapshot", "request_fields"]

class _Strict(BaseModel):
    # strict: a JSON value of the wrong type is refused, never coerced ("5", true, "yes").
    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorOut(BaseModel):
    """Every error: a stable code (the SDK raises the matching class) and a message."""

    error: str
    message: str


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorOut, "description": why} for status, why in [
        (400, "Invalid input: bad command, path outside /workspace, unknown tier..."),
        (401, "Missing, unknown or revoked API key."),
        (403, "Refused by policy, beyond the tenant's ceiling (ceiling_exceeded: hosts, "
              "templates, tiers, secrets, lifetime), or a browser Origin that is not the "
              "service's own (origin_refused)."),
        (404, "No such sandbox, snapshot, command, process or file (or not the caller's)."),
        (409, "The sandbox is busy (being created, paused, or running something during a "
              "snapshot or restore), or the snapshot is in use."),
        (413, "The body is over its size limit."),
        (421, "The Host header is not one of the service's names."),
        (422, "The request does not match the schema."),
        (429, "A tenant quota (sandboxes, tiers, commands per minute: commands, background "
              "processes and terminals alike) or a sandbox limit."),
        (500, "An internal error."),
        (503, "The host cannot run sandboxes."),
    ]
}
_NDJSON = {"application/x-ndjson": {"schema": {"type": "string"}}}
_BINARY = {"schema": {"type": "string", "format": "binary"}}
_BINARY_BODY = {"requestBody": {"content": {"application/octet-stream": _BINARY}}}
_NonEmpty = Annotated[str, Field(min_length=1)]
_PathQuery = Annotated[str, Query(min_length=1, description="A path in /workspace.")]
_Seconds = Annotated[float, Field(gt=0)]
_SnapshotRef = Annotated[str, Field(min_length=1, description="A snapshot's id or name.")]
# The control plane's own rule (it also refuses names shaped like a snapshot id, with a 400).
_SnapshotName = Annotated[str, Field(pattern=SNAPSHOT_NAME_PATTERN)]


# The schema names the tiers and templates this server has (built from the same tables).
Tier: Any = Literal[tuple(TIERS)]
# Templates are built on the host at any time: the name's shape here, its existence at create.
Template = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,39}$")]
# Only tiers whose backend this build has: a named tier that is missing would fail on import.
# A tier that is here but that the host cannot run (no runsc, say) answers 503.
ISOLATION_TIERS = tuple(name for name, target in BACKENDS.items()
                        if importlib.util.find_spec(target.partition(":")[0]) is not None)
Isolation: Any = Literal[ISOLATION_TIERS]


class NetworkBody(_Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"allow": ["api.github.com"], "presets": ["pypi"]}]})
    allow: list[str] = Field(default_factory=list)
    deny: list[str] = Field(default_factory=list)
    presets: list[str] = Field(
        default_factory=list,
        description="Package-index presets (pypi, npm, debian): allow the operator's index "
                    "hosts and point the clients at them.")
    require_lock: bool = Field(
        default=False,
        description="With the pypi preset: pip installs only hashed requirements "
                    "(--require-hashes).")


class VolumeMount(_Strict):
    path: str = Field(max_length=512)
    read_only: bool = False


class CreateVolume(_Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [{"name": "cache", "size": "1G"}]})
    name: str = Field(min_length=1, max_length=63)
    size: int | str = Field(default="1G", description="Bytes, or 512M, 10G, 1GiB.")


class CreateSandbox(_Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"template": "base", "resources": "small", "timeout": 600,
         "labels": {"agent": "triage"},
         "network": {"allow": ["pypi.org", "files.pythonhosted.org"]}}]})
    template: Template | None = Field(
        default=None, description="Root filesystem: base, or the snapshot's when starting "
                                  "from one.")
    resources: Tier = "small"
    timeout: _Seconds | None = Field(default=None, description="Lifetime in seconds.")
    idle_timeout: _Seconds | None = Field(
        default=None, description="Destroy after this many seconds without activity.")
    labels: dict[str, str] = Field(default_factory=dict)
    network: NetworkBody | Literal["none"] = "none"
    secrets: list[str] = Field(default_factory=list)
    isolation: Isolation | None = Field(
        default=None, description="Isolation tier (default: the server's); `corral doctor` "
                                  "says which this host supports.")
    snapshot: _SnapshotRef | None = Field(
        default=None, description="Start from this snapshot's workspace (id or name).")
    image: str | None = Field(
        default=None, min_length=1, max_length=1024,
        description="An image reference instead of a template ([host/]path[:tag][@sha256:...])"
                    ", from a registry the operator allows; pulled first unless it already "
                    "was.")
    volumes: dict[str, str | VolumeMount] = Field(
        default_factory=dict, max_length=16,
        description="Your volumes by name, each at a mount point under /mnt/ or /workspace/ "
                    "(a path, or {path, read_only}); one writer or many readers per volume.")
    data_mounts: dict[str, str] = Field(
        default_factory=dict, max_length=16,
        description="The operator's data mounts by name, each at a mount point; read-only.")


class TakeSnapshot(_Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [{"name": "before-refactor"}]})
    name: _SnapshotName | None = Field(
        default=None, description="A name unique among your snapshots (default: none).")
    memory: bool = Field(default=False, description=(
        "Also save the running sandbox's memory and processes, while commands run (the "
        "microvm tier only; 400 on another)."))


class Fork(_Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [{"count": 2}]})
    count: int = Field(default=1, ge=1, le=_MAX_FORKS, description="How many sandboxes.")
    memory: bool = Field(default=False, description=(
        "Each child resumes the running sandbox's memory and processes (the microvm tier "
        "only; 400 on another)."))


class ExposePort(_Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [{"public": False, "link_ttl": 3600}]})
    public: bool = Field(default=False, description=(
        "Reachable by anyone who has the URL, without credentials."))
    link_ttl: float | None = Field(default=None, gt=0, le=7 * 24 * 3600, description=(
        "Seconds the signed link in the answer works (default an hour, at most a week)."))


_NO_BODY_EXPOSE = ExposePort()


class Restore(_Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [{"snapshot": "before-refactor"}]})
    snapshot: _SnapshotRef


# A POST without a body takes one unnamed snapshot, or makes one fork (the models are immutable
# in use, so one shared default each is safe).
_NO_BODY_SNAPSHOT = TakeSnapshot()
_NO_BODY_FORK = Fork()


class RunCommand(_Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"cmd": "python3 -c 'print(6 * 7)'", "timeout": 30, "cwd": "/workspace"}]})
    cmd: _NonEmpty | Annotated[list[str], Field(min_length=1)] = Field(
        description="A shell string (bash -c) or an argv list.")
    timeout: _Seconds | None = None
    envs: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    stdin: str | None = None
    context: dict[str, Any] | None = None
    stream: bool = Field(default=False, description="Stream NDJSON events as output arrives.")
    output: Literal["text", "bytes"] = Field(
        default="text", description="`bytes`: the result also carries `stdout_b64` and "
        "`stderr_b64`, the kept output exactly as written, base64-encoded.")


class RunCode(_Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"code": "x = 6 * 7\nx", "language": "python"}]})
    code: str = Field(description="The cell's source.")
    context: str | None = Field(default=None, description="A context id (create_code_context); "
                                "default: the sandbox's default context of `language`.")
    language: str | None = Field(default=None, description=(
        "python (default), javascript (js), typescript (ts), r or bash."))
    envs: dict[str, str] | None = Field(default=None, description="For this cell only.")
    timeout: _Seconds | None = None


class CreateCodeContext(_Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"language": "python", "cwd": "/workspace"}]})
    language: str | None = Field(default=None, description=(
        "python (default), javascript (js), typescript (ts), r or bash."))
    cwd: str | None = Field(default=None, description=(
        "Where the kernel starts: any directory that exists in the sandbox; relative paths are "
        "under /workspace (the default)."))


class StartProcess(_Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"cmd": ["python3", "-m", "http.server", "8000"]}]})
    cmd: _NonEmpty | Annotated[list[str], Field(min_length=1)]
    envs: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    context: dict[str, Any] | None = None


class SetTimeout(_Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [{"timeout": 600}]})
    timeout: _Seconds


def request_fields() -> frozenset[str]:
    """Every field a request body may have (an unknown one's message suggests the closest)."""
    found: set[str] = set()
    pending = list(_Strict.__subclasses__())
    while pending:
        model = pending.pop()
        found.update(model.model_fields)
        pending += model.__subclasses__()
    return frozenset(found)
