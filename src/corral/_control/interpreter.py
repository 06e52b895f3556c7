"""The code interpreter: stateful kernels (contexts) inside a sandbox, cells run in them with
their output streamed and their rich results returned.

A kernel is the in-sandbox driver (``corral._kernels``) run as a *declared background
process* of the sandbox: admitted like any process, under all of the sandbox's limits, listed,
killed at its TTL. Host and driver speak JSON lines over the process's stdin and stdout (the
driver keeps a private dup of its stdout for them, so what the user's code prints cannot
corrupt the protocol); the tier's output cap cuts the process's result, never this stream
(``stream_past_limit``). A kernel that dies (crash, OOM, ``os._exit``) ends its cell with an
error that says so, and the next cell starts a fresh one.

Each cell is audited in the sandbox's trail as ``code.started`` / ``code.finished`` under the
kernel's command id, next to the kernel's own ``command.*`` events.

The protocol stream is still the tenant's to write: code in the kernel can reach the driver's
descriptor. So the host reads it as untrusted: in time linear in what is written, holding at
most ``MAX_MESSAGE_CHARS`` of a line (``lines.LineSplitter``). A longer line is dropped up to
its next newline and the cell it came during gets an ``OutputTooLarge`` error; the driver
starts every message on a line of its own, so no message of its is lost with the dropped line,
and keeps its own messages under the limit (long output in pieces, an oversized result refused).
What a cell sends of output and results is counted as it arrives, before any buffer: past
``MAX_CELL_OUTPUT_CHARS`` the rest is dropped, said in its stderr and as its error.
"""

from __future__ import annotations

import builtins
import json
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .._core.resources import get_tier
from .._kernels import driver_source
from ..errors import (
    ContextNotFound,
    CorralError,
    InterpreterUnavailable,
    SandboxNotFound,
    UsageError,
)
from ..models import CodeContext, Execution, ExecutionError, Logs, Result
from . import validate
from .lines import LineSplitter, Overflow
from .processes import BackgroundProcess, ProcessTable
from .records import SandboxRecord
from .sandboxes import Sandboxes
from .tenants import Tenant

__all__ = [
    "LANGUAGES",
    "MAX_CELL_OUTPUT_CHARS",
    "MAX_MESSAGE_CHARS",
    "CodeEvent",
    "CountEvent",
    "EndEvent",
    "ErrorEvent",
    "Interpreter",
    "OutputEvent",
    "ResultEvent",
    "event_line",
    "normalize_language",
]

LANGUAGES = ("python", "javascript", "typescript", "r", "bash")
# E2B's names (js, ts) and the usual others for the same kernels.
_ALIASES = {"python3": "python", "py": "python", "ipython": "python", "sh": "bash",
            "shell": "bash", "js": "javascript", "node": "javascript", "nodejs": "javascript",
            "ts": "typescript", "rscript": "r"}
# E2B's template has kernels for these too; Corral has none (refused with what is there).
_NOT_HERE = ("java", "deno")
_START_TIMEOUT_S = 30.0
_INTERRUPT_GRACE_S = 2.0
_AUDIT_CODE_CHARS = 16 * 1024
_MAX_CODE_BYTES = 1024 * 1024
#: The longest line the host takes from a kernel (the driver's ``_MAX_LINE`` is the same): room
#: for the largest display result worth sending, a PNG figure in base64 (a 4K figure is a few
#: MiB), with the rest of its bundle. The reader holds at most this much of an unfinished line.
MAX_MESSAGE_CHARS = 32 * 1024 * 1024
#: What one cell may send of output and results (their lines' characters): past it they are
#: dropped and the cell gets an ``OutputTooLarge`` error. A cell printing without end for its
#: timeout otherwise filled the service (1.7 GiB in 10 s here), each buffer on the way holding
#: all of it (the kernel's queue, the cell's ``Execution``, a surface's stream).
MAX_CELL_OUTPUT_CHARS = 64 * 1024 * 1024
# Kept out of the workspace: IPython's and matplotlib's per-user state goes to /tmp.
# PIP_BREAK_SYSTEM_PACKAGES: a cell's `!pip install x` (what generated code runs) on any
# template: Debian's pip refuses every install into its python3 (PEP 668), --user ones too,
# but the root is read-only, so pip installs into the user's site in the workspace, which the
# driver puts on the kernel's path. (The code-interpreter template's /etc/pip.conf says the
# same for every process.)
_KERNEL_ENV = {"IPYTHONDIR": "/tmp/.corral-ipython", "MPLCONFIGDIR": "/tmp/.corral-mpl",
               "PYTHONUNBUFFERED": "1", "PIP_BREAK_SYSTEM_PACKAGES": "1"}


@dataclass(frozen=True, slots=True)
class OutputEvent:
    stream: Literal["stdout", "stderr"]
    text: str
    timestamp: float


@dataclass(frozen=True, slots=True)
class ResultEvent:
    data: dict[str, Any]
    is_main_result: bool


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    name: str
    value: str
    traceback: str


@dataclass(frozen=True, slots=True)
class CountEvent:
    execution_count: int


@dataclass(frozen=True, slots=True)
class EndEvent:
    pass


CodeEvent = OutputEvent | ResultEvent | ErrorEvent | CountEvent | EndEvent
EventCallback = Callable[[CodeEvent], None]


def event_line(event: CodeEvent) -> dict[str, Any]:
    """One event as the native NDJSON stream carries it (``POST /v1/sandboxes/{id}/code``):
    ``stdout``/``stderr`` {text, timestamp}, ``result`` {is_main_result, data},
    ``execution_error`` {name, value, traceback}, ``execution_count`` {execution_count},
    ``end``. The SDK's transports, embedded too, parse these same dicts (``_sdk._wire``)."""
    if isinstance(event, OutputEvent):
        return {"type": event.stream, "text": event.text, "timestamp": event.timestamp}
    if isinstance(event, ResultEvent):
        return {"type": "result", "is_main_result": event.is_main_result, "data": event.data}
    if isinstance(event, ErrorEvent):
        return {"type": "execution_error", "name": event.name, "value": event.value,
                "traceback": event.traceback}
    if isinstance(event, CountEvent):
        return {"type": "execution_count", "execution_count": event.execution_count}
    return {"type": "end"}


def normalize_language(language: str | None) -> str:
    """``python`` (the default), ``javascript``, ``typescript``, ``r`` or ``bash``; E2B's
    names and other aliases accepted; anything else refused (``java`` and ``deno``, which
    E2B's template has, with ``InterpreterUnavailable``)."""
    name = (language or "python").strip().lower()
    name = _ALIASES.get(name, name)
    if name in _NOT_HERE:
        raise InterpreterUnavailable(
            f"no {name} kernel: Corral's code interpreter runs {', '.join(LANGUAGES)} (the "
            "code-interpreter template has all of them); run other languages as commands")
    if name not in LANGUAGES:
        raise UsageError(f"unknown language {language!r}; use one of {', '.join(LANGUAGES)}")
    return name


class _Exited:
    """Put on a kernel's queue when its process has ended."""


def _message(line: str | Overflow, cell: Any) -> dict[str, Any] | None:
    """One line of the protocol stream as a message: a dropped line is an ``overflow`` of
    ``cell``; a line that is not a JSON object (the blank line before each of the driver's
    messages, bytes code wrote there) is none."""
    if isinstance(line, Overflow):
        return {"ev": "overflow", "id": cell, "limit": line.limit}
    if not line:
        return None
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
        return None
    return message if isinstance(message, dict) else None


class _Budget:
    """``MAX_CELL_OUTPUT_CHARS`` of messages from one cell's start to the next, counted as they
    arrive (before any buffer) whatever ids they carry, which the tenant can write: past it
    only the running cell's ``end`` and its first ``error`` (how it ended: a timeout's
    interrupt, a traceback) pass, and one ``cut`` says so. Between cells (nobody reads the
    queue then) what a kernel's threads send is held to the rest of the last one."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._cell: int | None = None
        self._spent = 0
        self._error_passed = False

    @property
    def cell(self) -> int | None:
        """The running cell (None between cells)."""
        return self._cell

    def start(self, cell: int) -> None:
        self._cell, self._spent, self._error_passed = cell, 0, False

    def stop(self) -> None:
        self._cell = None

    def admit(self, message: dict[str, Any], size: int) -> dict[str, Any] | None:
        """``message`` while within the budget (and the running cell's end and first error
        past it), the ``cut`` at the first one past it, else None."""
        before, self._spent = self._spent, self._spent + size
        if self._spent <= self.limit or self._outcome(message):
            return message
        return {"ev": "cut", "id": self._cell, "limit": self.limit} \
            if before <= self.limit else None

    def _outcome(self, message: dict[str, Any]) -> bool:
        if self._cell is None or message.get("id") != self._cell:
            return False
        kind = message.get("ev")
        if kind == "error" and not self._error_passed:
            self._error_passed = True
            return True
        return kind == "end"


class _Kernel:
    """One running driver: its process, its stdout turned into messages as it comes, and
    the budget those are held to (``budget``: started with each cell, stopped at its end)."""

    def __init__(self, process: BackgroundProcess) -> None:
        self.process = process
        self.messages: queue.Queue[dict[str, Any] | _Exited] = queue.Queue()
        self.diagnostics: list[str] = []  # the driver's stderr before it redirected fd 2
        self.alive = True
        self._lines = LineSplitter(MAX_MESSAGE_CHARS)
        self.budget = _Budget(MAX_CELL_OUTPUT_CHARS)
        # Read in the thread that feeds the process, not a thread of our own: a reader that
        # falls behind loses what the process's window drops, messages with it.
        process.tap(self._take, self._exited)

    def _take(self, stream: str, text: str) -> None:
        if stream == "notice":  # output dropped before the tap (never, at a kernel's start)
            self._lines.gap()
            self.messages.put({"ev": "lost", "id": self.budget.cell, "text": text.strip()})
        elif stream != "stdout":
            if len(self.diagnostics) < 64:
                self.diagnostics.append(text)
        else:
            for line in self._lines.feed(text):
                # A dropped line is the running cell's (not the last id seen: ids in the
                # stream are the tenant's to write).
                message = _message(line, self.budget.cell)
                if message is not None:
                    size = len(line) if isinstance(line, str) else 0
                    message = self.budget.admit(message, size)
                if message is not None:
                    self.messages.put(message)

    def _exited(self) -> None:
        self.alive = False
        self.messages.put(_Exited())

    def send(self, message: dict[str, Any]) -> None:
        self.process.send((json.dumps(message) + "\n").encode())

    def why_exited(self) -> tuple[str, str]:
        """(error name, message) for a kernel whose process has ended."""
        result = self.process.wait(timeout=5)
        if result is not None and result.usage.oom_killed:
            return ("KernelOutOfMemory", "the kernel ran out of memory and was killed (the "
                    "sandbox's memory limit); its state is lost, the next cell starts a fresh "
                    "kernel")
        detail = "".join(self.diagnostics).strip()[-500:]
        code = "?" if result is None else str(result.exit_code)
        if self.process.error:
            detail = self.process.error
        return ("KernelDied", f"the kernel exited (exit code {code})"
                f"{': ' + detail if detail else ''}; its state is lost, the next cell starts "
                "a fresh kernel")


@dataclass
class _Context:
    id: str
    sandbox_id: str
    language: str
    cwd: str
    is_default: bool = False
    kernel: _Kernel | None = None
    kernel_name: str | None = None
    next_id: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def public(self) -> CodeContext:
        return CodeContext(id=self.id, language=self.language, cwd=self.cwd,
                           kernel=self.kernel_name, sandbox_id=self.sandbox_id)


class Interpreter:
    """Contexts per sandbox and the cells run in them (``manager.interpreter``)."""

    def __init__(self, *, sandboxes: Sandboxes, processes: ProcessTable, auditor: Any) -> None:
        self._sandboxes = sandboxes
        self._processes = processes
        self._auditor = auditor
        self._contexts: dict[str, _Context] = {}
        self._lock = threading.Lock()

    # -- contexts ---------------------------------------------------------------------------

    def create_context(self, sandbox_id: str, *, language: str | None = None,
                       cwd: str | None = None, caller: Tenant | None = None) -> CodeContext:
        """A new context; its kernel starts on its first cell."""
        name = normalize_language(language)
        self._sandbox(sandbox_id)
        context = _Context(id="ctx_" + secrets.token_hex(6), sandbox_id=sandbox_id,
                           language=name, cwd=self._cwd(cwd))
        with self._lock:
            self._contexts[context.id] = context
        return context.public()

    def list_contexts(self, sandbox_id: str) -> builtins.list[CodeContext]:
        self._sandbox(sandbox_id)
        with self._lock:
            return [c.public() for c in self._contexts.values() if c.sandbox_id == sandbox_id]

    def get_context(self, sandbox_id: str, context_id: str) -> CodeContext:
        return self._context(sandbox_id, context_id).public()

    def restart_context(self, sandbox_id: str, context_id: str) -> CodeContext:
        """Kill the context's kernel: its state is gone, the next cell starts a fresh one."""
        context = self._context(sandbox_id, context_id)
        self._stop(context)
        with context.lock:
            context.kernel = None
        return context.public()

    def remove_context(self, sandbox_id: str, context_id: str) -> None:
        context = self._context(sandbox_id, context_id)
        with self._lock:
            self._contexts.pop(context.id, None)
        self._stop(context)

    def forget_sandbox(self, sandbox_id: str) -> None:
        """Drop a sandbox's contexts (its kernels die with it)."""
        with self._lock:
            for key in [k for k, c in self._contexts.items() if c.sandbox_id == sandbox_id]:
                del self._contexts[key]

    def _sandbox(self, sandbox_id: str) -> SandboxRecord:
        try:
            return self._sandboxes.awake(sandbox_id, doing="run code")
        except SandboxNotFound:
            self.forget_sandbox(sandbox_id)  # gone: so are its kernels
            raise

    def _context(self, sandbox_id: str, context_id: str) -> _Context:
        self._sandbox(sandbox_id)
        with self._lock:
            context = self._contexts.get(context_id)
        if context is None or context.sandbox_id != sandbox_id:
            raise ContextNotFound(f"no code context {context_id!r} in {sandbox_id}; "
                                  "list_code_contexts() shows its contexts")
        return context

    def _default(self, sandbox_id: str, language: str, cwd: str) -> _Context:
        with self._lock:
            for context in self._contexts.values():
                if (context.sandbox_id == sandbox_id and context.is_default
                        and context.language == language):
                    return context
            context = _Context(id="ctx_" + secrets.token_hex(6), sandbox_id=sandbox_id,
                               language=language, cwd=self._cwd(cwd), is_default=True)
            self._contexts[context.id] = context
            return context

    @staticmethod
    def _cwd(cwd: str | None) -> str:
        # The commands' own rule (inside /workspace), so a context cwd fails as a cwd does.
        return validate.command(["python3"], cwd, None, None).cwd

    def _stop(self, context: _Context) -> None:
        kernel = context.kernel
        if kernel is not None and kernel.alive:
            try:
                self._processes.kill(context.sandbox_id, kernel.process.id)
            except CorralError:
                pass  # already gone with its sandbox
            kernel.process.wait(timeout=5)

    # -- running cells ----------------------------------------------------------------------

    def execute(self, sandbox_id: str, code: str, *, context_id: str | None = None,
                language: str | None = None, envs: Mapping[str, str] | None = None,
                timeout: float | None = None, caller: Tenant | None = None,
                on_event: EventCallback | None = None,
                default_cwd: str = "/workspace") -> Execution:
        """Run ``code`` in a context (``context_id``, else the sandbox's default context of
        ``language``, started on demand in ``default_cwd``: E2B's surface starts it in
        ``/home/user``) and return its ``Execution``; ``on_event`` gets each
        ``CodeEvent`` as it happens (from this thread). A timeout interrupts the cell (then
        kills the kernel if it does not stop); a dead kernel is an error of the cell."""
        if not isinstance(code, str):
            raise UsageError(f"code must be a str, not {type(code).__name__}")
        if len(code.encode()) > _MAX_CODE_BYTES:
            raise UsageError(f"the code is over {_MAX_CODE_BYTES} bytes; write it to a file "
                             "and run that")
        env = validate.command(["python3"], None, envs, None).env if envs else {}
        info = self._sandbox(sandbox_id)
        limit = validate.command_timeout(timeout, get_tier(info.resources))
        context = self._resolve(sandbox_id, context_id, language, default_cwd)
        with context.lock:
            return self._run(context, code, env, limit, caller, on_event)

    def prepare(self, sandbox_id: str, *, context_id: str | None = None,
                language: str | None = None, caller: Tenant | None = None,
                default_cwd: str = "/workspace") -> CodeContext:
        """The context a cell would run in, its kernel started: for a surface that must
        refuse (quota, a template without python3) with a status before it streams."""
        context = self._resolve(sandbox_id, context_id, language, default_cwd)
        with context.lock:
            self._kernel(context, caller)
        return context.public()

    def _resolve(self, sandbox_id: str, context_id: str | None,
                 language: str | None, default_cwd: str) -> _Context:
        if context_id is not None:
            context = self._context(sandbox_id, context_id)
            if language is not None and normalize_language(language) != context.language:
                raise UsageError(f"context {context_id} runs {context.language}, not "
                                 f"{language}; pass either context or language")
            return context
        self._sandbox(sandbox_id)
        return self._default(sandbox_id, normalize_language(language), default_cwd)

    def _kernel(self, context: _Context, caller: Tenant | None) -> _Kernel:
        if context.kernel is not None and context.kernel.alive:
            return context.kernel
        process = self._processes.start(
            context.sandbox_id,
            ["python3", "-I", "-u", "-c", driver_source(), context.cwd, context.language],
            envs=_KERNEL_ENV, cwd=context.cwd, caller=caller, stream_past_limit=True,
            context={"corral": "code interpreter", "context": context.id})
        kernel = _Kernel(process)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                message = kernel.messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._processes.kill(context.sandbox_id, process.id)
                raise InterpreterUnavailable(
                    f"the {context.language} kernel did not start within "
                    f"{_START_TIMEOUT_S:.0f} s in {context.sandbox_id}") from None
            if isinstance(message, _Exited):
                result = process.wait(timeout=5)
                detail = "".join(kernel.diagnostics).strip()[-300:] or process.error or ""
                hint = ("python3 is missing from the sandbox's template; use the "
                        "code-interpreter template" if result is not None
                        and result.exit_code == 127 else detail)
                raise InterpreterUnavailable(
                    f"the {context.language} kernel could not start in {context.sandbox_id}: "
                    f"{hint}")
            if message.get("ev") == "fatal":
                self._processes.kill(context.sandbox_id, process.id)
                raise InterpreterUnavailable(f"{message.get('message')} (in "
                                             f"{context.sandbox_id})")
            if message.get("ev") == "ready":
                context.kernel, context.kernel_name = kernel, str(message.get("kernel"))
                return kernel

    def _run(self, context: _Context, code: str, env: dict[str, str], limit: float,
             caller: Tenant | None, on_event: EventCallback | None) -> Execution:
        started = time.monotonic()
        kernel = self._kernel(context, caller)
        context.next_id += 1
        cell = context.next_id
        command = kernel.process.command_id
        self._audit(context, "code.started", {
            "context": context.id, "language": context.language,
            "kernel": context.kernel_name, "code": code[:_AUDIT_CODE_CHARS],
            "code_chars": len(code)}, command)
        execution = _Collector(context.id, on_event)
        kernel.budget.start(cell)
        kernel.send({"op": "exec", "id": cell, "code": code, "envs": env})
        deadline = started + limit
        interrupted_at: float | None = None
        outcome = "ok"
        while True:
            now = time.monotonic()
            wait = (deadline - now) if interrupted_at is None else \
                (interrupted_at + _INTERRUPT_GRACE_S - now)
            try:
                message = kernel.messages.get(timeout=max(0.0, wait))
            except queue.Empty:
                if interrupted_at is None:
                    interrupted_at = time.monotonic()
                    kernel.send({"op": "interrupt"})
                    continue
                self._stop(context)  # it did not stop: the kernel goes, the cell ends
                context.kernel = None
                execution.error(ErrorEvent(
                    "TimeoutError", f"the cell ran past its {limit:g} s timeout and did not "
                    "stop when interrupted; the kernel was restarted (its state is lost)", ""))
                outcome = "timeout"
                break
            if isinstance(message, _Exited):
                name, text = kernel.why_exited()
                context.kernel = None
                execution.error(ErrorEvent(name, text, ""))
                outcome = "oom" if name == "KernelOutOfMemory" else "kernel_died"
                break
            if message.get("id") != cell:
                continue  # late output of an earlier, interrupted cell
            if not execution.message(message, timed_out=interrupted_at is not None,
                                     limit=limit):
                if interrupted_at is not None:
                    outcome = "timeout"
                break
        kernel.budget.stop()  # its end came: what follows is no cell's until the next
        if not execution.ended:
            execution.end()  # the kernel went before it could say so: the cell ends anyway
        result = execution.finish(time.monotonic() - started)
        if result.error is not None and outcome == "ok":
            outcome = "error"
        self._audit(context, "code.finished", {
            "context": context.id, "outcome": outcome,
            "execution_count": result.execution_count,
            "error": None if result.error is None else
            {"name": result.error.name, "value": result.error.value[:1000]},
            "results": [sorted(r.data) for r in result.results],
            "stdout_chars": sum(map(len, result.logs.stdout)),
            "stderr_chars": sum(map(len, result.logs.stderr)),
            "duration_s": round(result.duration_s, 6)}, command)
        return result

    def _audit(self, context: _Context, type_: str, data: dict[str, Any],
               command: str) -> None:
        self._auditor.event(context.sandbox_id, type_, data, command=command)


class _Collector:
    """Turns one cell's driver messages into events (for ``on_event``) and an ``Execution``."""

    def __init__(self, context_id: str, on_event: EventCallback | None) -> None:
        self._context_id = context_id
        self._on_event = on_event
        self._results: list[Result] = []
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._error: ExecutionError | None = None
        self._count: int | None = None
        self.ended = False

    def end(self) -> None:
        self.ended = True
        self._emit(EndEvent())

    def _emit(self, event: CodeEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)

    def error(self, event: ErrorEvent) -> None:
        self._error = ExecutionError(name=event.name, value=event.value,
                                     traceback=event.traceback)
        self._emit(event)

    def message(self, message: dict[str, Any], *, timed_out: bool, limit: float) -> bool:
        """Handle one message; False once the cell has ended."""
        kind = message.get("ev")
        if kind == "count":
            n = message.get("n")
            self._count = n if isinstance(n, int) else 0
            self._emit(CountEvent(self._count))
        elif kind in ("stdout", "stderr"):
            text = str(message.get("text", ""))
            (self._stdout if kind == "stdout" else self._stderr).append(text)
            self._emit(OutputEvent("stdout" if kind == "stdout" else "stderr", text,
                                   time.time()))
        elif kind == "result":
            raw = message.get("data")
            data: dict[str, Any] = dict(raw) if isinstance(raw, dict) else {}
            main = bool(message.get("main"))
            self._results.append(Result(is_main_result=main, data=data))
            self._emit(ResultEvent(data, main))
        elif kind == "error":
            name = str(message.get("name", "Error"))
            value = str(message.get("value", ""))
            if timed_out and name == "KeyboardInterrupt":
                name, value = "TimeoutError", f"the cell ran past its {limit:g} s timeout " \
                                              "and was interrupted (the kernel's state is kept)"
            self.error(ErrorEvent(name, value, str(message.get("traceback", ""))))
        elif kind == "overflow":
            self.error(ErrorEvent(
                "OutputTooLarge", f"the kernel sent a line of more than {message.get('limit')} "
                "characters, over the limit of one message; it was dropped (code writing to "
                "the kernel's protocol stream?)", ""))
        elif kind == "cut":
            # In the output too, where it stops: a later error of the cell's (its timeout)
            # takes the error's place.
            said = (f"the cell's output and results passed {message.get('limit')} characters; "
                    "the rest was dropped (write large output to a file)")
            self._stderr.append(f"[corral: {said}]\n")
            self._emit(OutputEvent("stderr", self._stderr[-1], time.time()))
            self.error(ErrorEvent("OutputTooLarge", said, ""))
        elif kind == "lost":
            self.error(ErrorEvent("OutputLost", "some of the kernel's output was lost before "
                                  f"it was read: {message.get('text')}", ""))
        elif kind == "end":
            self.end()
            return False
        return True

    def finish(self, duration_s: float) -> Execution:
        return Execution(results=self._results,
                         logs=Logs(stdout=self._stdout, stderr=self._stderr),
                         error=self._error, execution_count=self._count,
                         context_id=self._context_id, duration_s=duration_s)
