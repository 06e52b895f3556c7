"""The in-memory backend's watch capability, without root: the same events a host tier's
inotify watch reports for the same operations."""

from __future__ import annotations

import select

import pytest

from corral.backends import WatchableFS
from corral.errors import FileError, FileNotFound
from corral.testing import MemoryFS


def test_memory_watch_reports_changes_and_wakes_its_descriptor() -> None:
    fs = MemoryFS()
    fs.make_dir("/workspace/w")
    assert isinstance(fs, WatchableFS)
    watch = fs.watch("/workspace/w")
    try:
        assert watch.read() == []
        fs.write("/workspace/w/a.txt", b"1")
        assert select.select([watch.fileno()], [], [], 0)[0]
        fs.write("/workspace/w/a.txt", b"2")
        fs.rename("/workspace/w/a.txt", "/workspace/w/b.txt")
        fs.write("/workspace/w/deep/c.txt", b"3")  # not recursive: not seen
        fs.remove("/workspace/w/b.txt")
        fs.write("/workspace/elsewhere.txt", b"4")
        assert [(e.name, e.op) for e in watch.read()] == [
            ("a.txt", "create"), ("a.txt", "write"), ("a.txt", "write"),
            ("a.txt", "rename"), ("b.txt", "create"), ("deep", "create"),
            ("b.txt", "remove")]
        assert not select.select([watch.fileno()], [], [], 0)[0]
        fs.remove("/workspace/w")
        watch.read()
        assert watch.ended
    finally:
        watch.close()


def test_memory_watch_refuses_what_a_host_watch_refuses() -> None:
    fs = MemoryFS()
    fs.write("/workspace/f", b"")
    with pytest.raises(FileNotFound):
        fs.watch("/workspace/nope")
    with pytest.raises(FileError):
        fs.watch("/workspace/f")
