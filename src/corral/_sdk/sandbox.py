"""``Sandbox`` and its helpers, from the generated sync SDK (``_sync/sandbox.py``)."""

from __future__ import annotations

from ._sync.sandbox import Audit, Commands, Files, Network, Process, Processes, Sandbox, read_audit

__all__ = ["Audit", "Commands", "Files", "Network", "Process", "Processes", "Sandbox",
           "read_audit"]
