"""Wire conformance of the E2B surface's control plane and sandbox-plane gate, without an SDK:
the request shapes of E2B-COMPAT §4 and §9 replayed in-process (over the memory backend, so it
runs in a second on every commit); statuses, field names and error shapes as the SDKs parse
them. The official SDKs themselves run in tests/e2b."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from corral._control.manager import Manager
from corral._control.tenants import TenantDirectory
from corral._e2b.app import E2BConfig, create_e2b_app

BASE = "http://127.0.0.1"
SANDBOX_FIELDS = {"templateID", "sandboxID", "clientID", "envdVersion", "envdAccessToken",
                  "trafficAccessToken", "domain"}
DETAIL_FIELDS = SANDBOX_FIELDS | {"startedAt", "endAt", "cpuCount", "memoryMB", "diskSizeMB",
                                  "state", "metadata"}


@pytest.fixture
def keys(manager: Manager) -> dict[str, str]:
    tenants = TenantDirectory(manager.store)
    tenants.add_tenant("acme")
    tenants.add_tenant("other")
    return {"acme": tenants.create_key("acme", e2b=True)[1],
            "other": tenants.create_key("other", e2b=True)[1]}


@pytest.fixture
def client(manager: Manager) -> Iterator[TestClient]:
    app = create_e2b_app(manager, E2BConfig.build())
    with TestClient(app, base_url=BASE) as client:
        yield client


def _h(key: str) -> dict[str, str]:
    return {"X-API-KEY": key}


def _create(client: TestClient, key: str, **body: Any) -> dict[str, Any]:
    answer = client.post("/v2/sandboxes", headers=_h(key), json={"templateID": "base", **body})
    assert answer.status_code == 201, answer.text
    data: dict[str, Any] = answer.json()
    return data


def _is_error(answer: Any, status: int) -> None:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    body = answer.json()
    assert body["code"] == status and isinstance(body["message"], str) and body["message"]


def test_keys_have_the_sdk_format(keys: dict[str, str]) -> None:
    # Every SDK checks ^e2b_[0-9a-f]+$ before sending (E2B-COMPAT §3).
    for key in keys.values():
        assert re.fullmatch(r"e2b_[0-9a-f]{48}", key)


def test_create_answers_the_sandbox_object(client: TestClient, keys: dict[str, str]) -> None:
    created = _create(client, keys["acme"], metadata={"run": "r1"}, envVars={"A": "1"})
    assert SANDBOX_FIELDS <= set(created)
    assert re.fullmatch(r"[a-z0-9-]{1,57}", created["sandboxID"])  # a DNS label (P4)
    assert created["templateID"] == "base" and created["domain"] == "localhost"  # get_host
    assert tuple(int(p) for p in created["envdVersion"].split(".")) >= (0, 1, 0)
    # The v1 path (Py ≤ 2.48) sends timeout and secure always.
    old = client.post("/sandboxes", headers=_h(keys["acme"]), json={
        "templateID": "base", "allow_internet_access": True, "autoPause": False,
        "envVars": {}, "metadata": {}, "secure": True, "timeout": 300})
    assert old.status_code == 201, old.text


def test_get_info_types_and_timeout(client: TestClient, keys: dict[str, str]) -> None:
    sid = _create(client, keys["acme"], metadata={"k": "v"}, timeout=60)["sandboxID"]
    info = client.get(f"/sandboxes/{sid}", headers=_h(keys["acme"])).json()
    assert DETAIL_FIELDS <= set(info)
    assert info["state"] == "running" and info["metadata"] == {"k": "v"}
    assert info["cpuCount"] >= 1 and info["memoryMB"] >= 128 and info["diskSizeMB"] >= 0
    assert info["startedAt"].endswith("Z") and info["endAt"] > info["startedAt"]
    answer = client.post(f"/sandboxes/{sid}/timeout", headers=_h(keys["acme"]),
                         json={"timeout": 600})
    assert answer.status_code == 204
    later = client.get(f"/sandboxes/{sid}", headers=_h(keys["acme"])).json()
    assert later["endAt"] > info["endAt"]


def test_errors_are_code_and_message(client: TestClient, keys: dict[str, str]) -> None:
    _is_error(client.post("/v2/sandboxes", json={"templateID": "base"}), 401)
    _is_error(client.post("/v2/sandboxes", headers=_h("e2b_" + "0" * 48),
                          json={"templateID": "base"}), 401)
    _is_error(client.post("/v2/sandboxes", headers=_h("e2b_nothex"),
                          json={"templateID": "base"}), 401)
    _is_error(client.post("/v2/sandboxes", headers=_h(keys["acme"]), json={}), 400)
    _is_error(client.post("/v2/sandboxes", headers=_h(keys["acme"]),
                          json={"templateID": "base", "timeout": "soon"}), 400)
    _is_error(client.post("/v2/sandboxes", headers=_h(keys["acme"]),
                          content=b"{not json", ), 400)
    _is_error(client.get("/no/such/path", headers=_h(keys["acme"])), 404)
    _is_error(client.put("/v2/sandboxes", headers=_h(keys["acme"])), 405)
    _is_error(client.get("/sandboxes/sbx-000000000000", headers=_h(keys["acme"])), 404)
    _is_error(client.post("/v2/sandboxes", headers=_h(keys["acme"]),
                          json={"templateID": "base", "volumeMounts": [{"name": "v",
                                                                          "path": "/mnt"}]}),
              400)


def test_another_tenants_sandbox_is_not_found(client: TestClient,
                                              keys: dict[str, str]) -> None:
    sid = _create(client, keys["acme"])["sandboxID"]
    other = _h(keys["other"])
    _is_error(client.get(f"/sandboxes/{sid}", headers=other), 404)
    assert client.delete(f"/sandboxes/{sid}", headers=other).status_code == 404
    _is_error(client.post(f"/sandboxes/{sid}/pause", headers=other, json={}), 404)
    _is_error(client.post(f"/v2/sandboxes/{sid}/connect", headers=other, json={}), 404)
    assert client.get("/v2/sandboxes", headers=other).json() == []
    assert client.get(f"/sandboxes/{sid}", headers=_h(keys["acme"])).status_code == 200


def test_kill_then_kill_again(client: TestClient, keys: dict[str, str]) -> None:
    sid = _create(client, keys["acme"])["sandboxID"]
    assert client.delete(f"/sandboxes/{sid}", headers=_h(keys["acme"])).status_code == 204
    assert client.delete(f"/sandboxes/{sid}", headers=_h(keys["acme"])).status_code == 404
    _is_error(client.get(f"/sandboxes/{sid}", headers=_h(keys["acme"])), 404)


def test_list_pages_and_filters(client: TestClient, keys: dict[str, str]) -> None:
    ids = [_create(client, keys["acme"], metadata={"run": run})["sandboxID"]
           for run in ("a", "b", "a")]
    seen: list[str] = []
    token = None
    for _ in range(5):
        params = {"limit": "1", **({"nextToken": token} if token else {})}
        answer = client.get("/v2/sandboxes", headers=_h(keys["acme"]), params=params)
        assert answer.status_code == 200
        page = answer.json()
        assert len(page) == 1 and DETAIL_FIELDS <= set(page[0])
        seen.append(page[0]["sandboxID"])
        token = answer.headers.get("x-next-token")
        if not token:
            break
    assert seen == ids
    filtered = client.get("/v2/sandboxes", headers=_h(keys["acme"]),
                          params={"metadata": "run=a"}).json()
    assert [s["sandboxID"] for s in filtered] == [ids[0], ids[2]]
    _is_error(client.get("/v2/sandboxes", headers=_h(keys["acme"]),
                         params={"limit": "0"}), 400)
    _is_error(client.get("/v2/sandboxes", headers=_h(keys["acme"]),
                         params={"nextToken": "!!!"}), 400)


def test_pause_connect_resume(client: TestClient, keys: dict[str, str]) -> None:
    h = _h(keys["acme"])
    sid = _create(client, keys["acme"])["sandboxID"]
    assert client.post(f"/v2/sandboxes/{sid}/connect", headers=h, json={}).status_code == 200
    assert client.post(f"/sandboxes/{sid}/pause", headers=h, json={}).status_code == 204
    assert client.post(f"/sandboxes/{sid}/pause", headers=h, json={}).status_code == 409
    assert client.get(f"/sandboxes/{sid}", headers=h).json()["state"] == "paused"
    listed = client.get("/v2/sandboxes", headers=h, params={"state": "paused"}).json()
    assert [s["sandboxID"] for s in listed] == [sid]
    connected = client.post(f"/v2/sandboxes/{sid}/connect", headers=h, json={"timeout": 300})
    assert connected.status_code == 201 and SANDBOX_FIELDS <= set(connected.json())
    assert client.post(f"/sandboxes/{sid}/resume", headers=h, json={}).status_code == 409


def test_snapshots_and_forks(client: TestClient, keys: dict[str, str]) -> None:
    h = _h(keys["acme"])
    sid = _create(client, keys["acme"])["sandboxID"]
    snap = client.post(f"/sandboxes/{sid}/snapshots", headers=h, json={"name": "warm"})
    assert snap.status_code == 201, snap.text
    snap_id = snap.json()["snapshotID"]
    assert snap.json()["names"] == ["warm"] and re.fullmatch(r"[a-z0-9-]+", snap_id)
    listed = client.get("/snapshots", headers=h, params={"sandboxID": sid}).json()
    assert listed == [{"snapshotID": snap_id, "names": ["warm"]}]
    child = _create(client, keys["acme"], templateID=snap_id)
    assert child["templateID"] == snap_id
    forks = client.post(f"/sandboxes/{sid}/fork", headers=h, json={"count": 2})
    assert forks.status_code == 201 and len(forks.json()) == 2
    assert all(SANDBOX_FIELDS <= set(item["sandbox"]) for item in forks.json())
    # In use (the child, the parent and its forks are built on it): refused, kept.
    assert client.delete(f"/templates/{snap_id}", headers=h).status_code == 409
    for user in [child["sandboxID"], sid, *(f["sandbox"]["sandboxID"] for f in forks.json())]:
        assert client.delete(f"/sandboxes/{user}", headers=h).status_code == 204
    assert client.delete(f"/templates/{snap_id}", headers=h).status_code == 204
    assert client.delete(f"/templates/{snap_id}", headers=h).status_code == 404
    _is_error(client.get("/snapshots", headers=_h(keys["other"]),
                         params={"limit": "abc"}), 400)


def test_sandbox_plane_gate(client: TestClient, keys: dict[str, str]) -> None:
    a = _create(client, keys["acme"])
    b = _create(client, keys["acme"])

    def health(sandbox: str, **headers: str) -> Any:
        return client.get("/health", headers={"E2b-Sandbox-Id": sandbox,
                                              "E2b-Sandbox-Port": "49983", **headers})

    assert health(a["sandboxID"], **{"X-Access-Token": a["envdAccessToken"]}).status_code == 204
    _is_error(health(a["sandboxID"]), 401)  # no token
    # A's token with B's id.
    _is_error(health(b["sandboxID"], **{"X-Access-Token": a["envdAccessToken"]}), 401)
    gone = health("sbx-000000000000", **{"X-Access-Token": a["envdAccessToken"]})
    assert gone.status_code == 502
    assert gone.json() == {"sandboxId": "sbx-000000000000",
                           "message": "The sandbox was not found", "code": 502}
    # The code interpreter also takes the traffic token.
    jupyter = client.get("/health", headers={
        "E2b-Sandbox-Id": a["sandboxID"], "E2b-Sandbox-Port": "49999",
        "E2B-Traffic-Access-Token": a["trafficAccessToken"]})
    assert jupyter.status_code == 204
    closed = health(a["sandboxID"], **{"X-Access-Token": a["envdAccessToken"],
                                       "E2b-Sandbox-Port": "3000"})
    assert closed.status_code == 502 and "port is not open" in closed.json()["message"]
    # An RPC path is refused with a Connect error.
    rpc = client.post("/process.Process/List", headers={"E2b-Sandbox-Id": a["sandboxID"]},
                      json={})
    assert rpc.status_code == 401 and rpc.json()["code"] == "unauthenticated"


def test_host_and_body_limits(client: TestClient, keys: dict[str, str]) -> None:
    _is_error(client.get("/v2/sandboxes", headers={**_h(keys["acme"]),
                                                   "Host": "evil.example"}), 421)
    big = client.post("/v2/sandboxes", headers=_h(keys["acme"]),
                      content=b"{" + b" " * (2 * 1024 * 1024) + b"}")
    _is_error(big, 413)


def test_domain_mode_routes_by_host(manager: Manager, keys: dict[str, str]) -> None:
    app = create_e2b_app(manager, E2BConfig.build(domain="corral.test"))
    with TestClient(app, base_url="https://api.corral.test") as client:
        created = _create(client, keys["acme"])
        assert created["domain"] == "corral.test"
        sid = created["sandboxID"]
        answer = client.get(f"https://49983-{sid}.corral.test/health",
                            headers={"X-Access-Token": created["envdAccessToken"]})
        assert answer.status_code == 204
        _is_error(client.get("https://elsewhere.test/v2/sandboxes",
                             headers=_h(keys["acme"])), 421)
        gone = client.get("https://49983-sbx-000000000000.corral.test/health",
                          headers={"X-Access-Token": created["envdAccessToken"]})
        assert gone.status_code == 502


def test_a_token_alone_names_its_sandbox(client: TestClient, keys: dict[str, str]) -> None:
    # SDKs 2.7–2.20 reconnected with `connect` send envd calls with the token only.
    a = _create(client, keys["acme"])
    assert client.get("/health", headers={"X-Access-Token": a["envdAccessToken"]}
                      ).status_code == 204
    _is_error(client.get("/health", headers={"X-Access-Token": "0" * 48}), 401)
    # Without a token the same path is the control plane's, which needs a key.
    _is_error(client.get("/health"), 401)


def test_allow_out_takes_host_names_not_addresses(client: TestClient,
                                                  keys: dict[str, str]) -> None:
    for rule in ("10.0.0.0/8", "8.8.8.8", "2001:db8::/32"):
        answer = client.post("/v2/sandboxes", headers=_h(keys["acme"]), json={
            "templateID": "base", "network": {"allowOut": [rule]}})
        _is_error(answer, 400)
        assert "host names" in answer.json()["message"]
    # A name that starts with a digit is a name (no ceiling here: allowed as asked).
    created = _create(client, keys["acme"], network={"allowOut": ["1password.com"]})
    info = client.get(f"/sandboxes/{created['sandboxID']}", headers=_h(keys["acme"])).json()
    assert info["allowInternetAccess"] is True
