"""Sweeps remove and read what they find without opening a special file (issue 36: a FIFO a
crashed gVisor start left in its bundles directory hung every later sweep in rmtree's open).
Each call runs on a thread joined with a bound: a call that blocks fails the test instead of
hanging it."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from corral._core.fsafe import is_special, read_regular, remove_special, remove_tree

_BOUND_S = 30.0


def _returns(call: Callable[[], object]) -> object:
    box: list[object] = []
    thread = threading.Thread(target=lambda: box.append(call()), daemon=True)
    thread.start()
    thread.join(_BOUND_S)
    assert not thread.is_alive(), "it blocked"
    return box[0]


def _specials(directory: Path) -> list[Path]:
    fifo, sock = directory / "a.release", directory / "b.sock"
    os.mkfifo(fifo)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
    return [fifo, sock]


def test_remove_tree_unlinks_what_is_not_a_directory_without_opening_it(tmp_path: Path) -> None:
    fifo, sock = _specials(tmp_path)
    (tmp_path / "tree" / "deep").mkdir(parents=True)
    os.mkfifo(tmp_path / "tree" / "deep" / "inner")
    (tmp_path / "link").symlink_to(tmp_path / "tree")
    for path in (fifo, sock, tmp_path / "link", tmp_path / "tree", tmp_path / "missing"):
        _returns(lambda path=path: remove_tree(path))  # type: ignore[misc]
        assert not os.path.lexists(path)
    assert sorted(os.listdir(tmp_path)) == []


def test_read_regular_reads_files_and_refuses_everything_else(tmp_path: Path) -> None:
    fifo, sock = _specials(tmp_path)
    (tmp_path / "pid").write_text("123.456\n")
    (tmp_path / "link").symlink_to(tmp_path / "pid")
    assert _returns(lambda: read_regular(tmp_path / "pid")) == b"123.456\n"
    assert _returns(lambda: read_regular(tmp_path / "pid", limit=3)) == b"123"
    for refused in (fifo, sock, tmp_path / "link", tmp_path, tmp_path / "missing"):
        assert _returns(lambda refused=refused: read_regular(refused)) is None  # type: ignore[misc]


def test_remove_special_leaves_files_and_directories(tmp_path: Path) -> None:
    fifo, sock = _specials(tmp_path)
    (tmp_path / "file").write_text("x")
    assert remove_special(fifo) and remove_special(sock)
    assert not remove_special(tmp_path / "file") and not remove_special(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["file"]
    assert is_special(os.stat("/dev/null").st_mode)
    assert not is_special(os.stat(tmp_path).st_mode)
