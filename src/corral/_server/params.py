"""Numbers in a URL (path and query parameters), parsed strictly.

pydantic's lax parsing strips whitespace from a string before it reads a number, so
``DELETE …/ports/1%0C`` acted on port 1: a malformed URL must be refused (422), never read as
another value than the one written. Use ``Annotated[int, IntText]`` / ``Annotated[float,
FloatText]``; the OpenAPI schema stays ``integer`` / ``number``.
"""

from __future__ import annotations

import re

from pydantic import BeforeValidator

__all__ = ["FloatText", "IntText"]

_INT = re.compile(r"-?[0-9]{1,18}")
_FLOAT = re.compile(r"-?(?:[0-9]{1,18}(?:\.[0-9]{0,18})?|\.[0-9]{1,18})(?:[eE][-+]?[0-9]{1,3})?")


def _int_text(value: object) -> object:
    if isinstance(value, str) and not _INT.fullmatch(value):
        raise ValueError("an integer is written as digits alone (no spaces or other characters)")
    return value


def _float_text(value: object) -> object:
    if isinstance(value, str) and not _FLOAT.fullmatch(value):
        raise ValueError("a number is written as digits with an optional fraction and exponent "
                         "(no spaces or other characters)")
    return value


IntText = BeforeValidator(_int_text)
FloatText = BeforeValidator(_float_text)
