"""The drill's vocabulary: categories, outcomes, the evidence behind them, each case's result,
the report (a case itself is ``case.Case``: it names the context it runs in)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

Verdict = Literal["held", "breached", "error", "skipped"]
Category = Literal["network", "credentials", "filesystem", "privilege", "resources", "control",
                   "caller", "e2b", "previews", "relays", "cookies", "audit", "hibernation"]
CATEGORIES: tuple[Category, ...] = (
    "network", "credentials", "filesystem", "privilege", "resources", "control", "caller",
    "e2b", "previews", "relays", "cookies", "audit", "hibernation")


@dataclass(frozen=True, slots=True)
class Evidence:
    """Something a reader can check: an audit event, a gateway decision, an HTTP answer."""

    kind: Literal["audit", "gateway", "response", "observation"]
    detail: str
    sandbox: str | None = None
    seq: int | None = None  # the audit event's position in the sandbox's log
    event: str | None = None  # the audit event's type

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one case observed."""

    verdict: Verdict
    observed: str
    evidence: tuple[Evidence, ...] = ()


@dataclass(frozen=True, slots=True)
class CaseResult:
    id: str
    category: Category
    tries: str
    held_when: str
    verdict: Verdict
    observed: str
    evidence: tuple[Evidence, ...]
    duration_s: float

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["evidence"] = [e.to_dict() for e in self.evidence]
        data["duration_s"] = round(self.duration_s, 3)
        return data


@dataclass(slots=True)
class DrillReport:
    target: dict[str, Any]
    results: list[CaseResult] = field(default_factory=list)
    duration_s: float = 0.0

    def counts(self) -> dict[str, int]:
        counts = {"held": 0, "breached": 0, "error": 0, "skipped": 0}
        for result in self.results:
            counts[result.verdict] += 1
        return counts

    @property
    def ok(self) -> bool:
        """No breach and no error: every case that ran held."""
        counts = self.counts()
        return counts["breached"] == 0 and counts["error"] == 0

    def summary(self) -> str:
        c = self.counts()
        return (f"{len(self.results)} cases: {c['held']} held, {c['breached']} breached, "
                f"{c['error']} errors, {c['skipped']} skipped in {self.duration_s:.1f} s")

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "summary": self.summary(), "counts": self.counts(),
                "ok": self.ok, "duration_s": round(self.duration_s, 3),
                "results": [r.to_dict() for r in self.results]}
