"""Isolation backends, one module per tier, loaded lazily by name.

Importing this package costs nothing (no settings, no pydantic): the microVM tier's keeper, a
process of its own per VM, imports modules under it and must start in milliseconds.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._settings import Settings
    from ..backends import BackendName, IsolationBackend

__all__ = ["BACKENDS", "load_backend"]

BACKENDS: dict[BackendName, str] = {
    "namespace": "corral._backends.namespace:NamespaceBackend",
    "gvisor": "corral._backends.gvisor:GvisorBackend",
}


def load_backend(settings: Settings, name: str | None = None) -> IsolationBackend:
    """Import and build the backend ``name`` (default: ``settings.backend``)."""
    from ..errors import BackendUnavailable, ConfigError

    name = settings.backend if name is None else name
    target = BACKENDS.get(name)  # type: ignore[call-overload]
    if target is None:
        raise ConfigError(
            f"unknown isolation tier {name!r}; choose one of: {', '.join(BACKENDS)}"
        )
    module_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise BackendUnavailable(
            f"the {name} isolation tier is not available in this installation: {exc}") from exc
    backend: IsolationBackend = cls(settings)
    return backend
