"""Corral: self-hosted execution sandboxes for AI agents.

    >>> from corral import Sandbox
    >>> with Sandbox.create() as sb:
    ...     print(sb.commands.run("echo hi").stdout)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    AuthError,
    BackendError,
    BackendUnavailable,
    CeilingExceeded,
    CommandError,
    CommandNotFound,
    ConfigError,
    ContextNotFound,
    CorralError,
    DiskFullError,
    FileError,
    FileNotFound,
    HostRefused,
    InterpreterUnavailable,
    InvalidRequestError,
    OriginRefused,
    PathRefused,
    PolicyError,
    PortClosed,
    PortError,
    PortNotExposed,
    QuotaExceeded,
    RequestRefused,
    SandboxBusy,
    SandboxError,
    SandboxExpired,
    SandboxLost,
    SandboxNotFound,
    SnapshotError,
    SnapshotInUse,
    SnapshotNotFound,
    TooLarge,
    TransportError,
    UsageError,
    VolumeError,
    VolumeInUse,
    VolumeNotFound,
)

if TYPE_CHECKING:
    from ._audit.events import AuditEvent
    from ._audit.log import AuditTrail
    from ._sdk.async_sandbox import AsyncProcess, AsyncSandbox, AsyncVolume, aread_audit
    from ._sdk.fanout import AsyncFanOut, FanOut, Rollout
    from ._sdk.sandbox import Audit, Commands, Files, Network, Process, Sandbox, Volume, read_audit
    from .backends import OutputCut
    from .models import (
        CodeContext,
        CommandResult,
        Execution,
        ExecutionError,
        FileEntry,
        Lifecycle,
        Logs,
        OutputMessage,
        PortInfo,
        ResourceTier,
        Result,
        SandboxInfo,
        SnapshotInfo,
        Usage,
        VolumeInfo,
    )

# The SDK is imported on first use, not with the package: `corral` is also the CLI's package,
# and `corral run` must not pay for the async SDK, the HTTP client and their imports
# (PEP 562). The models too (pydantic's import is most of `corral --help`); errors stay eager.
_LAZY = {
    "AuditEvent": "._audit.events",
    "AuditTrail": "._audit.log",
    **dict.fromkeys(("AsyncProcess", "AsyncSandbox", "AsyncVolume", "aread_audit"),
                    "._sdk.async_sandbox"),
    **dict.fromkeys(("Audit", "Commands", "Files", "Network", "Process", "Sandbox", "Volume",
                     "read_audit"), "._sdk.sandbox"),
    **dict.fromkeys(("AsyncFanOut", "FanOut", "Rollout"), "._sdk.fanout"),
    "OutputCut": ".backends",
    **dict.fromkeys(("CodeContext", "CommandResult", "Execution", "ExecutionError",
                     "FileEntry", "Lifecycle", "Logs", "OutputMessage", "ResourceTier", "Result",
                     "PortInfo", "SandboxInfo", "SnapshotInfo", "Usage", "VolumeInfo"),
                    ".models"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

__version__ = "0.1.0"

__all__ = [
    "AsyncFanOut",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncVolume",
    "Audit",
    "AuthError",
    "AuditEvent",
    "AuditTrail",
    "BackendError",
    "BackendUnavailable",
    "CeilingExceeded",
    "CodeContext",
    "CommandError",
    "CommandNotFound",
    "CommandResult",
    "Commands",
    "ConfigError",
    "ContextNotFound",
    "CorralError",
    "Execution",
    "ExecutionError",
    "FanOut",
    "FileEntry",
    "FileError",
    "FileNotFound",
    "HostRefused",
    "InterpreterUnavailable",
    "InvalidRequestError",
    "OriginRefused",
    "Files",
    "Lifecycle",
    "Logs",
    "Network",
    "OutputCut",
    "OutputMessage",
    "PathRefused",
    "PolicyError",
    "PortClosed",
    "PortError",
    "PortInfo",
    "PortNotExposed",
    "Process",
    "DiskFullError",
    "QuotaExceeded",
    "RequestRefused",
    "ResourceTier",
    "Result",
    "Rollout",
    "Sandbox",
    "SandboxBusy",
    "SandboxError",
    "SandboxExpired",
    "SandboxInfo",
    "SandboxLost",
    "SandboxNotFound",
    "SnapshotError",
    "SnapshotInUse",
    "SnapshotInfo",
    "SnapshotNotFound",
    "TooLarge",
    "TransportError",
    "Usage",
    "UsageError",
    "Volume",
    "VolumeError",
    "VolumeInUse",
    "VolumeInfo",
    "VolumeNotFound",
    "__version__",
    "aread_audit",
    "read_audit",
]
