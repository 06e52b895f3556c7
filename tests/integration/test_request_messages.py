"""A malformed request body is answered with what to change: a missing field is "required", an
unknown one names the field meant (``command`` for ``cmd``), never a control-plane message about
the whole body ("must be a string ... not dict")."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from corral._control.manager import Manager
from corral._serve.app import create_app

pytestmark = pytest.mark.needs_root


@pytest.fixture(scope="module")
def client(manager: Manager) -> Iterator[tuple[TestClient, str]]:
    with TestClient(create_app(manager), base_url="http://127.0.0.1") as http:
        made = http.post("/v1/sandboxes", json={})
        assert made.status_code == 201, made.text
        sandbox_id = made.json()["id"]
        try:
            yield http, sandbox_id
        finally:
            http.delete(f"/v1/sandboxes/{sandbox_id}")


@pytest.mark.parametrize(("body", "message"), [
    ({"command": "ls"}, "body.cmd: required; body.command: not a field of this request "
                        "(did you mean 'cmd'?)"),
    ({"cmd": "ls", "timout": 3}, "body.timout: not a field of this request "
                                 "(did you mean 'timeout'?)"),
    ({}, "body.cmd: required"),
])
def test_a_misshapen_body_names_the_field(client: tuple[TestClient, str],
                                          body: dict[str, object], message: str) -> None:
    http, sandbox_id = client
    answer = http.post(f"/v1/sandboxes/{sandbox_id}/commands", json=body)
    assert answer.status_code == 422
    assert answer.json() == {"error": "invalid_request", "message": message}


def test_a_bad_value_keeps_the_control_planes_message(client: tuple[TestClient, str]) -> None:
    http, sandbox_id = client
    answer = http.post(f"/v1/sandboxes/{sandbox_id}/commands", json={"cmd": {"a": 1}})
    assert answer.status_code == 400
    assert answer.json()["error"] == "command_error"
