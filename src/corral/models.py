"""Public result and description types, defined once and shared by the SDK (embedded and
remote), the HTTP API, MCP and the CLI's ``--json``.

``SandboxInfo`` and ``SnapshotInfo`` are the wire schema itself (pydantic): the server answers
with them, and the remote SDK parses its answers into them, ignoring fields it does not know
(so an older client works against a newer server). What the control plane keeps about a
sandbox beyond them (its host uid, secret placeholders, last activity) is not public.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "CodeContext",
    "CommandResult",
    "Execution",
    "ExecutionError",
    "FileEntry",
    "Lifecycle",
    "Logs",
    "OutputMessage",
    "PortInfo",
    "ProcessInfo",
    "ResourceTier",
    "Result",
    "SandboxInfo",
    "SandboxState",
    "SnapshotInfo",
    "VolumeInfo",
    "Usage",
]

# ``paused``: frozen in place (processes stopped, memory, mounts and network namespace kept);
# ``hibernated``: nothing left in the kernel, its files and ``/tmp`` on disk (see ``Lifecycle``).
SandboxState = Literal["creating", "running", "paused", "hibernated", "destroying"]


@dataclass(frozen=True, slots=True)
class ResourceTier:
    """Hard limits applied to one sandbox; ``small`` and ``large`` are built in.

    Attributes:
        name: the tier's name.
        cpus: CPU quota in cores (CFS quota; 1.0 is one full core).
        memory_bytes: memory limit of the whole sandbox, swap included (no swap).
        pids: most processes and threads alive at once in the sandbox.
        disk_bytes: size of the sandbox's ``/workspace`` filesystem.
        tmp_bytes: size of each command's ``/tmp`` tmpfs (counted in memory too).
        command_timeout_s: default and maximum per-command timeout.
        ttl_s: default sandbox lifetime.
        max_ttl_s: the longest lifetime a caller may ask for.
        output_limit_bytes: bytes kept per stream (stdout, stderr) of one command.
    """

    name: str
    cpus: float
    memory_bytes: int
    pids: int
    disk_bytes: int
    tmp_bytes: int
    command_timeout_s: float
    ttl_s: float
    max_ttl_s: float
    output_limit_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class Usage:
    """What one command consumed, read from its own cgroup.

    Attributes:
        wall_s: seconds from start to exit.
        cpu_s: CPU seconds (user + system) of the whole process tree.
        peak_memory_bytes: highest memory use of the process tree.
        oom_killed: True when the kernel's OOM killer ended a process of the command.
    """

    wall_s: float
    cpu_s: float
    peak_memory_bytes: int
    oom_killed: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class CommandResult:
    """The outcome of one command.

    Attributes:
        exit_code: the command's exit status; 128+N when killed by signal N; 124 on timeout.
        stdout: captured standard output (UTF-8, invalid bytes replaced), capped.
        stderr: captured standard error, capped the same way.
        timed_out: True when the command hit its timeout and its whole tree was killed.
        duration_s: wall-clock seconds.
        usage: resource usage of the command's process tree.
        stdout_truncated: bytes of stdout dropped past the cap (0 when nothing was dropped).
        stderr_truncated: the same for stderr.
        command_id: the command's id in the sandbox's audit trail.
        stdout_bytes: the kept standard output exactly as written (binary output intact), when
            asked for with ``run(..., output="bytes")``; ``None`` otherwise.
        stderr_bytes: the same for standard error.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    usage: Usage
    stdout_truncated: int = 0
    stderr_truncated: int = 0
    command_id: str = ""
    stdout_bytes: bytes | None = field(default=None, repr=False)
    stderr_bytes: bytes | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        """True when the command exited 0 without timing out."""
        return self.exit_code == 0 and not self.timed_out

    def to_dict(self, *, exact_bytes: bool = False) -> dict[str, Any]:
        """The JSON form: the REST API's answer and the CLI's ``--json`` (the SDK reads it back).
        ``exact_bytes`` adds ``stdout_b64``/``stderr_b64``, the kept output byte-exact."""
        data = dataclasses.asdict(self)
        del data["stdout_bytes"], data["stderr_bytes"]
        # The clock's digits past the microsecond are float noise, not information.
        data["duration_s"] = round(self.duration_s, 6)
        if exact_bytes:
            for name, raw in (("stdout", self.stdout_bytes), ("stderr", self.stderr_bytes)):
                data[f"{name}_b64"] = base64.b64encode(raw or b"").decode()
        return data


class _Public(BaseModel):
    # Frozen like the dataclasses; unknown fields from a newer server are ignored. Defaults are
    # for parsing an older server's answers: this one always sends every field, so the
    # document says so (serialization schema: all required).
    model_config = ConfigDict(frozen=True, extra="ignore",
                              json_schema_serialization_defaults_required=True)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form (the wire form, and the CLI's ``--json``)."""
        return self.model_dump(mode="json")


class Lifecycle(_Public):
    """What happens to a sandbox at the end of its lifetime, and to a call that finds it
    paused. The default is the safe one: destroyed at its timeout, and a paused sandbox is
    resumed only when asked (``resume``)."""

    on_timeout: Literal["kill", "pause"] = Field(
        default="kill", description="kill: destroyed at its timeout. pause: paused (its "
                                    "processes frozen, its memory and files kept) and kept "
                                    "paused for the operator's paused_keep_s; a resume "
                                    "starts its lifetime again.")
    auto_resume: bool = Field(
        default=False, description="A call that needs it running (a command, a file, code, "
                                   "a port request) resumes it first, instead of being "
                                   "refused while it is paused or hibernated.")
    on_idle: Literal["destroy", "pause"] = Field(
        default="destroy", description="After its idle_timeout without calls (and with nothing "
                                       "running): destroy: destroyed. pause: paused, until a "
                                       "resume (or, with auto_resume, the next call); its "
                                       "lifetime goes on.")
    hibernate_after: float | None = Field(
        default=None, ge=0, le=30 * 86400,
        description="Seconds paused before it is hibernated: every process, mount, loop device, "
                    "cgroup and network namespace of it released, its files and /tmp kept on "
                    "disk, woken like a paused one. On the microVM tier its processes' memory "
                    "is kept too; on the namespace and gVisor tiers only a sandbox with no "
                    "process running hibernates, one with processes stays paused. Null: the "
                    "operator's hibernate_after_s "
                    "(CORRAL_HIBERNATE_AFTER_S, default 900; 0 there: never).")


class SandboxInfo(_Public):
    """A sandbox, as every surface describes it."""

    id: str
    template: str
    resources: str
    state: SandboxState
    created_at: float
    expires_at: float
    labels: dict[str, str] = Field(default_factory=dict)
    network: dict[str, Any] = Field(default_factory=dict)
    secrets: list[str] = Field(default_factory=list, description="Names of its secrets.")
    idle_timeout: float | None = Field(
        default=None, description="Destroyed after this long without commands or file use.")
    # An older server sends neither: it only has the one (namespace) tier and no layers.
    isolation: str = Field(default="namespace", description="The isolation tier it runs on.")
    layer: str | None = Field(
        default=None, description="The top read-only layer of its workspace (from a snapshot, "
                                  "fork or restore); null for a fresh workspace.")
    memory_image: str | None = Field(
        default=None, description="The memory image its processes resumed from (a memory "
                                  "snapshot or fork, microvm tier), as named in the audit "
                                  "trail, while its workspace is still that image's; null for "
                                  "one that booted or was sealed or restored since.")
    template_version: str | None = Field(
        default=None, description="The exact build of its template it runs on: an image's "
                                  "manifest digest (sha256:...), or a Debian template build's "
                                  "spec hash; null for base.")
    mounts: list[dict[str, Any]] = Field(
        default_factory=list, description="Its volumes and data mounts: kind (volume or "
                                          "data), source (volume id or data mount name), "
                                          "target and read_only.")
    lifecycle: Lifecycle = Field(
        default_factory=Lifecycle, description="What happens at its timeout and to a call "
                                               "that finds it paused.")
    sleeping_since: float | None = Field(
        default=None, description="When it was paused (it stays so when it hibernates); null "
                                  "while it runs.")


class PortInfo(_Public):
    """An exposed port of a sandbox and how to reach it through ``corral serve``."""

    sandbox_id: str
    port: int
    public: bool = Field(description="Reachable without credentials.")
    url: str | None = Field(
        default=None, description="Path URL (<service>/ports/<sandbox>/<port>/); null when "
                                  "the service's URL is not known here.")
    host_url: str | None = Field(
        default=None, description="Host URL (<port>-<sandbox>.<domain>), when the service "
                                  "has a ports domain.")
    token: str | None = Field(
        default=None, description="Send as X-Corral-Port-Token (or Authorization: Bearer); "
                                  "revoked when the port is unexposed.")
    signed_url: str | None = Field(
        default=None, description="The URL with a signature: opened in a browser, it sets a "
                                  "cookie for the port and redirects to the plain URL.")
    signed_expires_at: float | None = Field(
        default=None, description="When the signed URL stops working (the cookie it set "
                                  "lasts as long as the exposure).")


class VolumeInfo(_Public):
    """A persistent named volume: a filesystem of a fixed size that outlives sandboxes."""

    id: str
    name: str
    size_bytes: int = Field(description="Its quota: past it, writes fail with ENOSPC.")
    used_bytes: int | None = Field(default=None, description="Bytes in use.")
    created_at: float
    mounted_by: list[str] = Field(default_factory=list,
                                  description="The sandboxes that mount it now.")
    writer: str | None = Field(default=None,
                               description="The one sandbox mounting it read-write, if any.")


class SnapshotInfo(_Public):
    """A sealed, read-only state of a sandbox's workspace that sandboxes can start from."""

    id: str
    name: str | None
    sandbox: str = Field(description="The sandbox it was taken from.")
    template: str
    created_at: float
    size_bytes: int = Field(description="Bytes its own layer adds.")
    depth: int = Field(description="Layers under a sandbox started from it.")
    memory: bool = Field(default=False, description=(
        "Whether it holds the running sandbox's memory and processes too (microvm tier): a "
        "sandbox started from it resumes them."))


class ProcessInfo(_Public):
    """A background process of a sandbox, as the service describes it."""

    id: str
    sandbox_id: str
    argv: list[str]
    started_at: float
    state: Literal["starting", "running", "exited"]
    exit_code: int | None = None
    command_id: str = Field(description="Its command's id in the audit trail.")
    error: str | None = Field(default=None, description="Why it could not run, if so.")
    output_bytes: int = Field(default=0, description="Bytes of output so far (the next offset).")


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One entry of a directory listing or a stat, with its path as seen inside the sandbox."""

    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    modified_at: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- the code interpreter ----------------------------------------------------------------------

# MIME type -> the attribute of ``Result`` that holds it (E2B's names, so results read alike).
RESULT_MIME = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown",
    "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg",
    "application/pdf": "pdf", "text/latex": "latex", "application/json": "json",
    "application/javascript": "javascript",
}


class CodeContext(_Public):
    """A stateful kernel of a sandbox: variables, imports and cwd stay across its cells."""

    id: str
    language: str = Field(description="python, javascript, typescript, r or bash.")
    cwd: str = Field(description="Its working directory inside the sandbox.")
    kernel: str | None = Field(
        default=None, description="What runs it: ipython, plain (Python without IPython), "
                                  "bash or node; null until it has started.")
    sandbox_id: str = ""


class Result(_Public):
    """One rich result of a cell: its value (``is_main_result``) or something it displayed.

    The MIME bundle is in ``data`` (binary types such as ``image/png`` base64-encoded); the
    common types have their own attribute, as E2B names them."""

    is_main_result: bool = False
    data: dict[str, Any] = Field(default_factory=dict,
                                 description="MIME type -> content (base64 for images).")

    def _mime(self, mime: str) -> Any:
        return self.data.get(mime)

    @property
    def text(self) -> str | None:
        return self._mime("text/plain")  # type: ignore[no-any-return]

    @property
    def html(self) -> str | None:
        return self._mime("text/html")  # type: ignore[no-any-return]

    @property
    def markdown(self) -> str | None:
        return self._mime("text/markdown")  # type: ignore[no-any-return]

    @property
    def svg(self) -> str | None:
        return self._mime("image/svg+xml")  # type: ignore[no-any-return]

    @property
    def png(self) -> str | None:
        """base64 of the PNG image."""
        return self._mime("image/png")  # type: ignore[no-any-return]

    @property
    def jpeg(self) -> str | None:
        return self._mime("image/jpeg")  # type: ignore[no-any-return]

    @property
    def pdf(self) -> str | None:
        return self._mime("application/pdf")  # type: ignore[no-any-return]

    @property
    def latex(self) -> str | None:
        return self._mime("text/latex")  # type: ignore[no-any-return]

    @property
    def json(self) -> Any:  # pydantic's deprecated json(); E2B's name
        return self._mime("application/json")

    @property
    def javascript(self) -> str | None:
        return self._mime("application/javascript")  # type: ignore[no-any-return]

    def formats(self) -> list[str]:
        """The attribute names this result has (``["text", "png"]``)."""
        return [RESULT_MIME[m] for m in self.data if m in RESULT_MIME]


class ExecutionError(_Public):
    """The error a cell raised (or that ended it: a timeout, a crashed kernel)."""

    name: str
    value: str
    traceback: str = ""


class OutputMessage(_Public):
    """One chunk of a cell's stdout or stderr, with when it was printed."""

    text: str
    timestamp: float
    error: bool = Field(default=False, description="True for stderr.")


class Logs(_Public):
    stdout: list[str] = Field(default_factory=list)
    stderr: list[str] = Field(default_factory=list)


class Execution(_Public):
    """The outcome of one cell: its results, its output and its error, if any."""

    results: list[Result] = Field(default_factory=list)
    logs: Logs = Field(default_factory=Logs)
    error: ExecutionError | None = None
    execution_count: int | None = None
    context_id: str | None = None
    duration_s: float = 0.0

    @property
    def text(self) -> str | None:
        """The main result's text/plain, if the cell had a value."""
        for result in self.results:
            if result.is_main_result:
                return result.text
        return None
