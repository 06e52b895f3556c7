"""The conformance matrix: every behavioural SDK case on every transport (embedded, HTTP over
loopback, the app in-process over ASGI) and every isolation tier (namespace, gVisor, microVM; a
tier skips with the host check's reasons where it cannot run, and the microVM tier runs the
embedded transport only)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from corral import Sandbox
from corral._control.manager import Manager
from corral._server.app import create_app
from corral.testing import asgi_transport

from ..integration import conftest as integration
from ..integration.servers import Server

TRANSPORTS = ["embedded", "http", "asgi"]

# The tier matrix and the loopback server are the integration suite's own fixtures.
server = integration.server
gvisor_problems = integration.gvisor_problems
microvm_problems = integration.microvm_problems
isolation = integration.isolation_all


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
    if isolation == "microvm" and "home" not in target:
        # The transports sit above the tier: the other tiers prove each of them, and under
        # TCG emulation a VM per case per transport costs more than it shows.
        pytest.skip("the microVM tier runs the conformance cases over the embedded transport")
    with Sandbox.create(isolation=isolation, **target) as sandbox:
        yield sandbox
