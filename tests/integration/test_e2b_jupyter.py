"""The E2B code interpreter's port (``/execute``, ``/contexts``) on Corral's E2B app, without an
SDK: the reference server's line shapes and statuses (E2B-COMPAT.md §8) over a real sandbox
(base template; the official SDK's own run lives in tests/e2b)."""

from __future__ import annotations

import base64
import datetime as dt
import json
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from corral._control.tenants import TenantDirectory
from corral._e2b.app import E2BConfig, create_e2b_app
from corral._settings import Settings

from ..conftest import managed

pytestmark = pytest.mark.needs_root


@pytest.fixture(scope="module")
def e2b() -> Iterator[tuple[TestClient, dict[str, str]]]:
    """The E2B app on a home of its own (its keys switch authentication on there)."""
    home = Path(tempfile.mkdtemp(prefix="corral-test-e2b-ci-"))
    settings = Settings(home=home, uid_start=2_145_000_000 + secrets.randbelow(100) * 1000,
                        uid_count=1000)
    with managed(settings) as mgr:
        tenants = TenantDirectory(mgr.store)
        keys = {}
        for name in ("acme", "other"):
            tenants.add_tenant(name)
            keys[name] = tenants.create_key(name, e2b=True)[1]
        with TestClient(create_e2b_app(mgr, E2BConfig.build()),
                        base_url="http://127.0.0.1") as client:
            yield client, keys
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def sandbox(e2b: tuple[TestClient, dict[str, str]]) -> Iterator[dict[str, Any]]:
    client, keys = e2b
    created = client.post("/v2/sandboxes", headers={"X-API-KEY": keys["acme"]},
                          json={"templateID": "base"})
    assert created.status_code == 201, created.text
    data: dict[str, Any] = created.json()
    yield data
    client.delete(f"/sandboxes/{data['sandboxID']}", headers={"X-API-KEY": keys["acme"]})


def _plane(sandbox: dict[str, Any], *, traffic: bool = False) -> dict[str, str]:
    headers = {"E2b-Sandbox-Id": sandbox["sandboxID"], "E2b-Sandbox-Port": "49999"}
    if traffic:
        headers["E2B-Traffic-Access-Token"] = sandbox["trafficAccessToken"]
    else:
        headers["X-Access-Token"] = sandbox["envdAccessToken"]
    return headers


def _execute(client: TestClient, sandbox: dict[str, Any], **body: Any) -> list[dict[str, Any]]:
    # The Python SDK sends every key; nulls included.
    full = {"context_id": None, "language": None, "env_vars": None, **body}
    with client.stream("POST", "/execute", headers=_plane(sandbox), json=full) as answer:
        assert answer.status_code == 200, answer.read()
        assert answer.headers["content-type"].startswith("application/x-ndjson")
        raw = answer.read().decode()
    assert raw.endswith("\n")
    lines = raw[:-1].split("\n")
    assert all(line.strip() for line in lines), "a blank line crashes the SDKs' json.loads"
    return [json.loads(line) for line in lines]


def test_execute_lines_in_the_reference_order(e2b: tuple[TestClient, dict[str, str]],
                                              sandbox: dict[str, Any]) -> None:
    client, _ = e2b
    events = _execute(client, sandbox, code="import sys\nx = 41\nprint('out')\n"
                                            "print('err', file=sys.stderr)\nx + 1")
    kinds = [e["type"] for e in events]
    assert kinds[0] == "number_of_executions" and kinds[-1] == "end_of_execution"
    assert kinds[1:-1] == ["stdout", "stderr", "result"]  # a line per event, as Jupyter
    assert "".join(e["text"] for e in events if e["type"] == "stdout") == "out\n"
    for event in events:
        if event["type"] in ("stdout", "stderr"):
            dt.datetime.fromisoformat(event["timestamp"])  # ISO 8601, as Python callbacks need
    assert events[-2] == {"type": "result", "is_main_result": True, "text": "42"}
    count = events[0]["execution_count"]
    again = _execute(client, sandbox, code="x")
    assert again[0]["execution_count"] == count + 1
    assert again[1] == {"type": "result", "is_main_result": True, "text": "41"}


def test_rich_results_and_errors(e2b: tuple[TestClient, dict[str, str]],
                                 sandbox: dict[str, Any]) -> None:
    client, _ = e2b
    chart = _execute(client, sandbox, code="import matplotlib.pyplot as plt\n"
                                           "plt.plot([1, 2]); plt.show()")
    figures = [e for e in chart if e["type"] == "result" and "png" in e]
    assert len(figures) == 1 and figures[0]["is_main_result"] is False
    assert base64.b64decode(figures[0]["png"]).startswith(b"\x89PNG")
    # A figure as the last expression: the main result carries the PNG, shown once.
    last = [e for e in _execute(client, sandbox, code="fig = plt.figure()\nplt.plot([1])\nfig")
            if e["type"] == "result"]
    assert len(last) == 1 and last[0]["is_main_result"] is True
    assert last[0]["text"] == "<Figure size 640x480 with 1 Axes>"
    assert base64.b64decode(last[0]["png"]).startswith(b"\x89PNG")
    frame = _execute(client, sandbox, code="import pandas as pd\npd.DataFrame({'a': [1]})")
    html = [e for e in frame if e["type"] == "result"][0]
    assert "<table" in html["html"] and "text" in html
    error = [e for e in _execute(client, sandbox, code="1/0") if e["type"] == "error"]
    assert len(error) == 1 and error[0]["name"] == "ZeroDivisionError"
    assert set(error[0]) == {"type", "name", "value", "traceback"}
    env = _execute(client, sandbox, code="import os\nos.environ['GREETING']",
                   env_vars={"GREETING": "hi"})
    assert {"type": "result", "is_main_result": True, "text": "'hi'"} in env
    gone = _execute(client, sandbox, code="import os\n'GREETING' in os.environ")
    assert {"type": "result", "is_main_result": True, "text": "False"} in gone


def test_contexts_with_the_reference_statuses(e2b: tuple[TestClient, dict[str, str]],
                                              sandbox: dict[str, Any]) -> None:
    client, keys = e2b
    plane = _plane(sandbox, traffic=True)  # CI >= 2.9 sends the traffic token alone
    made = client.post("/contexts", headers=plane, json={"language": "python",
                                                         "cwd": "/home/user"})
    assert made.status_code == 200, made.text
    ctx = made.json()
    assert set(ctx) == {"id", "language", "cwd"} and ctx["cwd"] == "/home/user"
    assert ctx["id"] in [c["id"] for c in client.get("/contexts", headers=plane).json()]
    _execute(client, sandbox, code="z = 7", context_id=ctx["id"])
    z = _execute(client, sandbox, code="z", context_id=ctx["id"])
    assert {"type": "result", "is_main_result": True, "text": "7"} in z
    assert client.post(f"/contexts/{ctx['id']}/restart", headers=plane).status_code == 200
    after = _execute(client, sandbox, code="z", context_id=ctx["id"])
    assert [e["name"] for e in after if e["type"] == "error"] == ["NameError"]

    bash = client.post("/contexts", headers=plane, json={"language": "bash"}).json()
    _execute(client, sandbox, code="cd /tmp", context_id=bash["id"])
    pwd = _execute(client, sandbox, code="pwd", context_id=bash["id"])
    assert [e["text"] for e in pwd if e["type"] == "stdout"] == ["/tmp\n"]

    both = client.post("/execute", headers=_plane(sandbox),
                       json={"code": "1", "context_id": ctx["id"], "language": "python"})
    assert both.status_code == 400 and both.headers["content-type"].startswith("text/plain")
    unknown = client.post("/execute", headers=_plane(sandbox),
                          json={"code": "1", "context_id": "nope"})
    assert unknown.status_code == 404 and unknown.text == "Context nope not found"
    assert client.delete(f"/contexts/{ctx['id']}", headers=plane).status_code == 200
    assert client.delete(f"/contexts/{ctx['id']}", headers=plane).status_code == 404
    assert client.post(f"/contexts/{ctx['id']}/restart", headers=plane).status_code == 404
    js = _execute(client, sandbox, code="[1, 2].map(x => x * 2)", language="js")
    assert {"type": "result", "is_main_result": True, "text": "[ 2, 4 ]"} in js
    ts = _execute(client, sandbox, code="const n: number = 41; n + 1", language="ts")
    assert {"type": "result", "is_main_result": True, "text": "42"} in ts
    r = _execute(client, sandbox, code="x <- 41; x + 1", language="r")
    assert {"type": "result", "is_main_result": True, "text": "[1] 42"} in r
    # No kernel for it here: the cell's error in a 200 stream, not a bare 400 (E2B's JS SDK
    # shows a 400 as its status line alone), saying what there is.
    java = _execute(client, sandbox, code="1", language="java")
    assert [e["type"] for e in java] == ["error", "end_of_execution"]
    assert java[0]["name"] == "InterpreterUnavailable" and "no java kernel" in java[0]["value"]
    assert "javascript, typescript, r, bash" in java[0]["value"]

    # Another tenant's sandbox is not found on this plane either, whatever its tokens.
    theirs = client.post("/v2/sandboxes", headers={"X-API-KEY": keys["other"]},
                         json={"templateID": "base"}).json()
    crossed = client.get("/contexts", headers={**_plane(sandbox, traffic=True),
                                               "E2b-Sandbox-Id": theirs["sandboxID"]})
    assert crossed.status_code in (401, 502)
    client.delete(f"/sandboxes/{theirs['sandboxID']}", headers={"X-API-KEY": keys["other"]})
