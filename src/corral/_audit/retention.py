"""Retention of the trails of destroyed sandboxes: by age and by their total size.

A trail is a destroyed sandbox's when the control plane no longer knows the sandbox (asked
for each trail just before it is removed, so a sandbox made meanwhile is never touched) and
its last event is ``sandbox.destroyed``, or, for a trail a crash left without that ending, when
nothing has been written to it for ``settle_s``. A live sandbox's trail is never removed: its
budget bounds it. Age is the time since the trail's last write (its destruction, as a rule).
Past ``max_age_s`` a trail is removed; then, while the destroyed trails add up to more than
``max_total_bytes``, the oldest go first.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .._core.fsafe import remove_special
from .log import _last_line

__all__ = ["PruneReport", "Pruned", "prune"]

_TRAIL = re.compile(r"^(sbx_[0-9a-z]{12})\.jsonl$")
# A trail without its ending (a crash mid-destroy, an interrupted create) counts as a destroyed
# sandbox's only after this long without a write: a destroy under way writes its end within
# seconds.
SETTLE_S = 3600.0


@dataclass(frozen=True, slots=True)
class Pruned:
    """A trail removed (or, in a dry run, that would be)."""

    sandbox_id: str
    bytes: int
    age_s: float
    reason: Literal["age", "size"]

    def to_dict(self) -> dict[str, Any]:
        return {"sandbox": self.sandbox_id, "bytes": self.bytes, "age_s": round(self.age_s, 1),
                "reason": self.reason}


@dataclass(slots=True)
class PruneReport:
    """What a prune did: removed trails, and what is left (destroyed and live)."""

    removed: list[Pruned] = field(default_factory=list)
    kept: int = 0  # destroyed sandboxes' trails left
    kept_bytes: int = 0
    live: int = 0  # trails of sandboxes the control plane knows (never removed)
    live_bytes: int = 0
    unsettled: int = 0  # without an ending and written to within SETTLE_S: left alone
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "removed": [p.to_dict() for p in self.removed],
                "removed_bytes": sum(p.bytes for p in self.removed),
                "kept": self.kept, "kept_bytes": self.kept_bytes, "live": self.live,
                "live_bytes": self.live_bytes, "unsettled": self.unsettled}


@dataclass(frozen=True, slots=True)
class _Trail:
    sandbox_id: str
    path: Path
    size: int
    mtime: float


def _ended(path: Path, size: int) -> bool:
    """Whether the trail's last complete line is ``sandbox.destroyed``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        line, _ = _last_line(fd, size)
    finally:
        os.close(fd)
    try:
        return bool(json.loads(line).get("type") == "sandbox.destroyed")
    except (ValueError, AttributeError):
        return False


def prune(directory: Path, *, is_live: Callable[[str], bool], max_age_s: float,
          max_total_bytes: int, dry_run: bool = False, now: float | None = None,
          settle_s: float = SETTLE_S) -> PruneReport:
    """Remove the trails of destroyed sandboxes past ``max_age_s`` (0: no age limit), then the
    oldest while they add up to more than ``max_total_bytes`` (0: no limit)."""
    now = time.time() if now is None else now
    report = PruneReport(dry_run=dry_run)
    destroyed: list[_Trail] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return report
    for entry in entries:
        found = _TRAIL.match(entry.name)
        if found is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            # No trail (a trail is a regular file), and never opened: a FIFO's open would
            # wait for a writer, and the reaper with it. A special file is removed.
            if not dry_run:
                remove_special(entry.path)
            continue
        trail = _Trail(found.group(1), Path(entry.path), st.st_size, st.st_mtime)
        if is_live(trail.sandbox_id):
            report.live += 1
            report.live_bytes += trail.size
        elif now - trail.mtime >= settle_s or _ended(trail.path, trail.size):
            destroyed.append(trail)
        else:
            report.unsettled += 1
    destroyed.sort(key=lambda t: t.mtime)  # oldest first
    total = sum(t.size for t in destroyed)
    for trail in destroyed:
        age = now - trail.mtime
        reason: Literal["age", "size"] | None = None
        if max_age_s > 0 and age > max_age_s:
            reason = "age"
        elif max_total_bytes > 0 and total > max_total_bytes:
            reason = "size"
        # Asked again right before removing: never a trail whose sandbox exists now.
        if reason is None or is_live(trail.sandbox_id):
            report.kept += 1
            report.kept_bytes += trail.size
            continue
        if not dry_run:
            try:
                trail.path.unlink()
            except FileNotFoundError:  # another pruner was first
                pass
        total -= trail.size
        report.removed.append(Pruned(trail.sandbox_id, trail.size, age, reason))
    return report
