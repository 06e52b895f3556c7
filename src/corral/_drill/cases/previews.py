"""Preview URLs and the service's own origin: a page a sandbox serves must never run with the
authority of the dashboard or the API (its session, its cookies, its Origin)."""

from __future__ import annotations

from ..model import Case

CASES: list[Case] = []
