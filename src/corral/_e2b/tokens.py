"""Per-sandbox access tokens of the E2B surface, derived rather than stored.

``envdAccessToken`` opens a sandbox's envd (commands, files); ``trafficAccessToken`` its code
interpreter. Both are an HMAC of the sandbox id under a secret kept in the data directory, so a
token is the same after a restart (``connect`` returns it again), a token of sandbox A can never
open sandbox B, and nothing per sandbox needs storing or cleaning up.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from .._core.secretfile import load_or_create_secret

__all__ = ["SandboxTokens"]

_SECRET_FILE = "e2b-token.secret"


class SandboxTokens:
    def __init__(self, home: Path) -> None:
        self._secret = load_or_create_secret(home / _SECRET_FILE)

    def envd(self, sandbox_id: str) -> str:
        return self._derive("envd", sandbox_id)

    def traffic(self, sandbox_id: str) -> str:
        return self._derive("traffic", sandbox_id)

    def _derive(self, purpose: str, sandbox_id: str) -> str:
        mac = hmac.new(self._secret, f"{purpose}\0{sandbox_id}".encode(), hashlib.sha256)
        return mac.hexdigest()[:48]

    def check_envd(self, sandbox_id: str, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(
            presented.encode(), self.envd(sandbox_id).encode())

    def check_traffic(self, sandbox_id: str, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(
            presented.encode(), self.traffic(sandbox_id).encode())
