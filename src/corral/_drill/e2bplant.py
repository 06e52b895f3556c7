"""The E2B cases' sandboxes, made through the E2B dialect's API on first use and killed at the
end of the drill; the drill's context holds one (as it holds ``preview.PreviewPlant``)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Literal

import httpx

from .target import ServiceAccess

__all__ = ["TIMEOUT", "E2BPlant", "Which"]

Which = Literal["a", "a2", "b"]
TIMEOUT = 10.0  # no answer on loopback within this is a hang, not a slow server


class E2BPlant:
    """The sandboxes the E2B cases attack, made through the E2B API on first use: two of the
    first tenant (``a``, ``a2``) and one of the second (``b``); and everything a case made."""

    def __init__(self, access: ServiceAccess) -> None:
        assert access.e2b_url is not None
        self.access = access
        self.url = access.e2b_url
        self._named: dict[str, dict[str, Any]] = {}
        self._made: list[tuple[str, str]] = []  # (key, E2B id), killed by ``close``

    def client(self, key: str | None, timeout: float = TIMEOUT) -> httpx.Client:
        headers = {"X-API-KEY": key} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def key(self, which: Literal["a", "b", "ceiling"]) -> str:
        key = {"a": self.access.e2b_api_key, "b": self.access.e2b_other_api_key,
               "ceiling": self.access.e2b_ceiling_api_key}[which]
        if key is None:
            raise RuntimeError(f"the drill was given no E2B key for tenant {which}")
        return key

    def create(self, key: str, body: Mapping[str, Any] | None = None) -> httpx.Response:
        """E2B's create (``POST /v2/sandboxes``); a sandbox it makes is killed at the end."""
        with self.client(key, timeout=60) as api:
            response = api.post("/v2/sandboxes", json={
                "templateID": "base", "timeout": 600, "metadata": {"corral-drill": "e2b"},
                **(body or {})})
        if response.status_code == 201:
            self._made.append((key, str(response.json()["sandboxID"])))
        return response

    def sandbox(self, which: Which) -> dict[str, Any]:
        """The create answer (``sandboxID``, ``envdAccessToken``, ...) of a named sandbox."""
        if which not in self._named:
            response = self.create(self.key("b" if which == "b" else "a"))
            if response.status_code != 201:
                raise RuntimeError(f"tenant {which[0]} could not create a sandbox on the E2B "
                                   f"surface: {response.status_code} {response.text[:160]}")
            self._named[which] = response.json()
        return self._named[which]

    def kill(self, key: str, e2b_id: str) -> int:
        with self.client(key) as api:
            return api.delete(f"/sandboxes/{e2b_id}").status_code

    def close(self) -> None:
        for key, e2b_id in reversed(self._made):
            with contextlib.suppress(httpx.HTTPError):
                self.kill(key, e2b_id)
        self._made.clear()
        self._named.clear()
