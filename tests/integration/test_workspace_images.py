"""Workspace images: each one a sparse copy of one blank per size, checked before it is used."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from corral._backends._linux.storage import _SparePool

_SIZE = 64 * 1024 * 1024


def _fsck(image: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["e2fsck", "-fn", str(image)], capture_output=True, text=True,
                          timeout=60)


def test_images_are_sparse_copies_of_one_blank_each_a_clean_filesystem(tmp_path: Path) -> None:
    pool = _SparePool(tmp_path / ".spare")
    first, second = tmp_path / "a.img", tmp_path / "b.img"
    pool.make(_SIZE, first)
    blank = tmp_path / ".spare" / f"{_SIZE}.blank.img"
    made = blank.stat()
    pool.make(_SIZE, second)
    assert blank.stat().st_mtime_ns == made.st_mtime_ns, "the blank was made twice"
    for image in (first, second):
        assert image.stat().st_size == _SIZE
        assert image.stat().st_blocks * 512 < 4 * 1024 * 1024, "the copy filled its holes"
        checked = _fsck(image)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert image.read_bytes() == blank.read_bytes()
    assert sorted(p.name for p in (tmp_path / ".spare").iterdir()) == [blank.name]


def test_a_damaged_blank_is_made_again_and_every_image_is_sound(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pool = _SparePool(tmp_path / ".spare")
    pool.make(_SIZE, tmp_path / "first.img")
    blank = tmp_path / ".spare" / f"{_SIZE}.blank.img"
    with open(blank, "r+b") as f:
        f.seek(1024 + 0x38)
        f.write(b"\0\0")  # no ext4 superblock magic
    pool.make(_SIZE, tmp_path / "second.img")
    os.truncate(blank, _SIZE // 2)  # not the size its name says
    pool.make(_SIZE, tmp_path / "third.img")
    assert caplog.text.count("is damaged; making it again") == 2
    for name in ("first", "second", "third"):
        checked = _fsck(tmp_path / f"{name}.img")
        assert checked.returncode == 0, checked.stdout + checked.stderr
    assert _fsck(blank).returncode == 0


def test_an_image_that_cannot_be_made_leaves_nothing(tmp_path: Path) -> None:
    pool = _SparePool(tmp_path / ".spare")
    taken = tmp_path / "taken.img"
    taken.write_bytes(b"someone's data")
    with pytest.raises(FileExistsError):
        pool.make(_SIZE, taken)
    assert taken.read_bytes() == b"someone's data"
    bad = _SparePool(tmp_path / "file")  # its directory cannot be made: a file is there
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        bad.make(_SIZE, tmp_path / "never.img")
    assert not (tmp_path / "never.img").exists()


def test_where_the_filesystem_reports_no_holes_images_are_made_by_mkfs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem without SEEK_HOLE says the whole file is data (the kernel's generic
    lseek): a copy would write every byte of the size, so the image is formatted instead."""
    from corral._backends._linux import storage

    pool = _SparePool(tmp_path / ".spare")
    pool.make(_SIZE, tmp_path / "first.img")
    monkeypatch.setattr(storage, "data_extents", lambda fd: [(0, os.fstat(fd).st_size)])
    pool.make(_SIZE, tmp_path / "second.img")
    second = tmp_path / "second.img"
    assert second.stat().st_blocks * 512 < 4 * 1024 * 1024, "the whole size was written"
    assert _fsck(second).returncode == 0


def test_data_extents_are_the_files_data_and_not_its_holes(tmp_path: Path) -> None:
    from corral._backends._linux.storage import data_extents

    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.truncate(64 * 1024 * 1024)
        f.seek(1024 * 1024)
        f.write(b"x" * 4096)
        f.seek(32 * 1024 * 1024)
        f.write(b"y" * 8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        extents = data_extents(fd)
    finally:
        os.close(fd)
    # Block-granular: each run covers what was written and starts at or before it.
    assert len(extents) == 2, extents
    (a, b), (c, d) = extents
    assert a <= 1024 * 1024 < 1024 * 1024 + 4096 <= b < 32 * 1024 * 1024
    assert c <= 32 * 1024 * 1024 < 32 * 1024 * 1024 + 8192 <= d
