"""A stdio server ends with its client.

Over stdio the client is the server's parent and stdin its only line to it: the SDK ends the
server at stdin's end of file. A client that is killed (SIGKILL, a crash) closes its end of
the pipe, unless another process inherited it (a sibling the client spawned, a wrapper):
then stdin never ends and the server, with its session sandbox, would run on for nobody. So
the server also asks the kernel for a signal when its parent dies (``PR_SET_PDEATHSIG``) and
watches its parent pid change (the process is re-parented when the parent goes), either of
which makes it end the way SIGTERM does: session sandboxes destroyed, then exit.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal

import anyio

__all__ = ["die_with_parent", "watch_parent"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_S = 0.5


def die_with_parent(signum: int = signal.SIGTERM) -> int:
    """Have the kernel send ``signum`` when this process's parent dies; the parent's pid.

    The signal comes when the parent *thread* that spawned this process ends: a client that
    spawns from a thread it later ends (rare) makes this server end with it.
    """
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG): %s", os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as exc:  # not glibc/Linux: the watch below still works
        log.warning("prctl(PR_SET_PDEATHSIG) unavailable: %s", exc)
    return parent


async def watch_parent(parent: int, signum: int = signal.SIGTERM) -> None:
    """Send ``signum`` to this process once its parent is no longer ``parent`` (it died and
    this process was re-parented: to init, or to a subreaper)."""
    while os.getppid() == parent:
        await anyio.sleep(_POLL_S)
    log.warning("corral mcp: the client (pid %d) is gone; stopping", parent)
    os.kill(os.getpid(), signum)
