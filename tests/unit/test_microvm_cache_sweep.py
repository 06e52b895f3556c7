"""The microVM cache sweep: images of removed templates (and their warm snapshots) go, the
images of templates that exist and builds in progress stay."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from corral._backends.microvm.cachesweep import sweep


def _template(tmp_path: Path, name: str) -> tuple[Path, Path]:
    root, etc = tmp_path / "templates" / name / "root", tmp_path / "templates" / name / "etc.1"
    root.mkdir(parents=True)
    etc.mkdir()
    return root, etc


def _image(cache: Path, key: str, root: Path, etc: Path) -> None:
    roots = cache / "roots"
    roots.mkdir(parents=True, exist_ok=True)
    (roots / f"{key}.json").write_text(json.dumps({"key": key, "root": str(root),
                                                   "etc": str(etc), "size_bytes": 4096}))
    (roots / f"{key}.ext4").write_bytes(b"\0" * 8192)


def _warm(cache: Path, key: str, root_key: str) -> Path:
    entry = cache / "warm" / key
    entry.mkdir(parents=True)
    (entry / "warm.json").write_text(json.dumps({"key": key, "root_image": root_key}))
    (entry / "ram").write_bytes(b"\1" * 8192)
    (entry / "state").write_bytes(b"\2" * 100)
    return entry


def test_images_of_removed_templates_and_their_warm_snapshots_are_removed(
        tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    kept_root, kept_etc = _template(tmp_path, "kept")
    gone_root, gone_etc = _template(tmp_path, "gone")
    _, stale_etc = _template(tmp_path, "etc-changed")
    _image(cache, "aaaa", kept_root, kept_etc)
    _image(cache, "bbbb", gone_root, gone_etc)
    _image(cache, "cccc", kept_root, stale_etc)
    kept_warm, gone_warm = _warm(cache, "w1", "aaaa"), _warm(cache, "w2", "bbbb")
    stale_warm = _warm(cache, "w3", "cccc")
    (cache / "roots" / "orphan.ext4").write_bytes(b"\0" * 4096)  # its json was removed
    (gone_root.parent / "root").rmdir()
    stale_etc.rmdir()

    report = sweep(cache)

    roots = cache / "roots"
    assert sorted(p.name for p in roots.iterdir()) == ["aaaa.ext4", "aaaa.json"]
    assert kept_warm.is_dir() and not gone_warm.exists() and not stale_warm.exists()
    assert len(report.removed) == 7 and report.freed_bytes > 0
    assert sweep(cache).removed == []  # nothing more to do


def test_builds_in_progress_stay_and_abandoned_builds_go(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "roots").mkdir(parents=True)
    (cache / "warm").mkdir()
    fresh = cache / "roots" / ".build-1234-abc"
    fresh.mkdir()
    (fresh / "tree").mkdir()
    abandoned = cache / "warm" / ".build-5678-def"
    abandoned.mkdir()
    old = time.time() - 2 * 3600
    os.utime(abandoned, (old, old))
    unreadable = cache / "roots" / "dddd.json"  # a torn metadata file: left to its owner
    unreadable.write_text("{")

    sweep(cache)

    assert fresh.is_dir() and not abandoned.exists() and unreadable.exists()


def test_a_missing_cache_is_nothing_to_sweep(tmp_path: Path) -> None:
    assert sweep(tmp_path / "nowhere").removed == []


def test_beyond_the_bound_the_least_recently_used_go_with_their_warm_snapshots(
        tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    now = time.time()
    entries = {}
    for key, used_ago in (("old1", 7200), ("old2", 3600), ("recent", 60)):
        root, etc = _template(tmp_path, key)
        _image(cache, key, root, etc)
        warm = _warm(cache, f"w-{key}", key)
        for marker in (cache / "roots" / f"{key}.json", warm / "warm.json"):
            os.utime(marker, (now - used_ago, now - used_ago))
        entries[key] = warm
    group_bytes = sum(p.stat().st_blocks * 512 for p in cache.rglob("*") if p.is_file()) // 3

    # Room for two groups: only the least recently used goes.
    sweep(cache, max_bytes=2 * group_bytes, now=now)
    assert not (cache / "roots" / "old1.ext4").exists() and not entries["old1"].exists()
    assert (cache / "roots" / "old2.ext4").exists() and entries["old2"].exists()

    # Room for none: what was used in the last minutes stays all the same.
    sweep(cache, max_bytes=1, now=now)
    assert not (cache / "roots" / "old2.json").exists()
    assert (cache / "roots" / "recent.ext4").exists() and entries["recent"].exists()


def test_a_cache_hit_marks_the_entry_used(tmp_path: Path) -> None:
    from corral._backends.microvm import rootimage, warm

    cache = tmp_path / "cache"
    root, etc = _template(tmp_path, "t")
    _image(cache, "aaaa", root, etc)
    entry = _warm(cache, "w1", "aaaa")
    old = time.time() - 3600
    for marker in (cache / "roots" / "aaaa.json", entry / "warm.json"):
        os.utime(marker, (old, old))
    (entry / "warm.json").write_text(json.dumps({"root_image": "aaaa", "memory_mib": 128}))
    os.utime(entry / "warm.json", (old, old))

    assert rootimage._load(cache / "roots", "aaaa") is not None
    assert warm.find_warm(cache / "warm", "w1") is not None

    for marker in (cache / "roots" / "aaaa.json", entry / "warm.json"):
        assert marker.stat().st_mtime > old + 3000
