"""Audit byte budgets: noticing a trail (or a tenant's trails) past its budget.

The writer's side is ``wrote``, called after every append with the file's new size: a lock, a
dict lookup and a comparison, so it costs nothing on the egress gateway's loop. It never acts:
it says whether the worker should look now. ``check`` runs on the worker's thread: it asks the
budget source (the control plane) for each written sandbox's budget and its tenant's, adds up
a tenant's live trails, and returns the overruns, which the worker hands to the handler (the
control plane pauses the sandbox) on a thread of their own.

A tenant's trails are added up at most every ``tenant_every_s`` (a store read and a stat per
live sandbox of the tenant): past its budget, the sandboxes that wrote most since the last look,
as many as make up the excess, are reported (then every further writer, while it stays over).

A sandbox is reported once; the report is forgotten after ``recheck_s``, so a budget raised in
another process, or a sandbox resumed there, is seen again (the handler is idempotent: it acts
only on a running sandbox).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

__all__ = ["Budget", "BudgetSource", "BudgetWatch", "Overrun"]


@dataclass(frozen=True, slots=True)
class Budget:
    """A sandbox's audit budget and its tenant's, in bytes (0: none)."""

    sandbox_bytes: int
    tenant: str
    tenant_bytes: int


@dataclass(frozen=True, slots=True)
class Overrun:
    """A trail (``scope="sandbox"``) or a tenant's live trails (``"tenant"``) past budget."""

    sandbox_id: str
    scope: Literal["sandbox", "tenant"]
    tenant: str
    used_bytes: int
    budget_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"scope": self.scope, "tenant": self.tenant, "used_bytes": self.used_bytes,
                "budget_bytes": self.budget_bytes}


class BudgetSource(Protocol):
    """What the control plane tells the watch."""

    def budget(self, sandbox_id: str) -> Budget | None:
        """The sandbox's budget; None when it is not a live sandbox (nothing to enforce)."""
        ...

    def tenant_sandboxes(self, tenant: str) -> Iterable[str]:
        """The ids of the tenant's live sandboxes (their trails make up its usage)."""
        ...


def trail_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


class BudgetWatch:
    """Notices trails past their budgets; see the module docstring."""

    def __init__(self, *, path_of: Callable[[str], Path], recheck_s: float = 5.0,
                 tenant_every_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._path_of = path_of
        self._recheck_s = recheck_s
        self._tenant_every_s = tenant_every_s
        self._clock = clock
        self._source: BudgetSource | None = None
        self._lock = threading.Lock()
        self._dirty: dict[str, int] = {}  # sandbox -> size at its last write since a check
        self._tenant_dirty: set[str] = set()  # written since the last tenant check
        self._limits: dict[str, tuple[int, float]] = {}  # sandbox -> (bytes, when looked up)
        self._reported: dict[str, float] = {}  # sandbox -> when
        self._seen: dict[str, int] = {}  # sandbox -> trail size at the last tenant check
        self._tenant_checked = 0.0

    def attach(self, source: BudgetSource) -> None:
        self._source = source

    @property
    def attached(self) -> bool:
        return self._source is not None

    def wrote(self, sandbox_id: str, size: int) -> bool:
        """A write left the sandbox's trail at ``size`` bytes: True when it is (probably) past
        its budget and the worker should look now."""
        with self._lock:
            self._dirty[sandbox_id] = size
            self._tenant_dirty.add(sandbox_id)
            limit = self._limits.get(sandbox_id)
            return (limit is not None and 0 < limit[0] < size
                    and sandbox_id not in self._reported)

    def forget(self, sandbox_id: str) -> None:
        """Look afresh next time (the sandbox was resumed or destroyed)."""
        with self._lock:
            self._limits.pop(sandbox_id, None)
            self._reported.pop(sandbox_id, None)
            self._seen.pop(sandbox_id, None)
            self._dirty.pop(sandbox_id, None)
            self._tenant_dirty.discard(sandbox_id)

    def check(self) -> list[Overrun]:
        """The overruns since the last check (the worker's side; may read the store)."""
        source = self._source
        if source is None:
            return []
        now = self._clock()
        with self._lock:
            dirty, self._dirty = self._dirty, {}
            for sandbox_id, when in list(self._reported.items()):
                if now - when >= self._recheck_s:
                    del self._reported[sandbox_id]
            tenants_due = now - self._tenant_checked >= self._tenant_every_s
            tenant_dirty: set[str] = set()
            if tenants_due:
                tenant_dirty, self._tenant_dirty = self._tenant_dirty, set()
                self._tenant_checked = now
        overruns: list[Overrun] = []
        budgets: dict[str, Budget | None] = {}
        for sandbox_id in {*dirty, *tenant_dirty}:
            budgets[sandbox_id] = budget = source.budget(sandbox_id)
            with self._lock:
                if budget is None:
                    self._limits.pop(sandbox_id, None)
                    continue
                self._limits[sandbox_id] = (budget.sandbox_bytes, now)
                reported = sandbox_id in self._reported
            size = dirty.get(sandbox_id)
            if size is None or reported:
                continue
            if 0 < budget.sandbox_bytes < size:
                overruns.append(Overrun(sandbox_id, "sandbox", budget.tenant, size,
                                        budget.sandbox_bytes))
        # Tenants: each written-to tenant's live trails added up, at most every few seconds.
        by_tenant: dict[tuple[str, int], list[str]] = {}
        for sandbox_id in tenant_dirty:
            budget = budgets.get(sandbox_id)
            if budget is not None and budget.tenant_bytes > 0:
                by_tenant.setdefault((budget.tenant, budget.tenant_bytes), []).append(sandbox_id)
        flagged = {o.sandbox_id for o in overruns}
        for (tenant, limit), writers in by_tenant.items():
            sizes = {s: trail_size(self._path_of(s)) for s in source.tenant_sandboxes(tenant)}
            used = sum(sizes.values())
            with self._lock:
                before = {s: self._seen.get(s, 0) for s in writers}
                self._seen.update(sizes)
            if used <= limit:
                continue
            # The writers that grew most since the last look, as many as make up the excess:
            # a sandbox that wrote a little beside the one that flooded keeps running.
            excess = used - limit
            for grown, sandbox_id in sorted(((sizes.get(s, 0) - before[s], s)
                                             for s in writers), reverse=True):
                if excess <= 0:
                    break
                if sandbox_id not in flagged:
                    overruns.append(Overrun(sandbox_id, "tenant", tenant, used, limit))
                excess -= max(grown, 0)
        with self._lock:
            fresh = [o for o in overruns if o.sandbox_id not in self._reported]
            for overrun in fresh:
                self._reported[overrun.sandbox_id] = now
        return fresh

    def expire_limits(self) -> None:
        """Drop budgets looked up longer than ``recheck_s`` ago (a tenant's may change)."""
        now = self._clock()
        with self._lock:
            for sandbox_id, (_, when) in list(self._limits.items()):
                if now - when >= self._recheck_s:
                    del self._limits[sandbox_id]
