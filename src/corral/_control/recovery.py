"""Crash recovery and the reaper: finish interrupted destroys, destroy what outlived its
lifetime or idle timeout, and sweep what a crash left behind (runtime pieces, layers)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from .._audit.auditor import Auditor
from ..backends import IsolationBackend, Leftover
from ..errors import BackendUnavailable, SandboxNotFound
from .layers import Layers
from .processes import ProcessTable
from .records import SandboxRecord
from .registry import BackendRegistry
from .sandboxes import Sandboxes
from .snapshots import is_running
from .store import Store

__all__ = ["Reaper", "Recovery"]

logger = logging.getLogger(__name__)


class Recovery:
    """Runs once before the first use of a control plane, and then on every reaper pass."""

    def __init__(self, *, store: Store, sandboxes: Sandboxes, processes: ProcessTable,
                 backends: BackendRegistry, layers: Layers, auditor: Auditor) -> None:
        self._store = store
        self._sandboxes = sandboxes
        self._processes = processes
        self._backends = backends
        self._layers = layers
        self._auditor = auditor
        self._done = False
        # Not the registry's lock: recovery loads backends (a store may hold sandboxes of
        # any tier), so loading one must never wait on the lock recovery holds.
        self._lock = threading.Lock()

    def ensure(self) -> None:
        """Recover, unless this control plane already has."""
        if not self._done:
            with self._lock:
                if not self._done:
                    self.recover()

    def recover(self) -> list[str]:
        """Finish interrupted destroys, reap expired sandboxes and sweep crash leftovers."""
        removed: list[str] = []
        now = time.time()
        for info in self._store.list():
            # A create takes milliseconds; one still "creating" after a minute was interrupted.
            stale_create = info.state == "creating" and info.created_at < now - 60
            if info.expires_at <= now and info.state in ("running", "paused"):
                self._sandboxes.expire(info)
            elif self._idle(info, now):
                self._auditor.event(info.id, "sandbox.expired", {
                    "idle_timeout": info.idle_timeout, "last_active": info.last_active})
                self._sandboxes.destroy(info, reason="idle")
            elif info.state == "destroying" or stale_create:
                self._sandboxes.destroy(info, reason="interrupted")
            else:
                continue
            self._auditor.count("corral_reaper_actions", action="destroy_sandbox")
            removed.append(f"sandbox {info.id}")
        # Every tier that has sandboxes sweeps its own leftovers; pieces shared by the tiers
        # (workspaces, cgroups, netns) are only removed for ids the store does not know.
        for name in {info.isolation for info in self._store.list()} - set(self._backends.loaded):
            with contextlib.suppress(BackendUnavailable):
                self._backends.get(name)
        swept: list[Leftover] = []
        backend: IsolationBackend
        for backend in self._backends.all():
            swept += backend.sweep(lambda sandbox_id: self._store.get(sandbox_id) is not None)
        removed += self._layers.sweep()
        for item in swept:
            self._auditor.count("corral_reaper_actions", action=f"sweep_{item.kind}")
            if item.kind == "command" and item.command_id is not None \
                    and not self._finished(item.sandbox_id, item.command_id):
                # Its process died (crash, SIGKILL): close the command's story in the trail.
                # A command that had finished (its group is removed after its result) has
                # its end there already.
                self._auditor.event(item.sandbox_id, "command.finished", {
                    "exit_code": None, "interrupted": True,
                    "error": "interrupted: the process running it stopped",
                }, command=item.command_id, sync=True)
        self._done = True
        return removed + [str(item) for item in swept]

    def _finished(self, sandbox_id: str, command_id: str) -> bool:
        try:
            trail = self._auditor.trail(sandbox_id, types=["command.finished"],
                                        command=command_id)
        except SandboxNotFound:  # no trail (auditing off): nothing is there to contradict
            return False
        return bool(trail.events)

    def _idle(self, info: SandboxRecord, now: float) -> bool:
        """Past its idle timeout with nothing running (no command, no background process)."""
        if info.idle_timeout is None or info.state != "running":
            return False
        if now - info.last_active < info.idle_timeout:
            return False
        return not is_running(self._sandboxes, self._processes, info)


class Reaper:
    """Calls ``recover`` (destroys expired sandboxes and sweeps leftovers) every
    ``interval_s`` seconds on a thread of its own, until stopped."""

    def __init__(self, recover: Callable[[], list[str]], interval_s: float = 5.0) -> None:
        self._recover = recover
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="corral-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                removed = self._recover()
                if removed:
                    logger.info("reaper removed %s", ", ".join(removed))
            except Exception:  # keep reaping: one bad sandbox must not stop the others
                logger.exception("reaper pass failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
