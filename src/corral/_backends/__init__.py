"""Isolation backends, one module per tier, loaded lazily by name."""

from __future__ import annotations

import importlib

from .._settings import Settings
from ..backends import BackendName, IsolationBackend
from ..errors import ConfigError

__all__ = ["BACKENDS", "load_backend"]

BACKENDS: dict[BackendName, str] = {
    "namespace": "corral._backends.namespace:NamespaceBackend",
}


def load_backend(settings: Settings) -> IsolationBackend:
    """Import and build the backend named by ``settings.backend``."""
    target = BACKENDS.get(settings.backend)
    if target is None:
        raise ConfigError(
            f"unknown backend {settings.backend!r}; choose one of: {', '.join(BACKENDS)}"
        )
    module_name, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    backend: IsolationBackend = cls(settings)
    return backend
