"""The cgroup drivers against the real hierarchies of this host.

This host mounts the v1 controllers, so v2 can only be exercised where it needs no controller:
placement, `cgroup.kill` of a whole tree and removal (its limits are covered on v2 hosts only).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral._backends._linux.cgroups import CgroupV1, CgroupV2, _mounts, detect_cgroups
from corral._core.resources import get_tier

pytestmark = pytest.mark.needs_root


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _forking_tree() -> subprocess.Popen[bytes]:
    """A process that forks three sleepers only once released, so it can be placed first."""
    return subprocess.Popen(
        ["bash", "-c",
         "read go; p=; for i in 1 2 3; do sleep 60 & p=\"$p $!\"; done; echo $p; wait"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
    )


def _close(proc: subprocess.Popen[bytes]) -> None:
    proc.wait(timeout=5)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def _place_and_release(driver: CgroupV1 | CgroupV2, group: str) -> tuple[
    subprocess.Popen[bytes], list[int]
]:
    proc = _forking_tree()
    driver.attach(group, [proc.pid])
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    children = [int(p) for p in proc.stdout.readline().split()]
    assert len(children) == 3
    return proc, children


def test_detection_prefers_v1_when_controllers_are_bound_to_it() -> None:
    driver = detect_cgroups("corral-detect")
    has_v1_memory = any(t == "cgroup" and "memory" in o for _, t, o in _mounts())
    assert driver.version == (1 if has_v1_memory else 2)


def test_v1_limits_placement_usage_and_tree_kill() -> None:
    driver = detect_cgroups(f"corral-test-{secrets.token_hex(3)}")
    if driver.version != 1:
        pytest.skip("this host runs cgroup v2")
    tier = get_tier("small")
    driver.create_sandbox("sbx", tier)
    try:
        mem = Path("/sys/fs/cgroup/memory") / driver._prefix / "sbx"  # type: ignore[union-attr]
        assert int((mem / "memory.limit_in_bytes").read_text()) == tier.memory_bytes
        pids = Path("/sys/fs/cgroup/pids") / driver._prefix / "sbx"  # type: ignore[union-attr]
        assert int((pids / "pids.max").read_text()) == tier.pids
        driver.create_command("sbx/cmd")
        proc, children = _place_and_release(driver, "sbx/cmd")
        assert all(_alive(p) for p in children)
        driver.kill("sbx/cmd")
        _close(proc)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(_alive(p) for p in children)
        assert driver.usage("sbx/cmd").cpu_s >= 0
    finally:
        driver.kill("sbx")
        driver.remove("")
    assert not (Path("/sys/fs/cgroup/freezer") / driver._prefix).exists()  # type: ignore[union-attr]


def test_v1_kill_of_a_sandbox_group_kills_what_runs_in_its_children() -> None:
    """A destroy kills the sandbox's group: its processes are all in child groups (commands,
    the resident helper), none in the group itself, and every one of them dies; a group
    whose last process is already exiting is let go without a freeze."""
    driver = detect_cgroups(f"corral-test-{secrets.token_hex(3)}")
    if driver.version != 1:
        pytest.skip("this host runs cgroup v2")
    driver.create_sandbox("sbx", get_tier("small"))
    try:
        driver.create_command("sbx/cmd")
        driver.create_command("sbx/r.1.2.0")
        proc, children = _place_and_release(driver, "sbx/cmd")
        other, more = _place_and_release(driver, "sbx/r.1.2.0")
        driver.kill("sbx")
        _close(proc)
        _close(other)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in children + more) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(_alive(p) for p in children + more)
        driver.remove("sbx")  # nothing populated is left: no EBUSY
    finally:
        driver.kill("sbx")
        driver.remove("")
    assert not (Path("/sys/fs/cgroup/freezer") / driver._prefix).exists()  # type: ignore[union-attr]


def test_v1_a_group_left_half_renamed_by_a_crash_is_listed_killed_and_removed() -> None:
    """A group is renamed one hierarchy at a time: a crash in between leaves its processes
    under the new name in some hierarchies (the freezer among them) and the old in the rest.
    Both names are listed, and each is killed and removed without the other."""
    driver = detect_cgroups(f"corral-test-{secrets.token_hex(3)}")
    if not isinstance(driver, CgroupV1):
        pytest.skip("this host runs cgroup v2")
    driver.create_sandbox("sbx", get_tier("small"))
    try:
        driver.create_command("sbx/old")
        proc, children = _place_and_release(driver, "sbx/old")
        freezer = driver._path("freezer", "sbx/old")
        freezer.rename(freezer.with_name("new"))
        assert driver.children("sbx") == ["new", "old"]
        driver.kill("sbx/old")  # no freezer group under this name: killed without it
        _close(proc)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(_alive(p) for p in children)
        driver.remove("sbx/old")
        driver.kill("sbx/new")
        driver.remove("sbx/new")
        assert driver.children("sbx") == []
    finally:
        driver.kill("sbx")
        driver.remove("")
    assert not (Path("/sys/fs/cgroup/freezer") / driver._prefix).exists()


def test_v2_placement_and_cgroup_kill_without_controllers() -> None:
    root = next((Path(p) for p, t, _ in _mounts() if t == "cgroup2"), None)
    if root is None or not os.access(root / "cgroup.procs", os.W_OK):
        pytest.skip("no writable cgroup2 mount")
    prefix = f"corral-test-{secrets.token_hex(3)}"
    driver = CgroupV2(root, prefix)
    (root / prefix).mkdir()
    try:
        driver.create_command("cmd")
        if not (root / prefix / "cmd" / "cgroup.kill").exists():
            pytest.skip("kernel older than 5.14: no cgroup.kill")
        proc, children = _place_and_release(driver, "cmd")
        procs = {int(p) for p in (root / prefix / "cmd" / "cgroup.procs").read_text().split()}
        assert {proc.pid, *children} <= procs
        driver.kill("cmd")
        _close(proc)
        assert not any(_alive(p) for p in children)
        assert driver.children("") == ["cmd"]
    finally:
        driver.kill("cmd")
        driver.remove("")
    assert not (root / prefix).exists()


@pytest.fixture
def traversable_dir() -> Iterator[Path]:
    """A fresh directory the sandboxes' uids can pass through (pytest's tmp_path is 0700, and
    a host-backed tier refuses a home they cannot reach)."""
    path = Path(tempfile.mkdtemp(prefix="corral-test-instance-"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_one_home_path_in_two_mount_namespaces_names_two_instances(
        traversable_dir: Path) -> None:
    """Two Corral instances (two containers, say) that both see their own data at the same
    CORRAL_HOME path must not name their cgroups and netns pins the same: each would sweep the
    other's as leftovers."""
    import sys

    tmp_path = traversable_dir
    shown = tmp_path / "corral-home"  # the one path both instances use
    shown.mkdir()
    probe = ("import sys; from corral._settings import Settings; "
             "from corral._backends.namespace import NamespaceBackend; "
             "s = Settings(home=sys.argv[1]); "
             "print(s.instance, NamespaceBackend(s)._netns_path('sb').name)")
    seen = []
    for name in ("first", "second", "first"):
        data = tmp_path / name
        data.mkdir(exist_ok=True)
        out = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
             'mount --bind "$1" "$2" && exec "$3" -c "$4" "$2"', "sh",
             str(data), str(shown), sys.executable, probe],
            capture_output=True, text=True, timeout=60, check=True)
        seen.append(out.stdout.split())
    first, second, first_again = seen
    assert first[0] != second[0] and first[1] != second[1], seen
    assert first == first_again  # stable: every process using one home agrees
    assert first[0] in first[1]
