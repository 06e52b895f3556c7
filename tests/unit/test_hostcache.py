"""``hostcache``: a tier's passing host checks are reused by later processes of the same boot
while the programs they vetted are unchanged; a failure never is, and the file survives
racing writers and garbage. No root needed: the checks here are counted stand-ins."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral._backends._linux import hostcache
from corral._backends._linux.hostcache import HostKey, TierChecks
from corral.backends import HostCheck


class Probe:
    """A tier's checks: counts its runs and answers what ``ok`` says."""

    def __init__(self) -> None:
        self.runs = 0
        self.ok = True

    def __call__(self) -> list[HostCheck]:
        self.runs += 1
        return [HostCheck("tool", True, "found"),
                HostCheck("probe", self.ok, "started" if self.ok else "refused", "fix it")]


@pytest.fixture(autouse=True)
def new_process() -> Iterator[None]:
    """Each test starts as a new process would: no failure remembered in memory."""
    hostcache._failures.clear()
    yield
    hostcache._failures.clear()


@pytest.fixture
def program(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "runsc"
    path.parent.mkdir()
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def checks(path: Path, program: Path, probe: Probe, **values: str) -> TierChecks:
    """What one process makes of the tier: a new object per call, as a new process has."""
    return TierChecks(path, key=lambda: HostKey(
        tier="gvisor", version="1", programs={"runsc": str(program)}, values=values),
        run=probe)


def test_a_pass_is_checked_once_and_reused_by_the_next_process(
        tmp_path: Path, program: Path) -> None:
    probe, path = Probe(), tmp_path / "hostchecks" / "gvisor.json"
    first = checks(path, program, probe).cached()
    assert probe.runs == 1 and all(c.ok for c in first)
    again = checks(path, program, probe).cached()
    assert probe.runs == 1 and again == first
    assert checks(path, program, probe).recorded()
    assert json.loads(path.read_text())["host"]["programs"]["runsc"][0] == str(program)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in path.parent.iterdir()] == ["gvisor.json"]  # no temporary left


@pytest.mark.parametrize("change", ["rewritten", "replaced", "chmod", "removed"])
def test_a_changed_program_is_checked_again(tmp_path: Path, program: Path,
                                            change: str) -> None:
    probe, path = Probe(), tmp_path / "gvisor.json"
    checks(path, program, probe).cached()
    if change == "rewritten":  # an upgrade in place: same inode, new content and mtime
        with program.open("a") as f:
            f.write("# 2\n")
    elif change == "replaced":  # dpkg's way: a new file renamed over the old one
        new = program.with_name(".runsc.new")
        shutil.copy2(program, new)
        os.replace(new, program)
    elif change == "chmod":
        program.chmod(0o4755)
    else:
        program.unlink()
    checks(path, program, probe).cached()
    assert probe.runs == 2


def test_another_boot_kernel_or_setting_is_checked_again(
        tmp_path: Path, program: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probe, path = Probe(), tmp_path / "gvisor.json"
    checks(path, program, probe, allow_tcg="False").cached()
    checks(path, program, probe, allow_tcg="True").cached()
    assert probe.runs == 2
    monkeypatch.setattr(hostcache, "boot_id", lambda: "another-boot")
    checks(path, program, probe, allow_tcg="True").cached()
    assert probe.runs == 3
    uname = os.uname()
    monkeypatch.setattr(os, "uname", lambda: os.uname_result(
        (uname.sysname, uname.nodename, uname.release + "-new", uname.version,
         uname.machine)))
    checks(path, program, probe, allow_tcg="True").cached()
    assert probe.runs == 4


def test_without_a_boot_id_nothing_is_remembered(
        tmp_path: Path, program: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostcache, "boot_id", lambda: None)
    probe, path = Probe(), tmp_path / "gvisor.json"
    checks(path, program, probe).cached()
    checks(path, program, probe).cached()
    assert probe.runs == 2 and not path.exists()


def test_a_failure_is_never_recorded_and_drops_an_earlier_pass(
        tmp_path: Path, program: Path) -> None:
    probe, path = Probe(), tmp_path / "gvisor.json"
    checks(path, program, probe).cached()
    probe.ok = False
    # The operator's tool always runs the checks: what it finds replaces the record.
    found = checks(path, program, probe).fresh()
    assert probe.runs == 2 and not all(c.ok for c in found)
    assert not path.exists()
    hostcache._failures.clear()  # the next process
    assert not all(c.ok for c in checks(path, program, probe).cached())
    assert probe.runs == 3
    probe.ok = True  # fixed: the next process sees it at once
    hostcache._failures.clear()
    assert all(c.ok for c in checks(path, program, probe).cached())
    assert probe.runs == 4 and path.exists()


def test_one_process_reuses_a_failure_only_briefly(
        tmp_path: Path, program: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    probe, path = Probe(), tmp_path / "gvisor.json"
    probe.ok = False
    checks(path, program, probe).cached()
    checks(path, program, probe).cached()  # a reaper pass a moment later
    assert probe.runs == 1
    now[0] += hostcache.FAILURE_TTL_S
    checks(path, program, probe).cached()
    assert probe.runs == 2
    program.chmod(0o700)  # something changed: not the same question any more
    checks(path, program, probe).cached()
    assert probe.runs == 3


@pytest.mark.parametrize("content", [
    b"", b"{not json", b"[]", b'{"key": 1}', b'{"checks": [{"name": "x"}]}'])
def test_a_torn_or_foreign_file_counts_as_absent(tmp_path: Path, program: Path,
                                                 content: bytes) -> None:
    probe, path = Probe(), tmp_path / "gvisor.json"
    path.write_bytes(content)
    assert all(c.ok for c in checks(path, program, probe).cached())
    assert probe.runs == 1
    checks(path, program, probe).cached()
    assert probe.runs == 1  # replaced by a good record


def test_a_recorded_failure_is_not_taken_for_a_pass(tmp_path: Path, program: Path) -> None:
    """Even a file that carries the right key but a failing line (written by hand, or by a
    future version) is never read as a pass."""
    probe, path = Probe(), tmp_path / "gvisor.json"
    checks(path, program, probe).cached()
    data = json.loads(path.read_text())
    data["checks"][1]["ok"] = False
    path.write_text(json.dumps(data))
    checks(path, program, probe).cached()
    assert probe.runs == 2


def test_a_record_that_cannot_be_written_costs_only_the_saving(
        tmp_path: Path, program: Path) -> None:
    blocker = tmp_path / "hostchecks"
    blocker.write_text("a file where the directory would be")
    probe = Probe()
    for _ in range(2):
        assert all(c.ok for c in checks(blocker / "gvisor.json", program, probe).cached())
    assert probe.runs == 2


def test_racing_writers_leave_one_whole_record(tmp_path: Path, program: Path) -> None:
    """Last writer wins; a reader meanwhile sees a whole record or none, never a torn one."""
    path = tmp_path / "hostchecks" / "gvisor.json"
    stop = threading.Event()
    torn: list[bytes] = []

    def write() -> None:
        for _ in range(50):
            checks(path, program, Probe()).fresh()

    def read() -> None:
        while not stop.is_set():
            try:
                raw = path.read_bytes()
            except FileNotFoundError:
                continue
            try:
                json.loads(raw)
            except ValueError:
                torn.append(raw)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write) for _ in range(4)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    stop.set()
    reader.join()
    assert torn == []
    assert [p.name for p in path.parent.iterdir()] == ["gvisor.json"]
    probe = Probe()
    checks(path, program, probe).cached()
    assert probe.runs == 0


def test_an_edit_of_the_check_code_is_checked_again(tmp_path: Path, program: Path) -> None:
    source = tmp_path / "hostcheck.py"
    source.write_text("# v1\n")
    probe, path = Probe(), tmp_path / "gvisor.json"

    def of_code() -> TierChecks:
        return TierChecks(path, key=lambda: HostKey(
            tier="gvisor", version="1", programs={"runsc": str(program)}, files=(source,)),
            run=probe)

    of_code().cached()
    of_code().cached()
    assert probe.runs == 1
    source.write_text("# v2, a new check\n")
    of_code().cached()
    assert probe.runs == 2
