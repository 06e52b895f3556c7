"""The audit event schema (version 1). One JSON object per line in ``audit/<sandbox>.jsonl``.

Every event has a per-sandbox sequence number that only grows (across processes), a wall-clock
timestamp, the sandbox, the command it belongs to (if any), a type and type-specific data.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["EVENT_TYPES", "SCHEMA_VERSION", "AuditEvent", "EventType"]

SCHEMA_VERSION = 1

EventType = Literal[
    "sandbox.created",
    "sandbox.timeout_changed",
    "sandbox.policy_changed",
    "sandbox.paused",
    "sandbox.resumed",
    "sandbox.hibernated",
    "sandbox.expired",
    "sandbox.destroyed",
    "sandbox.forked",
    "command.started",
    "command.output",
    "command.output_truncated",
    "command.finished",
    "code.started",
    "code.finished",
    "file.read",
    "file.write",
    "file.remove",
    "file.mkdir",
    "file.rename",
    "file.upload",
    "file.download",
    "file.refused",
    "egress.decision",
    "egress.summary",
    "snapshot.created",
    "snapshot.restored",
    "snapshot.deleted",
    "port.exposed",
    "port.unexposed",
    "port.connection",
    "port.summary",
    "audit.recovered",
    "recovery.rolled_forward",
    "recovery.rolled_back",
    "audit.budget_exceeded",
]
EVENT_TYPES: tuple[str, ...] = EventType.__args__  # type: ignore[attr-defined]


class AuditEvent(BaseModel):
    """One audit record.

    Attributes:
        v: schema version.
        seq: position in the sandbox's log, starting at 1, never reused.
        ts: Unix time in seconds.
        sandbox: the sandbox id.
        command: the command id (``cmd_...``) for command and egress events, else None.
        type: what happened.
        data: type-specific fields (see README's audit section).
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    v: int = SCHEMA_VERSION
    seq: int = Field(ge=1)
    ts: float
    sandbox: str
    command: str | None = None
    type: EventType
    data: dict[str, Any] = Field(default_factory=dict)
