"""Cookie tossing: a sandbox's app cannot set, replace or clear a cookie Corral uses."""

from __future__ import annotations

from ..model import Case

CASES: list[Case] = []
