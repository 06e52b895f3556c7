"""Pinning a long-lived sandbox runtime to a few of the host's CPUs, the least used first.

Why: a gVisor command is a chain of hand-offs between threads (the Sentry's, the stub
processes that run the sandbox's code, the gofer). On a host where waking a thread on another,
idle CPU is slow (a VM: every cross-CPU wake-up is an IPI through the hypervisor, and nested
virtualization doubles it), those hand-offs dominate: measured on the 2-core development VMs,
``true`` through a resident gVisor sandbox took 37-39 ms p50 unpinned and 19-23 ms pinned to
one CPU, with the channel round trip unchanged (``bench/bench_gvisor.py``).

Pinned only *after* the runtime has started, never by starting it under a narrower mask: Go
sizes ``GOMAXPROCS`` from the affinity mask at start, and a Sentry with one P leaves its
network poller unserviced while that P runs (host-pipe wake-ups then wait for ``sysmon``,
10-12 ms). Started wide and pinned after, it keeps two Ps on one CPU and wakes at once.

The mask is a placement hint, never a limit: CPU time stays bounded by the sandbox's cgroup
(its quota), and a sandbox given as many CPUs as the host has is not pinned at all. Threads the
runtime makes later inherit the mask of the thread that makes them.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterable
from pathlib import Path

__all__ = ["CpuPlacer", "pin_tasks"]


class CpuPlacer:
    """Hands out CPU sets of a given size, least used first; thread-safe."""

    def __init__(self, allowed: Iterable[int] | None = None) -> None:
        cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
        self._uses: dict[int, int] = dict.fromkeys(cpus, 0)
        self._lock = threading.Lock()

    def place(self, cpus: float) -> frozenset[int] | None:
        """A set of ``ceil(cpus)`` CPUs, or None when that is all of them (nothing to pin)."""
        count = max(1, math.ceil(cpus))
        if count >= len(self._uses):
            return None
        with self._lock:
            chosen = sorted(self._uses, key=lambda cpu: (self._uses[cpu], cpu))[:count]
            for cpu in chosen:
                self._uses[cpu] += 1
        return frozenset(chosen)

    def release(self, chosen: frozenset[int] | None) -> None:
        if not chosen:
            return
        with self._lock:
            for cpu in chosen:
                if self._uses.get(cpu, 0) > 0:
                    self._uses[cpu] -= 1

    def uses(self) -> dict[int, int]:
        """How many placed sets hold each CPU (for tests and ``describe``)."""
        with self._lock:
            return dict(self._uses)


def pin_tasks(procs_file: Path, cpus: frozenset[int], *, passes: int = 3) -> int:
    """Set every thread of every process listed in a cgroup's ``cgroup.procs`` to ``cpus``.

    Repeated (at most ``passes`` times) until a pass finds nothing new, for a thread made by a
    not-yet-pinned thread meanwhile. Threads that exit under us are skipped. Returns how many
    threads were pinned."""
    pinned: set[int] = set()
    for _ in range(passes):
        found = False
        pids: list[int] = []
        with contextlib.suppress(OSError):
            pids = [int(p) for p in procs_file.read_text().split()]
        for pid in pids:
            with contextlib.suppress(OSError):
                for entry in os.listdir(f"/proc/{pid}/task"):
                    tid = int(entry)
                    if tid in pinned:
                        continue
                    with contextlib.suppress(OSError):  # it exited meanwhile
                        os.sched_setaffinity(tid, cpus)
                        pinned.add(tid)
                        found = True
        if not found:
            break
    return len(pinned)
