"""The crash matrix (issue 36): a process that snapshots, forks or restores a sandbox is killed
(SIGKILL) at each failpoint of the operation (``corral._core.failpoints``), right after it wrote
a file and was told so; then a new start recovers, and every acknowledged byte is there, the
interrupted operation is done or undone and said so in the sandbox's trail, nothing is left over
(layer, mount, intent), and the sandbox works on: namespace and gVisor tiers.

Each case runs the operation in a child process of its own over the module's data directory, as
``corral serve`` or a CLI call would; this process's control plane plays "the next start".
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral._backends._linux.storage import MAX_LAYERS
from corral._control.manager import Manager
from corral._core.failpoints import NAMES

from ..conftest import managed, private_settings
from .conftest import host_tier

pytestmark = pytest.mark.needs_root

# The child: write a file (the acknowledged byte), arm the failpoint, run the operation.
CHILD = r"""
import sys
from corral._control.manager import Manager
from corral._core import failpoints
from corral._settings import Settings

home, uid_start, tier, sandbox_id, operation, point, snapshot = sys.argv[1:]
mgr = Manager(Settings(home=home, uid_start=int(uid_start), uid_count=1000))
mgr.files(sandbox_id).write("acked.txt", f"acknowledged before {point}".encode())
print("acked", flush=True)
failpoints.arm(point)
if operation in ("snapshot", "squash"):
    mgr.snapshot(sandbox_id)
elif operation == "fork":
    mgr.fork(sandbox_id, 1)
else:
    mgr.restore(sandbox_id, snapshot)
print("survived", flush=True)
"""

SEAL = NAMES["seal"]
CASES = ([("snapshot", point) for point in (*SEAL, *NAMES["snapshot"])]
         + [("fork", point) for point in (*SEAL, *NAMES["fork"])]
         + [("restore", point) for point in NAMES["restore"]]
         # A seal at the deepest chain squashes it (a copy, not a move): its own steps.
         + [("squash", point) for point in ("seal.layer-made", "seal.moved", "seal.marked",
                                            "seal.new-upper")])


@pytest.fixture(scope="module", params=["namespace", "gvisor"])
def plane(request: pytest.FixtureRequest) -> Iterator[tuple[Manager, str]]:
    tier = host_tier(request)
    with private_settings("corral-test-crash-") as settings, managed(settings) as mgr:
        yield mgr, tier


def _crash(mgr: Manager, tier: str, sandbox_id: str, operation: str, point: str,
           snapshot: str = "") -> None:
    settings = mgr.settings
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(settings.home), str(settings.uid_start), tier,
         sandbox_id, operation, point, snapshot],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")})
    assert child.stdout.startswith("acked"), child.stderr[-2000:]
    assert child.returncode == -9, (child.returncode, child.stdout, child.stderr[-2000:])


def _mounts_under(home: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p.startswith(str(home) + "/")]


def _leftovers(mgr: Manager) -> list[str]:
    """Layers, mounts and intents the store does not account for."""
    home = mgr.settings.home
    known_layers = mgr.store.layer_ids()
    live = {info.id for info in mgr.store.list()}
    found = [f"intent {i['id']} ({i['kind']})" for i in mgr.store.intents()]
    layers_dir = home / "layers"
    if layers_dir.is_dir():
        found += [f"layer {p.name}" for p in layers_dir.iterdir()
                  if not p.name.startswith(".") and p.name not in known_layers]
    for point in _mounts_under(home):
        parts = Path(point).relative_to(home).parts
        if parts[0] == "sandboxes" and len(parts) > 1 and not parts[1].startswith(".") \
                and parts[1] not in live:
            found.append(f"mount {point}")
        if parts[0] == "layers" and len(parts) > 1 and parts[1] not in known_layers:
            found.append(f"mount {point}")
    return found


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("operation", "point"), CASES)
def test_a_crash_at_each_step_loses_nothing_acknowledged(
        plane: tuple[Manager, str], operation: str, point: str) -> None:
    mgr, tier = plane
    info = mgr.create(isolation=tier, timeout=1800)
    try:
        snapshot = ""
        if operation == "restore":
            mgr.files(info.id).write("snapped.txt", b"in the snapshot")
            snapshot = mgr.snapshot(info.id).id
        if operation == "squash":  # the chain at its deepest: the next seal squashes it
            for depth in range(MAX_LAYERS):
                mgr.files(info.id).write(f"layer-{depth}.txt", str(depth).encode())
                mgr.snapshot(info.id)
        snapshots_before = {s.id for s in mgr.list_snapshots()}
        _crash(mgr, tier, info.id, operation, point, snapshot)
        mgr.recover()  # the next start

        assert _leftovers(mgr) == []
        assert mgr.get(info.id).state == "running"
        files = mgr.files(info.id)
        if operation == "restore":  # begun, a restore is finished: the snapshot's state
            assert files.read("snapped.txt") == b"in the snapshot"
            assert not files.exists("acked.txt")
        else:
            assert files.read("acked.txt") == f"acknowledged before {point}".encode()
        if operation == "squash":  # every layer's files, squashed or not
            assert [files.read(f"layer-{d}.txt") for d in range(MAX_LAYERS)] == [
                str(d).encode() for d in range(MAX_LAYERS)]
        # Whatever the store says the sandbox stands on is what it sees, and it works on.
        run = mgr.run(info.id, "cat /workspace/*.txt && echo ok", timeout=60)
        assert run.exit_code == 0 and run.stdout.endswith("ok\n"), run
        # The operation is done or undone, and the trail says which when it had begun.
        events = [e.type for e in mgr.auditor.trail(info.id).events]
        recovered = {"recovery.rolled_forward", "recovery.rolled_back"} & set(events)
        closed_before_crash = point in ("seal.recorded", "snapshot.sealed", "fork.sealed",
                                        "fork.child-made")
        assert bool(recovered) != closed_before_crash, events
        new = [s for s in mgr.list_snapshots() if s.id not in snapshots_before]
        assert new == []  # the crash came before the snapshot was recorded: never made
        # A snapshot and a fork of it now keep the acknowledged file, as any would.
        if operation != "restore":
            later = mgr.snapshot(info.id)
            child = mgr.create(snapshot=later.id, isolation=tier, timeout=600)
            try:
                assert mgr.files(child.id).read("acked.txt") == \
                    f"acknowledged before {point}".encode()
            finally:
                mgr.destroy(child.id)
    finally:
        for other in mgr.store.list():  # the sandbox, and a fork's child a crash left whole
            mgr.destroy(other.id)
        for snap in mgr.list_snapshots():
            mgr.delete_snapshot(snap.id)
    assert _leftovers(mgr) == []


VOLUME_CHILD = r"""
import sys
from corral._control.manager import Manager
from corral._core import failpoints
from corral._settings import Settings

home, uid_start, operation, point, name = sys.argv[1:]
mgr = Manager(Settings(home=home, uid_start=int(uid_start), uid_count=1000))
print("acked", flush=True)
failpoints.arm(point)
if operation == "create":
    mgr.volumes.create(name, "16M")
else:
    mgr.volumes.delete(name)
print("survived", flush=True)
"""

VOLUME_CASES = ([("create", point) for point in NAMES["volume create"]]
                + [("delete", point) for point in NAMES["volume delete"]])


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("operation", "point"), VOLUME_CASES)
def test_a_crash_in_a_volume_operation_is_undone_or_finished(
        operation: str, point: str) -> None:
    """A volume create cut short is rolled back (it was never acknowledged), a delete cut
    short finished; the volume acknowledged before is untouched, and no intent, record or
    image is left over."""
    with private_settings("corral-test-crash-vol-") as settings, managed(settings) as mgr:
        kept = mgr.volumes.create("kept", "16M")
        if operation == "delete":
            mgr.volumes.create("doomed", "16M")
        name = "fresh" if operation == "create" else "doomed"
        child = subprocess.run(
            [sys.executable, "-c", VOLUME_CHILD, str(settings.home), str(settings.uid_start),
             operation, point, name], capture_output=True, text=True, timeout=300,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")})
        assert child.returncode == -9, (child.returncode, child.stdout, child.stderr[-2000:])
        said = mgr.recover()  # the next start
        # Killed before its first step, a delete changed nothing: the volume stays, whole.
        untouched = point == "volume.delete.intent"
        names = {v.name for v in mgr.volumes.list()}
        assert names == ({"kept", "doomed"} if untouched else {"kept"}), (names, said)
        storage = mgr.volumes._storage()
        assert sorted(storage.volume_ids()) == sorted(v.id for v in mgr.volumes.list())
        if untouched:
            mgr.volumes.delete("doomed")
        assert [i for i in mgr.store.intents()] == []
        if point not in ("volume.create.intent", "volume.delete.intent"):
            assert any(name in item or "volume" in item for item in said), said
        # And the name is free again: made and deleted as usual.
        again = mgr.volumes.create(name, "16M")
        mgr.volumes.delete(again.id)
        mgr.volumes.delete(kept.id)


HIBERNATE_CHILD = r"""
import sys
from corral._control.manager import Manager
from corral._core import failpoints
from corral._settings import Settings

home, uid_start, sandbox_id, point = sys.argv[1:]
mgr = Manager(Settings(home=home, uid_start=int(uid_start), uid_count=1000))
run = mgr.run(sandbox_id, f"echo 'in /tmp before {point}' > /tmp/acked.txt", timeout=60)
assert run.exit_code == 0, run
mgr.files(sandbox_id).write("acked.txt", f"acknowledged before {point}".encode())
print("acked", flush=True)
failpoints.arm(point)
mgr.hibernate(sandbox_id)
print("survived", flush=True)
"""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("point", NAMES["hibernate"])
def test_a_crash_in_a_hibernate_loses_nothing(plane: tuple[Manager, str], point: str) -> None:
    """Killed before its tier released anything, a hibernate is undone (the sandbox paused,
    whole); killed after, finished (hibernated, nothing of it left mounted). Either way the
    trail says which, and the wake finds its workspace and its /tmp."""
    mgr, tier = plane
    info = mgr.create(isolation=tier, timeout=1800)
    try:
        child = subprocess.run(
            [sys.executable, "-c", HIBERNATE_CHILD, str(mgr.settings.home),
             str(mgr.settings.uid_start), info.id, point], capture_output=True, text=True,
            timeout=600,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")})
        assert child.stdout.startswith("acked"), child.stderr[-2000:]
        assert child.returncode == -9, (child.returncode, child.stdout, child.stderr[-2000:])
        said = mgr.recover()  # the next start
        assert _leftovers(mgr) == []
        finished = point == "hibernate.released"
        assert mgr.get(info.id).state == ("hibernated" if finished else "paused"), said
        if finished:  # nothing of it is mounted any more
            sandbox_dir = str(mgr.settings.home / "sandboxes" / info.id)
            assert [p for p in _mounts_under(mgr.settings.home)
                    if p.startswith(sandbox_dir + "/") or p == sandbox_dir] == []
        events = [e.type for e in mgr.auditor.trail(info.id).events]
        assert ("recovery.rolled_forward" if finished else "recovery.rolled_back") in events, \
            (events, said)
        mgr.resume(info.id)
        run = mgr.run(info.id, "cat /tmp/acked.txt /workspace/acked.txt", timeout=60)
        assert run.exit_code == 0, run
        assert run.stdout == (f"in /tmp before {point}\n"
                              f"acknowledged before {point}"), run
        # And it hibernates and wakes as any other.
        assert mgr.hibernate(info.id).state == "hibernated"
        assert mgr.resume(info.id).state == "running"
        assert mgr.run(info.id, "cat /tmp/acked.txt", timeout=60).stdout == \
            f"in /tmp before {point}\n"
    finally:
        mgr.destroy(info.id)
    assert _leftovers(mgr) == []


PAUSED_CHILD = r"""
import os, signal, sys
from corral._control.manager import Manager
from corral._settings import Settings

home, uid_start, sandbox_id = sys.argv[1:]
mgr = Manager(Settings(home=home, uid_start=int(uid_start), uid_count=1000))
assert mgr.run(sandbox_id, "echo 'before the pause' > /tmp/kept.txt", timeout=60).exit_code == 0
mgr.pause(sandbox_id)
print("paused", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(600)
def test_a_process_killed_with_a_sandbox_it_paused_is_recovered(
        plane: tuple[Manager, str]) -> None:
    """The process that ran a sandbox's commands (its resident, on gVisor) paused it and was
    killed: the next start's sweep cannot kill that process's frozen groups, and must not stop
    there (it once raised, and every later step of the recovery was skipped). They go once
    the sandbox wakes."""
    mgr, tier = plane
    info = mgr.create(isolation=tier, timeout=1800)
    try:
        child = subprocess.run(
            [sys.executable, "-c", PAUSED_CHILD, str(mgr.settings.home),
             str(mgr.settings.uid_start), info.id], capture_output=True, text=True, timeout=300,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")})
        assert child.stdout.startswith("paused"), child.stderr[-2000:]
        assert child.returncode == -9, (child.returncode, child.stderr[-2000:])
        mgr.recover()  # the next start: raises nothing
        assert mgr.get(info.id).state == "paused"
        mgr.resume(info.id)
        run = mgr.run(info.id, "cat /tmp/kept.txt", timeout=60)
        assert (run.exit_code, run.stdout) == (0, "before the pause\n"), run
        mgr.recover()  # awake now: the dead process's groups go
        driver = mgr.sandboxes.backend(mgr.sandboxes.get(info.id)).cgroups  # type: ignore[attr-defined]
        # Command groups are named c.<owner pid>.<start>.<id>: none is the dead child's.
        assert [g for g in driver.children(info.id)
                if g.startswith("c.") and not g.startswith(f"c.{os.getpid()}.")] == []
    finally:
        mgr.destroy(info.id)
    assert _leftovers(mgr) == []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("point", ["hibernate.archived", "hibernate.released"])
def test_a_hibernate_that_fails_in_its_process_is_settled_there(
        plane: tuple[Manager, str], point: str) -> None:
    """An error (not a crash) inside a hibernate: before its tier released anything, the
    sandbox is put back as it was (running) and the error told; after, the hibernate is
    finished. No intent is left open either way."""
    from corral._core import failpoints

    mgr, tier = plane
    info = mgr.create(isolation=tier, timeout=1800)
    try:
        assert mgr.run(info.id, "echo kept > /tmp/kept.txt", timeout=60).exit_code == 0
        failpoints.arm(point, "eio")
        try:
            if point == "hibernate.archived":
                with pytest.raises(OSError, match="failpoint hibernate.archived"):
                    mgr.hibernate(info.id)
                assert mgr.get(info.id).state == "running"
            else:
                assert mgr.hibernate(info.id).state == "hibernated"
        finally:
            failpoints.disarm()
        assert mgr.store.intents(info.id) == []
        mgr.resume(info.id)
        assert mgr.run(info.id, "cat /tmp/kept.txt", timeout=60).stdout == "kept\n"
    finally:
        mgr.destroy(info.id)
    assert _leftovers(mgr) == []
