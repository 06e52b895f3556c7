"""Scenario 7, security over the E2B surface (fail closed), with the official Python SDK (latest)
and, where the SDK would never send the request, plain HTTP (httpx, from the same venv).

Usage: python security.py     (BETA_KEY in the environment: the other tenant's key)
"""

from __future__ import annotations

import os

import httpx
from _steps import done, step
from e2b import Sandbox

URL = os.environ["E2B_SANDBOX_URL"]
API = os.environ["E2B_API_URL"]
BETA = os.environ["BETA_KEY"]

a = step("create_a", lambda: Sandbox.create(timeout=120))
b = step("create_b", lambda: Sandbox.create(timeout=120))
step("ids", lambda: [a.sandbox_id, b.sandbox_id])


def envd(sandbox: str, token: str | None, *, port: int = 49983,
         path: str = "/filesystem.Filesystem/Stat",
         body: object = None) -> dict[str, object]:
    headers = {"E2b-Sandbox-Id": sandbox, "E2b-Sandbox-Port": str(port),
               "Content-Type": "application/json", "Connect-Protocol-Version": "1"}
    if token is not None:
        headers["X-Access-Token"] = token
    r = httpx.post(URL + path, headers=headers, timeout=20,
                   json={"path": "/home/user"} if body is None else body)
    try:
        payload = r.json()
    except ValueError:
        payload = r.text[:300]
    return {"status": r.status_code, "body": payload}


def token(sb: Sandbox) -> str:
    return sb._envd_access_token  # type: ignore[no-any-return]


step("own_token", lambda: envd(b.sandbox_id, token(b)))  # the positive control
step("a_token_for_b", lambda: envd(b.sandbox_id, token(a)))
step("no_token", lambda: envd(b.sandbox_id, None))
step("bad_token", lambda: envd(b.sandbox_id, "0" * 64))
step("unknown_sandbox", lambda: envd("sbx-000000000000", token(a)))
step("files_no_token", lambda: {"status": httpx.get(
    URL + "/files", params={"path": "/home/user/x"}, timeout=20,
    headers={"E2b-Sandbox-Id": b.sandbox_id, "E2b-Sandbox-Port": "49983"}).status_code})
step("jupyter_no_token", lambda: envd(b.sandbox_id, None, port=49999, path="/execute",
                                      body={"code": "1+1"}))
step("jupyter_a_token_for_b", lambda: envd(b.sandbox_id, token(a), port=49999,
                                           path="/execute", body={"code": "1+1"}))
step("wrong_key_rest", lambda: (lambda r: {"status": r.status_code, "body": r.json()})(
    httpx.get(API + "/sandboxes", headers={"X-API-KEY": "e2b_" + "f" * 48}, timeout=20)))
step("no_key_rest", lambda: (lambda r: {"status": r.status_code, "body": r.json()})(
    httpx.get(API + "/sandboxes", timeout=20)))
step("other_tenant_connect", lambda: Sandbox.connect(a.sandbox_id, api_key=BETA))
step("other_tenant_info", lambda: Sandbox.get_info(a.sandbox_id, api_key=BETA))
step("other_tenant_kill", lambda: Sandbox.kill(a.sandbox_id, api_key=BETA))
step("other_tenant_list", lambda: [s.sandbox_id for s in
                                   Sandbox.list(api_key=BETA, limit=100).next_items()])
step("still_alive", lambda: a.commands.run("echo alive").stdout)


def network() -> dict[str, object]:
    out: dict[str, object] = {}
    for name, cmd in {
        "curl": "curl -sS -m 5 -o /dev/null -w '%{http_code}' http://example.com/",
        "raw_ip": "curl -sS -m 5 -o /dev/null -w '%{http_code}' http://1.1.1.1/",
        "python": "python3 -c \"import urllib.request as u; u.urlopen('http://example.com', "
                  "timeout=5)\"",
    }.items():
        try:
            r = a.commands.run(cmd, timeout=20)
            out[name] = {"exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr}
        except Exception as exc:  # noqa: BLE001 - CommandExitException is the expected path
            out[name] = {"exit_code": getattr(exc, "exit_code", None),
                         "stderr": str(getattr(exc, "stderr", exc))[:300]}
    return out


step("network_default", network)


def internet_asked() -> dict[str, object]:
    """allow_internet_access=True (every old SDK sends it) never means raw internet: either the
    create is refused, or the sandbox still cannot reach out."""
    try:
        c = Sandbox.create(timeout=60, allow_internet_access=True)
    except Exception as exc:  # noqa: BLE001 - a clear refusal is one of the right answers
        return {"created": False, "error": type(exc).__name__, "message": str(exc)[:300]}
    try:
        # -f: a 403 from Corral's gateway (its network policy) fails the command too.
        r = c.commands.run("curl -fsS -m 5 -o /dev/null http://example.com/ || echo refused")
        return {"created": True, "stdout": r.stdout, "stderr": r.stderr[:300]}
    finally:
        c.kill()


step("network_asked", internet_asked)
step("kill_a", lambda: a.kill())
step("kill_b", lambda: b.kill())
done()
