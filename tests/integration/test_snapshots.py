"""Snapshots, forks and restore on real overlay layers, loop-mounted images and idmapped mounts.

Workspace state is compared by a tree hash computed inside the sandbox (paths, types, modes,
sizes, contents, link targets), so "exact" means exact as the sandboxed code sees it.
"""

from __future__ import annotations

import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import (
    QuotaExceeded,
    Sandbox,
    SandboxBusy,
    SnapshotInUse,
    SnapshotNotFound,
    UsageError,
)
from corral._backends._linux.storage import MAX_LAYERS
from corral._control.manager import Manager

pytestmark = pytest.mark.needs_root

MiB = 1024 * 1024

TREE_HASH = textwrap.dedent("""
    import hashlib, os, stat, sys
    h = hashlib.sha256()
    root = "/workspace"
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            h.update(f"{os.path.relpath(p, root)}|{stat.S_IFMT(st.st_mode)}|"
                     f"{stat.S_IMODE(st.st_mode):o}|{st.st_uid}".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(p).encode())
            elif stat.S_ISREG(st.st_mode):
                h.update(str(st.st_size).encode())
                with open(p, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    print(h.hexdigest())
""")

POPULATE = """
set -e
mkdir -p src/pkg empty deep/a/b/c
printf 'print(1)\\n' > src/main.py
printf 'x' > src/pkg/__init__.py
head -c 300000 /dev/urandom > blob.bin
echo doomed > doomed.txt
mkdir doomed-dir && echo y > doomed-dir/inner
ln -s src/main.py link
ln blob.bin hard.bin
chmod 750 src/main.py
echo deep > deep/a/b/c/file
"""

MUTATE = """
set -e
echo changed >> src/main.py
rm doomed.txt
rm -r doomed-dir
mv deep deeper
chmod 600 blob.bin
ln -sf elsewhere link
echo new > new.txt
mkdir -p empty/now-full && echo z > empty/now-full/z
"""


def tree(sb: Sandbox) -> str:
    r = sb.commands.run(["python3", "-c", TREE_HASH])
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


def sh(sb: Sandbox, script: str) -> str:
    r = sb.commands.run(script)
    assert r.exit_code == 0, (script, r.stdout, r.stderr)
    return r.stdout


@pytest.fixture
def sandboxes(home: str, manager: Manager) -> Iterator[list[Sandbox]]:
    """Sandboxes (and afterwards every snapshot) of one test, cleaned up at the end."""
    made: list[Sandbox] = []
    yield made
    for sb in made:
        sb.kill()
    for info in manager.store.list():
        manager._destroy(info, reason="cleanup")
    for snap in manager.list_snapshots():
        manager.delete_snapshot(snap.id)


def layer_mounts(home: str) -> list[str]:
    out = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line.startswith(f"{home}/layers/")]


def test_writes_after_a_snapshot_are_invisible_to_it_and_to_siblings(
    home: str, sandboxes: list[Sandbox]
) -> None:
    sb = Sandbox.create(home=home)
    sandboxes.append(sb)
    sh(sb, POPULATE)
    before = tree(sb)
    snap = sb.snapshot("base-state")
    assert tree(sb) == before  # sealing changes nothing the sandbox can see
    kid_a, kid_b = sb.fork(2)
    sandboxes += [kid_a, kid_b]
    assert tree(kid_a) == tree(kid_b) == before

    sh(sb, MUTATE)
    sh(kid_a, "echo only-a > only-a.txt && rm blob.bin")
    parent_after = tree(sb)
    assert parent_after != before
    assert tree(kid_b) == before  # the parent's writes are invisible to its forks
    assert "only-a.txt" not in sh(kid_b, "ls") and "only-a.txt" not in sh(sb, "ls")
    assert "blob.bin" in sh(sb, "ls") and "blob.bin" in sh(kid_b, "ls")

    fresh = Sandbox.create(home=home, snapshot=snap)
    sandboxes.append(fresh)
    assert tree(fresh) == before  # and to the snapshot itself
    assert tree(sb) == parent_after


def test_concurrent_forks_and_snapshots_of_one_sandbox_lose_nothing(
        home: str, sandboxes: list[Sandbox]) -> None:
    # Two threads forking one sandbox used to seal by a layer stack read before the other's
    # seal: the source lost its files and a child came out empty. Now each seal reads the
    # sandbox under the workspace lock; a contender either waits its turn or is told busy.
    import concurrent.futures

    from corral import SandboxBusy

    sb = Sandbox.create(home=home)
    sandboxes.append(sb)
    sh(sb, POPULATE)
    before = tree(sb)

    def fork_one() -> list[Sandbox]:
        return sb.fork(1)

    def snapshot_one() -> list[Sandbox]:
        return [Sandbox.create(home=home, snapshot=sb.snapshot())]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(fn) for fn in (fork_one, fork_one, snapshot_one, fork_one)]
    made = []
    for future in futures:
        try:
            made += future.result()
        except SandboxBusy:
            pass  # waited over a second for the others: refused, nothing changed
    sandboxes += made
    assert len(made) >= 2
    assert tree(sb) == before
    for child in made:
        assert tree(child) == before


def test_deletions_and_replacements_across_layers(home: str, sandboxes: list[Sandbox]) -> None:
    sb = Sandbox.create(home=home)
    sandboxes.append(sb)
    sh(sb, POPULATE)
    (kid,) = sb.fork(1)
    sandboxes.append(kid)
    # Delete a file and a directory from the layer below, replace a file by a directory and a
    # directory by a file: whiteouts and opaque directories.
    sh(kid, "rm doomed.txt && rm -r doomed-dir && rm src/main.py && mkdir src/main.py "
            "&& rm -r deep && echo now-a-file > deep")
    listing = sh(kid, "ls -F; ls -F src")
    assert "doomed.txt" not in listing and "doomed-dir" not in listing
    assert "main.py/" in listing
    assert sh(kid, "cat deep") == "now-a-file\n"
    expected = tree(kid)
    snap = kid.snapshot()
    grandchild = Sandbox.create(home=home, snapshot=snap.id)
    sandboxes.append(grandchild)
    assert tree(grandchild) == expected
    # The parent still has everything.
    assert sh(sb, "cat doomed.txt doomed-dir/inner deep/a/b/c/file") == "doomed\ny\ndeep\n"


def test_a_fork_of_a_fork_sees_every_generation(home: str, sandboxes: list[Sandbox],
                                                manager: Manager) -> None:
    sb = Sandbox.create(home=home)
    sandboxes.append(sb)
    sh(sb, "echo 1 > gen1")
    (child,) = sb.fork(1)
    sh(child, "echo 2 > gen2 && echo child >> gen1")
    (grandchild,) = child.fork(1)
    sh(grandchild, "echo 3 > gen3")
    sandboxes += [child, grandchild]
    assert sh(grandchild, "cat gen1 gen2 gen3") == "1\nchild\n2\n3\n"
    assert sh(child, "ls") == "gen1\ngen2\n"
    assert sh(sb, "ls; cat gen1") == "gen1\n1\n"
    # Files a fork inherits are its own: it may change, chmod and remove them.
    r = grandchild.commands.run("stat -c '%U %a' gen1 && chmod 600 gen1 && echo g >> gen1 "
                                "&& rm gen2 && stat -c '%U %a' gen1")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "user 644\nuser 600\n"
    layers = manager.store.layer_chain(grandchild.get_info().layer)
    assert len(layers) == 2  # one layer per generation that forked


def test_restore_is_exact(home: str, sandboxes: list[Sandbox]) -> None:
    sb = Sandbox.create(home=home)
    sandboxes.append(sb)
    sh(sb, POPULATE)
    at_snapshot = tree(sb)
    snap = sb.snapshot("before-mutation")
    sh(sb, MUTATE)
    assert tree(sb) != at_snapshot
    sb.restore(snap)
    assert tree(sb) == at_snapshot
    sh(sb, "rm -rf ./* && echo scratch > s")
    sb.restore("before-mutation")  # by name
    assert tree(sb) == at_snapshot
    # Restoring to another sandbox's snapshot brings that sandbox's state, owned by this one.
    other = Sandbox.create(home=home)
    sandboxes.append(other)
    sh(other, "echo other > o.txt")
    other_tree = tree(other)
    other_snap = other.snapshot()
    sb.restore(other_snap)
    assert sh(sb, "cat o.txt && stat -c %U o.txt") == "other\nuser\n"
    assert tree(sb) == other_tree


def test_a_snapshot_in_use_cannot_be_deleted_and_unused_layers_go(
    home: str, sandboxes: list[Sandbox], manager: Manager
) -> None:
    sb = Sandbox.create(home=home)
    sandboxes.append(sb)
    sh(sb, "echo a > a")
    snap = sb.snapshot("in-use")
    (kid,) = sb.fork(1)
    with pytest.raises(SnapshotInUse, match=sb.id):
        Sandbox.delete_snapshot("in-use", home=home)
    assert Sandbox.get_snapshot("in-use", home=home).id == snap.id  # nothing was lost
    kid.kill()
    sb.kill()
    Sandbox.delete_snapshot(snap, home=home)
    with pytest.raises(SnapshotNotFound):
        Sandbox.get_snapshot("in-use", home=home)
    # Nothing references the layers any more: records, directories and mounts are gone.
    assert manager.store.layer_ids() == set()
    assert manager.backend.layer_ids() == []
    assert layer_mounts(home) == []


def test_snapshot_refused_while_a_command_runs(home: str, sandboxes: list[Sandbox]) -> None:
    import threading

    sb = Sandbox.create(home=home)
    sandboxes.append(sb)
    idle = sb.snapshot()
    started = threading.Event()
    # Runs until the test lets it go (at most 20 s on its own).
    worker = threading.Thread(target=lambda: sb.commands.run(
        "echo started; for i in $(seq 400); do [ -e go ] && break; sleep 0.05; done",
        on_stdout=lambda _: started.set()))
    worker.start()
    try:
        assert started.wait(10)
        with pytest.raises(SandboxBusy, match="running"):
            sb.snapshot()
        with pytest.raises(SandboxBusy):
            sb.fork(1)
        with pytest.raises(SandboxBusy):
            sb.restore(idle)
    finally:
        sb.files.write("go", "")
        worker.join()
    sb.snapshot()  # idle again: fine


def test_bad_input_is_refused_and_changes_nothing(home: str, sandboxes: list[Sandbox]) -> None:
    sb = Sandbox.create(home=home)
    sandboxes.append(sb)
    sh(sb, "echo keep > keep")
    for bad in ["", "-x", "a" * 64, "has space", "snap_0123456789ab", "../up", "é"]:
        with pytest.raises(UsageError, match="snapshot name"):
            sb.snapshot(bad)
    sb.snapshot("taken")
    with pytest.raises(UsageError, match="already exists"):
        sb.snapshot("taken")
    for count in [0, -1, 65, True, 1.5, "2"]:
        with pytest.raises(UsageError, match="count"):
            sb.fork(count)  # type: ignore[arg-type]
    with pytest.raises(SnapshotNotFound):
        sb.restore("no-such-snapshot")
    with pytest.raises(SnapshotNotFound):
        Sandbox.create(home=home, snapshot="no-such-snapshot")
    assert sh(sb, "cat keep") == "keep\n"
    assert [s.name for s in Sandbox.list_snapshots(home=home)] == ["taken"]


def test_layer_depth_stays_bounded(home: str, sandboxes: list[Sandbox], manager: Manager) -> None:
    sb = Sandbox.create(home=home)
    sandboxes.append(sb)
    first = None
    for i in range(MAX_LAYERS + 2):
        sh(sb, f"echo {i} > file{i} && echo {i} >> log && rm -f file{i - 2}")
        snap = sb.snapshot()
        first = first or snap
        depth = len(manager.store.layer_chain(sb.get_info().layer))
        assert depth <= MAX_LAYERS
    expected = tree(sb)
    assert sh(sb, "ls | sort | tr '\\n' ' '") == (
        f"file{MAX_LAYERS} file{MAX_LAYERS + 1} log ")
    assert sh(sb, "wc -l < log") == f"{MAX_LAYERS + 2}\n"
    # After squashing, the early snapshots still hold their own state.
    early = Sandbox.create(home=home, snapshot=first)
    sandboxes.append(early)
    assert sh(early, "ls") == "file0\nlog\n"
    again = Sandbox.create(home=home, snapshot=snap)
    sandboxes.append(again)
    assert tree(again) == expected


def test_the_writable_layer_has_the_tiers_quota(home: str, sandboxes: list[Sandbox]) -> None:
    sb = Sandbox.create(home=home)
    sandboxes.append(sb)
    sh(sb, "head -c 300000000 /dev/zero > base.bin")
    kid, sibling = sb.fork(2)
    sandboxes += [kid, sibling]
    # The layers below do not count: the fork gets the whole tier's disk for its own writes.
    r = kid.commands.run("head -c 2000000000 /dev/zero > fill; echo rc=$?; stat -c %s fill",
                         timeout=60)
    assert "rc=1" in r.stdout and "No space left on device" in r.stderr, (r.stdout, r.stderr)
    assert 900 * MiB < int(r.stdout.split()[-1]) <= 1024 * MiB
    # Neither the sibling, the parent nor the host noticed.
    for other in (sibling, sb):
        assert sh(other, "head -c 50000000 /dev/zero > more && stat -c %s more") == "50000000\n"
    assert subprocess.run(["sh", "-c", "echo ok"], capture_output=True, text=True).stdout == "ok\n"
    image = Path(home) / "sandboxes" / kid.id / "upper.img"
    assert image.stat().st_blocks * 512 <= 1024 * MiB + 8 * MiB
    # The file API says so in words, and keeps nothing half-written.
    with pytest.raises(QuotaExceeded, match="workspace is full"):
        kid.files.write("more.bin", b"x" * 10_000_000)
    assert not kid.files.exists("more.bin")
    sh(kid, "rm fill")
    assert int(sh(kid, "df -B1 --output=avail /workspace | tail -1")) > 900 * MiB


def test_layers_come_back_after_the_mounts_are_gone(home: str, sandboxes: list[Sandbox],
                                                   manager: Manager) -> None:
    """What a reboot does: every mount of the data directory disappears; the next use rebuilds
    the overlay, the idmapped binds and the layer mounts."""
    sb = Sandbox.create(home=home)
    sandboxes.append(sb)
    sh(sb, "echo 1 > one")
    (kid,) = sb.fork(1)
    sandboxes.append(kid)
    sh(kid, "echo 2 > two")
    expected = tree(kid)
    out = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True)
    ours = [m for m in out.stdout.splitlines() if m.startswith(home + "/")]
    assert any("/layers/" in m for m in ours) and any("/priv/l" in m for m in ours)
    for point in sorted(ours, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=True)
    time.sleep(0.2)
    assert tree(kid) == expected
    assert sh(sb, "cat one") == "1\n"


def test_snapshot_fork_and_restore_are_audited(home: str, sandboxes: list[Sandbox]) -> None:
    sb = Sandbox.create(home=home)
    sandboxes.append(sb)
    snap = sb.snapshot("audited")
    (kid,) = sb.fork(1)
    sandboxes.append(kid)
    sb.restore(snap)
    kid.kill()
    sb.kill()
    Sandbox.delete_snapshot(snap, home=home)
    from corral import read_audit

    events = read_audit(sb.id, home=home).events
    by_type = {e.type: e for e in events}
    assert by_type["snapshot.created"].data["snapshot"] == snap.id
    assert by_type["snapshot.created"].data["name"] == "audited"
    assert by_type["sandbox.forked"].data["children"] == [kid.id]
    assert by_type["snapshot.restored"].data["snapshot"] == snap.id
    assert by_type["snapshot.deleted"].data["snapshot"] == snap.id
    kid_created = read_audit(kid.id, home=home).events[0]
    assert kid_created.type == "sandbox.created"
    assert kid_created.data["forked_from"] == sb.id


def test_snapshot_fork_and_restore_on_each_tier(home: str, sandboxes: list[Sandbox],
                                                isolation_all: str) -> None:
    """The same workspace semantics on every tier: the host tiers share the layers; the microVM
    tier's workspace is a disk whose seal is a qcow2 layer (its own code, the same contract)."""
    isolation = isolation_all
    sb = Sandbox.create(home=home, isolation=isolation)
    sandboxes.append(sb)
    sh(sb, POPULATE)
    at_snapshot = tree(sb)
    snap = sb.snapshot()
    (kid,) = sb.fork(1)
    sandboxes.append(kid)
    assert kid.get_info().isolation == isolation
    sh(kid, MUTATE)
    sh(sb, "rm -rf src && echo parent > parent-only")
    assert tree(kid) != at_snapshot
    assert "parent-only" not in sh(kid, "ls")
    sb.restore(snap)
    assert tree(sb) == at_snapshot


def test_a_snapshot_right_after_fresh_writes_does_not_wait_for_writeback(
    home: str, sandboxes: list[Sandbox],
) -> None:
    """Sealing is O(1) even when the data is still dirty in memory: the seal must not wait for
    300 MB to reach the disk (it did, 0.4-1.8 s here, through the overlay's sync on umount),
    and what was sealed is whole for every reader of the layer right away."""
    sb = Sandbox.create(home=home, resources="large")
    sandboxes.append(sb)
    took = []
    for round_ in range(2):
        written = sb.commands.run(
            f"head -c 300M /dev/urandom > blob{round_} && sha256sum blob{round_}", timeout=120)
        assert written.exit_code == 0, written.stderr
        start = time.perf_counter()
        snap = sb.snapshot()
        took.append(time.perf_counter() - start)
        (kid,) = sb.fork(1)
        sandboxes.append(kid)
        assert sh(kid, f"sha256sum blob{round_}") == written.stdout
        fresh = Sandbox.create(home=home, snapshot=snap, resources="large")
        sandboxes.append(fresh)
        assert sh(fresh, f"sha256sum blob{round_}") == written.stdout
    assert max(took) < 0.25, took


def layer_loop_devices(home: str) -> list[str]:
    """The loop devices backed by a layer image of the data directory (workspaces, made
    ahead or in use, have their own)."""
    found = []
    for device in Path("/sys/block").glob("loop*"):
        try:
            backing = (device / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue
        if backing.startswith(str(Path(home).resolve() / "layers") + "/"):
            found.append(f"{device.name} {backing}")
    return found


def test_stored_snapshots_hold_no_loop_device_or_mount(home: str, sandboxes: list[Sandbox],
                                                       manager: Manager) -> None:
    """Issue 36: 200 snapshots of one sandbox held 378 loop devices, and the kernel's loop
    limit was the snapshot limit. A layer no sandbox stands on is released."""
    sb = Sandbox.create(home=home)
    sandboxes.append(sb)
    snaps = []
    count = 2 * MAX_LAYERS + 3  # two squashes: two chains only snapshots stand on
    for i in range(count):
        sh(sb, f"echo {i} > file{i} && echo {i} >> log")
        snaps.append(sb.snapshot())
    # Mounted: the live sandbox's own chain, nothing of the chains only snapshots name.
    chain = set(manager.store.layer_chain(sb.get_info().layer))
    mounted = {Path(m).parent.name for m in layer_mounts(home)}
    assert mounted == chain, (sorted(mounted - chain), len(mounted))
    deadline = time.monotonic() + 60  # a released layer's device goes once its last user has
    while len(layer_loop_devices(home)) > len(chain) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(layer_loop_devices(home)) == len(chain)
    sb.kill()
    # The sandbox's teardown finishes behind its destroy; then nothing is held at all.
    deadline = time.monotonic() + 120
    while (layer_mounts(home) or layer_loop_devices(home)) and time.monotonic() < deadline:
        manager.layers.release_idle()
        time.sleep(0.05)
    assert layer_mounts(home) == []
    assert layer_loop_devices(home) == []
    # Every snapshot is whole: each one's sandbox mounts its layers again.
    for index in (0, MAX_LAYERS - 1, MAX_LAYERS, count - 1):
        again = Sandbox.create(home=home, snapshot=snaps[index])
        sandboxes.append(again)
        assert sh(again, "wc -l < log") == f"{index + 1}\n"
        assert sh(again, f"cat file{index}") == f"{index}\n"
        (kid,) = again.fork(1)  # and a fork of it, on another uid (idmapped)
        sandboxes.append(kid)
        assert sh(kid, f"cat file{index}") == f"{index}\n"
        again.kill()
        kid.kill()
