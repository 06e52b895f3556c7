"""The isolation backends of one control plane, one per tier, loaded on first use."""

from __future__ import annotations

import threading

from .._backends import BACKENDS, load_backend
from .._settings import Settings
from ..backends import IsolationBackend
from ..errors import UsageError

__all__ = ["BackendRegistry"]


class BackendRegistry:
    """The default tier's backend, loaded now; any other tier's when first asked for."""

    def __init__(self, settings: Settings, *, default: IsolationBackend | None = None) -> None:
        self._settings = settings
        self.default: IsolationBackend = default or load_backend(settings)
        self.loaded: dict[str, IsolationBackend] = {self.default.name: self.default}
        # Its own lock: recovery loads backends while it holds the recovery lock.
        self._lock = threading.Lock()

    def get(self, isolation: str) -> IsolationBackend:
        """The backend of tier ``isolation``; ``UsageError`` for a tier this build lacks."""
        backend = self.loaded.get(isolation)
        if backend is None:
            if isolation not in BACKENDS:
                raise UsageError(f"unknown isolation tier {isolation!r}; choose one of: "
                                 f"{', '.join(BACKENDS)}")
            with self._lock:
                backend = self.loaded.get(isolation)
                if backend is None:
                    backend = self.loaded[isolation] = load_backend(self._settings, isolation)
        return backend

    def all(self) -> list[IsolationBackend]:
        return list(self.loaded.values())

    def close(self) -> None:
        for backend in self.all():
            backend.close()
