"""A case: one declared attack, and the function that runs it against a drill's context."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .context import DrillContext
from .model import Category, Outcome

__all__ = ["Case"]


@dataclass(frozen=True, slots=True)
class Case:
    """One attack: what it tries, what counts as held, and how to run it.

    ``needs`` names what the case requires of the target ("python3", "admin" for host-side
    planting, "service" for the HTTP control plane); a target without it reports ``skipped``.
    """

    id: str
    category: Category
    tries: str
    held_when: str
    run: Callable[[DrillContext], Outcome]
    needs: frozenset[str] = frozenset()
