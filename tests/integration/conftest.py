"""Fixtures for tests that run the same behaviour against both transports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from corral._control.manager import Manager

from .servers import Server


@pytest.fixture(scope="module")
def server(manager: Manager) -> Iterator[Server]:
    """The API for the session's manager, on loopback."""
    with Server(manager) as srv:
        yield srv


@pytest.fixture(params=["embedded", "remote"])
def where(request: pytest.FixtureRequest, home: str, server: Server) -> dict[str, str]:
    """Keyword arguments that point the SDK at one transport or the other."""
    return {"home": home} if request.param == "embedded" else {"url": server.url}
