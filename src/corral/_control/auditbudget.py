"""Audit byte budgets, the control plane's side: what each sandbox's and tenant's budget is,
what their trails use, and whether a paused sandbox may be resumed.

A sandbox's trail may grow to its budget (``CORRAL_AUDIT_SANDBOX_MAX_BYTES``, or its tenant's
own); a tenant's live sandboxes' trails together to the tenant's (``CORRAL_AUDIT_TENANT_MAX_
BYTES``, or ``corral tenants set --audit-max-bytes``). Trails of destroyed sandboxes count
against neither: retention bounds them (``corral audit prune``). The audit layer notices an
overrun (``_audit.budget``); ``Sandboxes.stop_over_budget`` pauses the sandbox.
"""

from __future__ import annotations

from collections.abc import Iterable

from .._audit.auditor import Auditor
from .._audit.budget import Budget, Overrun, trail_size
from .._settings import Settings
from ..errors import QuotaExceeded
from .records import LIVE, SandboxRecord
from .store import Store

__all__ = ["AuditBudgets", "size_text"]


def size_text(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class AuditBudgets:
    """Each sandbox's and tenant's audit byte budget (the audit layer's ``BudgetSource``)."""

    def __init__(self, *, settings: Settings, store: Store, auditor: Auditor) -> None:
        self._settings = settings
        self._store = store
        self._auditor = auditor

    def _limits(self, tenant: str) -> tuple[int, int]:
        """(per-sandbox, per-tenant) bytes for ``tenant``: its own where it sets them."""
        sandbox_bytes = self._settings.audit_sandbox_max_bytes
        tenant_bytes = self._settings.audit_tenant_max_bytes
        row = self._store.tenant(tenant) if tenant != "local" else None
        if row is not None:
            if row.get("audit_sandbox_max_bytes") is not None:
                sandbox_bytes = int(row["audit_sandbox_max_bytes"])
            if row.get("audit_max_bytes") is not None:
                tenant_bytes = int(row["audit_max_bytes"])
        return sandbox_bytes, tenant_bytes

    # -- BudgetSource ---------------------------------------------------------------------------

    def budget(self, sandbox_id: str) -> Budget | None:
        record = self._store.get(sandbox_id)
        if record is None or record.state not in LIVE:
            return None
        sandbox_bytes, tenant_bytes = self._limits(record.tenant)
        return Budget(sandbox_bytes, record.tenant, tenant_bytes)

    def tenant_sandboxes(self, tenant: str) -> Iterable[str]:
        return [r.id for r in self._store.list() if r.tenant == tenant and r.state in LIVE]

    # -- what the trails use ----------------------------------------------------------------------

    def overrun(self, record: SandboxRecord) -> Overrun | None:
        """The budget the sandbox's trail (or its tenant's trails) is over now, if any."""
        if not self._auditor.enabled:
            return None
        sandbox_bytes, tenant_bytes = self._limits(record.tenant)
        used = trail_size(self._auditor.path(record.id))
        if 0 < sandbox_bytes < used:
            return Overrun(record.id, "sandbox", record.tenant, used, sandbox_bytes)
        if tenant_bytes > 0:
            total = sum(trail_size(self._auditor.path(s))
                        for s in self.tenant_sandboxes(record.tenant))
            if total > tenant_bytes:
                return Overrun(record.id, "tenant", record.tenant, total, tenant_bytes)
        return None

    def check_resume(self, record: SandboxRecord) -> None:
        """Refuse to resume a sandbox whose trail (or tenant) is over its audit budget: its
        processes would only write on.

        Raises:
            QuotaExceeded: naming the budget, what is used and what to do.
        """
        over = self.overrun(record)
        if over is None:
            return
        if over.scope == "sandbox":
            raise QuotaExceeded(
                f"sandbox {record.id} is paused at its audit budget: its trail holds "
                f"{size_text(over.used_bytes)}, over its budget of "
                f"{size_text(over.budget_bytes)}. Read what it did (`corral replay "
                f"{record.id}`) and destroy it (its trail is kept, under the retention "
                "setting), or have the operator raise the budget (CORRAL_AUDIT_SANDBOX_MAX_"
                "BYTES, or `corral tenants set TENANT --audit-sandbox-max-bytes`) and resume "
                "again")
        raise QuotaExceeded(
            f"sandbox {record.id} is paused at its tenant's audit budget: the trails of "
            f"tenant {record.tenant!r}'s live sandboxes hold {size_text(over.used_bytes)}, "
            f"over its budget of {size_text(over.budget_bytes)}. Destroy sandboxes it no "
            "longer needs (their trails then leave the budget and are kept under the "
            "retention setting), or have the operator raise the budget "
            "(CORRAL_AUDIT_TENANT_MAX_BYTES, or `corral tenants set "
            f"{record.tenant} --audit-max-bytes`) and resume again")
