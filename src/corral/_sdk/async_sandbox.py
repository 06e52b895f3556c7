"""``AsyncSandbox`` and its helpers (``_async/sandbox.py``)."""

from __future__ import annotations

from ._async.sandbox import (
    AsyncAudit,
    AsyncCommands,
    AsyncFiles,
    AsyncNetwork,
    AsyncPorts,
    AsyncProcess,
    AsyncProcesses,
    AsyncSandbox,
    aread_audit,
)
from ._async.volume import AsyncVolume

__all__ = ["AsyncAudit", "AsyncCommands", "AsyncFiles", "AsyncNetwork", "AsyncPorts",
           "AsyncProcess", "AsyncProcesses", "AsyncSandbox", "AsyncVolume", "aread_audit"]
