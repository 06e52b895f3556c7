"""Host-side secrets: name, value, and the hosts the value may be sent to.

Values never enter a sandbox (the egress gateway will swap placeholders for them) and never reach a
log: every value registered here is redacted from the audit trail. Kept in their own SQLite file,
readable by root only, apart from the store that describes sandboxes.
"""

from __future__ import annotations

import builtins
import re
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

__all__ = ["HTTPS_PORT", "SecretInfo", "SecretStore"]

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_HOST_RE = re.compile(r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,62}\.)*[A-Za-z0-9-]{1,63}(:\d{1,5})?$")
_MAX_VALUE = 64 * 1024
#: The port a host named without one is bound on.
HTTPS_PORT = 443


@dataclass(frozen=True, slots=True)
class SecretInfo:
    """A secret as listed: never its value."""

    name: str
    hosts: tuple[str, ...]
    created_at: float


class SecretStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
        self._lock = threading.Lock()
        self._cache: tuple[int, builtins.list[str]] | None = None
        self._db = sqlite3.connect(path, timeout=30.0, isolation_level=None,
                                   check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS secrets (name TEXT PRIMARY KEY, value TEXT NOT NULL, "
            "hosts TEXT NOT NULL, created_at REAL NOT NULL)"
        )
        for suffix in ("", "-wal", "-shm"):
            candidate = Path(f"{path}{suffix}")
            if candidate.exists():
                candidate.chmod(0o600)

    def add(self, name: str, value: str, hosts: Sequence[str]) -> SecretInfo:
        """Register (or replace) a secret.

        Raises:
            UsageError: bad name, empty or oversized value, malformed host.
        """
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise UsageError(f"invalid secret name {name!r}: use letters, digits and _ "
                             "(it becomes an environment variable name)")
        if not isinstance(value, str) or not value or "\x00" in value:
            raise UsageError("a secret's value must be a non-empty string without NUL bytes")
        if len(value.encode()) > _MAX_VALUE:
            raise UsageError(f"a secret's value is limited to {_MAX_VALUE} bytes")
        clean_hosts: builtins.list[str] = []
        for host in hosts:
            if not isinstance(host, str) or not _HOST_RE.match(host):
                raise UsageError(f"invalid host {host!r}: use api.example.com, "
                                 "*.example.com or host:port")
            # A host without a port means HTTPS on 443, written out: a sandbox that reaches the
            # host on another port (allowed as host:8443) sends the placeholder there
            # unreplaced, and the binding must show that it does not cover that port. (Plain
            # HTTP never carries a value: the gateway swaps only inside TLS it intercepts.)
            named = [host.lower()] if ":" in host else [f"{host.lower()}:{HTTPS_PORT}"]
            clean_hosts += [h for h in named if h not in clean_hosts]
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO secrets (name, value, hosts, created_at) "
                "VALUES (?, ?, ?, ?)", (name, value, ",".join(clean_hosts), time.time()))
            self._cache = None
        return SecretInfo(name=name, hosts=tuple(clean_hosts), created_at=time.time())

    def list(self) -> builtins.list[SecretInfo]:
        with self._lock:
            rows = self._db.execute(
                "SELECT name, hosts, created_at FROM secrets ORDER BY name").fetchall()
        return [SecretInfo(name=r[0], hosts=tuple(h for h in r[1].split(",") if h),
                           created_at=r[2]) for r in rows]

    def remove(self, name: str) -> bool:
        with self._lock:
            cursor = self._db.execute("DELETE FROM secrets WHERE name = ?", (name,))
            self._cache = None
        return cursor.rowcount > 0

    def value(self, name: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM secrets WHERE name = ?", (name,)).fetchone()
        return row[0] if row else None

    def values(self) -> builtins.list[str]:
        """Every registered value: what the redactor must never let through.

        Cached: re-read only when SQLite's data_version says another connection changed the
        file, or after our own writes (which clear the cache).
        """
        with self._lock:
            version = self._db.execute("PRAGMA data_version").fetchone()[0]
            if self._cache is None or self._cache[0] != version:
                values = [r[0] for r in self._db.execute("SELECT value FROM secrets")]
                self._cache = (version, values)
            return list(self._cache[1])

    def close(self) -> None:
        with self._lock:
            self._db.close()
