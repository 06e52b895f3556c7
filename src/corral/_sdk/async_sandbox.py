"""``AsyncSandbox`` and its helpers (``_async/sandbox.py``)."""

from __future__ import annotations

from ._async.sandbox import (
    AsyncAudit,
    AsyncCommands,
    AsyncFiles,
    AsyncNetwork,
    AsyncProcess,
    AsyncProcesses,
    AsyncSandbox,
    aread_audit,
)

__all__ = ["AsyncAudit", "AsyncCommands", "AsyncFiles", "AsyncNetwork", "AsyncProcess",
           "AsyncProcesses", "AsyncSandbox", "aread_audit"]
