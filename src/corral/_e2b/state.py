"""What the E2B surface keeps about a sandbox beyond Corral's own record.

E2B's create takes things Corral's sandboxes do not have: environment variables for every
command (``envVars``), the template name as the caller gave it (``code-interpreter-v1``, reported
back as ``templateID``), whether internet access was asked for. They live in a small SQLite file
of their own (``e2b.db``) so Corral's store and its schema know nothing of this dialect; a row
goes with its sandbox, on every path that destroys it (``follow_destroys``: E2B's kill, any
other surface's, expiry, the reaper), and rows of sandboxes that no longer exist are ignored.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._control.plane import Manager

__all__ = ["E2BSandbox", "E2BState", "follow_destroys"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    template_id TEXT NOT NULL,
    envs TEXT NOT NULL,
    internet INTEGER,
    auto_pause INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL
);
"""


@dataclass(frozen=True, slots=True)
class E2BSandbox:
    id: str  # Corral's id
    template_id: str  # as the caller named it
    envs: dict[str, str] = field(default_factory=dict)
    internet: bool | None = None  # what was asked (None: not said)
    auto_pause: bool = False


class E2BState:
    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        self._unsubscribe: Callable[[], None] | None = None

    def remember(self, sandbox: E2BSandbox) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO sandboxes VALUES (?, ?, ?, ?, ?, ?)",
                (sandbox.id, sandbox.template_id, json.dumps(sandbox.envs),
                 None if sandbox.internet is None else int(sandbox.internet),
                 int(sandbox.auto_pause), time.time()))

    def get(self, sandbox_id: str) -> E2BSandbox | None:
        with self._lock:
            row = self._db.execute(
                "SELECT template_id, envs, internet, auto_pause FROM sandboxes WHERE id = ?",
                (sandbox_id,)).fetchone()
        if row is None:
            return None
        return E2BSandbox(id=sandbox_id, template_id=row[0], envs=json.loads(row[1]),
                          internet=None if row[2] is None else bool(row[2]),
                          auto_pause=bool(row[3]))

    def envs(self, sandbox_id: str) -> Mapping[str, str]:
        """The environment every command of the sandbox gets (before the command's own)."""
        found = self.get(sandbox_id)
        return {} if found is None else found.envs

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        with self._lock:
            self._db.close()


def follow_destroys(state: E2BState, manager: Manager) -> None:
    """Have ``state`` forget each sandbox ``manager`` destroys, whoever destroys it, until
    ``state`` is closed."""
    if state._unsubscribe is None:
        state._unsubscribe = manager.on_destroyed(state.forget)
