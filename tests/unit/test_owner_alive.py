"""``owner_alive``: how a sweep tells a dead owner's leftovers (command groups, spare
workspaces, a microVM's keeper) from a live neighbour's, on a real child process."""

from __future__ import annotations

import subprocess
import sys
import time

from corral._core.owner import owner_alive, proc_start_time


def test_a_running_process_is_alive_and_an_exited_unreaped_one_is_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        start = proc_start_time(child.pid)
        assert start is not None
        assert owner_alive(str(child.pid), start)
        assert not owner_alive(str(child.pid), str(int(start) + 1))  # a reused pid
        assert child.stdin is not None
        child.stdin.close()  # it exits; unreaped, it stays a zombie with the same start time
        deadline = time.monotonic() + 10
        while proc_state(child.pid) != "Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        assert proc_start_time(child.pid) == start
        assert not owner_alive(str(child.pid), start)
    finally:
        child.kill()
        child.wait()
    assert not owner_alive(str(child.pid), start)
    assert not owner_alive("not-a-pid", start)


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
