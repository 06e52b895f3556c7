"""Credential forwarding: no Corral cookie, key or token reaches an app in a sandbox through any
relay (the port proxy, the E2B surface, the cluster gateway, the microVM keeper)."""

from __future__ import annotations

from ..model import Case

CASES: list[Case] = []
