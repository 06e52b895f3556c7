"""Every 5xx answer of the HTTP API and of the E2B surface leaves one line in the service log,
naming the error's class and message, clipped and on one line whatever the caller sent
(issue 36: 500 ``backend_error`` answers left none)."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient

from corral._control.manager import Manager
from corral._control.tenants import TenantDirectory
from corral._e2b.app import E2BConfig, create_e2b_app
from corral._serve.app import create_app
from corral.backends import SandboxSpec
from corral.errors import BackendError
from corral.testing.backend import MemoryBackend

BASE = "http://127.0.0.1"
# What a caller may put into an error's message (here: the tier's, with a newline and 10 KB).
_LONG = "x" * 10_000


class FailingBackend(MemoryBackend):
    """Pausing fails the way a broken tier's call does; unpausing with an unexpected error."""

    def pause(self, spec: SandboxSpec, paused: bool) -> None:
        if paused:
            raise BackendError(f"the freezer is broken\nforged line {_LONG}")
        raise RuntimeError("a bug, not a Corral error")


@pytest.fixture
def manager_backend() -> MemoryBackend:
    return FailingBackend()


def _lines(caplog: pytest.LogCaptureFixture, status: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and f"answered {status}" in r.getMessage()]


def _assert_one_clipped_line(lines: list[str], *expected: str) -> None:
    assert len(lines) == 1, lines
    line = lines[0]
    assert "\n" not in line and len(line) < 1000, line
    for text in expected:
        assert text in line, line


def test_the_apis_5xx_answers_are_logged(manager: Manager,
                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    sandbox = manager.create().id
    with TestClient(create_app(manager), base_url=BASE, raise_server_exceptions=False) as api:
        answer = api.post(f"/v1/sandboxes/{sandbox}/pause")
        assert answer.status_code == 500 and answer.json()["error"] == "backend_error"
        _assert_one_clipped_line(_lines(caplog, 500), f"POST /v1/sandboxes/{sandbox}/pause",
                                 "BackendError: the freezer is broken")
        caplog.clear()
        manager.store.set_state(sandbox, "paused")
        answer = api.post(f"/v1/sandboxes/{sandbox}/resume")
        assert answer.status_code == 500 and answer.json()["error"] == "internal_error"
        _assert_one_clipped_line(_lines(caplog, 500), "RuntimeError: a bug")
        caplog.clear()
        assert api.get("/v1/sandboxes/sbx_nothere0000").status_code == 404
        assert api.get("/no/such/path/" + "y" * 5000).status_code == 404
        assert not [r for r in caplog.records if "answered" in r.getMessage()]


def test_the_e2b_surfaces_5xx_answers_are_logged(manager: Manager,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    tenants = TenantDirectory(manager.store)
    tenants.add_tenant("acme")
    key = {"X-API-KEY": tenants.create_key("acme", e2b=True)[1]}
    with TestClient(create_e2b_app(manager, E2BConfig.build()), base_url=BASE) as e2b:
        created = e2b.post("/v2/sandboxes", headers=key, json={"templateID": "base"})
        sandbox = created.json()["sandboxID"]
        answer = e2b.post(f"/sandboxes/{sandbox}/pause", headers=key)
        assert answer.status_code == 500, answer.text
        _assert_one_clipped_line(_lines(caplog, 500), f"/sandboxes/{sandbox}/pause",
                                 "BackendError: the freezer is broken")
