"""Per-sandbox access tokens of the E2B surface, derived rather than stored.

``envdAccessToken`` opens a sandbox's envd (commands, files); ``trafficAccessToken`` its code
interpreter. Both are an HMAC of the sandbox id under a secret kept in the data directory, so a
token is the same after a restart (``connect`` returns it again), a token of sandbox A can never
open sandbox B, and nothing per sandbox needs storing or cleaning up.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
from pathlib import Path

__all__ = ["SandboxTokens"]

_SECRET_FILE = "e2b-token.secret"


class SandboxTokens:
    def __init__(self, home: Path) -> None:
        self._secret = _load_or_create(home / _SECRET_FILE)

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


def _load_or_create(path: Path) -> bytes:
    with contextlib.suppress(FileNotFoundError):
        secret = path.read_bytes()
        if len(secret) == 32:
            return secret
        raise OSError(f"{path} is damaged (expected 32 bytes); remove it to issue new tokens")
    # Written under a temporary name and linked into place, so two processes starting at once
    # agree on one secret (the loser of the link reads the winner's).
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_bytes(32))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_bytes()
