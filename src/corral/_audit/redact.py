"""Redaction applied to everything before it reaches the audit log.

Two layers: the literal values of registered secrets (and their placeholders), which are exact,
and common credential shapes, which catch what nobody registered.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

__all__ = ["REDACTED", "Redactor"]

REDACTED = "[REDACTED]"

# (pattern, replacement) for credential shapes. Keys of key=value pairs are kept so a replay
# still shows what kind of value was there.
_SHAPES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----"
                r"|\Z)", re.DOTALL), "[REDACTED PRIVATE KEY]"),
    (re.compile(r"(?i)\b(bearer|token)(\s+)[A-Za-z0-9\-._~+/]{8,}=*"), r"\1\2" + REDACTED),
    (re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[0-9A-Z]{16}\b"), REDACTED),
    (re.compile(r"(?i)\b(aws_secret_access_key|aws_session_token)(\s*[=:]\s*)[\"']?"
                r"[A-Za-z0-9/+=]{16,}[\"']?"), r"\1\2" + REDACTED),
    (re.compile(r"(?i)\b(password|passwd|pwd|secret|api[_-]?key|access[_-]?token|auth[_-]?token"
                r"|client[_-]?secret)(\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|[^\s&;,\"']+)"),
     r"\1\2" + REDACTED),
    (re.compile(r"\b(gh[pousr]_[A-Za-z0-9]{36,}|xox[abposr]-[A-Za-z0-9-]{10,}"
                r"|sk-[A-Za-z0-9_-]{20,})\b"), REDACTED),
]

_MIN_LITERAL = 4  # shorter "secrets" would redact ordinary words


class Redactor:
    """Replaces secret literals and credential shapes in text and in JSON-like data."""

    def __init__(self, literals: Iterable[str] = ()) -> None:
        unique = sorted({s for s in literals if len(s) >= _MIN_LITERAL}, key=len, reverse=True)
        self._literal_re = (
            re.compile("|".join(re.escape(s) for s in unique)) if unique else None
        )
        self.longest = max((len(s) for s in unique), default=0)

    def text(self, value: str) -> str:
        if self._literal_re is not None:
            value = self._literal_re.sub(REDACTED, value)
        for pattern, replacement in _SHAPES:
            value = pattern.sub(replacement, value)
        return value

    def data(self, value: Any) -> Any:
        """Redact every string inside dicts, lists and tuples."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: self.data(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.data(v) for v in value]
        return value
