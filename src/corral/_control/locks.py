"""The per-sandbox workspace lock, shared by every process of one data directory."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from .._core import flocks
from ..errors import SandboxBusy

__all__ = ["WorkspaceLocks"]

_SHARED_WAIT_S = 120.0


class WorkspaceLocks:
    """Commands hold a sandbox's lock shared; snapshot and restore exclusively (across
    processes too), so no command starts on a workspace that is being sealed or replaced."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory

    @contextlib.contextmanager
    def hold(self, sandbox_id: str, *, exclusive: bool) -> Iterator[None]:
        with self._flock(sandbox_id, exclusive=exclusive,
                         busy=f"commands are running in sandbox {sandbox_id}; wait for them "
                              "(or kill them) and retry"):
            yield

    @contextlib.contextmanager
    def sealing(self, sandbox_id: str) -> Iterator[None]:
        """A memory snapshot's hold: the lock shared, since it is taken while commands run
        (it still waits out a snapshot or restore), and the sandbox's seal lock exclusively,
        so two memory snapshots never record their layers out of order."""
        with self._flock(sandbox_id, exclusive=False, busy=""), \
                self._flock(sandbox_id + ".seal", exclusive=True,
                            busy=f"another memory snapshot of sandbox {sandbox_id} is being "
                                 "taken; retry when it is done"):
            yield

    @contextlib.contextmanager
    def _flock(self, name: str, *, exclusive: bool, busy: str) -> Iterator[None]:
        self._directory.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(self._directory / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if not exclusive:
                # A snapshot or restore holds it exclusively for moments (a squashing seal
                # copies the workspace once: seconds); a command waits that out, not more.
                flocks.acquire(fd, shared=True, timeout_s=_SHARED_WAIT_S, busy=(
                    f"a snapshot or restore of sandbox {name} has held its workspace for "
                    f"{_SHARED_WAIT_S:.0f} s; retry when it is done"))
            else:
                deadline = time.monotonic() + 1.0
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise SandboxBusy(busy) from None
                        time.sleep(0.02)
            yield
        finally:
            os.close(fd)

    def remove(self, sandbox_id: str) -> None:
        (self._directory / sandbox_id).unlink(missing_ok=True)
        (self._directory / (sandbox_id + ".seal")).unlink(missing_ok=True)
