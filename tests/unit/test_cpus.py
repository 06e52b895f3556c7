"""CPU placement for long-lived runtimes (``_linux.cpus``): least used first, released on
close, never a set that is all of the host; pinning real threads of a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from corral._backends._linux.cpus import CpuPlacer, pin_tasks


def test_least_used_first_and_released() -> None:
    placer = CpuPlacer([0, 1, 2, 3])
    first, second = placer.place(1.0), placer.place(0.5)
    assert first == {0} and second == {1}
    pair = placer.place(1.5)  # rounded up: two CPUs, the unused ones
    assert pair == {2, 3}
    assert placer.place(1.0) == {0}
    placer.release(first)
    placer.release(pair)
    assert placer.uses() == {0: 1, 1: 1, 2: 0, 3: 0}
    placer.release(None)  # nothing placed: nothing to give back
    placer.release(frozenset({0}))
    placer.release(frozenset({0}))  # never below zero
    assert placer.uses()[0] == 0


def test_a_set_as_large_as_the_host_is_not_pinned() -> None:
    placer = CpuPlacer([0, 1])
    assert placer.place(2.0) is None
    assert placer.place(8.0) is None
    assert placer.uses() == {0: 0, 1: 0}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to pin to")
def test_pin_tasks_pins_every_thread_of_the_listed_processes(tmp_path: Path) -> None:
    code = ("import threading, time\n"
            "[threading.Thread(target=time.sleep, args=(30,), daemon=True).start()"
            " for _ in range(3)]\n"
            "print('up', flush=True); time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        procs = tmp_path / "cgroup.procs"
        procs.write_text(f"{proc.pid}\n999999999\n")  # a pid that is gone is skipped
        target = frozenset({min(os.sched_getaffinity(0))})
        assert pin_tasks(procs, target) == 4
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            assert os.sched_getaffinity(int(tid)) == target
    finally:
        proc.kill()
        proc.communicate()
