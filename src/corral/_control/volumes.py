"""Persistent named volumes and the operator's data mounts: naming, ownership, size limits, and
turning what a caller asks to mount into the ``Mount`` list a sandbox is built with.

A volume is a tenant's, by name; its bytes are a tier's (``VolumeStorage``). Who may mount it
how (one writer or many readers) is decided in the store's transaction that inserts the
sandbox, so two creates racing for one volume cannot both write it. A data mount is named by
the caller and resolved by the operator's list (``Settings.data_mounts``): no API caller ever
gives a host path.
"""

from __future__ import annotations

import builtins
import logging
import posixpath
import re
from collections.abc import Mapping
from typing import Any

from .._core.failpoints import failpoint
from .._core.owner import owner_alive
from .._settings import Settings
from ..backends import VolumeStorage
from ..errors import (
    BackendUnavailable,
    CorralError,
    PolicyError,
    UsageError,
    VolumeInUse,
    VolumeNotFound,
)
from ..models import VolumeInfo
from .admission import volume_slot
from .records import new_id
from .registry import BackendRegistry
from .store import Store

__all__ = ["MAX_MOUNTS", "VOLUME_INTENTS", "Volumes", "mount_target"]

logger = logging.getLogger(__name__)

MAX_MOUNTS = 16
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
_VOLUME_ID = re.compile(r"vol_[a-z0-9]{12}")
_TARGET_PART = re.compile(r"[A-Za-z0-9_.@+-]{1,128}")
_MIN_SIZE = 16 * 2**20
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?", re.IGNORECASE)
#: The intent kinds of volume operations (resolved here, not by ``Intents``): a create is
#: rolled back (never acknowledged: the intent closes before the answer), a delete forward.
VOLUME_INTENTS = ("volume.create", "volume.delete")


def parse_size(value: object) -> int:
    """Bytes, from an int or a string like ``512M``, ``10G`` or ``1GiB``."""
    if isinstance(value, bool):
        raise UsageError(f"a volume size is bytes or a string like 1G, not {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        found = _SIZE.fullmatch(value.strip())
        if found is not None:
            scale = 1024 ** "bkmgt".index((found.group(2) or "b").lower())
            return int(float(found.group(1)) * scale)
    raise UsageError(f"a volume size is bytes or a string like 512M or 10G, not {value!r}")


def mount_target(path: object) -> str:
    """A mount point inside the sandbox: under ``/mnt/`` or ``/workspace/``, normalised, and
    no deeper than it needs to be understood."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise UsageError(f"a mount point is an absolute path under /mnt/ or /workspace/, not "
                         f"{path!r}")
    parts = path.strip("/").split("/")
    if (len(parts) < 2 or parts[0] not in ("mnt", "workspace") or len(parts) > 8
            or not all(_TARGET_PART.fullmatch(part) and part not in (".", "..")
                       for part in parts[1:])):
        raise UsageError(f"mount point {path!r} must be a plain path under /mnt/ or "
                         "/workspace/ (like /mnt/data): no '..', no empty or odd parts")
    return "/" + "/".join(parts)


class Volumes:
    def __init__(self, *, settings: Settings, store: Store, backends: BackendRegistry) -> None:
        self._settings = settings
        self._store = store
        self._backends = backends

    def _storage(self) -> VolumeStorage:
        backend = self._backends.get(self._settings.backend)
        if not isinstance(backend, VolumeStorage):
            backend = self._backends.get("namespace")
        if not isinstance(backend, VolumeStorage):
            raise BackendUnavailable(f"the {backend.name} tier keeps no volumes")
        return backend

    # -- volumes ------------------------------------------------------------------------------

    def create(self, name: object, size: object, *, tenant: str = "local") -> VolumeInfo:
        if not isinstance(name, str) or not _NAME.fullmatch(name) or _VOLUME_ID.fullmatch(name):
            raise UsageError(f"invalid volume name {name!r}: 1-63 of a-z, 0-9, _ . - "
                             "(starting with a letter or digit), not shaped like a volume id")
        size_bytes = parse_size(size)
        if not _MIN_SIZE <= size_bytes <= self._settings.volume_max_bytes:
            raise UsageError(f"a volume's size must be from 16M to "
                             f"{self._settings.volume_max_bytes // 2**20}M "
                             f"(CORRAL_VOLUME_MAX_BYTES), not {size_bytes} bytes")
        volume_id = new_id("vol")
        admit = volume_slot(tenant, size_bytes, max_count=self._settings.volumes_per_tenant,
                            max_bytes=self._settings.volume_bytes_per_tenant)
        intent = self._store.begin_intent("volume.create", volume_id, volume=volume_id)
        try:
            self._store.add_volume(volume_id, name=name, tenant=tenant, size_bytes=size_bytes,
                                   admit=admit)
            failpoint("volume.recorded")
            try:
                self._storage().create_volume(volume_id, size_bytes)
            except BaseException:
                self._store.delete_volume(volume_id)
                raise
            failpoint("volume.made")
        finally:
            self._store.delete_intent(intent)  # made whole, or undone here
        logger.info("created volume %s (%s, %d bytes) for %s", name, volume_id, size_bytes,
                    tenant)
        return self.get(volume_id, tenant=tenant)

    def get(self, ref: object, *, tenant: str | None = None) -> VolumeInfo:
        row = self._row(ref, tenant)
        return self._info(row)

    def list(self, *, tenant: str | None = None) -> builtins.list[VolumeInfo]:
        return [self._info(row) for row in self._store.volumes(tenant=tenant)]

    def delete(self, ref: object, *, tenant: str | None = None) -> None:
        """Delete a volume and its data; refused (``VolumeInUse``) while a sandbox mounts it."""
        row = self._row(ref, tenant)
        intent = self._store.begin_intent("volume.delete", row["id"], volume=row["id"])
        try:
            self._store.delete_volume(row["id"])  # refuses while mounted, in its transaction
        except BaseException:
            self._store.delete_intent(intent)  # nothing changed
            raise
        failpoint("volume.forgotten")
        self._storage().remove_volume(row["id"])
        self._store.delete_intent(intent)
        logger.info("deleted volume %s (%s)", row["name"], row["id"])

    def recover(self) -> builtins.list[str]:
        """Finish or undo the volume operations a dead process left open (its intents): a
        create is undone (it was never acknowledged; unless a sandbox mounts the volume
        already, which keeps it), a delete finished. What became of each."""
        done = []
        for intent in self._store.intents():
            if intent["kind"] not in VOLUME_INTENTS:
                continue
            pid, _, start = str(intent["owner"]).partition(".")
            if owner_alive(pid, start):
                continue
            volume_id = str(intent["data"]["volume"])
            try:
                if intent["kind"] == "volume.create":
                    try:
                        self._store.delete_volume(volume_id)
                        self._storage().remove_volume(volume_id)
                        what = "rolled back"
                    except VolumeInUse:
                        what = "kept: a sandbox mounts it"
                else:
                    if volume_id not in self._store.volume_ids():
                        self._storage().remove_volume(volume_id)
                        what = "rolled forward"
                    else:
                        what = "rolled back: nothing was deleted"
            except CorralError as exc:  # its tier cannot load here: the next start retries
                logger.warning("volume intent %s (%s) not resolved: %s", intent["id"],
                               intent["kind"], exc)
                continue
            self._store.delete_intent(intent["id"])
            logger.warning("volume %s: %s interrupted by a crash, %s", volume_id,
                           intent["kind"].split(".")[1], what)
            done.append(f"volume {volume_id} ({intent['kind']} {what})")
        return done

    def leftovers(self) -> builtins.list[str]:
        """Remove volumes on disk that the store does not know (a crash between the two
        steps of ``create`` or ``delete``); return their ids."""
        storage = self._storage()
        known = self._store.volume_ids()
        removed = [v for v in storage.volume_ids() if v not in known]
        for volume_id in removed:
            storage.remove_volume(volume_id)
        return removed

    def _row(self, ref: object, tenant: str | None) -> dict[str, Any]:
        if not isinstance(ref, str) or not ref:
            raise UsageError(f"a volume is named by its name or id, not {ref!r}")
        row = self._store.volume(ref, tenant=tenant)
        if row is None:
            raise VolumeNotFound(f"no volume {ref!r}; `corral volumes ls` lists them")
        return row

    def _info(self, row: Mapping[str, Any]) -> VolumeInfo:
        try:
            used: int | None = self._storage().volume_usage(row["id"])
        except Exception:  # usage is informative; a listing must not fail for it
            used = None
        return VolumeInfo(id=row["id"], name=row["name"], size_bytes=row["size_bytes"],
                          used_bytes=used, created_at=row["created_at"],
                          mounted_by=[h["sandbox_id"] for h in row["mounted_by"]],
                          writer=next((h["sandbox_id"] for h in row["mounted_by"]
                                       if not h["read_only"]), None))

    # -- what a new sandbox mounts ------------------------------------------------------------

    def mounts(self, volumes: Mapping[str, object] | None, data: Mapping[str, object] | None,
               *, tenant: str) -> builtins.list[dict[str, Any]]:
        """The ``Mount`` fields for a sandbox asking for ``volumes`` (name → mount point, or
        ``{"path": ..., "read_only": bool}``) and ``data`` (data mount name → mount point),
        checked: the volumes are the tenant's, the data mounts the operator's, every mount
        point distinct and none inside another."""
        wanted = [("volume", name, *_where(name, where)) for name, where in
                  (volumes or {}).items()]
        wanted += [("data", name, *_where(name, where, data=True)) for name, where in
                   (data or {}).items()]
        if len(wanted) > MAX_MOUNTS:
            raise UsageError(f"at most {MAX_MOUNTS} volumes and data mounts per sandbox")
        targets = sorted(target for _, _, target, _ in wanted)
        for first, second in zip(targets, targets[1:], strict=False):
            if second == first or second.startswith(first + "/"):
                raise UsageError(f"mount points {first} and {second} overlap; give each "
                                 "volume or data mount a directory of its own")
        mounts: builtins.list[dict[str, Any]] = []
        for kind, name, target, read_only in wanted:
            if kind == "volume":
                source = self._row(name, tenant)["id"]
            elif name in self._settings.data_mounts:
                source = name
            else:
                approved = ", ".join(sorted(self._settings.data_mounts)) or "none"
                raise PolicyError(f"{name!r} is not a data mount the operator approved "
                                  f"(CORRAL_DATA_MOUNTS; approved: {approved}); data mounts "
                                  "are named, never host paths")
            mounts.append({"kind": kind, "source": source, "target": target,
                           "read_only": read_only})
        # Parents before children: a later mount may sit under /workspace, never under another.
        return sorted(mounts, key=lambda m: m["target"].count("/"))

    def check_free(self, mounts: builtins.list[dict[str, Any]]) -> None:
        """Refuse early (before a template pull or a build) what the insert would refuse."""
        for mount in mounts:
            if mount["kind"] == "volume":
                self._store.check_volume_free(mount["source"], read_only=mount["read_only"])


def _where(name: str, where: object, *, data: bool = False) -> tuple[str, bool]:
    read_only = data
    if isinstance(where, Mapping):
        extra = set(where) - {"path", "read_only"}
        if extra:
            raise UsageError(f"mount {name!r}: unknown field(s) {', '.join(sorted(extra))}; "
                             "give path and read_only")
        path = where.get("path")
        flag = where.get("read_only", data)
        if not isinstance(flag, bool):
            raise UsageError(f"mount {name!r}: read_only must be true or false")
        if data and not flag:
            raise UsageError(f"data mount {name!r} is always read-only")
        read_only = flag
    else:
        path = where
    if isinstance(path, str) and posixpath.normpath(path) != path.rstrip("/"):
        raise UsageError(f"mount point {path!r} must be a plain path (no '..' or '//')")
    return mount_target(path), read_only
