"""Workspaces made and mounted ahead of the creates that take them.

A plain sandbox's workspace (no layers below it) is the same for every sandbox of a disk
size until its root is given to the sandbox's uid: an image copied from the blank, a loop
device, the ext4 mount, the overlay on it (``WorkspaceStore.create``), ~4 ms of a ~6.5 ms
create on the development VM. A process that creates again and again (the service, an
evaluation loop, a burst) keeps ``SLOTS`` of them per size, made by one background thread
after each claim; a claim is a rename to the sandbox's directory (never over one that
exists) and a chown of the workspace's root through the overlay.

What it costs: each spare holds a loop device and two mounts while its process lives. The
first plain create of a process makes none (a CLI run creates once and exits); the second
starts the refill. ``close`` (the backend's, and at interpreter exit) unmounts and deletes
this process's spares; a process that dies first leaves ``.ready.<owner>.*`` or
``.making.<owner>.*``, which the next sweep removes once that owner is gone (``stale``).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import itertools
import logging
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..._core import linux
from ...backends import SandboxSpec
from ...errors import BackendError
from .storage import WorkspaceStore, is_mount

__all__ = ["ReadyWorkspaces", "spare_owner"]

logger = logging.getLogger(__name__)

_READY, _MAKING = ".ready.", ".making."
# Shared by every pool of the process: two tiers' pools name theirs with the same owner.
_NUMBERS = itertools.count()
_MIN_FREE = 64 * 1024 * 1024  # as a create's own check (storage._MIN_FREE)


def spare_owner(name: str) -> str | None:
    """The owner (``pid.start time``) named by a spare's entry in the sandboxes' directory
    (``.ready.`` or ``.making.``); None for any other entry."""
    for prefix in (_READY, _MAKING):
        if name.startswith(prefix):
            pid, start = (name[len(prefix):].split(".") + ["", ""])[:2]
            return f"{pid}.{start}"
    return None


class ReadyWorkspaces:
    """``SLOTS`` ready workspaces per disk size for ``store``'s plain creates, named with
    ``owner`` (pid.start time)."""

    SLOTS = 2

    def __init__(self, store: WorkspaceStore, owner: str) -> None:
        self._store = store
        self._owner = owner
        self._lock = threading.Lock()
        self._ready: dict[int, collections.deque[str]] = {}
        self._filling: set[int] = set()
        self._plain_creates = 0
        self._closed = False
        self._pool: ThreadPoolExecutor | None = None

    def claim(self, spec: SandboxSpec) -> Path | None:
        """``spec``'s workspace from a ready one, mounted and its root the sandbox's; None
        when there is none (the caller creates one as before)."""
        if spec.layers:
            return None
        size = spec.tier.disk_bytes
        with self._lock:
            if self._closed:
                return None
            self._plain_creates += 1
            ready = self._ready.get(size)
            name = ready.popleft() if ready else None
            start = self._plain_creates >= 2 and size not in self._filling
            if start:
                self._filling.add(size)
        if start:
            self._start_refill(spec)
        if name is None:
            return None
        root = self._store.root
        try:
            if shutil.disk_usage(root).free < _MIN_FREE:
                raise OSError("the disk is nearly full")  # the create's own check says how
            linux.rename_noreplace(root / name, self._store.sandbox_dir(spec.id))
        except OSError:
            # The sandbox's directory exists (the create fails as it would have), or the
            # disk is nearly full (the create says how): the spare stays for the next.
            if (root / name).exists():
                with self._lock:
                    self._ready.setdefault(size, collections.deque()).appendleft(name)
            return None
        point = self._store.mount_point(spec.id)
        if not is_mount(point):  # unmounted under us (by hand): made again, as a create would
            self._store.remove(spec.id)
            return None
        # Through the overlay: chowning the disk's upper directory beneath it would leave the
        # overlay's own inode of the root with the old owner.
        os.chown(point, spec.uid, spec.uid)
        return point

    def _start_refill(self, spec: SandboxSpec) -> None:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="corral-ready-workspace",
                                                initializer=linux.yield_cpu_to_others)
                atexit.register(self.close)
            pool = self._pool
        try:
            pool.submit(self._refill, spec)
        except RuntimeError:  # closing, or the interpreter is exiting
            with self._lock:
                self._filling.discard(spec.tier.disk_bytes)

    def _refill(self, spec: SandboxSpec) -> None:
        size = spec.tier.disk_bytes
        try:
            while True:
                with self._lock:
                    if self._closed or len(self._ready.get(size, ())) >= self.SLOTS:
                        return
                name = self._make(spec)
                if name is None:
                    return
                with self._lock:
                    keep = not self._closed
                    if keep:
                        self._ready.setdefault(size, collections.deque()).append(name)
                if not keep:
                    self._discard(name)
                    return
        finally:
            with self._lock:
                self._filling.discard(size)

    def _make(self, spec: SandboxSpec) -> str | None:
        number = next(_NUMBERS)
        size = spec.tier.disk_bytes
        making = f"{_MAKING}{self._owner}.{size}.{number}"
        # Owned by root until claimed: no sandbox's uid can enter it meanwhile.
        blank = dataclasses.replace(spec, id=making, uid=0, layers=(), mounts=())
        try:
            self._store.create(blank)
            ready = f"{_READY}{self._owner}.{size}.{number}"
            linux.rename_noreplace(self._store.root / making, self._store.root / ready)
        except (BackendError, OSError) as exc:
            logger.debug("could not make a ready workspace: %s", exc)
            self._discard(making)
            return None
        return ready

    def _discard(self, name: str) -> None:
        try:
            self._store.remove(name)
        except (BackendError, OSError) as exc:
            logger.warning("a ready workspace %s was not removed (the next sweep will): %s",
                           name, exc)

    def close(self) -> None:
        """Make no more, and unmount and delete this process's spares."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            atexit.unregister(self.close)
            pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            names = [name for ready in self._ready.values() for name in ready]
            self._ready.clear()
        for name in names:
            self._discard(name)

    def stale(self, alive: Callable[[str, str], bool]) -> list[str]:
        """Spares (and half-made ones) of owners ``alive(pid, start time)`` says are gone."""
        root = self._store.root
        if not root.exists():
            return []
        found = []
        for entry in root.iterdir():
            owner = spare_owner(entry.name)
            if owner is not None and owner != self._owner:
                pid, start = owner.split(".", 1)
                if not alive(pid, start):
                    found.append(entry.name)
        return found
