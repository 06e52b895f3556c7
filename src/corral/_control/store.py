"""SQLite store for sandbox metadata. Safe for several processes on one data directory."""

from __future__ import annotations

import builtins
import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, get_args

from .._core.diskfull import DiskReserve, disk_full_as_error
from .._core.failpoints import failpoint
from .._core.owner import this_owner
from ..errors import QuotaExceeded, UsageError, VolumeInUse, VolumeNotFound
from ..models import Lifecycle, SandboxState, SnapshotInfo
from .counters import CounterBuffer
from .records import ASLEEP, SandboxRecord, new_id

__all__ = ["Store"]

_PLACEHOLDERS_KEPT = 4096

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    uid INTEGER NOT NULL UNIQUE,
    template TEXT NOT NULL,
    resources TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    labels TEXT NOT NULL DEFAULT '{}',
    network TEXT NOT NULL DEFAULT '{}',
    secrets TEXT NOT NULL DEFAULT '{}',
    tenant TEXT NOT NULL DEFAULT 'local',
    idle_timeout REAL,
    last_active REAL
);
CREATE TABLE IF NOT EXISTS layers (
    id TEXT PRIMARY KEY,
    parent TEXT,
    depth INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS snapshots (
    id TEXT PRIMARY KEY,
    name TEXT,
    tenant TEXT NOT NULL,
    layer TEXT NOT NULL,
    template TEXT NOT NULL,
    sandbox TEXT NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (tenant, name)
);
CREATE TABLE IF NOT EXISTS memory_images (
    id TEXT PRIMARY KEY,
    layer TEXT NOT NULL,
    isolation TEXT NOT NULL,
    resources TEXT NOT NULL,
    template TEXT NOT NULL,
    created_at REAL NOT NULL,
    settled INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    max_sandboxes INTEGER NOT NULL,
    tiers TEXT NOT NULL,
    commands_per_minute INTEGER NOT NULL,
    created_at REAL NOT NULL,
    ceiling TEXT NOT NULL DEFAULT '{}',
    audit_max_bytes INTEGER,
    audit_sandbox_max_bytes INTEGER
);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    hash TEXT NOT NULL,
    created_at REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS flags (
    name TEXT PRIMARY KEY,
    set_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS ports (
    sandbox_id TEXT NOT NULL,
    port INTEGER NOT NULL,
    public INTEGER NOT NULL DEFAULT 0,
    nonce TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (sandbox_id, port)
);
CREATE TABLE IF NOT EXISTS volumes (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    tenant TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (tenant, name)
);
CREATE TABLE IF NOT EXISTS volume_mounts (
    volume_id TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    read_only INTEGER NOT NULL,
    PRIMARY KEY (volume_id, sandbox_id)
);
CREATE TABLE IF NOT EXISTS intents (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    data TEXT NOT NULL,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (
    name TEXT NOT NULL,
    labels TEXT NOT NULL,
    value REAL NOT NULL,
    PRIMARY KEY (name, labels)
);
"""


# ``slept_at`` as a state change leaves it (parameters: the new state, now).
_SLEPT_AT = (f"CASE WHEN ? NOT IN ({', '.join(repr(state) for state in ASLEEP)}) "
             "THEN NULL WHEN slept_at IS NULL THEN ? ELSE slept_at END")


def _row_to_info(row: sqlite3.Row) -> SandboxRecord:
    return SandboxRecord(
        id=row["id"], template=row["template"], resources=row["resources"],
        state=row["state"], created_at=row["created_at"], expires_at=row["expires_at"],
        uid=row["uid"], labels=json.loads(row["labels"]),
        network=json.loads(row["network"]), secrets=json.loads(row["secrets"]),
        tenant=row["tenant"], idle_timeout=row["idle_timeout"],
        last_active=row["last_active"] or row["created_at"],
        isolation=row["isolation"], layer=row["layer"], memory_image=row["memory_image"],
        template_version=row["template_version"], mounts=json.loads(row["mounts"]),
        creator=row["creator"], lifecycle=Lifecycle.model_validate_json(row["lifecycle"]),
        timeout_s=row["timeout_s"] or row["expires_at"] - row["created_at"],
        slept_at=row["slept_at"],
    )


def _row_to_snapshot(row: sqlite3.Row) -> SnapshotInfo:
    return SnapshotInfo(
        id=row["id"], name=row["name"], sandbox=row["sandbox"], template=row["template"],
        created_at=row["created_at"], size_bytes=row["bytes"], depth=row["depth"],
        memory=row["memory_image"] is not None,
    )


class Store:
    """Sandboxes by id; uid allocation happens inside the insert's transaction."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
        self._path = path
        self.reserve = DiskReserve(path.parent)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=30.0, isolation_level=None,
                                   check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(sandboxes)")}
        for column, default in (("network", "{}"), ("secrets", "{}"), ("tenant", "local")):
            if column not in columns:  # a store made before that column existed
                self._db.execute(f"ALTER TABLE sandboxes ADD COLUMN {column} TEXT NOT NULL "
                                 f"DEFAULT '{default}'")
        for column in ("idle_timeout", "last_active"):
            if column not in columns:
                self._db.execute(f"ALTER TABLE sandboxes ADD COLUMN {column} REAL")
        if "isolation" not in columns:
            self._db.execute("ALTER TABLE sandboxes ADD COLUMN isolation TEXT NOT NULL "
                             "DEFAULT 'namespace'")
        if "layer" not in columns:
            self._db.execute("ALTER TABLE sandboxes ADD COLUMN layer TEXT")
        if "memory_image" not in columns:
            self._db.execute("ALTER TABLE sandboxes ADD COLUMN memory_image TEXT")
        if "template_version" not in columns:  # a store made before it was recorded
            self._db.execute("ALTER TABLE sandboxes ADD COLUMN template_version TEXT")
        if "lifecycle" not in columns:  # made before lifecycles: killed at their timeout
            self._db.execute("ALTER TABLE sandboxes ADD COLUMN lifecycle TEXT NOT NULL "
                             "DEFAULT '{}'")
            self._db.execute("ALTER TABLE sandboxes ADD COLUMN timeout_s REAL")
        if "mounts" not in columns:  # a store made before volumes and data mounts
            self._db.execute("ALTER TABLE sandboxes ADD COLUMN mounts TEXT NOT NULL "
                             "DEFAULT '[]'")
        if "creator" not in columns:  # a store made before creators were recorded
            self._db.execute("ALTER TABLE sandboxes ADD COLUMN creator TEXT")
        if "slept_at" not in columns:  # a store made before sleeps were timed
            self._db.execute("ALTER TABLE sandboxes ADD COLUMN slept_at REAL")
            self._db.execute("ALTER TABLE sandboxes ADD COLUMN hibernated TEXT")
        if "memory_image" not in {r[1] for r in self._db.execute("PRAGMA table_info(snapshots)")}:
            # A store made before memory snapshots: every snapshot in it is a disk snapshot.
            self._db.execute("ALTER TABLE snapshots ADD COLUMN memory_image TEXT")
        if "settled" not in {r[1] for r in self._db.execute(
                "PRAGMA table_info(memory_images)")}:  # made by a build before settling
            self._db.execute("ALTER TABLE memory_images ADD COLUMN settled INTEGER NOT NULL "
                             "DEFAULT 1")
        if "ceiling" not in {r[1] for r in self._db.execute("PRAGMA table_info(tenants)")}:
            # A store made before ceilings: its tenants keep today's rules (no ceiling).
            self._db.execute("ALTER TABLE tenants ADD COLUMN ceiling TEXT NOT NULL DEFAULT '{}'")
        tenant_columns = {r[1] for r in self._db.execute("PRAGMA table_info(tenants)")}
        for column in ("audit_max_bytes", "audit_sandbox_max_bytes"):
            if column not in tenant_columns:  # a store made before audit budgets: the default
                self._db.execute(f"ALTER TABLE tenants ADD COLUMN {column} INTEGER")
        # A store whose keys predate the flag: they existed, so the flag is set.
        self._db.execute("INSERT OR IGNORE INTO flags SELECT 'keys_have_existed', ? "
                         "WHERE EXISTS (SELECT 1 FROM api_keys)", (time.time(),))
        path.chmod(0o600)
        self.reserve.ensure()
        self._counters = CounterBuffer(self._write_counters)
        # Placeholders by sandbox; a gone sandbox's are kept until the bound (redacting
        # strings no sandbox is handed any more is harmless).
        self._placeholders: dict[str, tuple[str, ...]] = {}
        self._placeholders_lock = threading.Lock()  # never held across a database call

    @property
    def path(self) -> Path:
        return self._path

    @contextmanager
    def _tx(self, *, freeing: bool = False) -> Iterator[sqlite3.Connection]:
        """One write transaction. A full disk refuses it as DiskFullError, having
        changed nothing; one that begins freeing space (``freeing``: a destroy, a delete) is
        given the disk's reserve first when it is nearly full, so it has room to."""
        if freeing:
            self.reserve.release_if_short()
        with self._lock, disk_full_as_error(self._path):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                with contextlib.suppress(sqlite3.OperationalError):  # already rolled back
                    self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def insert(
        self, *, sandbox_id: str, template: str, resources: str, ttl_s: float,
        labels: dict[str, str], allocate_uid: Callable[[set[int]], int],
        network: dict[str, object] | None = None, secrets: dict[str, str] | None = None,
        tenant: str = "local", admit: Callable[[int], None] | None = None,
        idle_timeout: float | None = None, isolation: str = "namespace",
        layer: str | None = None, memory_image: str | None = None,
        template_version: str | None = None,
        mounts: Sequence[Mapping[str, Any]] = (), creator: str | None = None,
        lifecycle: Lifecycle | None = None,
    ) -> SandboxRecord:
        """Insert a sandbox in state ``creating``; its uid is what the tier's ``allocate_uid``
        picks among the ones not recorded here, inside the insert's transaction. Its volume
        mounts (``mounts`` of kind ``volume``) are claimed in the same transaction: one
        writer or any number of readers per volume, so two creates racing for a volume
        cannot both win. ``admit`` (admission's judge of the tenant's sandbox count) is
        called with that count in the same transaction, so two creates racing for the last
        slot cannot both pass it either; it refuses by raising, and nothing is written.

        Raises:
            QuotaExceeded: the tier has no uid left.
            VolumeInUse: a volume is held by a writer, or by readers for a writer.
        """
        now = time.time()
        with self._tx() as db:
            if admit is not None:
                admit(self._count_sandboxes(db, tenant))
            for mount in mounts:
                if mount["kind"] == "volume":
                    self._claim_volume(db, mount["source"], sandbox_id,
                                       read_only=bool(mount["read_only"]))
            uid = allocate_uid({r[0] for r in db.execute("SELECT uid FROM sandboxes")})
            db.execute(
                "INSERT INTO sandboxes (id, uid, template, resources, state, created_at, "
                "expires_at, labels, network, secrets, tenant, idle_timeout, last_active, "
                "isolation, layer, memory_image, template_version, mounts, creator, "
                "lifecycle, timeout_s) "
                "VALUES (?, ?, ?, ?, 'creating', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (sandbox_id, uid, template, resources, now, now + ttl_s, json.dumps(labels),
                 json.dumps(network or {}), json.dumps(secrets or {}), tenant, idle_timeout,
                 now, isolation, layer, memory_image, template_version,
                 json.dumps([dict(m) for m in mounts]), creator,
                 (lifecycle or Lifecycle()).model_dump_json(), ttl_s),
            )
        self._remember_placeholders(sandbox_id, secrets or {})
        # The row as written (the insert's own values), not read back: in a burst every
        # store call waits its turn at the one connection.
        return SandboxRecord(
            id=sandbox_id, template=template, resources=resources, state="creating",
            created_at=now, expires_at=now + ttl_s, uid=uid, labels=dict(labels),
            network=dict(network or {}), secrets=dict(secrets or {}), tenant=tenant,
            idle_timeout=idle_timeout, last_active=now, isolation=isolation, layer=layer,
            memory_image=memory_image, template_version=template_version,
            mounts=[dict(m) for m in mounts], creator=creator,
            lifecycle=lifecycle or Lifecycle(), timeout_s=ttl_s)

    def count_sandboxes(self, tenant: str) -> int:
        """How many sandboxes ``tenant`` has (in any state)."""
        with self._lock:
            return self._count_sandboxes(self._db, tenant)

    @staticmethod
    def _count_sandboxes(db: sqlite3.Connection, tenant: str) -> int:
        count: int = db.execute("SELECT COUNT(*) FROM sandboxes WHERE tenant = ?",
                                (tenant,)).fetchone()[0]
        return count

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        return _row_to_info(row) if row else None

    def list(self) -> list[SandboxRecord]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM sandboxes ORDER BY created_at").fetchall()
        return [_row_to_info(r) for r in rows]

    def set_state(self, sandbox_id: str, state: str) -> None:
        """The sandbox's state; going to sleep (``paused``, ``hibernated``) from running
        records when (``slept_at``), a sleep deepening keeps it, waking clears it."""
        with self._tx(freeing=state == "destroying") as db:
            db.execute(f"UPDATE sandboxes SET state = ?, slept_at = {_SLEPT_AT} WHERE id = ?",
                       (state, state, time.time(), sandbox_id))

    def set_expiry(self, sandbox_id: str, expires_at: float, *,
                   timeout_s: float | None = None) -> None:
        """A new end of life; with ``timeout_s``, also the lifetime a resume starts again."""
        with self._tx() as db:
            if timeout_s is None:
                db.execute("UPDATE sandboxes SET expires_at = ? WHERE id = ?",
                           (expires_at, sandbox_id))
            else:
                db.execute("UPDATE sandboxes SET expires_at = ?, timeout_s = ? WHERE id = ?",
                           (expires_at, timeout_s, sandbox_id))

    def set_sleep(self, sandbox_id: str, state: str, expires_at: float) -> None:
        """Paused or running again, with the end of life that goes with it, in one write."""
        with self._tx() as db:
            db.execute(f"UPDATE sandboxes SET state = ?, expires_at = ?, slept_at = {_SLEPT_AT} "
                       "WHERE id = ?", (state, expires_at, state, time.time(), sandbox_id))

    def set_hibernated(self, sandbox_id: str, image: dict[str, Any], *, intent: str) -> None:
        """Hibernated, with what its tier left on disk (``backends.Hibernated``'s fields),
        and (one transaction) the hibernate's intent closed."""
        with self._tx() as db:
            db.execute(f"UPDATE sandboxes SET state = 'hibernated', hibernated = ?, "
                       f"slept_at = {_SLEPT_AT} WHERE id = ?",
                       (json.dumps(image), "hibernated", time.time(), sandbox_id))
            db.execute("DELETE FROM intents WHERE id = ?", (intent,))

    def hibernated_image(self, sandbox_id: str) -> dict[str, Any] | None:
        """What ``set_hibernated`` recorded for the sandbox's last hibernate, if any."""
        with self._lock:
            row = self._db.execute("SELECT hibernated FROM sandboxes WHERE id = ?",
                                   (sandbox_id,)).fetchone()
        return None if row is None or row[0] is None else dict(json.loads(row[0]))

    def touch(self, sandbox_id: str) -> None:
        """Record activity (for the idle timeout)."""
        with self._tx() as db:
            db.execute("UPDATE sandboxes SET last_active = ? WHERE id = ?",
                       (time.time(), sandbox_id))

    def set_network(self, sandbox_id: str, network: dict[str, object]) -> None:
        with self._tx() as db:
            db.execute("UPDATE sandboxes SET network = ? WHERE id = ?",
                       (json.dumps(network), sandbox_id))

    def delete(self, sandbox_id: str) -> None:
        """Forget the sandbox, its exposed ports and its hold on volumes, at once."""
        with self._placeholders_lock:
            self._placeholders.pop(sandbox_id, None)
        with self._tx(freeing=True) as db:
            db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))
            db.execute("DELETE FROM ports WHERE sandbox_id = ?", (sandbox_id,))
            db.execute("DELETE FROM volume_mounts WHERE sandbox_id = ?", (sandbox_id,))

    # -- exposed ports ----------------------------------------------------------------------

    def expose_port(self, sandbox_id: str, port: int, *, public: bool, nonce: str,
                    max_ports: int | None = None) -> None:
        """Expose (or re-expose, changing ``public``) a port; ``nonce`` is only set the first
        time, so tokens and links already handed out stay valid. At most ``max_ports`` per
        sandbox."""
        with self._tx() as db:
            count = db.execute("SELECT COUNT(*) FROM ports WHERE sandbox_id = ? AND port != ?",
                               (sandbox_id, port)).fetchone()[0]
            if max_ports is not None and count >= max_ports:
                raise QuotaExceeded(f"sandbox {sandbox_id} already exposes {count} ports, the "
                                    "most a sandbox may; unexpose one first")
            db.execute("INSERT INTO ports (sandbox_id, port, public, nonce, created_at) "
                       "VALUES (?, ?, ?, ?, ?) ON CONFLICT (sandbox_id, port) DO UPDATE SET "
                       "public = excluded.public", (sandbox_id, port, int(public), nonce,
                                                    time.time()))

    def unexpose_port(self, sandbox_id: str, port: int) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM ports WHERE sandbox_id = ? AND port = ?",
                              (sandbox_id, port)).rowcount > 0

    def port(self, sandbox_id: str, port: int) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM ports WHERE sandbox_id = ? AND port = ?",
                                   (sandbox_id, port)).fetchone()
        return dict(row) if row else None

    def ports(self, sandbox_id: str) -> builtins.list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM ports WHERE sandbox_id = ? ORDER BY port",
                                    (sandbox_id,)).fetchall()
        return [dict(r) for r in rows]

    # -- volumes ----------------------------------------------------------------------------

    def add_volume(self, volume_id: str, *, name: str, tenant: str, size_bytes: int,
                   admit: Callable[[int, int], None] | None = None) -> None:
        """Record a volume. ``admit`` (admission's judge of the tenant's quota) is called
        with the tenant's volume count and bytes in all in the same transaction, so
        concurrent creates cannot pass it together; it refuses by raising."""
        try:
            with self._tx() as db:
                if admit is not None:
                    count, total = db.execute(
                        "SELECT COUNT(*), COALESCE(SUM(size_bytes), 0) FROM volumes "
                        "WHERE tenant = ?", (tenant,)).fetchone()
                    admit(count, total)
                db.execute("INSERT INTO volumes (id, name, tenant, size_bytes, created_at) "
                           "VALUES (?, ?, ?, ?, ?)",
                           (volume_id, name, tenant, size_bytes, time.time()))
        except sqlite3.IntegrityError:
            raise UsageError(f"a volume named {name!r} already exists; choose another name "
                             f"or delete it with `corral volumes rm {name}`") from None

    def volume(self, ref: str, *, tenant: str | None) -> dict[str, Any] | None:
        """A volume by id or name (of ``tenant``; any tenant when None), with its holders."""
        query = "SELECT * FROM volumes WHERE (id = ? OR name = ?)"
        args: tuple[Any, ...] = (ref, ref)
        if tenant is not None:
            query += " AND tenant = ?"
            args += (tenant,)
        with self._lock:
            row = self._db.execute(query + " ORDER BY id = ? DESC", (*args, ref)).fetchone()
            if row is None:
                return None
            holders = self._holders(self._db, row["id"])
        return {**dict(row), "mounted_by": holders}

    def volumes(self, *, tenant: str | None) -> builtins.list[dict[str, Any]]:
        query = "SELECT * FROM volumes"
        args: tuple[Any, ...] = ()
        if tenant is not None:
            query, args = query + " WHERE tenant = ?", (tenant,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY created_at", args).fetchall()
            return [{**dict(r), "mounted_by": self._holders(self._db, r["id"])} for r in rows]

    def volume_ids(self) -> set[str]:
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT id FROM volumes")}

    def delete_volume(self, volume_id: str) -> None:
        """Forget a volume; refused while a sandbox mounts it (checked in the same
        transaction, so a create cannot claim it in between)."""
        with self._tx(freeing=True) as db:
            holders = self._holders(db, volume_id)
            if holders:
                raise VolumeInUse(
                    f"volume {volume_id} is mounted by sandbox {holders[0]['sandbox_id']}; "
                    "destroy the sandboxes that mount it first")
            db.execute("DELETE FROM volumes WHERE id = ?", (volume_id,))

    @staticmethod
    def _holders(db: sqlite3.Connection, volume_id: str) -> builtins.list[dict[str, Any]]:
        return [{"sandbox_id": r[0], "read_only": bool(r[1])} for r in db.execute(
            "SELECT sandbox_id, read_only FROM volume_mounts WHERE volume_id = ? "
            "ORDER BY sandbox_id", (volume_id,))]

    def check_volume_free(self, volume_id: str, *, read_only: bool) -> None:
        """Raise ``VolumeInUse`` if a sandbox's hold on the volume would refuse this mount
        now (``insert`` decides for good, in its transaction)."""
        with self._lock:
            self._refuse_conflict(self._db, volume_id, read_only=read_only)

    def _refuse_conflict(self, db: sqlite3.Connection, volume_id: str, *,
                         read_only: bool) -> None:
        for holder in self._holders(db, volume_id):
            if not holder["read_only"] or not read_only:
                how = "writes" if not holder["read_only"] else "reads"
                raise VolumeInUse(
                    f"volume {volume_id} is mounted by sandbox {holder['sandbox_id']}, which "
                    f"{how} it: a volume has one writer or any number of readers; mount it "
                    "read-only, or destroy that sandbox first")

    def _claim_volume(self, db: sqlite3.Connection, volume_id: str, sandbox_id: str, *,
                      read_only: bool) -> None:
        if db.execute("SELECT 1 FROM volumes WHERE id = ?", (volume_id,)).fetchone() is None:
            raise VolumeNotFound(f"volume {volume_id} does not exist (deleted meanwhile?)")
        self._refuse_conflict(db, volume_id, read_only=read_only)
        db.execute("INSERT INTO volume_mounts (volume_id, sandbox_id, read_only) "
                   "VALUES (?, ?, ?)", (volume_id, sandbox_id, int(read_only)))

    # -- workspace layers and snapshots -----------------------------------------------------

    def set_layer(self, sandbox_id: str, layer: str | None, *,
                  memory_image: str | None = None) -> None:
        """Put the sandbox on ``layer``; it resumed from ``memory_image`` (a restore) or from
        none: a workspace that changed is no longer the one any earlier image was taken over."""
        with self._tx() as db:
            db.execute("UPDATE sandboxes SET layer = ?, memory_image = ? WHERE id = ?",
                       (layer, memory_image, sandbox_id))

    def add_layer(self, layer_id: str, *, parent: str | None, bytes_used: int) -> int:
        """Record a sealed layer on top of ``parent``; return its depth (1 = no parent)."""
        with self._tx() as db:
            return self._add_layer(db, layer_id, parent=parent, bytes_used=bytes_used)

    @staticmethod
    def _add_layer(db: sqlite3.Connection, layer_id: str, *, parent: str | None,
                   bytes_used: int) -> int:
        depth = 1
        if parent is not None:
            row = db.execute("SELECT depth FROM layers WHERE id = ?", (parent,)).fetchone()
            depth = (row[0] if row else 0) + 1
        db.execute("INSERT OR IGNORE INTO layers (id, parent, depth, bytes, created_at) "
                   "VALUES (?, ?, ?, ?, ?)", (layer_id, parent, depth, bytes_used, time.time()))
        return depth

    def seal_done(self, sandbox_id: str, layer_id: str, *, parent: str | None,
                  bytes_used: int, intent: str | None = None) -> None:
        """Record a sealed layer and put the sandbox on it, and (one transaction) close the
        seal's intent: there is no moment the layer is the sandbox's but unrecorded, or
        recorded but not the sandbox's."""
        with self._tx() as db:
            self._add_layer(db, layer_id, parent=parent, bytes_used=bytes_used)
            db.execute("UPDATE sandboxes SET layer = ?, memory_image = NULL WHERE id = ?",
                       (layer_id, sandbox_id))
            if intent is not None:
                db.execute("DELETE FROM intents WHERE id = ?", (intent,))

    def restore_done(self, sandbox_id: str, layer: str | None, *, memory_image: str | None,
                     intent: str) -> None:
        """``set_layer`` and the restore's intent closed, in one transaction."""
        with self._tx() as db:
            db.execute("UPDATE sandboxes SET layer = ?, memory_image = ? WHERE id = ?",
                       (layer, memory_image, sandbox_id))
            db.execute("DELETE FROM intents WHERE id = ?", (intent,))

    # -- intents ----------------------------------------------------------------------------

    def begin_intent(self, kind: str, subject: str, **data: Any) -> str:
        """Record that this process is about to make a change of ``kind`` to ``subject`` (a
        sandbox's id; a volume's for a volume's intents); the intent's id (``intents``)."""
        intent = new_id("int")
        with self._tx() as db:
            self._add_intent(db, intent, kind, subject, data)
        failpoint(f"{kind}.intent")
        return intent

    def begin_hibernate(self, sandbox_id: str, *, tenant: str, limit: int | None) -> str:
        """``begin_intent("hibernate")``, holding ``tenant`` to ``limit`` sandboxes
        hibernated or being hibernated, counted in the same transaction: two hibernates
        racing for the last place (in any process) cannot both pass.

        Raises:
            QuotaExceeded: the tenant is at its limit; nothing is written.
        """
        intent = new_id("int")
        with self._tx() as db:
            if limit is not None:
                count: int = db.execute(
                    "SELECT COUNT(*) FROM sandboxes WHERE tenant = ? AND id != ? AND "
                    "(state = 'hibernated' OR id IN "
                    "(SELECT sandbox_id FROM intents WHERE kind = 'hibernate'))",
                    (tenant, sandbox_id)).fetchone()[0]
                if count >= limit:
                    raise QuotaExceeded(
                        f"tenant {tenant!r} keeps {count} hibernated sandboxes, the most its "
                        "ceiling allows (max_hibernated); destroy or resume one of them, leave "
                        "this one paused, or ask the operator for a higher bound")
            self._add_intent(db, intent, "hibernate", sandbox_id, {})
        failpoint("hibernate.intent")
        return intent

    @staticmethod
    def _add_intent(db: sqlite3.Connection, intent: str, kind: str, subject: str,
                    data: Mapping[str, Any]) -> None:
        db.execute("INSERT INTO intents (id, kind, sandbox_id, data, owner, created_at) "
                   "VALUES (?, ?, ?, ?, ?, ?)", (intent, kind, subject, json.dumps(dict(data)),
                                                 this_owner(), time.time()))

    def intents(self, subject: str | None = None) -> builtins.list[dict[str, Any]]:
        """Every open intent (of ``subject``), oldest first."""
        query, args = "SELECT * FROM intents", tuple[str, ...]()
        if subject is not None:
            query, args = query + " WHERE sandbox_id = ?", (subject,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY created_at", args).fetchall()
        return [{**dict(row), "data": json.loads(row["data"])} for row in rows]

    def delete_intent(self, intent_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM intents WHERE id = ?", (intent_id,))

    def intent_layers(self) -> set[str]:
        """The layers open intents name: garbage collection leaves them alone."""
        return {str(i["data"]["layer"]) for i in self.intents() if i["data"].get("layer")}

    def layer_chain(self, top: str | None) -> tuple[str, ...]:
        """``top`` and the layers under it, top first."""
        if top is None:  # most sandboxes: no layer, nothing to read
            return ()
        chain: list[str] = []
        with self._lock:
            while top is not None and len(chain) < 10_000:
                chain.append(top)
                row = self._db.execute("SELECT parent FROM layers WHERE id = ?", (top,)).fetchone()
                top = row[0] if row else None
        return tuple(chain)

    def layer_ids(self) -> set[str]:
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT id FROM layers")}

    def mounted_layers_needed(self) -> set[str]:
        """The layers a sandbox stands on (whatever its state but hibernated: one being
        created, destroyed or restored included) or an open intent names: the ones that must
        stay mounted. A hibernated sandbox mounts its layers again when it wakes."""
        with self._lock:
            return {r[0] for r in self._db.execute(
                "WITH RECURSIVE used(id) AS (SELECT layer FROM sandboxes WHERE layer IS NOT "
                "NULL AND state != 'hibernated' UNION SELECT json_extract(data, '$.layer') "
                "FROM intents WHERE json_extract(data, '$.layer') IS NOT NULL UNION SELECT "
                "layers.parent FROM layers JOIN used ON layers.id = used.id WHERE "
                "layers.parent IS NOT NULL) SELECT id FROM used")}

    def unused_layers(self) -> builtins.list[str]:
        """Delete and return layers no sandbox, snapshot or other layer stands on."""
        removed: builtins.list[str] = []
        with self._tx() as db:
            while True:
                rows = [r[0] for r in db.execute(
                    "SELECT id FROM layers WHERE id NOT IN (SELECT layer FROM sandboxes WHERE "
                    "layer IS NOT NULL) AND id NOT IN (SELECT layer FROM snapshots) AND id NOT "
                    "IN (SELECT parent FROM layers WHERE parent IS NOT NULL) AND id NOT IN "
                    "(SELECT layer FROM memory_images) AND id NOT IN (SELECT "
                    "json_extract(data, '$.layer') FROM intents WHERE json_extract(data, "
                    "'$.layer') IS NOT NULL)")]
                if not rows:
                    return removed
                db.executemany("DELETE FROM layers WHERE id = ?", [(r,) for r in rows])
                removed += rows

    # An unsettled image (recorded before it is made, not yet named by a snapshot or sandbox)
    # is left alone this long: it is being made, unless a crash left it.
    UNSETTLED_S = 3600.0

    def add_memory_image(self, image_id: str, *, layer: str, isolation: str, resources: str,
                         template: str) -> None:
        """Record, *before* the tier makes it (so no sweep takes a new image for a crash's
        leftover), a memory image over ``layer`` (which it holds) on tier ``isolation`` for a
        sandbox of ``resources`` and ``template`` (what a sandbox resuming it must be). It
        stays unsettled, never collected, until ``settle_memory_image``."""
        with self._tx() as db:
            db.execute("INSERT INTO memory_images (id, layer, isolation, resources, template, "
                       "created_at, settled) VALUES (?, ?, ?, ?, ?, ?, 0)",
                       (image_id, layer, isolation, resources, template, time.time()))

    def settle_memory_image(self, image_id: str) -> None:
        """From now on the image goes when nothing names it."""
        with self._tx() as db:
            db.execute("UPDATE memory_images SET settled = 1 WHERE id = ?", (image_id,))

    def delete_memory_image(self, image_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM memory_images WHERE id = ?", (image_id,))

    def memory_image(self, image_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM memory_images WHERE id = ?",
                                   (image_id,)).fetchone()
        return dict(row) if row else None

    def memory_image_ids(self) -> set[str]:
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT id FROM memory_images")}

    def unused_memory_images(self) -> builtins.list[tuple[str, str]]:
        """Delete and return (id, isolation) of the memory images no snapshot or sandbox
        names (their layers are then ``unused_layers``' to judge)."""
        with self._tx() as db:
            rows = [(r[0], r[1]) for r in db.execute(
                "SELECT id, isolation FROM memory_images WHERE (settled = 1 OR created_at < ?) "
                "AND id NOT IN (SELECT memory_image FROM snapshots WHERE memory_image IS NOT "
                "NULL) AND id NOT IN (SELECT memory_image FROM sandboxes WHERE memory_image IS "
                "NOT NULL)", (time.time() - self.UNSETTLED_S,))]
            db.executemany("DELETE FROM memory_images WHERE id = ?", [(r[0],) for r in rows])
        return rows

    def add_snapshot(self, snapshot_id: str, *, name: str | None, tenant: str, layer: str,
                     template: str, sandbox: str,
                     memory_image: str | None = None) -> SnapshotInfo:
        """Record a snapshot (a memory snapshot with ``memory_image``). Raises ``UsageError``
        if the tenant already has ``name``."""
        try:
            with self._tx() as db:
                db.execute("INSERT INTO snapshots (id, name, tenant, layer, template, sandbox, "
                           "created_at, memory_image) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                           (snapshot_id, name, tenant, layer, template, sandbox, time.time(),
                            memory_image))
        except sqlite3.IntegrityError:
            raise UsageError(f"a snapshot named {name!r} already exists; choose another name or "
                             f"remove it with `corral snapshots rm {name}`") from None
        info = self.snapshot(snapshot_id, tenant=tenant)
        assert info is not None
        return info

    _SNAPSHOT_SELECT = ("SELECT s.*, l.depth AS depth, l.bytes AS bytes FROM snapshots s "
                        "JOIN layers l ON l.id = s.layer")

    def snapshot(self, ref: str, *, tenant: str | None) -> SnapshotInfo | None:
        """A snapshot by id or name (of ``tenant``; any tenant when None)."""
        query = self._SNAPSHOT_SELECT + " WHERE (s.id = ? OR s.name = ?)"
        args: tuple[Any, ...] = (ref, ref)
        if tenant is not None:
            query += " AND s.tenant = ?"
            args += (tenant,)
        with self._lock:
            row = self._db.execute(query + " ORDER BY s.id = ? DESC", (*args, ref)).fetchone()
        return _row_to_snapshot(row) if row else None

    def snapshots(self, *, tenant: str | None) -> builtins.list[SnapshotInfo]:
        query = self._SNAPSHOT_SELECT
        args: tuple[Any, ...] = ()
        if tenant is not None:
            query += " WHERE s.tenant = ?"
            args = (tenant,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY s.created_at", args).fetchall()
        return [_row_to_snapshot(r) for r in rows]

    def snapshot_memory_image(self, snapshot_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT memory_image FROM snapshots WHERE id = ?",
                                   (snapshot_id,)).fetchone()
        return row[0] if row else None

    def snapshot_tenant(self, snapshot_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT tenant FROM snapshots WHERE id = ?",
                                   (snapshot_id,)).fetchone()
        return row[0] if row else None

    def snapshot_layer(self, snapshot_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT layer FROM snapshots WHERE id = ?",
                                   (snapshot_id,)).fetchone()
        return row[0] if row else None

    def delete_snapshot(self, snapshot_id: str) -> None:
        with self._tx(freeing=True) as db:
            db.execute("DELETE FROM snapshots WHERE id = ?", (snapshot_id,))

    # -- tenants and API keys ---------------------------------------------------------------

    def add_tenant(self, name: str, *, max_sandboxes: int, tiers: Sequence[str],
                   commands_per_minute: int, ceiling: Mapping[str, Any] | None = None,
                   audit_max_bytes: int | None = None,
                   audit_sandbox_max_bytes: int | None = None) -> None:
        """Add or replace a tenant; audit budgets left None follow the server's default."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO tenants (name, max_sandboxes, tiers, "
                       "commands_per_minute, created_at, ceiling, audit_max_bytes, "
                       "audit_sandbox_max_bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (name, max_sandboxes, json.dumps(list(tiers)), commands_per_minute,
                        time.time(), json.dumps(dict(ceiling or {})), audit_max_bytes,
                        audit_sandbox_max_bytes))

    def tenants(self) -> builtins.list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM tenants ORDER BY name").fetchall()
        return [{"name": r["name"], "max_sandboxes": r["max_sandboxes"],
                 "tiers": json.loads(r["tiers"]), "commands_per_minute": r["commands_per_minute"],
                 "created_at": r["created_at"], "ceiling": json.loads(r["ceiling"]),
                 "audit_max_bytes": r["audit_max_bytes"],
                 "audit_sandbox_max_bytes": r["audit_sandbox_max_bytes"]}
                for r in rows]

    def tenant(self, name: str) -> dict[str, Any] | None:
        return next((t for t in self.tenants() if t["name"] == name), None)

    def remove_tenant(self, name: str) -> bool:
        with self._tx() as db:
            db.execute("UPDATE api_keys SET revoked = 1 WHERE tenant = ?", (name,))
            return db.execute("DELETE FROM tenants WHERE name = ?", (name,)).rowcount > 0

    def add_key(self, key_id: str, tenant: str, digest: str) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO api_keys (id, tenant, hash, created_at) VALUES (?, ?, ?, ?)",
                       (key_id, tenant, digest, time.time()))
            # Never cleared: once keys existed, losing the last one must not reopen a keyless
            # service (see keys_have_existed).
            db.execute("INSERT OR IGNORE INTO flags VALUES ('keys_have_existed', ?)",
                       (time.time(),))

    def key(self, key_id: str) -> tuple[str, str] | None:
        """(tenant, hash) of a live key."""
        with self._lock:
            row = self._db.execute("SELECT tenant, hash FROM api_keys WHERE id = ? AND revoked = 0",
                                   (key_id,)).fetchone()
        return (row[0], row[1]) if row else None

    def revoke_key(self, key_id: str) -> bool:
        with self._tx() as db:
            return db.execute("UPDATE api_keys SET revoked = 1 WHERE id = ? AND revoked = 0",
                              (key_id,)).rowcount > 0

    def keys(self) -> builtins.list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT id, tenant, created_at, revoked FROM api_keys "
                                    "ORDER BY created_at").fetchall()
        return [{"id": r[0], "tenant": r[1], "created_at": r[2], "revoked": bool(r[3])}
                for r in rows]

    def live_key_count(self) -> int:
        with self._lock:
            return int(self._db.execute(
                "SELECT COUNT(*) FROM api_keys WHERE revoked = 0").fetchone()[0])

    def key_presence(self) -> tuple[bool, bool]:
        """(whether a live API key exists, whether any ever did), in one read: what a
        loopback service asks on every request."""
        with self._lock:
            live, ever = self._db.execute(
                "SELECT EXISTS(SELECT 1 FROM api_keys WHERE revoked = 0), "
                "EXISTS(SELECT 1 FROM flags WHERE name = 'keys_have_existed')").fetchone()
        return bool(live), bool(ever)

    def keys_have_existed(self) -> bool:
        """Whether any API key was ever created in this store (revoked or not)."""
        with self._lock:
            return self._db.execute(
                "SELECT 1 FROM flags WHERE name = 'keys_have_existed'").fetchone() is not None

    def add_counters(self, rows: Sequence[tuple[str, str, float]]) -> None:
        """Add to metric counters (batched in memory: see ``CounterBuffer``)."""
        self._counters.add(rows)

    def _write_counters(self, rows: Sequence[tuple[str, str, float]]) -> None:
        with self._tx() as db:
            db.executemany(
                "INSERT INTO counters (name, labels, value) VALUES (?, ?, ?) "
                "ON CONFLICT (name, labels) DO UPDATE SET value = value + excluded.value", rows)

    def counters(self) -> dict[tuple[str, str], float]:
        self._counters.flush()  # this process's own counts are part of the answer
        with self._lock:
            rows = self._db.execute("SELECT name, labels, value FROM counters").fetchall()
        return {(r[0], r[1]): r[2] for r in rows}

    def placeholders(self, sandbox_id: str) -> builtins.list[str]:
        """The secret placeholders handed to a sandbox (none for one this process never saw
        and that is gone). Set once, at the insert, so remembered: every audit event and
        command asks for them."""
        with self._placeholders_lock:
            known = self._placeholders.get(sandbox_id)
        if known is not None:
            return list(known)
        info = self.get(sandbox_id)
        if info is None:
            return []
        self._remember_placeholders(sandbox_id, info.secrets)
        return list(info.secrets.values())

    def _remember_placeholders(self, sandbox_id: str, secrets: Mapping[str, str]) -> None:
        with self._placeholders_lock:
            if len(self._placeholders) >= _PLACEHOLDERS_KEPT:
                self._placeholders.clear()  # a bound, not a policy: they are read again
            self._placeholders[sandbox_id] = tuple(secrets.values())

    def state_counts(self) -> dict[str, int]:
        """Sandboxes by state; every state appears, at zero when none is in it."""
        counts = dict.fromkeys(get_args(SandboxState), 0)
        with self._lock:
            rows = self._db.execute(
                "SELECT state, COUNT(*) FROM sandboxes GROUP BY state").fetchall()
        for state, count in rows:
            counts[state] = count
        return counts

    def close(self) -> None:
        self._counters.close()
        with self._lock:
            self._db.close()
