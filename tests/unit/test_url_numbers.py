"""Numbers in the API's URLs are read strictly: a malformed one is refused, never read as
another value (schemathesis found ``DELETE …/ports/1%0C`` unexposing port 1: pydantic strips
whitespace before it parses a number)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from corral._control.manager import Manager
from corral._serve.app import create_app

BASE = "http://127.0.0.1"


@pytest.fixture
def api(manager: Manager) -> Iterator[tuple[TestClient, Manager]]:
    with TestClient(create_app(manager), base_url=BASE) as client:
        yield client, manager


@pytest.mark.parametrize("port", ["1%0C", "%201", "1%20", "+1", "0x1", "1.0", "1_0", "１"])
def test_a_malformed_port_is_refused_and_changes_nothing(
        api: tuple[TestClient, Manager], port: str) -> None:
    client, manager = api
    sandbox = manager.create().id
    assert client.post(f"/v1/sandboxes/{sandbox}/ports/1").status_code == 201
    answer = client.delete(f"/v1/sandboxes/{sandbox}/ports/{port}")
    assert answer.status_code == 422, answer.text
    assert [p["port"] for p in client.get(f"/v1/sandboxes/{sandbox}/ports").json()] == [1]
    assert client.post(f"/v1/sandboxes/{sandbox}/ports/{port}").status_code == 422


@pytest.mark.parametrize("query", ["tail=%201", "tail=1%0C", "since=%201", "until=1e",
                                   "since=nan", "since=inf"])
def test_malformed_numbers_in_a_query_are_refused(api: tuple[TestClient, Manager],
                                                  query: str) -> None:
    client, manager = api
    sandbox = manager.create().id
    assert client.get(f"/v1/sandboxes/{sandbox}/audit?{query}").status_code == 422
    assert client.get(f"/v1/sandboxes/{sandbox}/audit?tail=1&since=1.5e3").status_code == 200
