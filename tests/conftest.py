"""Shared fixtures. Integration tests run as root against real namespaces, cgroups and mounts,
each session in its own data directory and uid range, and must leave nothing behind."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.id_generator import IdGenerator

from corral._control.manager import Manager
from corral._settings import Settings

# The longest files' halves (measured: ``--durations`` in CI's log), so the two halves of the
# rest take about as long; every other file goes by a hash of its path. The cluster's files
# share one half: each starts a Ray cluster, and one at a time is enough for 2 cores.
_HALF_OF = {
    "tests/integration/test_drill.py": 0, "tests/conformance/test_sdk.py": 0,
    "tests/integration/test_cluster_serve.py": 0, "tests/integration/test_cluster.py": 0,
    "tests/integration/test_templates.py": 1, "tests/integration/test_code_interpreter.py": 1,
    "tests/integration/test_gvisor.py": 1, "tests/integration/test_snapshot_surfaces.py": 0,
    "tests/integration/test_ports_volumes_cli.py": 1, "tests/integration/test_service.py": 1,
    "tests/integration/test_cli.py": 1,
}


# The sessions scripts/test runs side by side: each draws its uid ranges from its own slots.
_UID_SLOTS = {"microvm": 1, "rest-a": 2, "rest-b": 3}


def _partition_of(item: pytest.Item) -> str:
    if "microvm" in item.nodeid:
        return "microvm"
    path = item.nodeid.split("::", 1)[0]
    half = _HALF_OF.get(path, zlib.crc32(path.encode()) % 2)
    return f"rest-{'ab'[half]}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # scripts/test runs the suite in three sessions at once: CORRAL_TEST_PARTITION=microvm
    # keeps only the microVM cases, =rest-a and =rest-b each half of the others (=rest: all
    # of the others).
    partition = os.environ.get("CORRAL_TEST_PARTITION")
    if partition in ("microvm", "rest", "rest-a", "rest-b"):
        def wanted(item: pytest.Item) -> bool:
            mine = _partition_of(item)
            return mine == partition or (partition == "rest" and mine != "microvm")

        keep = [item for item in items if wanted(item)]
        dropped = [item for item in items if not wanted(item)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    # The microVM cases last: their guest kernel may still be building in the background
    # (scripts/bootstrap --test), and the rest of the suite runs meanwhile.
    items.sort(key=lambda item: "microvm" in item.nodeid)
    if any("microvm" in item.nodeid for item in items):
        from corral._backends.microvm.prepare import preparing, wait_for_prepare

        cache = Settings().microvm_cache
        if preparing(cache):
            # Here, not in a fixture: a per-test timeout must not cut the wait short.
            print("\nwaiting for the microVM guest kernel's background build ...", flush=True)
            wait_for_prepare(cache, timeout_s=1500)
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root: sandboxes need namespaces, cgroups and mounts")
    for item in items:
        if "needs_root" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def settings() -> Iterator[Settings]:
    home = Path(tempfile.mkdtemp(prefix="corral-test-"))
    # A uid range of our own, so a test run never shares uids with a real instance.
    # secrets, not the global `random`: Hypothesis owns that one's state while it generates.
    # Sessions run side by side (scripts/test) take slots of their own: never the same range.
    slot = _UID_SLOTS.get(os.environ.get("CORRAL_TEST_PARTITION", ""), 0)
    start = 2_100_000_000 + (secrets.randbelow(250) * 4 + slot) * 10_000
    yield Settings(home=home, uid_start=start, uid_count=10_000)
    shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def private_settings(prefix: str, **overrides: object) -> Iterator[Settings]:
    """Settings for a module's own service: a data directory (0711, removed after) and 1000 uids
    no other module of any session running beside this one draws (each session of scripts/test
    takes its own slot, as ``settings`` does; within a session, modules run one at a time)."""
    home = Path(tempfile.mkdtemp(prefix=prefix))
    home.chmod(0o711)
    slot = _UID_SLOTS.get(os.environ.get("CORRAL_TEST_PARTITION", ""), 0)
    # Below 2**31 - 1000: the gVisor tier runs a sandbox's kernel as its uid + 2**31.
    start = 2_115_000_000 + (secrets.randbelow(500) * 4 + slot) * 1000
    try:
        yield Settings.model_validate({"home": home, "uid_start": start, "uid_count": 1000,
                                       **overrides})
    finally:
        shutil.rmtree(home, ignore_errors=True)


class PrivateIds(IdGenerator):
    """Span and trace ids for a test's TracerProvider, from ``secrets``.

    The SDK's default draws them from the global ``random``, and spans are made on the service's
    threads while Hypothesis generates on the main one: it sees the global state move under its
    strategies and fails the run (HypothesisDeprecationWarning, an error here).
    """

    def generate_span_id(self) -> int:
        return secrets.randbits(64) or 1

    def generate_trace_id(self) -> int:
        return secrets.randbits(128) or 1


@contextlib.contextmanager
def managed(settings: Settings) -> Iterator[Manager]:
    """A manager for ``settings`` that leaves nothing behind when the block ends."""
    from corral._control import manager as manager_mod

    mgr = manager_mod.get_manager(settings)
    try:
        yield mgr
    finally:
        for info in mgr.store.list():
            mgr._destroy(info, reason="cleanup")
        for snap in mgr.list_snapshots():
            mgr.delete_snapshot(snap.id)
        for volume in mgr.volumes.list():  # unmounts them too: a test's home is removed next
            mgr.volumes.delete(volume.id)
        mgr.backend.sweep(set())
        mgr.backend.remove_instance()  # type: ignore[attr-defined]
        mgr.close()
        manager_mod._managers.pop(settings.home, None)


@pytest.fixture(scope="session")
def manager(settings: Settings) -> Iterator[Manager]:
    with managed(settings) as mgr:
        yield mgr


@pytest.fixture
def home(settings: Settings, manager: Manager) -> str:
    """The data directory to pass as ``home=`` to ``Sandbox`` calls."""
    return str(settings.home)


@pytest.fixture
def sandbox(home: str) -> Iterator[object]:
    from corral import Sandbox

    sb = Sandbox.create(home=home)
    yield sb
    sb.kill()
