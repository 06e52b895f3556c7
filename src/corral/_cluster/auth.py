"""The Ray cluster must be private: Corral refuses to join one without token authentication.

A Ray cluster without it runs any job anyone who reaches its ports submits, as root on every
node here (Corral's nodes must be root to make sandboxes). Ray 2.52+ enforces a shared token on
every RPC and HTTP entry point when ``RAY_AUTH_MODE=token``; the token comes from
``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or Ray's default token file. The check runs in the
gateway (its own connection) and again in every node agent (the environment its raylet gave
it), so a node started without the setting refuses instead of serving.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import ConfigError

__all__ = ["ALLOW_NO_AUTH_ENV", "require_token_auth"]

#: TEST ONLY, and loud about it: join a Ray cluster that has no token authentication.
ALLOW_NO_AUTH_ENV = "CORRAL_CLUSTER_ALLOW_NO_AUTH"


def require_token_auth(where: str, env: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError unless Ray token authentication is on in ``env`` (default: ours)."""
    env = os.environ if env is None else env
    if env.get(ALLOW_NO_AUTH_ENV) == "1":
        return
    mode = env.get("RAY_AUTH_MODE", "disabled")
    if mode != "token":
        raise ConfigError(
            f"{where} runs Ray without token authentication (RAY_AUTH_MODE={mode!r}): anyone "
            "who reaches the cluster's ports could run code as root on every node. Start every "
            "node with RAY_AUTH_MODE=token and the same token (RAY_AUTH_TOKEN, "
            f"RAY_AUTH_TOKEN_PATH or `ray get-auth-token --generate`); {ALLOW_NO_AUTH_ENV}=1 "
            "overrides this for a throw-away test cluster only")
