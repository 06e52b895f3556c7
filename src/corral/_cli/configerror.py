"""Invalid settings, said by the variables a person sets: ``invalid CORRAL_UID_START='abc': should
be a valid integer ...; e.g. CORRAL_UID_START=1800000000``, one line each, never pydantic's field
names, its error types or its documentation URLs.

Imported only when ``Settings`` refused: the start-up of a valid configuration pays nothing.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["describe"]

_JSON_FIELD = re.compile(r'error parsing value for field "(\w+)"')


def describe(exc: Exception) -> list[str]:
    """One line per invalid setting in ``exc`` (pydantic's ValidationError, or
    pydantic-settings' SettingsError for a value it could not parse as JSON)."""
    from .._settings import Settings

    prefix = str(Settings.model_config.get("env_prefix") or "CORRAL_")
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        found = _JSON_FIELD.search(str(exc))
        if found is None:
            return [f"invalid settings: {exc}"]
        field = found.group(1)
        cause = f" ({exc.__cause__})" if exc.__cause__ else ""
        example = _example(prefix, field)
        return [f"invalid {_variable(prefix, field)}: not valid JSON{cause}{example}"]
    lines = []
    for error in errors(include_url=False):
        loc = error.get("loc") or ()
        message = _message(error)
        if not loc:  # a check across settings: its message names the variables itself
            lines.append(f"invalid settings: {message}")
            continue
        field = str(loc[0])
        value = error.get("input")
        shown = f"={value!r}" if isinstance(value, str | int | float) else ""
        where = ".".join(str(part) for part in loc[1:])
        lines.append(f"invalid {_variable(prefix, field)}{shown}: {message}"
                     + (f" (at {where})" if where else "") + _example(prefix, field))
    return lines


def _variable(prefix: str, field: str) -> str:
    return f"{prefix}{field}".upper()


def _message(error: dict[str, Any]) -> str:
    message = str(error.get("msg", "invalid"))
    # pydantic's wording for a validator's own ValueError, and its capital "Input": read as
    # the tail of "CORRAL_X='abc': ...".
    message = message.removeprefix("Value error, ")
    if message.startswith("Input should"):
        message = message.replace("Input should", "should", 1)
    return message


def _example(prefix: str, field: str) -> str:
    """``; e.g. CORRAL_X=value`` from the setting's documented example, if it has one."""
    from .._settings import Settings

    info = Settings.model_fields.get(field)
    examples = getattr(info, "examples", None) if info is not None else None
    if not examples:
        return ""
    example = examples[0]
    if isinstance(example, bool):
        example = "1" if example else "0"
    return f"; e.g. {_variable(prefix, field)}={example}"
