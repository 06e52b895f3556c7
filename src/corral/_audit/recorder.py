"""Turns one command's life into audit records: started, output chunks, finished.

Output is cut into events at line ends, so a secret is never split across two events where the
redactor could miss it; a line longer than the flush size keeps its last ``longest secret``
characters back for the next event for the same reason. What the log keeps is capped per stream.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from ..models import CommandResult
from .inflight import InFlight
from .log import AuditLog, Record
from .redact import Redactor

__all__ = ["CommandRecorder", "new_command_id"]

_FLUSH_CHARS = 16 * 1024
_MAX_CONTEXT_CHARS = 16 * 1024


def new_command_id() -> str:
    return "cmd_" + secrets.token_hex(6)


class _StreamBuffer:
    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        self.pending = ""
        self.kept = 0
        self.dropped = 0

    def take(self, text: str, keep_back: int, final: bool) -> str:
        """Add ``text``; return what can be logged now (already capped)."""
        self.pending += text
        if final:
            ready, self.pending = self.pending, ""
        else:
            cut = self.pending.rfind("\n") + 1
            if cut == 0 and len(self.pending) > _FLUSH_CHARS:
                cut = len(self.pending) - keep_back
            ready, self.pending = self.pending[:cut], self.pending[cut:]
        if not ready:
            return ""
        size = len(ready.encode())
        room = self.limit - self.kept
        if room <= 0:
            self.dropped += size
            return ""
        if size > room:
            kept = ready.encode()[:room].decode(errors="ignore")
            self.dropped += size - len(kept.encode())
            ready = kept
        self.kept += len(ready.encode())
        return ready


class CommandRecorder:
    """Records one command. ``output`` is called from the command's pump as text arrives."""

    def __init__(self, log: AuditLog, redactor: Redactor, *, command_id: str,
                 output_limit_bytes: int, inflight: InFlight | None = None) -> None:
        """``inflight``: where the command is marked as started and not finished, so that
        the next recovery can close its story if this process dies first."""
        self.log = log
        self.redactor = redactor
        self.command_id = command_id
        self._inflight = inflight
        self._streams = {
            "stdout": _StreamBuffer("stdout", output_limit_bytes),
            "stderr": _StreamBuffer("stderr", output_limit_bytes),
        }

    def _record(self, type_: str, data: dict[str, Any]) -> Record:
        return Record(type_, data, self.command_id)

    def started(self, *, argv: Sequence[str], cwd: str, env: Mapping[str, str],
                timeout_s: float, context: Mapping[str, Any] | None) -> None:
        data: dict[str, Any] = {
            "argv": self.redactor.data(list(argv)),
            "cwd": cwd,
            "env_names": sorted(env),  # never values
            "timeout_s": round(timeout_s, 3),
        }
        if context:
            clean = self.redactor.data(dict(context))
            text = repr(clean)
            if len(text) > _MAX_CONTEXT_CHARS:
                clean = {"truncated": text[:_MAX_CONTEXT_CHARS] + "..."}
            data["context"] = clean
        if self._inflight is not None:
            self._inflight.add(self.log.sandbox_id, self.command_id)
        self.log.append([self._record("command.started", data)])

    def output(self, stream: str, text: str) -> None:
        self._emit(stream, text, final=False)

    def _emit(self, stream: str, text: str, *, final: bool) -> None:
        buffer = self._streams[stream]
        ready = buffer.take(text, self.redactor.longest, final)
        if ready:
            self.log.append([self._record("command.output", {
                "stream": stream, "text": self.redactor.text(ready),
            })])

    def finished(self, result: CommandResult | None, *, error: str | None = None) -> None:
        """Flush, write the closing events and make them durable before returning."""
        for name in self._streams:
            self._emit(name, "", final=True)
        records = [
            self._record("command.output_truncated", {
                "stream": b.name, "dropped_bytes": b.dropped, "kept_bytes": b.kept,
            })
            for b in self._streams.values() if b.dropped
        ]
        if result is not None:
            records.append(self._record("command.finished", {
                "exit_code": result.exit_code,
                "timed_out": result.timed_out,
                "duration_s": round(result.duration_s, 6),
                "cpu_s": round(result.usage.cpu_s, 6),
                "peak_memory_bytes": result.usage.peak_memory_bytes,
                "oom_killed": result.usage.oom_killed,
                "stdout_truncated": result.stdout_truncated,
                "stderr_truncated": result.stderr_truncated,
            }))
        else:
            records.append(self._record("command.finished", {
                "exit_code": None, "error": self.redactor.text(error or "unknown error"),
            }))
        self.log.append(records, sync=True)
        if self._inflight is not None:  # its end is on disk: nothing is left to close
            self._inflight.remove(self.log.sandbox_id, self.command_id)
