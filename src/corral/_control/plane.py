"""The control plane as every surface sees it: with ``requests`` (what a caller may ask), the
only ``_control`` module a module outside the package imports.

Everything else in ``_control`` is private to it and may be reorganised freely; a surface that
needs something new asks for it here, where the list of what the control plane offers is read
in one place. The import contract ``control-plane-facade`` in ``pyproject.toml`` holds it.
"""

from __future__ import annotations

from . import validate
from .admission import Admission, check_sandbox_count
from .commands import image_config
from .egress import network_spec
from .files import AuditedFiles
from .interpreter import (
    CodeEvent,
    CountEvent,
    EndEvent,
    ErrorEvent,
    OutputEvent,
    ResultEvent,
    event_line,
)
from .manager import Manager, get_manager
from .ports import PortURLs, Who
from .presets import ceiling_network
from .processes import MAX_PTY_SIZE, BackgroundProcess
from .records import ASLEEP, SandboxRecord
from .recovery import Reaper
from .store import Store
from .tenants import LOCAL_TENANT, Ceiling, Tenant, TenantDirectory, local_tenant, new_key
from .volumes import parse_size

__all__ = [
    "ASLEEP",
    "LOCAL_TENANT",
    "MAX_PTY_SIZE",
    "Admission",
    "AuditedFiles",
    "BackgroundProcess",
    "Ceiling",
    "CodeEvent",
    "CountEvent",
    "EndEvent",
    "ErrorEvent",
    "Manager",
    "OutputEvent",
    "PortURLs",
    "Reaper",
    "ResultEvent",
    "SandboxRecord",
    "Store",
    "Tenant",
    "TenantDirectory",
    "Who",
    "ceiling_network",
    "check_sandbox_count",
    "event_line",
    "get_manager",
    "image_config",
    "local_tenant",
    "network_spec",
    "new_key",
    "parse_size",
    "validate",
]
