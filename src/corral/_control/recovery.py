"""Crash recovery and the reaper: finish interrupted destroys, destroy what outlived its
lifetime or idle timeout, sweep what a crash left behind (runtime pieces, layers), and apply
the retention of destroyed sandboxes' audit trails (by age and total size)."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable

from .._audit.auditor import Auditor
from .._audit.inflight import abandoned
from .._audit.retention import PruneReport, prune
from .._core.owner import owner_alive
from .._settings import Settings
from ..backends import IsolationBackend, Leftover
from ..errors import BackendUnavailable, CorralError, SandboxNotFound
from .destroyer import DestroyJob
from .intents import Intents
from .layers import Layers
from .processes import ProcessTable
from .records import ASLEEP, LIVE, SandboxRecord
from .registry import BackendRegistry
from .sandboxes import Sandboxes, wait_all
from .snapshots import is_running
from .store import Store
from .volumes import Volumes

__all__ = ["Reaper", "Recovery"]

logger = logging.getLogger(__name__)

# The reaper applies the audit retention at most this often (a pass reads the directory).
_PRUNE_EVERY_S = 60.0
# A reaper pass starts this many destroys at once, and waits for each batch at most this long
# (a destroy takes well under a second; on a loaded host, seconds).
_REAP_BATCH = 8
_REAP_WAIT_S = 10.0


class Recovery:
    """Runs once before the first use of a control plane, and then on every reaper pass."""

    def __init__(self, *, store: Store, sandboxes: Sandboxes, processes: ProcessTable,
                 backends: BackendRegistry, layers: Layers, auditor: Auditor,
                 settings: Settings | None = None, intents: Intents | None = None,
                 volumes: Volumes | None = None) -> None:
        self._settings = settings
        self._intents = intents
        self._volumes = volumes
        self._pruned_at: float | None = None
        self._store = store
        self._sandboxes = sandboxes
        self._processes = processes
        self._backends = backends
        self._layers = layers
        self._auditor = auditor
        self._done = False
        # Paused sandboxes a hibernate refused (processes run in them), by the time they went
        # to sleep: asked again only after they woke and slept again.
        self._stay_paused: dict[str, float | None] = {}
        # Not the registry's lock: recovery loads backends (a store may hold sandboxes of
        # any tier), so loading one must never wait on the lock recovery holds.
        self._lock = threading.Lock()

    def ensure(self) -> None:
        """Recover, unless this control plane already has (retention is the reaper's)."""
        if not self._done:
            with self._lock:
                if not self._done:
                    self._recover(every_tier=False)

    def recover(self) -> list[str]:
        """Finish interrupted destroys, reap expired sandboxes, sweep crash leftovers, and
        (at most once a minute) prune the trails of destroyed sandboxes past retention."""
        removed = self._recover(every_tier=True)
        now = time.monotonic()
        if self._settings is not None and (
                self._pruned_at is None or now - self._pruned_at >= _PRUNE_EVERY_S):
            self._pruned_at = now
            report = self.prune_trails()
            removed += [f"audit trail {p.sandbox_id} ({p.reason})" for p in report.removed]
        self._store.reserve.ensure()  # given up to a delete on a full disk: back, if there is room
        return removed

    def prune_trails(self, *, max_age_s: float | None = None,
                     max_total_bytes: int | None = None,
                     dry_run: bool = False) -> PruneReport:
        """Apply the audit retention (the operator's settings unless given) to the trails of
        destroyed sandboxes; never to a live sandbox's."""
        settings = self._settings
        age = max_age_s if max_age_s is not None else (
            settings.audit_retention_s if settings is not None else 0.0)
        total = max_total_bytes if max_total_bytes is not None else (
            settings.audit_retention_max_bytes if settings is not None else 0)
        report = prune(self._auditor.directory,
                       is_live=lambda sandbox_id: self._store.get(sandbox_id) is not None,
                       max_age_s=age, max_total_bytes=total, dry_run=dry_run)
        if not dry_run:
            for pruned in report.removed:
                self._auditor.count("corral_audit_pruned_trails", reason=pruned.reason)
                logger.info("pruned the audit trail of destroyed sandbox %s (%s, %d bytes)",
                            pruned.sandbox_id, pruned.reason, pruned.bytes)
        return report

    def _recover(self, *, every_tier: bool) -> list[str]:
        # First, before anything reads or sweeps the data: operations a crash cut short.
        removed: list[str] = [] if self._intents is None else self._intents.resolve_abandoned()
        if self._volumes is not None:
            removed += self._volumes.recover()
        removed += self._close_abandoned_commands()  # before a reap ends their trails
        removed += self._reap()
        self._sandboxes.forget_gone()
        # Every tier that has sandboxes sweeps its own leftovers; pieces shared by the tiers
        # (workspaces, cgroups, netns) are only removed for ids the store does not know.
        # Before first use only the tiers loaded by now sweep (the default one, and any a
        # sandbox above needed): its sweep covers the shared pieces of every tier, and
        # loading another costs its host check and imports in every CLI process. The rest of
        # another tier's own leftovers (runsc state, microVM keepers and disks) is the
        # reaper's and `corral reap`'s.
        stored = {info.isolation for info in self._store.list()} if every_tier else set()
        for name in stored - set(self._backends.loaded):
            with contextlib.suppress(BackendUnavailable):
                self._backends.get(name)
        swept: list[Leftover] = []
        backend: IsolationBackend
        for backend in self._backends.all():
            swept += backend.sweep(lambda sandbox_id: self._store.get(sandbox_id) is not None)
        removed += self._layers.sweep()
        if every_tier and self._volumes is not None:
            # Volume images no record names (a crash in a delete before intents were kept).
            with contextlib.suppress(BackendUnavailable):
                removed += [f"volume {v}" for v in self._volumes.leftovers()]
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

    def _reap(self) -> list[str]:
        """Destroy what is due, a few at a time, each batch waited for at most
        ``_REAP_WAIT_S``: a destroy still under way then goes on in the background and is
        never waited for again (the next passes skip it), so a stuck sandbox costs the
        reaper one wait, once, and never stops it."""
        now = time.time()
        records = self._store.list()
        removed: list[str] = []
        for info in records:
            if info.expires_at <= now and self._sandboxes.sleeps_at_timeout(info):
                try:  # its lifecycle pauses it at its timeout instead
                    self._sandboxes.sleep(info)
                    removed.append(f"sandbox {info.id} (paused at its timeout)")
                except CorralError as exc:
                    logger.warning("sandbox %s: pausing it at its timeout failed: %s",
                                   info.id, exc)
            elif info.lifecycle.on_idle == "pause" and self._idle(info, now):
                try:  # its lifecycle pauses it when idle instead of destroying it
                    self._sandboxes.pause(info.id, reason="idle")
                    removed.append(f"sandbox {info.id} (paused: idle)")
                except CorralError as exc:
                    logger.warning("sandbox %s: pausing it when idle failed: %s", info.id, exc)
            elif (paused_for := self._sandboxes.hibernate_due(info, now)) is not None \
                    and self._stay_paused.get(info.id, 0.0) != info.slept_at:
                removed += self._hibernate(info, paused_for)
        if self._stay_paused:
            known = {info.id for info in records}
            self._stay_paused = {k: v for k, v in self._stay_paused.items() if k in known}
        # A tenant's bound on sleep, read once a pass however many of its sandboxes sleep.
        max_asleep = functools.cache(self._sandboxes.max_asleep_s)
        due = [(info, reason) for info in records
               if self._sandboxes.destroy_due(info.id)
               and (reason := self._due(info, now, max_asleep)) is not None]
        for start in range(0, len(due), _REAP_BATCH):
            batch = [(info, self._begin(info, reason, max_asleep))
                     for info, reason in due[start:start + _REAP_BATCH]]
            still = wait_all([job for _, job in batch], _REAP_WAIT_S)
            for info, job in batch:
                if job.done.is_set() and job.error is None:
                    self._auditor.count("corral_reaper_actions", action="destroy_sandbox")
                    removed.append(f"sandbox {info.id}")
                elif job in still:
                    self._auditor.count("corral_reaper_actions", action="destroy_underway")
        return removed

    def _hibernate(self, info: SandboxRecord, paused_for: float) -> list[str]:
        """Hibernate a sandbox paused past its ``hibernate_after``. One its tier cannot
        hibernate (processes run in it, or a tier without hibernation) stays paused, and is
        not asked again until it wakes and sleeps again."""
        try:
            self._sandboxes.hibernate(info.id, reason=f"paused for {paused_for:.0f} s")
        except SandboxNotFound:
            return []
        except CorralError as exc:
            logger.info("sandbox %s stays paused: %s", info.id, exc)
            self._stay_paused[info.id] = info.slept_at
            return []
        self._auditor.count("corral_reaper_actions", action="hibernate_sandbox")
        return [f"sandbox {info.id} (hibernated)"]

    def _due(self, info: SandboxRecord, now: float,
             max_asleep: Callable[[str], int | None]) -> str | None:
        """Why ``info`` is to be destroyed now (None: it is not). One whose lifecycle pauses it
        at its timeout or when idle is paused instead, by ``_reap``, never destroyed for it."""
        if info.state in ASLEEP and info.slept_at is not None:
            bound = max_asleep(info.tenant)
            if bound is not None and now - info.slept_at > bound:
                return "asleep"
        if info.expires_at <= now and info.state in LIVE:
            return None if self._sandboxes.sleeps_at_timeout(info) else "expired"
        if info.lifecycle.on_idle == "destroy" and self._idle(info, now):
            return "idle"
        if info.state == "destroying" or self._abandoned_create(info, now):
            return "interrupted"
        return None

    def _begin(self, info: SandboxRecord, reason: str,
               max_asleep: Callable[[str], int | None]) -> DestroyJob:
        if reason == "expired":
            return self._sandboxes.begin_expire(info)
        if reason == "idle":
            self._auditor.event(info.id, "sandbox.expired", {
                "idle_timeout": info.idle_timeout, "last_active": info.last_active})
        if reason == "asleep":  # its tenant's ceiling: kept asleep no longer than this
            self._auditor.event(info.id, "sandbox.expired", {
                "asleep_since": info.slept_at,
                "max_asleep_s": max_asleep(info.tenant)})
        return self._sandboxes.begin_destroy(info, reason=reason)

    @staticmethod
    def _abandoned_create(info: SandboxRecord, now: float) -> bool:
        """A create cut short: its process is gone (cleaned up at once, pieces and all), or,
        for a row that names no creator (made before they were recorded), still "creating"
        after a minute (a create takes seconds at most)."""
        if info.state != "creating":
            return False
        if info.creator is not None:
            pid, _, start = info.creator.partition(".")
            return not owner_alive(pid, start)
        return info.created_at < now - 60

    def _close_abandoned_commands(self) -> list[str]:
        """Commands a dead Corral process started and never finished (its ``inflight``
        marks): each trail gets the end that process never wrote."""
        closed = []
        for item in abandoned(self._auditor.directory, owner_alive):
            # A destroyed sandbox's trail ends with its destroy; one never made has none.
            if self._store.get(item.sandbox_id) is None \
                    or self._finished(item.sandbox_id, item.command_id):
                continue
            self._auditor.event(item.sandbox_id, "command.finished", {
                "exit_code": None, "interrupted": True,
                "error": f"interrupted: the Corral process running it (pid {item.owner_pid}) "
                         "ended before it did (killed or crashed)",
            }, command=item.command_id, sync=True)
            self._auditor.count("corral_reaper_actions", action="close_command")
            closed.append(f"command {item.command_id} of {item.sandbox_id} (interrupted)")
        return closed

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
