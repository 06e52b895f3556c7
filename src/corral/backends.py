"""The isolation backend protocol: one interface for every isolation tier.

The control plane decides what a sandbox is (id, uid, limits, lifetime) and stores it; a backend
decides how it runs. A backend owns the runtime of a sandbox (network namespace, cgroups, the
workspace filesystem) and must be able to rebuild it from a ``SandboxSpec`` alone, because the
control plane may restart at any time.

Contract:
    * ``create`` builds everything a sandbox needs; on failure it leaves nothing behind.
    * ``exec`` runs one command and returns only after every process it started is gone.
    * ``destroy`` is idempotent and succeeds on a half-built or already-removed sandbox.
    * ``sweep`` removes runtime pieces of sandboxes that are not in ``live_ids`` (crash leftovers)
      and commands whose owning process died.
    * Every method raises only ``corral.errors`` exceptions.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from .models import ResourceTier, Usage

__all__ = [
    "BackendName",
    "ExecOutcome",
    "ExecRequest",
    "HostCheck",
    "IsolationBackend",
    "OutputCallback",
    "OutputCut",
    "ProcessIO",
    "SandboxSpec",
    "SealResult",
]

BackendName = Literal["namespace", "gvisor"]
OutputCallback = Callable[[str], None]


class OutputCut(str):  # noqa: SLOT000 - a str with two read-only attributes
    """Handed to an ``OutputCallback`` once, when a stream reaches its cap: the text is a
    plain notice (so a callback that only prints still tells the user, live); ``stream`` and
    ``limit`` let a caller that knows tell it apart from output (the HTTP stream sends it as
    its own event). It is not part of the kept output."""

    stream: str
    limit: int

    def __new__(cls, stream: str, limit: int) -> OutputCut:
        note = super().__new__(cls, f"\n[corral: {stream} truncated: output past {limit} "
                                    "bytes is dropped from here on]\n")
        note.stream, note.limit = stream, limit
        return note


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """Everything a backend needs to build or rebuild a sandbox's runtime."""

    id: str
    uid: int
    template: str
    tier: ResourceTier
    # Read-only workspace layers under the writable one, top first (snapshots and forks).
    layers: tuple[str, ...] = ()


class ProcessIO(Protocol):
    """Handed to ``ExecRequest.on_start`` for interactive and PTY commands, from any thread."""

    def write(self, data: bytes) -> None:
        """Send bytes to the command's stdin (or its terminal)."""
        ...

    def close_stdin(self) -> None: ...

    def resize(self, rows: int, cols: int) -> None:
        """Change the terminal size (PTY commands only; the command gets SIGWINCH)."""
        ...


@dataclass(frozen=True, slots=True)
class ExecRequest:
    """One command, already validated by the control plane.

    ``cwd`` is a path inside the sandbox (under ``/workspace``); ``timeout_s`` is final (the control
    plane has already capped it by the tier and the sandbox's remaining lifetime).
    """

    argv: Sequence[str]
    cwd: str
    env: Mapping[str, str]
    timeout_s: float
    stdin: bytes | None = None
    output_limit_bytes: int = 1 << 20
    on_stdout: OutputCallback | None = None
    on_stderr: OutputCallback | None = None
    command_id: str = ""
    # Interactive: stdin stays open and is written through the ProcessIO given to on_start.
    interactive: bool = False
    # A terminal of (rows, cols): stdin, stdout and stderr are one PTY (output is "stdout").
    pty: tuple[int, int] | None = None
    on_start: Callable[[ProcessIO], None] | None = None


@dataclass(frozen=True, slots=True)
class ExecOutcome:
    """What ``exec`` observed."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    usage: Usage
    stdout_truncated: int = 0
    stderr_truncated: int = 0
    #: The kept bytes exactly as the command wrote them (``stdout`` is their UTF-8 reading).
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""


@dataclass(frozen=True, slots=True)
class SealResult:
    """What sealing a writable layer made: the sandbox's new lower chain (top first), the new
    layer's size, and whether the chain was squashed into one layer to bound its depth."""

    layers: tuple[str, ...]
    bytes_used: int
    squashed: bool


@dataclass(frozen=True, slots=True)
class HostCheck:
    """One line of ``corral doctor``: what was checked, whether it passed, how to fix it."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    extra: dict[str, str] = field(default_factory=dict)


class IsolationBackend(Protocol):
    """One isolation tier. See the module docstring for the contract."""

    name: BackendName

    def check_host(self) -> list[HostCheck]:
        """Inspect the host; never raises. Used by ``corral doctor`` and at start-up."""
        ...

    def create(self, spec: SandboxSpec) -> None:
        """Build the runtime of a new sandbox."""
        ...

    def exec(self, spec: SandboxSpec, request: ExecRequest) -> ExecOutcome:
        """Run one command to completion (or timeout) and return what happened."""
        ...

    def open_listener(self, spec: SandboxSpec) -> socket.socket:
        """A listening TCP socket on 127.0.0.1 *inside* the sandbox's network, for the egress
        gateway to serve; the caller owns and closes it."""
        ...

    def workspace_root(self, spec: SandboxSpec) -> Path:
        """Host path of the sandbox's ``/workspace``, mounted and ready for file operations."""
        ...

    def seal_workspace(self, spec: SandboxSpec, layer_id: str) -> SealResult:
        """Make the writable workspace layer read-only layer ``layer_id`` and give the sandbox a
        fresh writable layer on top (snapshots, forks). Nothing of the sandbox may be running."""
        ...

    def reset_workspace(self, spec: SandboxSpec) -> None:
        """Drop the writable layer and start a fresh one on ``spec.layers`` (restore)."""
        ...

    def remove_layer(self, layer_id: str) -> None:
        """Delete a layer nothing uses any more. Idempotent."""
        ...

    def layer_ids(self) -> list[str]:
        """Every layer on disk (to find ones a crash left without a record)."""
        ...

    def pause(self, spec: SandboxSpec, paused: bool) -> None:
        """Freeze (or thaw) every process of the sandbox; files stay reachable."""
        ...

    def busy(self, spec: SandboxSpec) -> bool:
        """True while any command of the sandbox runs (from any process)."""
        ...

    def kill_command(self, spec: SandboxSpec, command_id: str) -> bool:
        """Kill one running command's whole process tree; False when it is not running."""
        ...

    def destroy(self, spec: SandboxSpec) -> None:
        """Kill everything and remove every trace of the sandbox's runtime."""
        ...

    def sweep(self, live_ids: set[str] | Callable[[str], bool]) -> list[str]:
        """Remove leftovers not belonging to ``live_ids``; return what was removed."""
        ...

    def close(self) -> None:
        """Release process-local resources (not sandboxes)."""
        ...
