"""Tenants and API keys for the HTTP service: the control plane's (``_control/tenants.py``),
re-exported here because the service's callers (tests, the drill) import them from here."""

from __future__ import annotations

from .._control.plane import LOCAL_TENANT, Ceiling, Tenant, TenantDirectory, new_key

__all__ = ["LOCAL_TENANT", "Ceiling", "Tenant", "TenantDirectory", "new_key"]
