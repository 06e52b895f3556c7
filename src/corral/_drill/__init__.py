"""``corral drill``: attack your own sandboxes the way a hijacked agent would, and prove what holds.

A drill creates sandboxes with the operator's configuration (tier, template, network policy,
local or a service), plants a poisoned document and a fake secret, and runs a battery of small
declared attack cases (``cases/``). Each case says what it tries and what counts as held, and
reports held / breached / error with the audit events and gateway decisions that show it.
Every attack is bounded by its own construction: capped loops and sizes, loopback-only targets.
"""

from .case import Case
from .model import CaseResult, DrillReport, Evidence, Outcome
from .runner import run_drill

__all__ = ["Case", "CaseResult", "DrillReport", "Evidence", "Outcome", "run_drill"]
