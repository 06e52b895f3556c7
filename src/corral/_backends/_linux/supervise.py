"""The one supervise loop both host tiers run once a command's process is started and placed
in its cgroup: hand interactive callers their handle, pump the streams under the deadline, kill
the whole group on timeout, wait, kill what is left, read usage.

How a command *starts* is each tier's own (bwrap with a block fd, runsc behind a FIFO shim);
what happens after is the same, so it lives here once.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..._audit.tracing import tracer
from ...backends import ExecOutcome, ExecRequest
from ...models import Usage
from .cgroups import CgroupDriver, CgroupUsage
from .process_io import OutputStream, ProcessHandle, StreamHead, pump

__all__ = ["TIMEOUT_EXIT_CODE", "Supervised", "supervise"]

SETUP_TIMEOUT_S = 10.0
TIMEOUT_EXIT_CODE = 124
_NO_USAGE = CgroupUsage(cpu_s=0.0, peak_memory_bytes=0, oom_killed=False)


@dataclass(slots=True)
class Supervised:
    """What the loop observed; the tier turns it into an ``ExecOutcome``."""

    stdout: OutputStream
    stderr: OutputStream
    returncode: int
    timed_out: bool
    wall_s: float
    usage: CgroupUsage

    def exit_code(self) -> int:
        """The shell's convention: 124 on timeout, 128 + N for death by signal N."""
        if self.timed_out:
            return TIMEOUT_EXIT_CODE
        if self.returncode < 0:
            return 128 - self.returncode
        return self.returncode

    def outcome(self, exit_code: int | None = None) -> ExecOutcome:
        return ExecOutcome(
            exit_code=self.exit_code() if exit_code is None else exit_code,
            stdout=self.stdout.finish(),
            stderr=self.stderr.finish(),
            timed_out=self.timed_out,
            usage=Usage(wall_s=self.wall_s, cpu_s=self.usage.cpu_s,
                        peak_memory_bytes=self.usage.peak_memory_bytes,
                        oom_killed=self.usage.oom_killed),
            stdout_truncated=self.stdout.dropped,
            stderr_truncated=self.stderr.dropped,
            stdout_bytes=bytes(self.stdout.raw),
            stderr_bytes=bytes(self.stderr.raw),
        )


def supervise(
    proc: subprocess.Popen[bytes], request: ExecRequest, *, cgroups: CgroupDriver, group: str,
    started: float, terminal: int | None, abort: Callable[[], None],
    reap: Callable[[], None] = lambda: None, stderr_head: StreamHead | None = None,
    emptied: Callable[[], bool] = lambda: False,
) -> Supervised:
    """Follow a started command to its end. ``abort`` tears the launch down when a callback or
    the pump raises; ``reap`` collects what the tier's runtime re-parented to us, after the
    group is killed and before usage is read; ``stderr_head`` may rewrite the runtime's own
    "cannot start the program" line (see ``StreamHead``); ``emptied`` says, once the command
    has ended, that the runtime killed and reaped all of its processes itself (the caller then
    kills the group when it retires it)."""
    if request.on_start is not None and (request.interactive or terminal is not None):
        try:
            request.on_start(ProcessHandle(proc, terminal))
        except BaseException:
            abort()
            raise
    with tracer.start_as_current_span("corral.process.run"):
        try:
            streams, timed_out = pump(proc, request, started, terminal, stderr_head)
        except BaseException:
            abort()
            raise
        if timed_out:
            cgroups.kill(group)
        try:
            returncode = proc.wait(timeout=SETUP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            cgroups.kill(group)
            returncode = proc.wait()
    wall = time.monotonic() - started
    with tracer.start_as_current_span("corral.process.reap"):
        # Anything the command left behind (it cannot outlive its PID namespace or sandbox,
        # but belt and braces) dies before usage is read; unless the runtime has already
        # killed and reaped it all, when the caller's retirement of the group kills.
        if not emptied():
            cgroups.kill(group)
        reap()
        try:
            usage = cgroups.usage(group)
        except FileNotFoundError:
            # The sandbox was destroyed under the command (its cgroup went with it): the
            # command's result stands, its usage is unknown.
            usage = _NO_USAGE
    stdout, stderr = streams
    return Supervised(stdout=stdout, stderr=stderr, returncode=returncode, timed_out=timed_out,
                      wall_s=wall, usage=usage)
