"""What the preview, relay and cookie cases attack: a hostile web app of the second tenant on a
public port of the service (``hostileapp.py``), made on first use through the HTTP API as any
tenant would make it, and the first tenant's dashboard session.

Everything it makes is on the service the drill was given, and destroyed by ``close``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from .target import ServiceAccess

__all__ = ["APP_PORT", "PreviewPlant", "plant_of"]

APP_PORT = 8000
_APP = Path(__file__).with_name("hostileapp.py")
_TIMEOUT_S = 120.0  # a sandbox's app starting on a loaded host, a microVM under emulation


class PreviewPlant:
    """The second tenant's hostile app, its exposed port, and what the cases need around it."""

    def __init__(self, access: ServiceAccess, isolation: str | None) -> None:
        if access.api_key is None or access.other_api_key is None:
            raise RuntimeError("the preview cases need two tenants' keys")
        self.access = access
        self._isolation = isolation
        self._port: dict[str, Any] | None = None
        self._app_sandbox: str | None = None
        self._doomed: str | None = None

    def client(self, key: str | None, *, timeout: float = 60) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.access.url, headers=headers, timeout=timeout)

    @property
    def own_key(self) -> str:
        assert self.access.api_key is not None
        return self.access.api_key

    @property
    def other_key(self) -> str:
        assert self.access.other_api_key is not None
        return self.access.other_api_key

    def port(self) -> dict[str, Any]:
        """The app's exposed port (``PortInfo`` as JSON: ``url``, ``host_url``), public and
        answering, made on first use."""
        if self._port is None:
            self._port = self._start()
        return self._port

    @property
    def app_sandbox(self) -> str:
        self.port()
        assert self._app_sandbox is not None
        return self._app_sandbox

    def _start(self) -> dict[str, Any]:
        body: dict[str, Any] = {"labels": {"corral-drill": "preview"}, "timeout": 1800}
        if self._isolation:
            body["isolation"] = self._isolation
        with self.client(self.other_key) as api:
            made = api.post("/v1/sandboxes", json=body)
            if made.status_code != 201:
                raise RuntimeError(f"the second tenant could not create the app's sandbox: "
                                   f"{made.status_code} {made.text[:160]}")
            self._app_sandbox = sandbox = str(made.json()["id"])
            for name, data in (("hostileapp.py", _APP.read_bytes()), ("config.json", b"{}")):
                api.put(f"/v1/sandboxes/{sandbox}/files/content",
                        params={"path": f"/workspace/{name}"}, content=data).raise_for_status()
            api.post(f"/v1/sandboxes/{sandbox}/processes", json={
                "cmd": ["python3", "hostileapp.py", str(APP_PORT)]}).raise_for_status()
            exposed = api.post(f"/v1/sandboxes/{sandbox}/ports/{APP_PORT}",
                               json={"public": True})
            exposed.raise_for_status()
        port: dict[str, Any] = exposed.json()
        deadline = time.monotonic() + _TIMEOUT_S
        with httpx.Client(timeout=60) as web:
            while (answer := web.get(f"{port['url']}echo")).status_code != 200:
                if answer.status_code != 502 or time.monotonic() > deadline:
                    raise RuntimeError(f"the app never answered on its port: "
                                       f"{answer.status_code} {answer.text[:160]}")
                time.sleep(0.2)
        return port

    def configure(self, config: Mapping[str, Any]) -> None:
        """What the app's page attacks (``config.json``)."""
        with self.client(self.other_key) as api:
            api.put(f"/v1/sandboxes/{self.app_sandbox}/files/content",
                    params={"path": "/workspace/config.json"},
                    content=json.dumps(dict(config)).encode()).raise_for_status()

    def doomed(self) -> str:
        """A sandbox of the first tenant's that the page tries to destroy."""
        if self._doomed is None:
            with self.client(self.own_key) as api:
                made = api.post("/v1/sandboxes", json={"labels": {"corral-drill": "doomed"}})
                made.raise_for_status()
                self._doomed = str(made.json()["id"])
        return self._doomed

    def alive(self, sandbox_id: str) -> bool:
        with self.client(self.own_key) as api:
            return api.get(f"/v1/sandboxes/{sandbox_id}").status_code == 200

    def commands_in(self, sandbox_id: str) -> int:
        """How many commands the first tenant's sandbox's trail holds."""
        with self.client(self.own_key) as api:
            return api.get(f"/v1/sandboxes/{sandbox_id}/audit",
                           params={"types": "command.started"}).text.count(
                               '"command.started"')

    def session(self, key: str) -> tuple[str, str]:
        """(cookie name, value) of a dashboard session for ``key``, signed in as the
        dashboard signs in."""
        with httpx.Client(base_url=self.access.url, timeout=60) as web:
            answer = web.post("/ui/session", json={"key": key}, headers={"X-Corral-UI": "1"})
        if answer.status_code != 200:
            raise RuntimeError(f"could not sign in to the dashboard: {answer.status_code} "
                               f"{answer.text[:160]}")
        for name, value in answer.cookies.items():
            if name.endswith("corral_session"):
                return name, value
        raise RuntimeError("signing in to the dashboard set no session cookie")

    def host_request(self) -> tuple[str, str] | None:
        """(the service's URL, the Host to send) that reach the app's host URL without DNS,
        when the port has one and it lives on this service's listener."""
        host_url = self.port().get("host_url")
        if not host_url:
            return None
        host = urlsplit(host_url).netloc
        return self.access.url, host

    def close(self) -> None:
        for key, sandbox in ((self.other_key, self._app_sandbox), (self.own_key, self._doomed)):
            if sandbox is not None:
                with contextlib.suppress(httpx.HTTPError), self.client(key) as api:
                    api.delete(f"/v1/sandboxes/{sandbox}")
        self._port = self._app_sandbox = self._doomed = None


def plant_of(preview: PreviewPlant | None) -> PreviewPlant:
    """The context's plant; a case that needs one where there is none cannot run."""
    if preview is None:
        raise RuntimeError("this target has no service with two tenants")
    return preview
