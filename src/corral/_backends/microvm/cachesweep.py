"""Keeps the microVM cache bounded: root images nobody can reach any more go, and beyond a
size bound (``Settings.microvm_cache_max_bytes``) the least recently used go too.

A root image's key covers its template's resolved root and ``/etc`` (``rootimage._key``), so
once either directory is removed (``corral templates rm``, a data directory deleted, a test's
temporary home) no lookup can hit the image again. And the ``/etc`` of the microVM tier's own
base template carries each data directory's egress CA, so every data directory sharing the
cache makes an image (~200-300 MiB) and a warm snapshot (~75 MiB) of its own. Unswept, these
reached 69 GiB on a development host and filled its disk (a CI run's template build then
failed in dpkg). A sweep runs after every root image build. Eviction is safe: an image is
made again identically (fixed UUID and hash seed) and a warm snapshot again by one boot; a
running VM keeps the files it has open.

Layout (the cache directory, ``Settings.microvm_cache``)::

    roots/<key>.json + <key>.ext4    rootimage.py: the json names the template's root
    warm/<key>/warm.json             warm.py: names the root image it was made from
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SweepReport", "sweep"]

log = logging.getLogger(__name__)

# A ``.build-*`` directory this old belongs to a build that was killed (a root image builds
# in seconds, a warm snapshot in at most its boot timeout): nobody will finish it.
_ABANDONED_BUILD_S = 3600.0
# An entry used this recently is never evicted for size: a create that has just found it may
# not have opened it yet.
_RECENT_USE_S = 600.0


@dataclass(slots=True)
class SweepReport:
    removed: list[Path] = field(default_factory=list)
    freed_bytes: int = 0


def _size(path: Path) -> int:
    if path.is_dir() and not path.is_symlink():
        return sum(p.stat().st_blocks * 512 for p in path.rglob("*")
                   if p.is_file() and not p.is_symlink())
    return path.lstat().st_blocks * 512


def _remove(path: Path, report: SweepReport) -> None:
    try:
        size = _size(path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return  # another sweep got there first
    report.removed.append(path)
    report.freed_bytes += size


def _dead_roots(roots: Path, report: SweepReport) -> set[str]:
    """Removes root images whose template root or ``/etc`` is gone (both paths are in the
    key); returns the keys that remain."""
    live: set[str] = set()
    for meta_path in roots.glob("*.json"):
        key = meta_path.stem
        try:
            meta = json.loads(meta_path.read_text())
            sources = (Path(meta["root"]), Path(meta["etc"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable: leave it to its owner (it is never loaded either)
        if all(source.is_dir() for source in sources):
            live.add(key)
            continue
        # Metadata first: an image without its metadata is never loaded (rootimage._load).
        _remove(meta_path, report)
        _remove(roots / f"{key}.ext4", report)
    for image in roots.glob("*.ext4"):
        if image.stem not in live and not (roots / f"{image.stem}.json").exists():
            _remove(image, report)  # an image whose metadata a sweep or a crash removed
    return live


@dataclass(slots=True)
class _Group:
    """A root image and the warm snapshots made from it: evicted together."""

    paths: list[Path] = field(default_factory=list)
    size: int = 0
    last_used: float = 0.0

    def add(self, path: Path, used_marker: Path) -> None:
        self.paths.append(path)
        self.size += _size(path)
        try:
            self.last_used = max(self.last_used, used_marker.stat().st_mtime)
        except FileNotFoundError:
            pass


def _dead_warm(warm: Path, live_roots: set[str], report: SweepReport,
               groups: dict[str, _Group]) -> None:
    for entry in warm.iterdir():
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            root_key = json.loads((entry / "warm.json").read_text())["root_image"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if root_key not in live_roots:
            _remove(entry, report)
        else:
            groups[root_key].add(entry, entry / "warm.json")


def _least_recently_used(groups: dict[str, _Group], max_bytes: int, used_before: float,
                         report: SweepReport) -> None:
    total = sum(group.size for group in groups.values())
    for group in sorted(groups.values(), key=lambda g: g.last_used):
        if total <= max_bytes:
            break
        if group.last_used >= used_before:
            break  # the rest were used lately: a create may be about to open them
        for path in group.paths:
            _remove(path, report)
        total -= group.size


def _abandoned_builds(directory: Path, now: float, report: SweepReport) -> None:
    for entry in directory.glob(".build-*"):
        try:
            age = now - entry.stat().st_mtime
        except FileNotFoundError:
            continue
        if age > _ABANDONED_BUILD_S:
            _remove(entry, report)


def sweep(cache: Path, *, max_bytes: int = 0, now: float | None = None) -> SweepReport:
    """Removes what no lookup can reach any more from the microVM cache at ``cache``, then,
    beyond ``max_bytes`` (0: no bound), the least recently used root images with their warm
    snapshots (made again, identically, when next needed)."""
    now = time.time() if now is None else now
    report = SweepReport()
    roots, warm = cache / "roots", cache / "warm"
    live = _dead_roots(roots, report) if roots.is_dir() else set()
    groups = {key: _Group() for key in live}
    for key, group in groups.items():
        # Metadata first: removed in that order, an image is never loaded half-gone.
        group.add(roots / f"{key}.json", roots / f"{key}.json")
        group.add(roots / f"{key}.ext4", roots / f"{key}.json")
    if warm.is_dir():
        _dead_warm(warm, live, report, groups)
    if max_bytes:
        _least_recently_used(groups, max_bytes, now - _RECENT_USE_S, report)
    for directory in (roots, warm):
        if directory.is_dir():
            _abandoned_builds(directory, now, report)
    if report.removed:
        log.info("microVM cache: removed %d entries (%d MiB)",
                 len(report.removed), report.freed_bytes >> 20)
    return report

