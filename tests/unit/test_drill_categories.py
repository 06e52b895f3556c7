"""The dashboard's drill page offers the drill's own categories: the service asks the drill's
command once (the dashboard may not import the drill), and a start with known names asks it
nothing more."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from starlette.testclient import TestClient

from corral._control.plane import Manager
from corral._drill.model import CATEGORIES
from corral._drill.runner import select_cases
from corral._serve.app import create_app
from corral._ui import routes
from corral.errors import UsageError


def test_the_page_is_offered_every_category_with_its_cases(manager: Manager) -> None:
    with TestClient(create_app(manager), base_url="http://127.0.0.1") as client:
        listed = client.get("/ui/api/drill", headers={"X-Corral-UI": "1"})
    assert listed.status_code == 200, listed.text
    categories = listed.json()["categories"]
    assert [c["name"] for c in categories] == list(CATEGORIES)
    assert sum(c["cases"] for c in categories) == len(select_cases())


def test_known_categories_start_without_asking_the_drill_again(
        manager: Manager, monkeypatch: pytest.MonkeyPatch) -> None:
    drills = routes._Drills()
    runs: list[list[str]] = []
    real_run = subprocess.run

    def counted(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
        runs.append(argv)
        return real_run(argv, **kwargs)

    monkeypatch.setattr(routes.subprocess, "run", counted)
    drills.check(manager, ["filesystem", "e2b"])
    drills.check(manager, ["audit"])
    drills.check(manager, [])
    assert len(runs) == 1  # the one listing, kept
    with pytest.raises(UsageError, match="nosuch") as refused:
        drills.check(manager, ["filesystem", "nosuch"])
    assert "filesystem" in str(refused.value)  # the drill's own words: its list of choices
    assert len(runs) == 2
