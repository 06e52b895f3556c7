"""The conformance matrix: every behavioural SDK case on every transport (embedded, HTTP over
loopback, the app in-process over ASGI) and every isolation tier (namespace, gVisor; gVisor
cases skip with the host check's reasons where it cannot run)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from corral import Sandbox
from corral._control.manager import Manager
from corral._server.app import create_app
from corral._settings import Settings
from corral.testing import asgi_transport

from ..integration.servers import Server

TRANSPORTS = ["embedded", "http", "asgi"]


@pytest.fixture(scope="module")
def server(manager: Manager) -> Iterator[Server]:
    with Server(manager) as srv:
        yield srv


@pytest.fixture(scope="session")
def gvisor_problems(settings: Settings) -> list[str]:
    from corral._backends.gvisor import GvisorBackend

    return [f"{c.name}: {c.detail} (fix: {c.fix})"
            for c in GvisorBackend(settings).check_host() if not c.ok]


@pytest.fixture(params=["namespace", "gvisor"])
def isolation(request: pytest.FixtureRequest, gvisor_problems: list[str]) -> str:
    if request.param == "gvisor" and gvisor_problems:
        pytest.skip("the gVisor tier cannot run on this host: " + "; ".join(gvisor_problems))
    return str(request.param)


@pytest.fixture(params=TRANSPORTS)
def target(request: pytest.FixtureRequest, home: str, server: Server,
           manager: Manager) -> dict[str, Any]:
    """``Sandbox.create``/``connect`` keyword arguments for one transport."""
    if request.param == "embedded":
        return {"home": home}
    if request.param == "http":
        return {"url": server.url}
    return {"transport": asgi_transport(create_app(manager))}


@pytest.fixture
def sb(target: dict[str, Any], isolation: str) -> Iterator[Sandbox]:
    with Sandbox.create(isolation=isolation, **target) as sandbox:
        yield sandbox
