"""The conformance matrix: every behavioural SDK case on every transport (embedded, HTTP over
loopback, the app in-process over ASGI, and HTTP through ``corral serve --cluster`` over a
real two-node Ray cluster) and every isolation tier (namespace, gVisor, microVM; a tier skips
with the host check's reasons where it cannot run, and the microVM tier runs the embedded
transport only)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from corral import Sandbox
from corral._control.manager import Manager
from corral._serve.app import create_app
from corral.testing import asgi_transport

from ..integration import conftest as integration
from ..integration.raycluster import ray_cluster, served_gateway
from ..integration.servers import Server

TRANSPORTS = ["embedded", "http", "asgi", "cluster"]

# The tier matrix and the loopback server are the integration suite's own fixtures.
server = integration.server
gvisor_problems = integration.gvisor_problems
microvm_problems = integration.microvm_problems
isolation = integration.isolation_all


@pytest.fixture(scope="module")
def cluster_gateway() -> Iterator[str]:
    """``corral serve --cluster`` over two Ray nodes (started only if a case asks)."""
    with ray_cluster() as (cluster, _), served_gateway(cluster) as (served, _):
        yield served.url


@pytest.fixture(params=TRANSPORTS)
def target(request: pytest.FixtureRequest, home: str, server: Server,
           manager: Manager, isolation: str) -> dict[str, Any]:
    """``Sandbox.create``/``connect`` keyword arguments for one transport."""
    if isolation == "microvm" and request.param != "embedded":
        # The transports sit above the tier: the other tiers prove each of them, and under
        # TCG emulation a VM per case per transport costs more than it shows.
        pytest.skip("the microVM tier runs the conformance cases over the embedded transport")
    if request.param == "embedded":
        return {"home": home}
    if request.param == "http":
        return {"url": server.url}
    if request.param == "cluster":
        return {"url": request.getfixturevalue("cluster_gateway")}
    return {"transport": asgi_transport(create_app(manager))}


@pytest.fixture
def sb(target: dict[str, Any], isolation: str) -> Iterator[Sandbox]:
    with Sandbox.create(isolation=isolation, **target) as sandbox:
        yield sandbox
