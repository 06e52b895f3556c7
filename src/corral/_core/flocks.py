"""``flock`` with a bound. A lock file Corral shares between its processes (a sandbox's
workspace, its audit trail, a microVM's start) is held for moments; one held for long means
its holder is stopped (SIGSTOP, a debugger) or stuck in the kernel, and every caller behind a
blocking ``flock`` would wait with it for ever. Here a caller waits at most ``timeout_s`` and
is then told what is held and what to do (``SandboxBusy``: retry later)."""

from __future__ import annotations

import fcntl
import time

from ..errors import SandboxBusy

__all__ = ["acquire"]

_FIRST_PAUSE_S = 0.0005
_LONGEST_PAUSE_S = 0.05


def acquire(fd: int, *, timeout_s: float, busy: str, shared: bool = False) -> None:
    """Lock ``fd`` (exclusively, or ``shared``) within ``timeout_s`` seconds, else raise
    ``SandboxBusy(busy)``. Uncontended, it costs what a blocking ``flock`` costs: one call."""
    mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
    deadline = time.monotonic() + timeout_s
    pause = _FIRST_PAUSE_S
    while True:
        try:
            fcntl.flock(fd, mode)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise SandboxBusy(busy) from None
        time.sleep(pause)
        pause = min(pause * 2, _LONGEST_PAUSE_S)
