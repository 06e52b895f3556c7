"""What a tier learned about the host, remembered for this boot.

A tier checks the host before its first sandbox (``check_host``): from ~25 ms for the
namespace tier's tools to a second for gVisor, which starts a real sandbox. Every CLI call is
a new process, so without a memory each one paid that again. The answers hold until the host
changes under them, so a passing answer is recorded in ``<home>/hostchecks/<tier>.json`` and
reused while everything it depends on is unchanged (``HostKey``):

* the boot (``/proc/sys/kernel/random/boot_id``), the kernel release and the effective uid;
* the identity of every program the checks vetted and of every other file they read (path,
  device, inode, size, mtime, ctime, mode, owner): an upgraded, replaced, removed or chmod'ed
  binary changes it, and so does an edit of the check code itself (its source files are part
  of every key);
* the tier's own version of its checks, and the settings and sysctls they read.

Only a pass is recorded, so a cache never makes a broken host look fine. A failure is checked
again by the next process (an operator who fixed the host sees it at once); within one
process it is reused for ``FAILURE_TTL_S`` only, so a service's reaper does not start a probe
sandbox at every pass over a tier that cannot run. A pass whose program has gone since makes
a new key, so the real checks run and fail with their own message; one that goes between the
key and its use fails there, as it would without a cache.

The file is a cache: it is written whole to a temporary file and renamed over the old one
(readers see one whole answer or the other; concurrent writers: the last one wins), anything
unreadable or foreign in it counts as absent, and failing to write it (a full disk) costs only
the saving. ``corral doctor`` always runs the real checks and records what they find.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...backends import HostCheck

__all__ = ["FAILURE_TTL_S", "HostKey", "TierChecks", "boot_id", "file_identity", "which"]

logger = logging.getLogger(__name__)

# How long one process reuses a failed answer (see the module docstring).
FAILURE_TTL_S = 30.0
# The layout of the file; a file of another format is ignored (and replaced at the next pass).
_FORMAT = 1
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
# Every key covers the code that makes and reads the answers.
_OWN_SOURCES = (Path(__file__), Path(__file__).with_name("hostcheck.py"))


def boot_id() -> str | None:
    """This boot's id, or None where the kernel does not say (then nothing is remembered)."""
    try:
        return _BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def file_identity(path: str | Path | None) -> list[str | int] | None:
    """What changes when the file at ``path`` (symlinks followed) is replaced, rewritten,
    moved, chmod'ed or chown'ed; None when there is no such file."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
            st.st_ctime_ns, st.st_mode, st.st_uid]


def which(*names: str) -> dict[str, str | None]:
    """Each program's path on this process's PATH (None when missing)."""
    return {name: shutil.which(name) for name in names}


@dataclass(frozen=True, slots=True)
class HostKey:
    """What a tier's answer depends on besides the boot and the kernel.

    ``programs`` maps a name to the path the checks found (None: missing); ``files`` are any
    other files the checks read or vetted (the tier's check module among them); ``values``
    are whatever else they read that is cheap to read again (settings, sysctls).
    """

    tier: str
    version: str
    programs: Mapping[str, str | None] = field(default_factory=dict)
    files: Iterable[Path] = ()
    values: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> dict[str, Any] | None:
        """Everything the answer depends on, as JSON data; None when the boot is unknown."""
        from ... import __version__  # here: this module loads while the package does

        boot = boot_id()
        if boot is None:
            return None
        return {
            "format": _FORMAT, "corral": __version__, "tier": self.tier,
            "version": self.version, "boot": boot, "kernel": os.uname().release,
            "euid": os.geteuid(),
            "programs": {name: file_identity(path)
                         for name, path in sorted(self.programs.items())},
            "files": {str(path): file_identity(path)
                      for path in sorted({*_OWN_SOURCES, *self.files})},
            "values": dict(sorted(self.values.items())),
        }


def _digest(described: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def _checks_of(data: Any) -> list[HostCheck] | None:
    """The checks stored in ``data``, or None if anything in it is not what we write."""
    try:
        checks = [HostCheck(name=str(c["name"]), ok=c["ok"] is True, detail=str(c["detail"]),
                            fix=str(c.get("fix", "")),
                            extra={str(k): str(v) for k, v in dict(c.get("extra", {})).items()})
                  for c in data["checks"]]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return checks if checks and all(c.ok for c in checks) else None


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write(path: Path, data: Mapping[str, Any]) -> None:
    """Whole or not at all: a temporary file beside ``path``, renamed over it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# path -> (key digest, when, the failed answer): this process's recent failures.
_failures: dict[Path, tuple[str, float, list[HostCheck]]] = {}
_failures_lock = threading.Lock()


class TierChecks:
    """One tier's host checks in one data directory: ``cached`` for the hot path, ``fresh``
    for ``corral doctor``."""

    def __init__(self, path: Path, key: Callable[[], HostKey],
                 run: Callable[[], list[HostCheck]]) -> None:
        self.path = path
        self._key = key  # computed at each call: the programs may change under a process
        self._run = run

    def cached(self) -> list[HostCheck]:
        """The checks' answer: the recorded pass when nothing it depends on changed, a
        failure of this process's from the last ``FAILURE_TTL_S``, else the real checks."""
        described = self._key().describe()
        if described is None:
            return self._run()
        digest = _digest(described)
        data = _read(self.path)
        if data is not None and data.get("key") == digest:
            checks = _checks_of(data)
            if checks is not None:
                return checks
        with _failures_lock:
            failed = _failures.get(self.path)
        if failed is not None and failed[0] == digest \
                and time.monotonic() - failed[1] < FAILURE_TTL_S:
            return failed[2]
        return self._record(digest, described, self._run())

    def fresh(self) -> list[HostCheck]:
        """The real checks, run now; their answer replaces what was recorded."""
        described = self._key().describe()
        checks = self._run()
        if described is not None:
            self._record(_digest(described), described, checks)
        return checks

    def recorded(self) -> bool:
        """Whether a pass for this boot, these programs and this code is on record."""
        described = self._key().describe()
        data = _read(self.path)
        return (described is not None and data is not None
                and data.get("key") == _digest(described) and _checks_of(data) is not None)

    def _record(self, digest: str, described: Mapping[str, Any],
                checks: list[HostCheck]) -> list[HostCheck]:
        passed = bool(checks) and all(c.ok for c in checks)
        with _failures_lock:
            if passed:
                _failures.pop(self.path, None)
            else:
                _failures[self.path] = (digest, time.monotonic(), checks)
        try:
            if passed:
                _write(self.path, {
                    "key": digest, "host": described, "checked_at": time.time(),
                    "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail, "fix": c.fix,
                                "extra": c.extra} for c in checks]})
            else:
                # A pass recorded earlier (another boot's, or before the host broke) must
                # not outlive a failure seen now.
                self.path.unlink(missing_ok=True)
        except OSError as exc:  # a full or read-only disk: only the saving is lost
            logger.debug("host checks of %s not recorded in %s: %s", described["tier"],
                         self.path, exc)
        return checks
