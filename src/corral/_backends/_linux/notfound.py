"""One answer, on every tier, when the program of a command cannot be started: the shell's exit
codes (127 not found, 126 not runnable) and one plain line on stderr, live and in the result.

Each runtime reports the failure in its own words on the command's stderr (bwrap's ``execvp``,
runsc's loader); ``ExecFailureHead`` holds the first line back, and rewrites it when it is that
report. A command that started cannot produce it first: the report is written instead of the
program running.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["CANNOT_RUN_EXIT_CODE", "NOT_FOUND_EXIT_CODE", "ExecFailureHead", "exec_failure"]

NOT_FOUND_EXIT_CODE = 127
CANNOT_RUN_EXIT_CODE = 126


def exec_failure(program: str, reason: str) -> tuple[int, str] | None:
    """(exit code, stderr line) for a runtime's reason ``reason`` (an errno text), or None when
    it is not a "cannot start the program" reason (E2BIG, for example, is the caller's)."""
    lowered = reason.lower()
    if "no such file" in lowered:
        return NOT_FOUND_EXIT_CODE, f"corral: command not found: {program}\n"
    if "permission denied" in lowered or "exec format" in lowered:
        return CANNOT_RUN_EXIT_CODE, f"corral: cannot run {program}: {reason.strip()}\n"
    return None


class ExecFailureHead:
    """A ``StreamHead`` for stderr: the runtime's report on ``program``, whose lines start with
    ``prefix`` and whose reason ``reason_of`` finds (None: not that report), becomes Corral's
    line; ``exit_code`` then says what the command's exit code is."""

    def __init__(self, program: str, prefix: bytes,
                 reason_of: Callable[[str], str | None]) -> None:
        self._program = program
        self._prefix = prefix
        self._reason_of = reason_of
        self.exit_code: int | None = None

    def __call__(self, held: bytes) -> bytes | None:
        if held[:len(self._prefix)] != self._prefix[:len(held)]:
            return held  # not the runtime's report: pass everything on untouched
        line, newline, rest = held.partition(b"\n")
        if not newline:
            return None  # undecided until the line is whole (or the stream ends)
        reason = self._reason_of(line.decode(errors="replace"))
        failure = exec_failure(self._program, reason) if reason is not None else None
        if failure is None:
            return held
        self.exit_code, message = failure
        return message.encode() + rest
