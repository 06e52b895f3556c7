"""A refused file operation is evidence of what a steered agent tried: every one is in the audit
trail as a ``file.refused`` event (the operation, the path as given, the reason), embedded and
over HTTP alike, and a hostile path cannot forge or flood the trail."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from corral import PathRefused, Sandbox, read_audit

pytestmark = pytest.mark.needs_root


@pytest.fixture
def sandbox(where: dict[str, str]) -> Iterator[Sandbox]:
    sb = Sandbox.create(**where)
    try:
        yield sb
    finally:
        sb.kill()


def _refused(home: str, sandbox_id: str) -> list[dict[str, Any]]:
    return [e.data for e in read_audit(sandbox_id, home=home, types=["file.refused"]).events]


def _tar_escaping() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        member = tarfile.TarInfo("../../etc/corral-refusal-test")
        member.size = 1
        tar.addfile(member, io.BytesIO(b"x"))
    return buf.getvalue()


def test_every_refused_operation_is_recorded(sandbox: Sandbox, home: str) -> None:
    sandbox.commands.run("ln -s /etc/passwd leak")
    attempts: list[tuple[str, str, Callable[[], object]]] = [
        ("read", "/etc/shadow", lambda: sandbox.files.read("/etc/shadow")),
        ("read", "leak", lambda: sandbox.files.read("leak")),  # the sandbox's own symlink
        ("write", "../../etc/cron.d/x", lambda: sandbox.files.write("../../etc/cron.d/x", "x")),
        ("list", "/etc", lambda: sandbox.files.list("/etc")),
        ("stat", "/root", lambda: sandbox.files.stat("/root")),
        ("remove", "/workspace/../etc/passwd",
         lambda: sandbox.files.remove("/workspace/../etc/passwd")),
        ("mkdir", "../up", lambda: sandbox.files.make_dir("../up")),
        ("rename", "ok.txt", lambda: sandbox.files.rename("ok.txt", "/etc/moved")),
        ("upload", "/workspace", lambda: sandbox.files.upload(_tar_escaping())),
        ("download", "/etc", lambda: list(sandbox.files.download("/etc"))),
    ]
    for _, _, attempt in attempts:
        with pytest.raises(PathRefused):
            attempt()
    recorded = _refused(home, sandbox.id)
    assert [(e["op"], e["path"]) for e in recorded] == [(op, p) for op, p, _ in attempts]
    for event in recorded:
        assert event["reason"]["code"] == "path_refused" and event["reason"]["message"]
    assert "/etc/moved" in recorded[7]["dst"]
    assert "climbs out" in recorded[2]["reason"]["message"]


def test_a_hostile_path_is_recorded_escaped_and_bounded(sandbox: Sandbox, home: str) -> None:
    forged = '/etc/x\n{"type": "sandbox.destroyed"}\x1b[2J\u202e'
    huge = "/etc/" + "A" * 20_000
    for path in (forged, huge):
        with pytest.raises(PathRefused):
            sandbox.files.read(path)
    shown, bounded = (e["path"] for e in _refused(home, sandbox.id))
    assert "\n" not in shown and "\x1b" not in shown and "\u202e" not in shown
    assert shown.startswith("/etc/x\\x0a") and "\\x1b" in shown and "\\u202e" in shown
    assert len(bounded) < 600 and bounded.startswith("/etc/AAAA")
    big = _refused(home, sandbox.id)[1]
    assert big["path_chars"] == len(huge) and big["path_truncated"] is True


def test_replay_shows_a_refusal(sandbox: Sandbox, home: str) -> None:
    import subprocess
    import sys

    with pytest.raises(PathRefused):
        sandbox.files.read("/etc/shadow")
    shown = subprocess.run([sys.executable, "-m", "corral", "--home", home, "replay", sandbox.id,
                            "--type", "file.refused"], capture_output=True, text=True,
                           timeout=60, check=True).stdout
    assert "file.refused" in shown and "read /etc/shadow refused" in shown
