"""cgroup v1 and v2 behind one small interface: limits, placement, usage, reliable tree kill.

Layout, relative to each hierarchy's root: ``corral-<instance>/<sandbox>/<command>``. Limits live
on the sandbox group (so every command and, later, background processes share them); each command
gets its own child group so its usage can be read and its whole tree killed without names or pids.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ...errors import BackendError, BackendUnavailable
from ...models import ResourceTier

__all__ = ["CgroupDriver", "CgroupUsage", "detect_cgroups", "open_join_files"]

_V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")
_V2_CONTROLLERS = ("memory", "pids", "cpu")
_CFS_PERIOD_US = 100_000


@dataclass(frozen=True, slots=True)
class CgroupUsage:
    cpu_s: float
    peak_memory_bytes: int
    oom_killed: bool


@dataclass(frozen=True, slots=True)
class CgroupNow:
    """A sandbox's use at this moment: CPU time so far and memory now."""

    cpu_s: float
    memory_bytes: int


class CgroupDriver(Protocol):
    version: int

    def create_sandbox(self, group: str, tier: ResourceTier) -> None: ...
    def create_command(self, group: str) -> None: ...
    def attach(self, group: str, pids: Iterable[int]) -> None: ...
    def rename_command(self, group: str, new: str, pids: Iterable[int]) -> None:
        """Make ``group`` (holding ``pids``) the group ``new``, a sibling: a command's group
        made ahead takes the command's name."""
    def procs_files(self, group: str) -> list[Path]:
        """The ``cgroup.procs`` files a process is written to to join ``group`` (for a helper
        process that places its own child and should not load this driver)."""
        ...
    def join_files(self, group: str) -> list[Path]:
        """The files a process writes "0" to, to move itself into ``group`` (v1: each
        hierarchy's ``tasks``, where a thread moving itself takes no global lock)."""
        ...
    def usage(self, group: str) -> CgroupUsage: ...
    def now(self, group: str) -> CgroupNow: ...
    def kill(self, group: str) -> None: ...
    def freeze(self, group: str, frozen: bool) -> None: ...
    def remove(self, group: str) -> None: ...
    def remove_if_empty(self, group: str) -> bool:
        """Remove ``group`` if it has no child group and no process, never anything below
        it (a group made meanwhile by another process stays, and so does ``group``); whether
        it is gone."""
        ...
    def children(self, group: str) -> list[str]: ...
    def describe(self) -> str: ...


def open_join_files(cgroups: CgroupDriver, group: str) -> list[int]:
    """``group``'s ``join_files``, opened for writing (for a process that moves itself in:
    the files check the opener's credentials, so a sandbox's uid may write them); all or
    none."""
    opened: list[int] = []
    try:
        for path in cgroups.join_files(group):
            opened.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise
    return opened


def _keyed(path: Path | str, name: str) -> int:
    """The value of ``name`` in a ``key value`` per line file (cpu.stat, memory.events)."""
    for line in _read(path).splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return int(value)
    return 0


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: Path | str) -> str:
    # Raw reads: open() with its text layer cost a command's usage read a third of its time.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):  # a seq file may hand a long list out in parts
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(mount point, fstype, super options) for every cgroup mount."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = right.split()
            if fields and fields[0] in ("cgroup", "cgroup2"):
                found.append((left.split()[4], fields[0], fields[2].split(",")))
    return found


def _gone(exc: OSError) -> bool:
    """A group removed under us: ENOENT, or ENODEV for an open or listed group being deleted."""
    return exc.errno in (errno.ENOENT, errno.ENODEV)


def _read_procs(path: Path) -> str:
    try:
        return _read(path)
    except OSError as exc:
        if _gone(exc):
            return ""
        raise


# How long a kill lets a group that is emptying on its own finish before it freezes it.
_EXITING_S = 0.002


def _wait_empty(procs_files: list[Path], deadline_s: float = 5.0) -> bool:
    end = time.monotonic() + deadline_s
    delay = 0.0005
    while time.monotonic() < end:
        if all(not _read_procs(p).strip() for p in procs_files):
            return True
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    return False


def _groups(path: Path) -> list[Path]:
    """``path`` and every cgroup below it, parents first (d_type only: no stat per file)."""
    found = [path]
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    found.extend(_groups(Path(entry.path)))
    except FileNotFoundError:
        return []
    return found


def _procs(path: Path) -> list[int]:
    pids: list[int] = []
    for group in _groups(path):
        pids.extend(int(x) for x in _read_procs(group / "cgroup.procs").split())
    return pids


def _make(path: Path) -> None:
    """``mkdir -p`` of a group, again if its parent went in between: a process's clean exit
    removes the data directory's top group once it is empty (``remove_if_empty``)."""
    for attempt in range(3):
        try:
            path.mkdir(parents=True, exist_ok=True)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise


def _rmdir_if_empty(path: Path) -> bool:
    """One rmdir: False when the group holds a child group or a process (EBUSY)."""
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno in (errno.EBUSY, errno.ENOTEMPTY):
            return False
        raise BackendError(f"cannot remove cgroup {path}: {exc.strerror}") from exc
    return True


def _rmdir_tree(path: Path) -> None:
    """Remove a cgroup directory and its child groups, deepest first."""
    for attempt in range(50):
        try:
            path.rmdir()  # the common case: a leaf group, no walk needed
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno == errno.EBUSY and len(_groups(path)) > 1:
                for child in reversed(_groups(path)[1:]):
                    _rmdir_tree(child)
                continue
            if exc.errno != errno.EBUSY or attempt == 49:
                raise BackendError(f"cannot remove cgroup {path}: {exc.strerror}") from exc
            time.sleep(0.01)


class CgroupV1:
    """Separate v1 hierarchies (memory, pids, cpu, cpuacct, freezer), co-mounted or not."""

    version = 1

    def __init__(self, roots: dict[str, Path], prefix: str) -> None:
        self._roots = roots
        self._prefix = prefix
        self._hierarchies = sorted(set(roots.values()))
        # A command's group is named ~10 times over its life, in five hierarchies: joining
        # paths anew each time was a tenth of a command's cost in Python.
        self._paths = functools.lru_cache(maxsize=256)(self._join_all)
        self._path = functools.lru_cache(maxsize=1024)(self._join)

    def describe(self) -> str:
        return "cgroup v1: " + ", ".join(f"{c}={p}" for c, p in sorted(self._roots.items()))

    def _join_all(self, group: str) -> tuple[Path, ...]:
        return tuple(h / self._prefix / group for h in self._hierarchies)

    def _join(self, controller: str, group: str) -> Path:
        return self._roots[controller] / self._prefix / group

    def create_sandbox(self, group: str, tier: ResourceTier) -> None:
        for path in self._paths(group):
            _make(path)
        mem = self._path("memory", group)
        _write(mem / "memory.limit_in_bytes", str(tier.memory_bytes))
        if (mem / "memory.memsw.limit_in_bytes").exists():
            # memsw must be >= the memory limit; equal means "no swap at all".
            _write(mem / "memory.memsw.limit_in_bytes", str(tier.memory_bytes))
        with contextlib.suppress(OSError):
            _write(mem / "memory.swappiness", "0")
        _write(self._path("pids", group) / "pids.max", str(tier.pids))
        cpu = self._path("cpu", group)
        _write(cpu / "cpu.cfs_period_us", str(_CFS_PERIOD_US))
        _write(cpu / "cpu.cfs_quota_us", str(int(tier.cpus * _CFS_PERIOD_US)))

    def create_command(self, group: str) -> None:
        for path in self._paths(group):
            path.mkdir(parents=False, exist_ok=False)

    def attach(self, group: str, pids: Iterable[int]) -> None:
        pid_list = list(pids)
        for path in self._paths(group):
            for pid in pid_list:
                _write(path / "cgroup.procs", str(pid))

    def rename_command(self, group: str, new: str, pids: Iterable[int]) -> None:
        # A v1 rename moves no process: none of the RCU grace periods a move costs.
        done: list[tuple[Path, Path]] = []
        try:
            for old, dest in zip(self._paths(group), self._paths(new), strict=True):
                old.rename(dest)
                done.append((old, dest))
        except BaseException:
            for old, dest in done:
                dest.rename(old)
            raise

    def procs_files(self, group: str) -> list[Path]:
        return [path / "cgroup.procs" for path in self._paths(group)]

    def join_files(self, group: str) -> list[Path]:
        return [path / "tasks" for path in self._paths(group)]

    def now(self, group: str) -> CgroupNow:
        return CgroupNow(
            cpu_s=int(_read(self._path("cpuacct", group) / "cpuacct.usage")) / 1e9,
            memory_bytes=int(_read(self._path("memory", group) / "memory.usage_in_bytes")))

    def _usage_files(self, group: str) -> tuple[str, str, str]:
        mem = str(self._path("memory", group))
        return (f"{self._path('cpuacct', group)}/cpuacct.usage",
                f"{mem}/memory.max_usage_in_bytes", f"{mem}/memory.oom_control")

    def usage(self, group: str) -> CgroupUsage:
        cpu, peak, oom = self._usage_files(group)
        return CgroupUsage(cpu_s=int(_read(cpu)) / 1e9, peak_memory_bytes=int(_read(peak)),
                           oom_killed=_keyed(oom, "oom_kill") > 0)

    def kill(self, group: str) -> None:
        try:
            self._kill(group)
        except OSError as exc:
            if not _gone(exc):
                raise
            # The group went away under us: its processes are gone with it.

    def _kill(self, group: str) -> None:
        freezer = self._path("freezer", group)
        if not freezer.is_dir():
            self._kill_unfrozen(group)
            return
        if not _procs(freezer):
            # Nothing to kill (or no group). Worth the check: freezing a group whose children
            # were just removed can sit in FREEZING for tens of milliseconds.
            return
        if _wait_empty([g / "cgroup.procs" for g in _groups(freezer)], _EXITING_S):
            # A command's init that has just reported and is exiting (its PID namespace
            # with it): freezing and thawing it would cost more than its exit.
            return
        if _read(freezer / "freezer.parent_freezing").strip() == "1":
            # Frozen from above (its sandbox is paused): SIGKILL is not delivered until the
            # sandbox thaws, and this group's THAWED cannot thaw it. Say so at once instead
            # of retrying for a minute (a destroy thaws the sandbox first).
            raise BackendError(f"cannot kill the processes of cgroup {group} while its "
                               "sandbox is paused; resume or destroy the sandbox (a destroy "
                               "thaws it first)")
        # Freeze first so nothing can fork while we collect pids, then kill every pid, then thaw
        # so the kernel can deliver SIGKILL.
        _write(freezer / "freezer.state", "FROZEN")
        end = time.monotonic() + 2.0
        while _read(freezer / "freezer.state").strip() != "FROZEN" and time.monotonic() < end:
            time.sleep(0.0005)
        for _ in range(100):
            pids = _procs(freezer)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _write(freezer / "freezer.state", "THAWED")
            if _wait_empty([g / "cgroup.procs" for g in _groups(freezer)], 0.5):
                break
            _write(freezer / "freezer.state", "FROZEN")
        _write(freezer / "freezer.state", "THAWED")
        if not _wait_empty([p / "cgroup.procs" for p in self._paths(group)]):
            raise BackendError(f"processes of cgroup {group} survived SIGKILL")

    def _kill_unfrozen(self, group: str) -> None:
        """Kill what a group holds in the hierarchies it is still in, without the freezer:
        what a crash between two hierarchies' renames or removals leaves (its processes,
        if any are left, are under another name in the freezer)."""
        for _ in range(100):
            pids = [pid for path in self._paths(group) for pid in _procs(path)]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if _wait_empty([g / "cgroup.procs" for p in self._paths(group) for g in _groups(p)],
                           0.5):
                return
        raise BackendError(f"processes of cgroup {group} survived SIGKILL")

    def freeze(self, group: str, frozen: bool) -> None:
        state = self._path("freezer", group) / "freezer.state"
        want = "FROZEN" if frozen else "THAWED"
        _write(state, want)
        end = time.monotonic() + 5.0
        while _read(state).strip() != want:
            if time.monotonic() > end:
                raise BackendError(f"cgroup {group} did not become {want}")
            time.sleep(0.001)

    def remove(self, group: str) -> None:
        for path in self._paths(group):
            _rmdir_tree(path)

    def remove_if_empty(self, group: str) -> bool:
        return all([_rmdir_if_empty(path) for path in self._paths(group)])

    def children(self, group: str) -> list[str]:
        # Every hierarchy, not one: a group is made, renamed and removed one hierarchy at a
        # time, so a process killed in between leaves it in some and not others, and the
        # sweep must still find it.
        names: set[str] = set()
        for path in self._paths(group):
            try:
                with os.scandir(path) as entries:
                    names.update(e.name for e in entries if e.is_dir(follow_symlinks=False))
            except FileNotFoundError:
                continue
        return sorted(names)


class CgroupV2:
    """The unified hierarchy with memory, pids and cpu delegated to our subtree."""

    version = 2

    def __init__(self, root: Path, prefix: str) -> None:
        self._root = root
        self._base = root / prefix

    def describe(self) -> str:
        return f"cgroup v2: {self._root}"

    def _enable(self, path: Path) -> None:
        _write(path / "cgroup.subtree_control", " ".join(f"+{c}" for c in _V2_CONTROLLERS))

    def create_sandbox(self, group: str, tier: ResourceTier) -> None:
        if not self._base.exists():
            self._base.mkdir()
        self._enable(self._root)
        self._enable(self._base)
        path = self._base / group
        path.mkdir(exist_ok=True)
        self._enable(path)
        _write(path / "memory.max", str(tier.memory_bytes))
        if (path / "memory.swap.max").exists():
            _write(path / "memory.swap.max", "0")
        _write(path / "pids.max", str(tier.pids))
        _write(path / "cpu.max", f"{int(tier.cpus * _CFS_PERIOD_US)} {_CFS_PERIOD_US}")

    def create_command(self, group: str) -> None:
        (self._base / group).mkdir(exist_ok=False)

    def attach(self, group: str, pids: Iterable[int]) -> None:
        for pid in pids:
            _write(self._base / group / "cgroup.procs", str(pid))

    def rename_command(self, group: str, new: str, pids: Iterable[int]) -> None:
        # The unified hierarchy cannot rename a group: the processes move instead.
        self.create_command(new)
        try:
            self.attach(new, pids)
        except BaseException:
            _rmdir_tree(self._base / new)
            raise
        _rmdir_tree(self._base / group)

    def procs_files(self, group: str) -> list[Path]:
        return [self._base / group / "cgroup.procs"]

    def join_files(self, group: str) -> list[Path]:
        return self.procs_files(group)

    def now(self, group: str) -> CgroupNow:
        path = self._base / group
        return CgroupNow(cpu_s=_keyed(path / "cpu.stat", "usage_usec") / 1e6,
                         memory_bytes=int(_read(path / "memory.current")))

    def usage(self, group: str) -> CgroupUsage:
        path = self._base / group
        peak_file = path / "memory.peak"
        peak = int(_read(peak_file)) if peak_file.exists() else int(_read(path / "memory.current"))
        return CgroupUsage(cpu_s=_keyed(path / "cpu.stat", "usage_usec") / 1e6,
                           peak_memory_bytes=peak,
                           oom_killed=_keyed(path / "memory.events", "oom_kill") > 0)

    def kill(self, group: str) -> None:
        path = self._base / group
        if not _procs(path):
            return
        try:
            _write(path / "cgroup.kill", "1")
        except OSError as exc:
            if _gone(exc):
                return
            raise
        if not _wait_empty([g / "cgroup.procs" for g in _groups(path)]):
            raise BackendError(f"processes of cgroup {group} survived cgroup.kill")

    def freeze(self, group: str, frozen: bool) -> None:
        path = self._base / group
        _write(path / "cgroup.freeze", "1" if frozen else "0")
        end = time.monotonic() + 5.0
        want = f"frozen {1 if frozen else 0}"
        while want not in _read(path / "cgroup.events"):
            if time.monotonic() > end:
                raise BackendError(f"cgroup {group} did not {'freeze' if frozen else 'thaw'}")
            time.sleep(0.001)

    def remove(self, group: str) -> None:
        _rmdir_tree(self._base / group)

    def remove_if_empty(self, group: str) -> bool:
        return _rmdir_if_empty(self._base / group)

    def children(self, group: str) -> list[str]:
        path = self._base / group
        if not path.exists():
            return []
        return sorted(p.name for p in path.iterdir() if p.is_dir())


def detect_cgroups(prefix: str) -> CgroupDriver:
    """Pick v2 when its controllers are usable, else v1; refuse clearly when neither is complete."""
    mounts = _mounts()
    for point, fstype, _ in mounts:
        if fstype != "cgroup2":
            continue
        root = Path(point)
        available = set(_read(root / "cgroup.controllers").split())
        if set(_V2_CONTROLLERS) <= available:
            if _has_v1_for(mounts, _V2_CONTROLLERS):
                # A controller bound to v1 is unavailable to v2 even when listed; prefer v1 then.
                break
            return CgroupV2(root, prefix)
    roots: dict[str, Path] = {}
    for point, fstype, options in mounts:
        if fstype == "cgroup":
            for controller in _V1_CONTROLLERS:
                if controller in options:
                    roots.setdefault(controller, Path(point))
    missing = [c for c in _V1_CONTROLLERS if c not in roots]
    if missing:
        raise BackendUnavailable(
            "no usable cgroup hierarchy: cgroup v2 lacks the memory, pids or cpu controller and "
            f"cgroup v1 lacks {', '.join(missing)}; mount them (v2: enable the controllers in "
            "/sys/fs/cgroup/cgroup.subtree_control; v1: mount each controller) and run "
            "`corral doctor`"
        )
    return CgroupV1(roots, prefix)


def _has_v1_for(mounts: list[tuple[str, str, list[str]]], controllers: Iterable[str]) -> bool:
    wanted = set(controllers)
    return any(fstype == "cgroup" and wanted & set(opts) for _, fstype, opts in mounts)
