"""Destroys that never hold up anyone but their own sandbox.

Each sandbox's destroy runs on a thread of its own (``DestroyJob``); whoever asked waits for
it only as long as they choose (a request a few seconds, the reaper a shared deadline per
pass) and is told whether it finished. One that is not finished by then goes on in the
background: its sandbox is already ``destroying`` (gone for every caller), and nothing else
waits on it, so a sandbox stuck in its destroy (processes the kernel will not kill, a mount
that will not go) is isolated instead of jamming the reaper, other sandboxes or other calls.

A destroy that fails is tried again a few times on its thread, with pauses; after the last
try its row stays ``destroying`` and the reaper tries again later, each time after a longer
pause (``due``), so a sandbox that can never be destroyed costs a log line now and then,
never a busy loop. A destroy that hangs holds its thread and nothing else.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from .records import SandboxRecord

__all__ = ["DestroyJob", "Destroyer"]

logger = logging.getLogger(__name__)

#: Pauses between a failed destroy's tries on its own thread (then the reaper's turn).
RETRY_PAUSES_S = (0.5, 2.0, 8.0)
#: The reaper's pause before it tries a destroy that failed every try again: doubled after
#: each further failure, up to the last.
REAP_BACKOFF_S = (30.0, 60.0, 120.0, 300.0, 600.0)
#: How long a process that is exiting waits for the destroys it started (``corral rm`` of a
#: slow sandbox), so they finish rather than die with it half done.
_EXIT_WAIT_S = 60.0


@dataclass(slots=True)
class DestroyJob:
    """One sandbox's destroy under way."""

    sandbox_id: str
    reason: str
    started: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    attempts: int = 0
    thread: int | None = None  # the ident of the thread running it

    def wait(self, timeout_s: float | None) -> bool:
        """True once the sandbox is destroyed, False while the destroy is still under way
        after ``timeout_s`` (it goes on in the background); raises what made every try
        fail."""
        if not self.done.wait(timeout_s):
            return False
        if self.error is not None:
            raise self.error
        return True

    @property
    def running_s(self) -> float:
        return time.monotonic() - self.started


class Destroyer:
    """Runs ``destroy(record, reason)`` for one sandbox at a time per id, each on its own
    thread (see the module docstring)."""

    def __init__(self, destroy: Callable[[SandboxRecord, str], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._destroy = destroy
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[str, DestroyJob] = {}
        # Sandbox id -> (failed runs in a row, monotonic time before which the reaper waits)
        self._failed: dict[str, tuple[int, float]] = {}
        atexit.register(_drain_ref, weakref.ref(self))  # a weak one: Destroyers may come and go

    def start(self, info: SandboxRecord, reason: str) -> DestroyJob:
        """The destroy of ``info`` under way, started now unless one already is."""
        with self._lock:
            job = self._jobs.get(info.id)
            if job is not None:
                return job
            job = self._jobs[info.id] = DestroyJob(info.id, reason)
        # The caller's context (its trace) goes with the destroy it asked for.
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(self._run, info, job),
                                  name=f"corral-destroy-{info.id}", daemon=True)
        thread.start()
        return job

    def underway(self, sandbox_id: str) -> DestroyJob | None:
        with self._lock:
            return self._jobs.get(sandbox_id)

    def due(self, sandbox_id: str) -> bool:
        """Whether the reaper should start a destroy of ``sandbox_id`` now: none is under
        way, and the last one that failed every try is far enough behind."""
        with self._lock:
            if sandbox_id in self._jobs:
                return False
            failed = self._failed.get(sandbox_id)
        return failed is None or self._clock() >= failed[1]

    def _run(self, info: SandboxRecord, job: DestroyJob) -> None:
        job.thread = threading.get_ident()
        try:
            self._try(info, job)
        finally:
            with self._lock:
                del self._jobs[info.id]
                if job.error is None:
                    self._failed.pop(info.id, None)
                else:
                    self._back_off(info.id, job)
            job.done.set()

    def _try(self, info: SandboxRecord, job: DestroyJob) -> None:
        for pause in (*RETRY_PAUSES_S, None):
            job.attempts += 1
            try:
                self._destroy(info, job.reason)
                job.error = None
                return
            except Exception as exc:  # any failure: tried again, then left to the reaper
                job.error = exc
                if pause is None:
                    return
                logger.warning("destroying sandbox %s failed (try %d; again in %.1f s): %s",
                               info.id, job.attempts, pause, exc)
                time.sleep(pause)

    def _back_off(self, sandbox_id: str, job: DestroyJob) -> None:  # under the lock
        runs = self._failed.get(sandbox_id, (0, 0.0))[0] + 1
        pause = REAP_BACKOFF_S[min(runs, len(REAP_BACKOFF_S)) - 1]
        self._failed[sandbox_id] = (runs, self._clock() + pause)
        logger.error("could not destroy sandbox %s (%d tries): %s; it stays 'destroying', "
                     "hidden from every caller, and the reaper tries again in %.0f s "
                     "(`corral reap` tries now)", sandbox_id, job.attempts, job.error, pause)

    def drain(self) -> None:
        """Let the destroys under way finish (bounded: at exit, at a close), not die half
        done."""
        with self._lock:
            jobs = list(self._jobs.values())
        deadline = time.monotonic() + _EXIT_WAIT_S
        for job in jobs:
            job.done.wait(max(0.0, deadline - time.monotonic()))


def _drain_ref(ref: weakref.ReferenceType[Destroyer]) -> None:
    destroyer = ref()
    if destroyer is not None:
        destroyer.drain()
