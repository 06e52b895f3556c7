"""One long-running Corral instance per data directory, unless it is shared knowingly.

``corral serve`` and ``corral mcp`` run for hours, each with its own reaper, recovery and
spare workspaces over the data directory. A second one started there by mistake (an MCP client
passes its server none of the caller's environment, so ``CORRAL_HOME`` was lost and the
default directory, a running service's, was used) works on the first one's sandboxes without
anyone having decided so. So each holds a lock in the data directory for its whole life, and
the next one is refused with the holder's pid and command unless told to share.

Short commands (``corral run``, ``ls``) take no lock: they work beside a running service.

Layout: ``<home>/instances/<pid>-<random>.lock``, one per running instance, ``flock``ed
exclusively by its process for its life and holding a JSON line (pid, command, start). The
kernel drops a ``flock`` when its holder dies, SIGKILL included, so a crashed instance's file is
found stale by locking it, and removed. ``instances/.gate`` is held while an instance looks and
takes, so two starting at once cannot both find the directory free.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from ..errors import ConfigError

__all__ = ["Holder", "InstanceLock", "hold_home", "instances_using"]

_DIR = "instances"
_GATE = ".gate"
_GATE_WAIT_S = 10.0  # held for the time of a directory listing: a long wait means a stuck peer


@dataclass(frozen=True, slots=True)
class Holder:
    """A running instance as its lock file records it."""

    pid: int
    command: str
    started_at: float

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started_at))
        return f"pid {self.pid} ({self.command}), since {since}"


class InstanceLock:
    """This process's hold on a data directory; ``release`` (or the process's end) lets go."""

    def __init__(self, path: Path, fd: int, others: list[Holder]) -> None:
        self.path = path
        self._fd: int | None = fd
        self.others = others
        """Instances already there when this one started (only when sharing knowingly)."""

    def release(self) -> None:
        if self._fd is None:
            return
        # Unlinked first, while still locked: a peer probing it then finds a lock, never a
        # file it could mistake for a crashed instance's and remove under us.
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> InstanceLock:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def _command_line() -> str:
    """This process's command line, as ``ps`` shows it (shortened: it goes into messages)."""
    try:
        args = Path("/proc/self/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        text = shlex.join(a.decode(errors="replace") for a in args)
    except OSError:
        text = "?"
    return text if len(text) <= 200 else text[:197] + "..."


def _read(fd: int) -> Holder | None:
    try:
        data = json.loads(os.pread(fd, 4096, 0))
        return Holder(pid=int(data["pid"]), command=str(data["command"]),
                      started_at=float(data["started_at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _probe(path: Path) -> Holder | None:
    """The live instance holding ``path``; None (and the file removed) when none does."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)  # RDWR: NFS locks exclusively only so
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read(fd) or Holder(pid=0, command=f"unreadable {path.name}",
                                       started_at=os.fstat(fd).st_mtime)
        path.unlink(missing_ok=True)  # its process is gone: a stale file
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def _gate(directory: Path) -> Iterator[None]:
    fd = os.open(directory / _GATE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + _GATE_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ConfigError(
                        f"{directory / _GATE} has been locked for {_GATE_WAIT_S:.0f} s by a "
                        f"Corral instance starting there that does not finish (`fuser "
                        f"{directory / _GATE}` names it)") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)


def _live(directory: Path) -> list[Holder]:
    found = []
    for path in sorted(directory.glob("*.lock")):
        holder = _probe(path)
        if holder is not None:
            found.append(holder)
    return found


def instances_using(home: Path) -> list[Holder]:
    """The Corral instances holding ``home`` now (``corral serve --check-config`` reports them
    before a start that ``hold_home`` would refuse)."""
    directory = home / _DIR
    if not directory.is_dir():
        return []
    with _gate(directory):
        return _live(directory)


def hold_home(home: Path, command: str, *, share: bool = False,
              override: str | None = "--share-home") -> InstanceLock:
    """Lock ``home`` for this process's life as the instance ``command`` (``corral mcp``).

    Raises ``ConfigError`` naming the other instances when some already run there, unless
    ``share``; ``override`` is the option the message tells the operator to pass for that
    (None: the command has none, and the message says to stop the other instance).
    """
    home.mkdir(parents=True, exist_ok=True, mode=0o711)  # as Settings.instance_tag makes it
    directory = home / _DIR
    directory.mkdir(mode=0o700, exist_ok=True)
    with _gate(directory):
        others = _live(directory)
        if others and not share:
            share_how = ("stop that instance first" if override is None else
                         f"pass {override} to share this one knowingly (both then reap and "
                         "recover the same sandboxes)")
            listed = "; ".join(h.describe() for h in others)
            raise ConfigError(
                f"the data directory {home} is in use by another Corral instance: {listed}. "
                f"Give this one a data directory of its own (corral --home DIR ..., or CORRAL_HOME "
                f"in its environment: an MCP client passes its server none of your shell's, so "
                f"set it in the client's configuration) with sandbox uids of its own "
                f"(CORRAL_UID_START: two directories' ranges must not overlap), or {share_how}")
        path = directory / f"{os.getpid()}-{secrets.token_hex(4)}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            record = {"pid": os.getpid(), "command": f"{command}: {_command_line()}",
                      "started_at": time.time()}
            os.write(fd, (json.dumps(record) + "\n").encode())
        except BaseException:
            path.unlink(missing_ok=True)
            os.close(fd)
            raise
        return InstanceLock(path, fd, others)
