"""Which install this is: the base (client) install has no host parts, and a call that needs
them says so instead of failing with an import error deep inside."""

from __future__ import annotations

from ..errors import ConfigError

__all__ = ["HOST_MODULES", "host_install_needed"]

# The top-level modules of `corral[host]`'s dependencies (pyproject.toml) that the client lacks.
HOST_MODULES = frozenset({
    "rich", "pyseccomp", "prometheus_client", "opentelemetry", "cryptography", "uvloop",
    "fastapi", "starlette", "uvicorn", "dockerfile_parse", "websockets", "mcp"})


def host_install_needed(exc: ModuleNotFoundError, what: str) -> ConfigError | None:
    """The error to raise for ``exc`` when it is a host part missing from a client install
    (None for any other missing module, which is a bug to show as it is)."""
    if (exc.name or "").partition(".")[0] not in HOST_MODULES:
        return None
    return ConfigError(
        f"{what} runs sandboxes on this machine, which needs the host install "
        f"(`pip install 'corral[host]'`, then `corral setup` as root); this one is the client "
        f"(it lacks {exc.name}). To use a Corral service instead, set CORRAL_URL (and "
        "CORRAL_API_KEY) to it")
