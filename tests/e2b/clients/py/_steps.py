"""What every Python client script shares: run named steps, print each as one JSON line.

Runs inside the pinned SDK venvs (.venv-e2b/<set>/), so it imports nothing but the standard
library. A step's record is ``{"step": name, "value": ...}`` or, when it raised,
``{"step": name, "error": "<class>", "bases": [...], "message": ..., "attrs": {...}}``; the
last line is ``{"done": true}``. One step failing never stops the next ones; each step is
bounded by an alarm so a hung call cannot eat the whole script's budget.
"""

from __future__ import annotations

import base64
import json
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

STEP_SECONDS = 40
# Exception attributes worth reporting (CommandExitException and friends).
_ATTRS = ("exit_code", "stdout", "stderr", "error", "status_code")


class StepTimeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise StepTimeout(f"step took longer than {STEP_SECONDS} s")


signal.signal(signal.SIGALRM, _alarm)


def jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bytes_b64": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    # SDK objects (a Sandbox, a handle) are not results: their class only, never their fields
    # (they hold access tokens).
    return f"<{type(value).__name__}>"


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def step(name: str, fn: Callable[[], Any], *, seconds: int = STEP_SECONDS) -> Any:
    """Runs ``fn``, prints its record, returns its value (None when it raised)."""
    signal.alarm(seconds)
    started = time.monotonic()
    try:
        value = fn()
    except BaseException as exc:  # noqa: BLE001 - every failure is a result to report
        signal.alarm(0)
        if isinstance(exc, KeyboardInterrupt):
            raise
        attrs = {a: jsonable(getattr(exc, a)) for a in _ATTRS if hasattr(exc, a)}
        emit({"step": name, "ms": round((time.monotonic() - started) * 1000),
              "error": type(exc).__name__,
              "bases": [c.__name__ for c in type(exc).__mro__[1:]],
              "message": str(exc)[:2000], "attrs": attrs,
              "trace": traceback.format_exc()[-3000:]})
        return None
    signal.alarm(0)
    emit({"step": name, "value": jsonable(value),
          "ms": round((time.monotonic() - started) * 1000)})
    return value


def done() -> None:
    emit({"done": True})
