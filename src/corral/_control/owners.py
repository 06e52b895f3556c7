"""Which tenant each sandbox belongs to, remembered.

A sandbox's tenant is fixed when it is made and its id is never given again, so once read from
the store the answer holds for good: a guard on the service's event loop can tell a caller's
sandbox from another tenant's without a thread or a store read (the HTTP API's body guard does,
on every request with a body). Only answers that found a sandbox are kept; "no such sandbox"
is read again next time (it may be made meanwhile, by another process).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .store import Store

__all__ = ["Owners"]

#: Entries kept: the sandboxes recently asked about (a few hundred bytes each).
KEEP = 4096


class Owners:
    def __init__(self, store: Store, *, keep: int = KEEP) -> None:
        self._store = store
        self._keep = keep
        self._known: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def known(self, sandbox_id: str) -> str | None:
        """The tenant, if already read; never touches the store (safe on an event loop)."""
        with self._lock:
            tenant = self._known.get(sandbox_id)
            if tenant is not None:
                self._known.move_to_end(sandbox_id)
            return tenant

    def of(self, sandbox_id: str) -> str | None:
        """The tenant, or None when the store has no such sandbox."""
        tenant = self.known(sandbox_id)
        if tenant is not None:
            return tenant
        record = self._store.get(sandbox_id)
        if record is None:
            return None
        with self._lock:
            self._known[sandbox_id] = record.tenant
            while len(self._known) > self._keep:
                self._known.popitem(last=False)
        return record.tenant
