"""``Sandbox`` and its helpers, from the generated sync SDK (``_sync/sandbox.py``)."""

from __future__ import annotations

from ._sync.sandbox import (
    Audit,
    Commands,
    Files,
    Network,
    Ports,
    Process,
    Processes,
    Sandbox,
    read_audit,
)
from ._sync.volume import Volume

__all__ = ["Audit", "Commands", "Files", "Network", "Ports", "Process", "Processes", "Sandbox",
           "Volume", "read_audit"]
