"""Corral: self-hosted execution sandboxes for AI agents.

    >>> from corral import Sandbox
    >>> with Sandbox.create() as sb:
    ...     print(sb.commands.run("echo hi").stdout)
"""

from __future__ import annotations

from ._audit.events import AuditEvent
from ._audit.log import AuditTrail
from ._sdk.async_sandbox import AsyncProcess, AsyncSandbox, aread_audit
from ._sdk.sandbox import Audit, Commands, Files, Network, Process, Sandbox, read_audit
from .backends import OutputCut
from .errors import (
    AuthError,
    BackendError,
    BackendUnavailable,
    CeilingExceeded,
    CommandError,
    CommandNotFound,
    ConfigError,
    CorralError,
    FileError,
    FileNotFound,
    HostRefused,
    OriginRefused,
    PathRefused,
    PolicyError,
    QuotaExceeded,
    RequestRefused,
    SandboxBusy,
    SandboxError,
    SandboxExpired,
    SandboxNotFound,
    SnapshotError,
    SnapshotInUse,
    SnapshotNotFound,
    TooLarge,
    TransportError,
    UsageError,
)
from .models import CommandResult, FileEntry, ResourceTier, SandboxInfo, SnapshotInfo, Usage

__version__ = "0.1.0"

__all__ = [
    "AsyncProcess",
    "AsyncSandbox",
    "Audit",
    "AuthError",
    "AuditEvent",
    "AuditTrail",
    "BackendError",
    "BackendUnavailable",
    "CeilingExceeded",
    "CommandError",
    "CommandNotFound",
    "CommandResult",
    "Commands",
    "ConfigError",
    "CorralError",
    "FileEntry",
    "FileError",
    "FileNotFound",
    "HostRefused",
    "OriginRefused",
    "Files",
    "Network",
    "OutputCut",
    "PathRefused",
    "PolicyError",
    "Process",
    "QuotaExceeded",
    "RequestRefused",
    "ResourceTier",
    "Sandbox",
    "SandboxBusy",
    "SandboxError",
    "SandboxExpired",
    "SandboxInfo",
    "SandboxNotFound",
    "SnapshotError",
    "SnapshotInUse",
    "SnapshotInfo",
    "SnapshotNotFound",
    "TooLarge",
    "TransportError",
    "Usage",
    "UsageError",
    "__version__",
    "aread_audit",
    "read_audit",
]
