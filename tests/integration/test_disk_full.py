"""The disk-full matrix (issue 36): a data directory on a small loop-mounted filesystem of its
own, filled to the last block by a file beside it; then every operation either works or is
refused as ``DiskFullError`` (HTTP 507) with nothing changed, every delete works, nothing is
corrupted, and once the file is gone everything works again. Failpoints with the ``enospc``
action put the full disk at each step of a seal and a restore too. Namespace and gVisor tiers.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral._control.manager import Manager
from corral._core import failpoints
from corral._core.failpoints import NAMES
from corral.errors import DiskFullError

from ..conftest import managed, private_settings
from .conftest import host_tier
from .servers import Server

pytestmark = pytest.mark.needs_root

SIZE = "700M"  # room for a few sparse workspaces and the store; small enough to fill fast


@pytest.fixture(scope="module", params=["namespace", "gvisor"])
def plane(request: pytest.FixtureRequest) -> Iterator[tuple[Manager, str]]:
    tier = host_tier(request)
    scratch = Path(tempfile.mkdtemp(prefix="corral-test-full-"))
    scratch.chmod(0o711)  # sandboxes reach their workspaces through it
    image, point = scratch / "fs.img", scratch / "mnt"
    point.mkdir()
    subprocess.run(["truncate", "-s", SIZE, str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(point)], check=True)
    point.chmod(0o711)
    try:
        with private_settings("corral-test-full-home-") as base:
            settings = base.model_copy(update={"home": point / "home"})
            with managed(settings) as mgr:
                yield mgr, tier
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def full(mgr: Manager) -> Iterator[None]:
    """The data directory's disk filled to its last block (by root, so no reserve is left)."""
    filler = mgr.settings.home.parent / f"filler-{secrets.token_hex(4)}"
    with open(filler, "wb", buffering=0) as f:
        for _ in range(100_000):  # bounded: 100 GB at most, far above the filesystem
            try:
                f.write(b"\0" * (1 << 20))
            except OSError:
                break
        with contextlib.suppress(OSError):
            os.fsync(f.fileno())
    # What the first pass left: the blocks a smaller write still fits in.
    with open(filler, "ab", buffering=0) as f:
        for size in (1 << 16, 1 << 12, 1):
            for _ in range(10_000):
                try:
                    f.write(b"\0" * size)
                    os.fsync(f.fileno())
                except OSError:
                    break
    try:
        yield
    finally:
        filler.unlink()


def _refused_or_done(call: Callable[[], Any]) -> str:
    try:
        call()
    except DiskFullError as exc:
        assert "full" in exc.message and exc.status == 507, exc.message
        return "refused"
    return "done"


def test_on_a_full_disk_each_operation_is_refused_cleanly_and_deletes_work(
        plane: tuple[Manager, str]) -> None:
    mgr, tier = plane
    sb = mgr.create(isolation=tier, timeout=1800)
    doomed = mgr.create(isolation=tier, timeout=1800)
    mgr.files(sb.id).write("before.txt", b"written before the disk filled")
    snap = mgr.snapshot(sb.id)
    doomed_snap = mgr.snapshot(doomed.id)
    layers_before = mgr.store.layer_ids()
    outcomes: dict[str, str] = {}
    with full(mgr):
        outcomes["create"] = _refused_or_done(lambda: mgr.create(isolation=tier, timeout=600))
        outcomes["snapshot"] = _refused_or_done(lambda: mgr.snapshot(sb.id))
        outcomes["fork"] = _refused_or_done(lambda: mgr.fork(sb.id, 1))
        outcomes["restore"] = _refused_or_done(lambda: mgr.restore(sb.id, snap.id))
        # Nothing the refusals touched changed: the sandbox reads as before, and runs (or,
        # where starting its runtime writes to the disk, gVisor's, is refused cleanly too).
        assert mgr.files(sb.id).read("before.txt") == b"written before the disk filled"
        outcomes["run"] = _refused_or_done(
            lambda: mgr.run(sb.id, "cat /workspace/before.txt", timeout=60))
        assert mgr.store.intents() == []
        # Deletes free space, and work on a full disk.
        mgr.destroy(doomed.id)
        mgr.delete_snapshot(doomed_snap.id)
        # Over HTTP the refusal is 507 with the error's code.
        with Server(mgr) as server:
            answer = httpx.post(f"{server.url}/v1/sandboxes", json={"isolation": tier},
                                timeout=120)
        if answer.status_code != 201:
            assert answer.status_code == 507, answer.text
            assert answer.json()["error"] == "insufficient_storage"
    assert outcomes["create"] == "refused" and outcomes["snapshot"] == "refused"
    assert outcomes["restore"] == "refused" and outcomes["fork"] == "refused", outcomes
    # Space again: everything works, and nothing was lost or left over.
    assert mgr.store.layer_ids() <= layers_before
    assert mgr.files(sb.id).read("before.txt") == b"written before the disk filled"
    mgr.restore(sb.id, snap.id)
    mgr.files(sb.id).write("after.txt", b"after")
    child = mgr.fork(sb.id, 1)[0]
    assert mgr.files(child.id).read("after.txt") == b"after"
    for info in mgr.store.list():
        mgr.destroy(info.id)
    for leftover in mgr.list_snapshots():
        mgr.delete_snapshot(leftover.id)


@pytest.mark.parametrize("point", [*NAMES["seal"][1:-1], *NAMES["restore"][1:]])
def test_a_full_disk_at_each_step_leaves_the_sandbox_whole(
        plane: tuple[Manager, str], point: str) -> None:
    mgr, tier = plane
    sb = mgr.create(isolation=tier, timeout=1800)
    try:
        mgr.files(sb.id).write("kept.txt", b"kept")
        snap = mgr.snapshot(sb.id)
        mgr.files(sb.id).write("acked.txt", b"acknowledged")
        failpoints.arm(point, "enospc")
        try:
            with pytest.raises(DiskFullError):
                if point.startswith("restore"):
                    mgr.restore(sb.id, snap.id)
                else:
                    mgr.snapshot(sb.id)
        finally:
            failpoints.disarm()
        assert mgr.store.intents() == []
        files = mgr.files(sb.id)
        assert files.read("kept.txt") == b"kept"
        # A seal is undone or done whole: the acknowledged file is there either way. A
        # restore is always finished once begun, except when refused before its first step.
        if point.startswith("seal"):
            assert files.read("acked.txt") == b"acknowledged"
        assert mgr.run(sb.id, "ls /workspace", timeout=60).exit_code == 0
        again = mgr.snapshot(sb.id)
        assert mgr.files(mgr.create(snapshot=again.id, isolation=tier).id).read(
            "kept.txt") == b"kept"
    finally:
        for info in mgr.store.list():
            mgr.destroy(info.id)
        for leftover in mgr.list_snapshots():
            mgr.delete_snapshot(leftover.id)
