"""The unit tests' fixtures: a whole control plane without root, on the in-memory backend.

``manager`` here stands in for tests/conftest.py's session-wide one (a real backend, root): a
unit test gets a fresh control plane of its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from corral._control.plane import Manager
from corral.testing import memory_manager
from corral.testing.backend import MemoryBackend


@pytest.fixture
def manager_backend() -> MemoryBackend | None:
    """The backend ``manager`` runs on: ``None`` for a plain ``MemoryBackend``. A module whose
    tests need a backend that fails or behaves otherwise overrides this fixture."""
    return None


@pytest.fixture
def manager(tmp_path: Path, manager_backend: MemoryBackend | None) -> Iterator[Manager]:
    """A control plane in ``tmp_path / "home"`` (the test's own files can sit beside it)."""
    mgr = memory_manager(tmp_path / "home", backend=manager_backend)
    yield mgr
    # Every stored sandbox, whatever its state or owner, and without the public path's
    # checks: a test may leave one half-made or refused.
    for info in mgr.store.list():
        mgr._destroy(info, reason="cleanup")
    mgr.close()
