"""One line in the service log for every answer the service gives with a 5xx status (the
HTTP API and the E2B surface), and for every error of that class a stream ends with: a
``backend_error`` the operator never hears of cannot be fixed.

The line names the surface, the request (method and path), the status, and the error the
answer was made from (its class and message), which the code that turns an exception into an
answer hands over with ``note`` (the request's own list, a context variable, so it follows the
request into the thread pool and back). Whatever a caller can write (the path, and a message
that quotes it) is clipped and escaped: a line is at most a few hundred bytes, and never two.
Past a steady rate of such lines the rest are counted, and the next line says how many.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["PROXIED", "ServerErrorLog", "clip", "log_stream_error", "note"]

logger = logging.getLogger(__name__)

_PATH_CHARS = 160
_MESSAGE_CHARS = 400
# A flood of failing requests writes at most this many lines at once, then this many a second.
_BURST = 100
_PER_SECOND = 20.0

#: Set in a request's scope once it is relayed to a sandbox's own app: its answers are the
#: app's (a tenant's 500s are not the service's errors).
PROXIED = "corral.proxied"

_noted: contextvars.ContextVar[list[BaseException] | None] = contextvars.ContextVar(
    "corral_answer_errors", default=None)


def note(exc: BaseException) -> None:
    """Say that the answer being made comes from ``exc`` (its 5xx line names it)."""
    noted = _noted.get()
    if noted is not None:
        noted.append(exc)


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, every control character escaped (one line)."""
    cut = text[:limit]
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return shown + ("..." if len(text) > limit else "")


class _Budget:
    """A token bucket of log lines; counts what it refuses."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens = float(_BURST)
        self._at = time.monotonic()
        self._dropped = 0

    def take(self) -> int | None:
        """None when this line is over the budget; else how many were dropped before it."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(_BURST, self._tokens + (now - self._at) * _PER_SECOND)
            self._at = now
            if self._tokens < 1:
                self._dropped += 1
                return None
            self._tokens -= 1
            dropped, self._dropped = self._dropped, 0
            return dropped


_budget = _Budget()


def _error_text(error: BaseException | None) -> str:
    if error is None:
        return "no error recorded for it"
    message = getattr(error, "message", None) or str(error)
    return f"{type(error).__name__}: {clip(str(message), _MESSAGE_CHARS)}"


def _log(surface: str, what: str, status: int, error: BaseException | None) -> None:
    dropped = _budget.take()
    if dropped is None:
        return
    more = f" ({dropped} more such lines dropped: over {_PER_SECOND:.0f}/s)" if dropped else ""
    logger.warning("%s %s answered %d: %s%s", surface, what, status, _error_text(error), more)


def log_stream_error(surface: str, what: str, error: BaseException, status: int) -> None:
    """A stream (a command's NDJSON, a cell's) ended with ``error`` after its 200: logged as
    its status would have been, when that is a 5xx."""
    if status >= 500:
        _log(surface, clip(what, _PATH_CHARS), status, error)


class ServerErrorLog:
    """ASGI middleware: the line for every 5xx answer of ``app`` (see the module docstring),
    and for an exception that escapes it (the server answers 500 for that one)."""

    def __init__(self, app: ASGIApp, *, surface: str) -> None:
        self.app = app
        self.surface = surface

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        noted: list[BaseException] = []
        token = _noted.set(noted)
        what = f"{scope.get('method', '?')} {clip(str(scope.get('path', '')), _PATH_CHARS)}"

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 500 \
                    and not scope.get(PROXIED):
                _log(self.surface, what, int(message["status"]), noted[-1] if noted else None)
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            # Answered 500 by the server around (a framework's own refusal carries its
            # status: a 404 for an unknown path is no error of the service's).
            if getattr(exc, "status_code", 500) >= 500 and not scope.get(PROXIED):
                _log(self.surface, what, 500, exc)
            raise
        finally:
            _noted.reset(token)
