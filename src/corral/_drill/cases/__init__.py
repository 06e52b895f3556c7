"""The declared attack cases, one module per category. Add a case by appending a ``Case`` to
its module's ``CASES``: an id, what it tries, what counts as held, and a function that runs it."""

from __future__ import annotations

from ..case import Case

__all__ = ["all_cases"]


def all_cases() -> list[Case]:
    from . import (
        audit,
        caller,
        control,
        cookies,
        credentials,
        e2b,
        filesystem,
        hibernation,
        network,
        previews,
        privilege,
        relays,
        resources,
    )

    cases = [*network.CASES, *credentials.CASES, *filesystem.CASES, *privilege.CASES,
             *resources.CASES, *control.CASES, *caller.CASES, *e2b.CASES, *previews.CASES,
             *relays.CASES, *cookies.CASES, *audit.CASES, *hibernation.CASES]
    ids = [c.id for c in cases]
    duplicated = {i for i in ids if ids.count(i) > 1}
    assert not duplicated, f"duplicate drill case ids: {duplicated}"
    return cases
