"""What a caller asks the control plane for, one frozen model per operation's input.

Every surface builds these from its own wire form (a REST body, an E2B JSON body or Connect
message, an MCP tool's arguments, CLI flags) and the control plane's rules run in their
validators, which are ``validate``'s functions: a rule and its message are written once, and
a refusal is the same error class and words on every surface. A field's validator sees the raw
value (``PlainValidator``), so a value of the wrong type is refused by the control plane's own
rule ("timeout must be a positive number of seconds, got '5'"), never coerced.

``parse`` turns any refusal into a ``CorralError``: the rule's own error when a rule refused,
``InvalidRequestError`` (422) naming the field when the request's shape is wrong (an unknown field
suggests the one that was meant). ``refusal`` does the same for a ``ValidationError`` raised
elsewhere (FastAPI's body parsing).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
)

from .._backends import BACKENDS
from .._core.resources import TIERS, get_tier
from ..errors import CorralError, InvalidRequestError
from ..models import Lifecycle
from . import validate

__all__ = ["CreateCodeContext", "CreateSandbox", "CreateVolume", "ExposePort", "Fork",
           "LifecycleRequest", "NetworkRequest", "Request", "Restore", "RunCode", "RunCommand",
           "SetTimeout", "StartProcess", "TakeSnapshot", "VolumeMount", "refusal",
           "request_fields"]


def _rule(check: Callable[[Any], object], schema_type: Any) -> PlainValidator:
    """The field is refused by ``check`` (a ``validate`` rule, its words first) and by its
    type (``schema_type``, strict: what the OpenAPI document shows), and kept as given."""
    adapter: TypeAdapter[Any] = TypeAdapter(schema_type, config=ConfigDict(strict=True))

    def run(value: Any, info: ValidationInfo) -> Any:
        try:
            check(value)
        except CorralError:
            raise
        except (TypeError, AttributeError, ValueError):
            pass  # a value of a type the rule never expected: the type check says what
        try:
            adapter.validate_python(value)
        except ValidationError as exc:
            problem = exc.errors()[0]
            where = ".".join(str(part) for part in (info.field_name, *problem["loc"]))
            raise InvalidRequestError(f"{where}: {problem['msg']}") from None
        return value

    return PlainValidator(run, json_schema_input_type=schema_type)


def _optional(check: Callable[[Any], object]) -> Callable[[Any], object]:
    return lambda value: None if value is None else check(value)


def _string_map(name: str) -> Callable[[Any], object]:
    def check(value: Any) -> None:
        if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise InvalidRequestError(f"{name} must be an object of string values")

    return check


def _seconds(name: str) -> Callable[[Any], object]:
    return lambda value: validate.positive_seconds(value, name)


# Each rule's schema type says what the OpenAPI document shows (the rule's own shape, which
# tests/integration/test_schemathesis.py holds against what the server refuses).
_PositiveFloat = Annotated[float, Field(gt=0)]
_NonEmpty = Annotated[str, Field(min_length=1)]
_Seconds = Annotated[float, _rule(_seconds("timeout"), _PositiveFloat)]
_OptionalSeconds = Annotated[float | None, _rule(_optional(_seconds("timeout")),
                                                 _PositiveFloat | None)]
_Command = Annotated[str | list[str], _rule(
    validate.command_argv, _NonEmpty | Annotated[list[str], Field(min_length=1)])]
_Envs = Annotated[dict[str, str], _rule(validate.command_env, dict[str, str])]
_Cwd = Annotated[str | None, _rule(validate.command_cwd, str | None)]
_SnapshotRef = Annotated[str, _rule(validate.snapshot_ref, _NonEmpty)]


class Request(BaseModel):
    """A request's input: frozen, unknown fields refused, nothing coerced."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @classmethod
    def parse(cls, data: Any) -> Self:
        """The request from its JSON-shaped ``data``, or the ``CorralError`` that refuses it."""
        if not isinstance(data, Mapping):
            raise InvalidRequestError(f"the request must be a JSON object, not "
                                 f"{type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise refusal(exc) from None


class SetTimeout(Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{"timeout": 600}]})
    timeout: _Seconds = Field(description="The sandbox's lifetime from now, in seconds.")


class Restore(Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{"snapshot": "before-refactor"}]})
    snapshot: _SnapshotRef = Field(description="A snapshot's id or name.")


class TakeSnapshot(Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{"name": "before-refactor"}]})
    name: Annotated[str | None, _rule(validate.snapshot_name, Annotated[
        str, Field(pattern=validate.SNAPSHOT_NAME_PATTERN)] | None)] = Field(
        default=None, description="A name unique among your snapshots (default: none).")
    memory: bool = Field(default=False, description=(
        "Also save the running sandbox's memory and processes, while commands run (the "
        "microvm tier only; 400 on another)."))


class Fork(Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{"count": 2}]})
    count: Annotated[int, _rule(validate.fork_count, Annotated[
        int, Field(ge=1, le=validate.MAX_FORKS)])] = Field(
        default=1, description="How many sandboxes.")
    memory: bool = Field(default=False, description=(
        "Each child resumes the running sandbox's memory and processes (the microvm tier "
        "only; 400 on another)."))


class NetworkRequest(Request):
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


class VolumeMount(Request):
    path: str = Field(max_length=512)
    read_only: bool = False


class CreateVolume(Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{"name": "cache", "size": "1G"}]})
    name: str = Field(min_length=1, max_length=63)
    size: int | str = Field(default="1G", description="Bytes, or 512M, 10G, 1GiB.")


class LifecycleRequest(Request):
    """``Lifecycle`` as a request: the same fields and words, but a misspelt field is refused
    (the public model ignores unknown fields, for a newer server's answers)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"on_timeout": "pause", "auto_resume": True}]})
    on_timeout: Literal["kill", "pause"] = Field(
        default="kill", description=Lifecycle.model_fields["on_timeout"].description)
    auto_resume: bool = Field(
        default=False, description=Lifecycle.model_fields["auto_resume"].description)
    on_idle: Literal["destroy", "pause"] = Field(
        default="destroy", description=Lifecycle.model_fields["on_idle"].description)
    hibernate_after: float | None = Field(
        default=None, ge=0, le=30 * 86400, allow_inf_nan=False,
        description=Lifecycle.model_fields["hibernate_after"].description)

    def lifecycle(self) -> Lifecycle:
        return Lifecycle(on_timeout=self.on_timeout, auto_resume=self.auto_resume,
                         on_idle=self.on_idle, hibernate_after=self.hibernate_after)


class CreateSandbox(Request):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"template": "base", "resources": "small", "timeout": 600,
         "labels": {"agent": "triage"},
         "network": {"allow": ["pypi.org", "files.pythonhosted.org"]}},
        {"timeout": 3600, "lifecycle": {"on_timeout": "pause", "auto_resume": True}}]})
    template: Annotated[str | None, _rule(_optional(validate.template),
                                          _NonEmpty | None)] = Field(
        default=None, description="Root filesystem: base, or the snapshot's when starting "
                                  "from one.")
    resources: Annotated[str, _rule(get_tier, Literal[tuple(TIERS)])] = Field(
        default="small", description="Resource tier (limits per sandbox and command).")
    timeout: _OptionalSeconds = Field(default=None, description="Lifetime in seconds.")
    idle_timeout: Annotated[float | None, _rule(_optional(_seconds("idle_timeout")),
                                                _PositiveFloat | None)] = Field(
        default=None, description="Destroy after this many seconds without activity.")
    labels: Annotated[dict[str, str], _rule(validate.labels, dict[str, str])] = Field(
        default_factory=dict)
    network: NetworkRequest | Literal["none"] = "none"
    secrets: Annotated[list[str], _rule(validate.secret_names, list[str])] = Field(
        default_factory=list)
    isolation: Annotated[str | None, _rule(_optional(validate.isolation),
                                           Literal[tuple(BACKENDS)] | None)] = Field(
        default=None, description="Isolation tier (default: the server's); `corral doctor` "
                                  "says which this host supports.")
    snapshot: Annotated[str | None, _rule(_optional(validate.snapshot_ref),
                                          _NonEmpty | None)] = Field(
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
    lifecycle: LifecycleRequest | None = Field(
        default=None,
        description="What happens at its timeout: killed (default), or paused and kept for "
                    "the operator's paused_keep_s; auto_resume has a call resume it when "
                    "paused.")


class ExposePort(Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{"public": False,
                                                               "link_ttl": 3600}]})
    public: bool = Field(default=False, description=(
        "Reachable by anyone who has the URL, without credentials."))
    link_ttl: float | None = Field(default=None, gt=0, le=7 * 24 * 3600, description=(
        "Seconds the signed link in the answer works (default an hour, at most a week)."))


class RunCommand(Request):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"cmd": "python3 -c 'print(6 * 7)'", "timeout": 30, "cwd": "/workspace"}]})
    cmd: _Command = Field(description="A shell string (bash -c) or an argv list.")
    timeout: _OptionalSeconds = None
    envs: _Envs = Field(default_factory=dict)
    cwd: _Cwd = None
    stdin: Annotated[str | None, _rule(validate.command_stdin, str | None)] = None
    context: Annotated[dict[str, Any] | None, _rule(validate.context, dict[str, Any] | None)] \
        = None
    stream: bool = Field(default=False, description="Stream NDJSON events as output arrives.")
    output: Literal["text", "bytes"] = Field(
        default="text", description="`bytes`: the result also carries `stdout_b64` and "
        "`stderr_b64`, the kept output exactly as written, base64-encoded.")


class StartProcess(Request):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"cmd": ["python3", "-m", "http.server", "8000"]}]})
    cmd: _Command
    envs: _Envs = Field(default_factory=dict)
    cwd: _Cwd = None
    context: Annotated[dict[str, Any] | None, _rule(validate.context, dict[str, Any] | None)] \
        = None


class RunCode(Request):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"code": "x = 6 * 7\nx", "language": "python"}]})
    code: str = Field(description="The cell's source.")
    context: str | None = Field(default=None, description="A context id (create_code_context); "
                                "default: the sandbox's default context of `language`.")
    language: str | None = Field(default=None, description=(
        "python (default), javascript (js), typescript (ts), r or bash."))
    envs: Annotated[dict[str, str] | None, _rule(validate.command_env, dict[str, str] | None)] \
        = Field(default=None, description="For this cell only.")
    timeout: _OptionalSeconds = None


class CreateCodeContext(Request):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"language": "python", "cwd": "/workspace"}]})
    language: str | None = Field(default=None, description=(
        "python (default), javascript (js), typescript (ts), r or bash."))
    cwd: str | None = Field(default=None, description=(
        "Where the kernel starts: any directory that exists in the sandbox; relative paths are "
        "under /workspace (the default)."))


# -- refusals ------------------------------------------------------------------------------------

# Names callers reach for that mean a field of ours (the E2B SDK's, shells', other APIs').
_SAME_MEANING = {"command": "cmd", "cmds": "cmd", "env": "envs", "environment": "envs",
                 "working_dir": "cwd", "workdir": "cwd", "ttl": "timeout"}


def request_fields() -> frozenset[str]:
    """Every field a request may have (an unknown one's message suggests the closest)."""
    found: set[str] = set()
    pending = list(Request.__subclasses__())
    while pending:
        model = pending.pop()
        found.update(model.model_fields)
        pending += model.__subclasses__()
    return frozenset(found)


def _close_field(name: str) -> str:
    if name in _SAME_MEANING:
        return f" (did you mean {_SAME_MEANING[name]!r}?)"
    close = difflib.get_close_matches(name, sorted(request_fields()), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def problem_text(error: Mapping[str, Any]) -> str:
    """One problem of a request's shape, for a person: an unknown field names the field that
    was meant (a misspelled ``command`` for ``cmd`` says so), a missing one says required."""
    where = ".".join(str(part) for part in error["loc"])
    if error.get("type") == "missing":
        return f"{where}: required"
    if error.get("type") == "extra_forbidden":
        return f"{where}: not a field of this request{_close_field(str(error['loc'][-1]))}"
    return f"{where}: {error['msg']}"


def refusal(exc: ValidationError | Sequence[Mapping[str, Any]]) -> CorralError:
    """The ``CorralError`` for a request's validation problems: the control plane rule's own
    error if a rule refused (a rule's ``ValueError`` subclass rides in the problem's context),
    otherwise ``InvalidRequestError`` listing every shape problem."""
    problems = exc.errors() if isinstance(exc, ValidationError) else list(exc)
    for problem in problems:
        raised = (problem.get("ctx") or {}).get("error")
        if isinstance(raised, CorralError):
            return raised
    return InvalidRequestError("; ".join(problem_text(p) for p in problems))
