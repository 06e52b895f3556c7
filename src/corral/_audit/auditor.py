"""The control plane's one door to the audit trail and metrics."""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import logging
import re
import threading
import unicodedata
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from .._core.owner import this_owner
from .._core.text import readable
from ..errors import CorralError, SandboxNotFound
from .aggregate import FULL_MAX_BYTES, SUMMARY_MAX_BYTES, Aggregator, Summary, bounded
from .budget import BudgetSource, BudgetWatch, Overrun
from .inflight import InFlight
from .log import AuditLog, AuditTrail, Record, read_trail
from .metrics import CounterSink, Metrics
from .recorder import CommandRecorder, new_command_id
from .redact import Redactor
from .worker import Worker

__all__ = ["Auditor", "PlaceholderSource", "SecretValues", "new_command_id"]


class SecretValues(Protocol):
    """Every secret value there is (redacted wherever it appears)."""

    def values(self) -> Iterable[str]: ...


class PlaceholderSource(Protocol):
    """The placeholders a sandbox was handed for its secrets (empty for an unknown one)."""

    def placeholders(self, sandbox_id: str) -> Iterable[str]: ...

logger = logging.getLogger(__name__)

_ID_RE = re.compile(r"^sbx_[0-9a-z]{12}$")
# Before these a sandbox's pending counts are written: its trail pauses, ends or stops at its
# budget with every count it had.
_FLUSH_BEFORE = frozenset({"sandbox.paused", "sandbox.hibernated", "sandbox.expired",
                           "sandbox.destroyed", "audit.budget_exceeded"})
# The worker looks at the budgets this often, and sooner when a window ends or a write is over.
_TICK_S = 1.0
# Summaries a failing disk would not take, kept to try again (beyond: logged as lost).
_UNWRITTEN_KEPT = 1024
# A refused path is the caller's text, chosen by whoever steers it: kept one line and bounded.
_GIVEN_CHARS = 512
_REASON_CHARS = 1000


def _escaped(text: str) -> str:
    """``text`` unambiguous on one line: a backslash doubled; control, format, separator and
    surrogate characters (newlines, terminal escapes, bidi overrides) as ``\\xNN``/``\\uNNNN``."""
    return "".join(
        "\\\\" if c == "\\" else
        c if unicodedata.category(c) not in ("Cc", "Cf", "Zl", "Zp", "Cs") else
        f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
        for c in text)


def _given(name: str, value: object) -> dict[str, Any]:
    """``{name: value}`` escaped and cut to a bound; a cut adds its full length."""
    text = value if isinstance(value, str) else repr(value)
    shown = _escaped(text[:_GIVEN_CHARS])
    if len(text) <= _GIVEN_CHARS:
        return {name: shown}
    return {name: shown, f"{name}_chars": len(text), f"{name}_truncated": True}


class Auditor:
    """Writes lifecycle, command and file events (redacted) and keeps the metrics.

    With ``enabled`` False nothing is written: neither events nor metrics.

    Repeated events (``repeated``: refusals, public port connections) are aggregated per
    interval (``aggregate``). Every write's new trail size goes to the budget watch; once the
    control plane attaches its budgets (``watch_budgets``), an overrun is handed to its
    handler on a thread of its own, never on the writer's (the egress gateway's loop).
    """

    def __init__(self, *, directory: Path, secrets: SecretValues,
                 placeholders: PlaceholderSource, counters: CounterSink, enabled: bool,
                 output_limit_bytes: int, aggregate_window_s: float = 30.0,
                 aggregate_burst: int = 5) -> None:
        self.directory = directory
        self.enabled = enabled
        self.output_limit_bytes = output_limit_bytes
        self._secrets = secrets
        self._placeholders = placeholders
        self.metrics = Metrics(counters)
        self._logs: dict[str, AuditLog] = {}
        self._lock = threading.Lock()
        self._listeners: list[Callable[[str, str], None]] = []
        self.aggregator = Aggregator(window_s=aggregate_window_s, burst=aggregate_burst)
        self.budgets = BudgetWatch(path_of=self.path)
        self._on_overrun: Callable[[Overrun], None] | None = None
        self._unwritten: list[Summary] = []
        self._worker = Worker(self._work)
        #: this process's commands started and not finished (see ``inflight``)
        self.inflight = InFlight(directory, this_owner())
        # A CLI process never closes its auditor: its pending counts are written at exit.
        ref = weakref.ref(self)
        self._exit_hook: Callable[[], None] = lambda: _flush_ref(ref)
        atexit.register(self._exit_hook)

    def path(self, sandbox_id: str) -> Path:
        if not _ID_RE.match(sandbox_id):
            raise SandboxNotFound(f"{sandbox_id!r} is not a sandbox id")
        return self.directory / f"{sandbox_id}.jsonl"

    def _log(self, sandbox_id: str) -> AuditLog:
        with self._lock:
            log = self._logs.get(sandbox_id)
            if log is None:
                log = self._logs[sandbox_id] = AuditLog(
                    self.path(sandbox_id), sandbox_id,
                    on_write=functools.partial(self._wrote, sandbox_id))
            return log

    def redactor(self, sandbox_id: str | None = None) -> Redactor:
        # Read per use: another process may have registered a secret a moment ago.
        # Secret values: all of them (cached, re-read when the secret store changes). Placeholders:
        # the sandbox's own, the only ones its commands can print.
        placeholders = [] if sandbox_id is None else self._placeholders.placeholders(sandbox_id)
        return Redactor([*self._secrets.values(), *placeholders])

    # -- writing ------------------------------------------------------------------------------

    def event(self, sandbox_id: str, type_: str, data: dict[str, Any], *,
              command: str | None = None, sync: bool = False,
              max_bytes: int | None = None) -> None:
        """Write one event (redacted); with ``max_bytes``, its data (as redacted) is cut to
        fit (``aggregate.bounded``): repeated events and summaries have a size bound."""
        if self.enabled:
            if type_ in _FLUSH_BEFORE:
                self.flush(sandbox_id)
            redacted = self.redactor(sandbox_id).data(data)
            if max_bytes is not None:
                redacted = bounded(redacted, max_bytes)
            self._log(sandbox_id).append([Record(type_, redacted, command)], sync=sync)
            for listener in tuple(self._listeners):
                # Only news for a reader (the dashboard's live list): what it does wrong must
                # never fail the operation that wrote the event (a destroy, a create).
                try:
                    listener(sandbox_id, type_)
                except Exception:
                    logger.exception("an audit listener failed on %s of %s", type_, sandbox_id)

    def repeated(self, sandbox_id: str, type_: str, key: Mapping[str, str | int],
                 data: dict[str, Any], *, command: str | None = None) -> None:
        """An event a sandbox can repeat at will (a refused request, a public connection):
        written in full while its interval's burst lasts, otherwise counted into the summary
        its key writes when the interval ends. ``key`` must come from what the sandbox cannot
        pick freely (a command id, a rule, a port), never from what it can (a host name, a
        path): each key has its own burst."""
        if not self.enabled:
            return
        full, ended = self.aggregator.offer(sandbox_id, type_, key, data, command)
        self._write_summaries(ended)
        if full:
            self.event(sandbox_id, type_, data, command=command, max_bytes=FULL_MAX_BYTES)
        elif not self._worker.running:
            self._worker.wake()  # the window's end must be written even if nothing follows

    def flush(self, sandbox_id: str | None = None) -> None:
        """Write the pending counts of the sandbox (of every sandbox with None) now."""
        self._write_summaries(self.aggregator.drain(sandbox_id))

    def _write_summaries(self, summaries: list[Summary]) -> None:
        with self._lock:
            retry, self._unwritten = self._unwritten, []
        for summary in [*retry, *summaries]:
            try:
                self.event(summary.sandbox_id, summary.type, summary.data,
                           command=summary.command, max_bytes=SUMMARY_MAX_BYTES)
            except OSError as exc:  # a full or failing disk: keep the counts, say so
                with self._lock:
                    kept = len(self._unwritten) < _UNWRITTEN_KEPT
                    if kept:
                        self._unwritten.append(summary)
                logger.error("could not write the summary of %d %s event(s) of %s (%s); %s",
                             summary.count, summary.of, summary.sandbox_id, exc,
                             "will try again" if kept else "their count is lost")
                continue
            self.metrics.inc("corral_audit_aggregated_events", amount=float(summary.count),
                             labels={"type": summary.of})

    # -- budgets ------------------------------------------------------------------------------

    def watch_budgets(self, source: BudgetSource,
                      on_overrun: Callable[[Overrun], None]) -> None:
        """Enforce audit byte budgets: ``source`` says each sandbox's, ``on_overrun`` (the
        control plane's) is called, on a thread of its own, for a trail past its budget."""
        self._on_overrun = on_overrun
        self.budgets.attach(source)

    def _wrote(self, sandbox_id: str, size: int) -> None:
        # On the writer's thread (the gateway's loop too): take note, wake the worker, no more.
        if self.budgets.attached and (self.budgets.wrote(sandbox_id, size)
                                      or not self._worker.running):
            self._worker.wake()

    def _work(self) -> float:
        """The worker's step: summaries of ended windows, then budget overruns."""
        self._write_summaries(self.aggregator.due())
        if self.budgets.attached:
            self.budgets.expire_limits()
            for overrun in self.budgets.check():
                threading.Thread(target=self._overrun, args=(overrun,), daemon=True,
                                 name=f"corral-audit-budget-{overrun.sandbox_id}").start()
        due = self.aggregator.next_due()
        return _TICK_S if due is None else min(_TICK_S, due + 0.01)

    def _overrun(self, overrun: Overrun) -> None:
        handler = self._on_overrun
        if handler is None:
            return
        try:
            handler(overrun)
        except Exception:
            logger.exception("could not stop sandbox %s at its audit budget",
                             overrun.sandbox_id)

    def listen(self, callback: Callable[[str, str], None]) -> Callable[[], None]:
        """Call ``callback(sandbox_id, type)`` after each lifecycle event this process writes
        (the dashboard's live list); returns the function that stops it. The callback runs on
        the writer's thread: it must only hand the news on."""
        with self._lock:
            self._listeners.append(callback)

        def stop() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._listeners.remove(callback)

        return stop

    def command(self, sandbox_id: str, command_id: str | None = None) -> CommandRecorder | None:
        if not self.enabled:
            return None
        return CommandRecorder(self._log(sandbox_id), self.redactor(sandbox_id),
                               command_id=command_id or new_command_id(),
                               output_limit_bytes=self.output_limit_bytes,
                               inflight=self.inflight)

    def file_event(self, sandbox_id: str, op: str, path: str,
                   data: bytes | None = None, **extra: Any) -> None:
        if not self.enabled:
            return
        fields: dict[str, Any] = {"path": path, **extra}
        if data is not None:
            fields["size"] = len(data)
            fields["sha256"] = hashlib.sha256(data).hexdigest()
        self.event(sandbox_id, f"file.{op}", fields)
        self.metrics.inc("corral_file_operations", labels={"op": op})

    def file_refused(self, sandbox_id: str, op: str, path: object, error: CorralError,
                     **paths: object) -> None:
        """A file operation refused (a path leaving /workspace): what was tried, as given.

        ``paths`` are the operation's other paths (``dst`` of a rename), kept the same way.
        """
        if not self.enabled:
            return
        fields: dict[str, Any] = {"op": op, **_given("path", path)}
        for name, value in paths.items():
            fields.update(_given(name, value))
        fields["reason"] = {"code": error.code,
                            "message": _escaped(error.message[:_REASON_CHARS])}
        self.event(sandbox_id, "file.refused", fields)
        self.metrics.inc("corral_file_refusals", labels={"op": op})

    def count(self, name: str, **labels: str) -> None:
        if self.enabled:
            self.metrics.inc(name, labels=labels)

    def close_log(self, sandbox_id: str) -> None:
        self.budgets.forget(sandbox_id)
        with self._lock:
            log = self._logs.pop(sandbox_id, None)
        if log is not None:
            log.close()

    # -- reading ------------------------------------------------------------------------------

    def trail(self, sandbox_id: str, **filters: Any) -> AuditTrail:
        path = self.path(sandbox_id)
        if not path.exists():
            raise SandboxNotFound(f"no audit trail for {sandbox_id}; `corral ls` lists sandboxes")
        return read_trail(path, **filters)

    def recorded_callback(
        self, recorder: CommandRecorder | None, stream: str,
        user: Callable[[str], None] | None, *, lossless: bool = False,
    ) -> Callable[[str], None] | None:
        """The output callback for the runner: audit first, then the caller's. ``lossless``
        output (``ExecRequest.lossless_output``) is recorded as readable text, U+FFFD for
        bytes that are not UTF-8, as every other command's is."""
        if recorder is None:
            return user

        def callback(text: str) -> None:
            recorder.output(stream, readable(text) if lossless else text)
            if user is not None:
                user(text)

        return callback

    def close(self) -> None:
        self._worker.close()
        self.flush()
        atexit.unregister(self._exit_hook)
        with self._lock:
            logs, self._logs = list(self._logs.values()), {}
        for log in logs:
            log.close()


def _flush_ref(ref: weakref.ReferenceType[Auditor]) -> None:
    auditor = ref()
    if auditor is not None:
        with contextlib.suppress(Exception):  # at exit: nothing left to tell
            auditor.flush()
