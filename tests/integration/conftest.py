"""Fixtures for tests that run the same behaviour against both transports or both isolation
tiers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from corral._control.manager import Manager
from corral._settings import Settings

from ..browser import chromium_page
from .servers import Server

if TYPE_CHECKING:
    from playwright.sync_api import Page


@pytest.fixture(scope="module")
def server(manager: Manager) -> Iterator[Server]:
    """The API for the session's manager, on loopback."""
    with Server(manager) as srv:
        yield srv


@pytest.fixture(params=["embedded", "remote"])
def where(request: pytest.FixtureRequest, home: str, server: Server) -> dict[str, str]:
    """Keyword arguments that point the SDK at one transport or the other."""
    return {"home": home} if request.param == "embedded" else {"url": server.url}


@pytest.fixture(scope="session")
def gvisor_problems(settings: Settings) -> list[str]:
    """Why this host cannot run the gVisor tier (empty when it can), from its own host check."""
    from corral._backends.gvisor import GvisorBackend

    return [f"{c.name}: {c.detail} (fix: {c.fix})"
            for c in GvisorBackend(settings).check_host() if not c.ok]


def host_tier(request: pytest.FixtureRequest) -> str:
    """``request.param``, a host tier (namespace or gvisor), skipped with the host check's
    reasons where the host cannot run it: for fixtures of a wider scope than ``isolation``."""
    tier = str(request.param)
    if tier == "gvisor":
        problems: list[str] = request.getfixturevalue("gvisor_problems")
        if problems:
            pytest.skip("the gVisor tier cannot run on this host: " + "; ".join(problems))
    return tier


@pytest.fixture(params=["namespace", "gvisor"])
def isolation(request: pytest.FixtureRequest, gvisor_problems: list[str]) -> str:
    """Each isolation tier in turn. Where the host cannot run gVisor, its cases are skipped with
    the host check's reasons; `corral doctor` says the same."""
    if request.param == "gvisor" and gvisor_problems:
        pytest.skip("the gVisor tier cannot run on this host: " + "; ".join(gvisor_problems))
    return str(request.param)


@pytest.fixture(scope="session")
def microvm_problems(settings: Settings) -> list[str]:
    """Why this host cannot run the microVM tier (empty when it can). Here that needs the test
    setting ``CORRAL_MICROVM_ALLOW_TCG=1`` (``scripts/test`` sets it): PVM runs no stock guest."""
    from corral._backends.microvm.hostcheck import check_host

    # (tests/conftest.py waited for the background build of the guest kernel already)
    return [f"{c.name}: {c.detail} (fix: {c.fix})" for c in check_host(settings) if not c.ok]


@pytest.fixture(params=["namespace", "gvisor", "microvm"])
def isolation_all(request: pytest.FixtureRequest, gvisor_problems: list[str]) -> str:
    """Every tier, the microVM one included (the suites the issue holds it to: conformance,
    isolation, the drill). Tiers the host cannot run are skipped with the host check's reasons.
    The microVM check is asked for only by the microVM cases."""
    if request.param == "gvisor" and gvisor_problems:
        pytest.skip("the gVisor tier cannot run on this host: " + "; ".join(gvisor_problems))
    if request.param == "microvm":
        problems: list[str] = request.getfixturevalue("microvm_problems")
        if problems:
            pytest.skip("the microVM tier cannot run on this host: " + "; ".join(problems))
    return str(request.param)


@pytest.fixture
def browser_page() -> Iterator[Page]:
    """A page in a fresh headless Chromium that reaches loopback only (tests/browser.py);
    skipped where Chromium or Playwright is missing, closed after the test."""
    with chromium_page() as page:
        yield page
