"""The ``base`` template's curated ``/etc`` is made once and reused by every later load (and
process) until the host's ``/etc`` changes; a change makes a new copy beside the old one,
which sandboxes running on it keep."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from corral._backends._linux import template


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every copy of the host's /etc made from now on."""
    made: list[Path] = []
    copy = template._copy_host_etc

    def counted(tmp: Path) -> None:
        made.append(tmp)
        copy(tmp)

    monkeypatch.setattr(template, "_copy_host_etc", counted)
    return made


def test_base_etc_is_copied_once_and_again_only_when_the_host_etc_changes(
        tmp_path: Path, copies: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    first = template.load_template("base", tmp_path)
    again = template.load_template("base", tmp_path)
    assert len(copies) == 1 and again.etc == first.etc
    assert (first.etc / "passwd").is_file() and not (first.etc / "ssl" / "private").exists()
    state = template._host_etc_state()
    monkeypatch.setattr(template, "_host_etc_state", lambda: state + "-changed")
    changed = template.load_template("base", tmp_path)
    assert len(copies) == 2 and changed.etc != first.etc
    assert first.etc.is_dir()  # a running sandbox may have it bound


def _tree(root: Path) -> Path:
    etc = root / "etc"
    (etc / "ssl" / "certs").mkdir(parents=True)
    (etc / "ssl" / "certs" / "a.pem").write_text("a")
    (etc / "profile").write_text("x")
    return etc


@pytest.mark.parametrize("change", ["top-level edit", "file added deep", "file renamed over",
                                    "directory added", "entry removed"])
def test_the_host_etc_state_sees_the_changes_package_tools_make(
        tmp_path: Path, change: str) -> None:
    etc = _tree(tmp_path)
    before = template._host_etc_state(str(etc))
    assert template._host_etc_state(str(etc)) == before
    certs = etc / "ssl" / "certs"
    if change == "top-level edit":
        with (etc / "profile").open("a") as f:
            f.write("y")
    elif change == "file added deep":
        (certs / "b.pem").write_text("b")
    elif change == "file renamed over":  # dpkg and update-ca-certificates replace this way
        (certs / ".a.new").write_text("a2")
        os.replace(certs / ".a.new", certs / "a.pem")
    elif change == "directory added":
        (etc / "ssl" / "extra").mkdir()
    else:
        (etc / "profile").unlink()
    assert template._host_etc_state(str(etc)) != before
