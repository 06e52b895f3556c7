"""The guest agent: runs inside the microVM as root (``python3 -I -S /corral/agent.py``), never on
the host. Standard library only: it runs on the template's python3, not Corral's virtualenv.

It speaks the agent protocol of ``notes/contract14.md`` (JSON lines on the virtio-serial port
``corral.agent``): commands (``exec`` and the ops on a running one), the ``fs.*`` file operations,
the egress tunnel and the lifecycle ops. Everything is multiplexed: the reader thread only parses
and routes, anything that can block (a command, a file operation, a socket) has its own thread,
ordered streams (stdin of a command, chunks of a file write, data of a tunnel connection) go
through a per-stream ``Lane`` with a byte bound, and writes to the channel are serialized.

Where this agent differs from (or adds to) the contract:

* ``fs.list`` and ``fs.walk`` can exceed the 4 MiB line limit (100 000 entries), so they send
  ``{"id", "more": [ENTRY...]}`` batches of at most ``BATCH_ENTRIES`` entries before the final
  ``{"id", "ok": [ENTRY...]}`` with the rest: the result is the concatenation. Over
  ``MAX_WALK_ENTRIES`` entries or ``MAX_WALK_DEPTH`` levels the reply is a ``too_large`` error.
* The channel is ``/dev/virtio-ports/corral.agent`` when udev made that link; the guest has no
  udev, so the agent finds the port by its name in ``/sys/class/virtio-ports`` (``/dev/vportNpM``).
* ``ready`` is sent at start and again when the agent saw the host end hang up and come back
  (reads EOF, then the port stops polling POLLHUP). A quick close-and-reconnect can hide the
  hang-up from the guest, and the agent cannot see a restore itself, so a host that connects to
  a running guest sends ``{"id", "op": "ping"}`` (→ ``{"id", "ok": true}``) rather than wait for
  ``ready``, and ``resume`` after a restore.
* ``resume`` also detaches the commands running at snapshot time: they keep running (and count
  as ``orphans`` in ``procs``) but send nothing more, and open write handles and tunnel
  connections of the old session are dropped.
* Ops the channel may carry while a previous slow op runs (more than ``MAX_INFLIGHT`` file or
  lifecycle ops at once, a stream lane over its bound) get a ``busy`` error rather than queue.
* ``kill`` of an exec whose ``started`` has not been sent yet answers true and kills the command
  the moment it is placed (its ``exit`` then has signal 9).
* A write handle that failed (e.g. ``no_space``) is gone: later ops on it get a ``protocol``
  error naming it. An unknown exec ``timeout`` of null means no time limit.
* A command's cgroup is ``cmd/<id>``, or ``cmd/<id>.<n>`` when a group of that name is still
  alive (an orphan from before a restore).
* Port connections, the tunnel's other direction: ``{"conn", "op": "tcp.connect", "port",
  "timeout"}`` from the host (its ids are negative, the guest's own are positive, so the two
  never meet) makes the agent connect to ``127.0.0.1:<port>`` in the guest and answer
  ``{"conn", "opened": true}`` or ``{"conn", "closed": true, "error", "kind"}`` (kind
  ``port_closed`` when nothing accepts in time, ``busy`` past ``MAX_PORT_CONNS``). From then on
  ``data``/``eof``/``closed`` flow as on the egress tunnel, plus ``{"conn", "ack": n}`` each way
  once n bytes reached the far socket: neither side has more than ``PORT_WINDOW`` bytes unacked
  in flight, so a slow reader at either end slows the sender instead of filling a queue. Port
  connections belong to no command; they end with the VM (or a ``resume``).

The overrides ``CORRAL_AGENT_CHANNEL=fd:N``, ``CORRAL_AGENT_WORKSPACE``, ``CORRAL_AGENT_CGROUP``
and ``CORRAL_AGENT_RUN`` exist for the host-side unit tests only (the guest's init starts the
agent with a fixed environment). With any of them set the agent is in test mode: cgroup
controllers that are missing are skipped instead of refusing the command, and ``resume`` leaves
the clock and the hostname alone.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import posixpath
import queue
import secrets
import select
import socket
import stat as stat_mod
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

AGENT_VERSION = 1
PORT_PATH = "/dev/virtio-ports/corral.agent"
WORKSPACE = "/workspace"
HOME = "/home/user"
USER_ID = 1000
MAX_LINE = 4 << 20
CHUNK = 64 << 10
MAX_READ = 1 << 20
MAX_WALK_ENTRIES = 100_000
MAX_WALK_DEPTH = 256
BATCH_ENTRIES = 2000
MAX_INFLIGHT = 64
MAX_HANDLES = 64
MAX_CONNS_PER_COMMAND = 64
MAX_PORT_CONNS = 256
PORT_WINDOW = 256 << 10
STDIN_PENDING = 8 << 20
WRITE_PENDING = 16 << 20
CONN_PENDING = 4 << 20
MAX_ARG_STRLEN = 128 << 10
MAX_ARGS_TOTAL = 1 << 20

_RESOLVE_NO_XDEV, _RESOLVE_NO_MAGICLINKS, _RESOLVE_BENEATH = 0x01, 0x02, 0x08
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_XDEV
_SYS_OPENAT2 = 437
_MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND = 0x2, 0x4, 0x20, 0x1000
_RNDADDENTROPY = 0x40085203
_RNDRESEEDCRNG = 0x5207
_BLKFLSBUF = 0x1261
_FIFREEZE, _FITHAW = 0xC0045877, 0xC0045878

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syncfs.argtypes = [ctypes.c_int]

Message = dict[str, Any]


class AgentError(Exception):
    """A request failed; ``kind`` is one of the contract's error kinds."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def _log(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"corral-agent: {text}\n".encode(errors="replace"))


# -- Linux calls Python 3.11 lacks --------------------------------------------------------------

class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str, flags: int, mode: int = 0, resolve: int = _RESOLVE) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd),
                       ctypes.c_char_p(os.fsencode(path)), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


def syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
    finally:
        os.close(fd)


def _mount(source: str, target: str, fstype: str | None, flags: int) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                   flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), f"mount {source} on {target}")


def _umount(target: str) -> None:
    if _libc.umount2(target.encode(), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), f"umount {target}")


# -- configuration and channel ------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    channel: str
    workspace: str
    cgroup_root: str
    run: str
    disk: str | None
    home: str | None
    strict: bool

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Config:
        keys = ("CORRAL_AGENT_CHANNEL", "CORRAL_AGENT_WORKSPACE", "CORRAL_AGENT_CGROUP",
                "CORRAL_AGENT_RUN")
        test = any(k in env for k in keys)
        return cls(channel=env.get("CORRAL_AGENT_CHANNEL", PORT_PATH),
                   workspace=env.get("CORRAL_AGENT_WORKSPACE", WORKSPACE),
                   cgroup_root=env.get("CORRAL_AGENT_CGROUP", "/sys/fs/cgroup"),
                   run=env.get("CORRAL_AGENT_RUN", "/corral/run"),
                   disk=None if test else "/dev/vdb", home=None if test else HOME,
                   strict=not test)


class Channel:
    """One JSON object per line each way. A virtio-serial port reads EOF while no host is
    connected; a file descriptor handed over by a test ends the agent at EOF."""

    def __init__(self, spec: str) -> None:
        if spec.startswith("fd:"):
            self.fd = int(spec[3:])
            self.reconnects = False
        else:
            self.fd = self._open_port(spec)
            self.reconnects = True
        self._lock = threading.Lock()

    @staticmethod
    def _open_port(path: str) -> int:
        # /dev/virtio-ports/NAME is a udev symlink and the guest runs no udev: find the port's
        # device by its name in sysfs.
        name = os.path.basename(path)
        deadline = time.monotonic() + 30
        while True:
            for candidate in (path, *Channel._ports_named(name)):
                with contextlib.suppress(FileNotFoundError):
                    return os.open(candidate, os.O_RDWR | os.O_CLOEXEC)
            if time.monotonic() > deadline:
                raise SystemExit(f"corral-agent: no channel {path} (no virtio-serial port "
                                 f"named {name!r})")
            time.sleep(0.05)

    @staticmethod
    def _ports_named(name: str) -> list[str]:
        root = "/sys/class/virtio-ports"
        found = []
        with contextlib.suppress(OSError):
            for port in sorted(os.listdir(root)):
                with contextlib.suppress(OSError), open(os.path.join(root, port, "name")) as f:
                    if f.read().strip() == name:
                        found.append(f"/dev/{port}")
        return found

    def send(self, message: Message) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(self.fd, view):]
            except OSError as exc:  # the host went away; it resynchronises on reconnect
                _log(f"channel write failed: {exc.strerror}")

    def _wait_host(self) -> None:
        # The port polls POLLHUP while the host end is closed: sleep between looks, never spin.
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while True:
            events = poller.poll(1000)
            if not events or not events[0][1] & select.POLLHUP:
                return
            time.sleep(0.1)

    def lines(self) -> Iterator[bytes | None]:
        """Yield each line; ``None`` for a line over ``MAX_LINE`` (dropped) and ``b""`` when the
        host reconnected."""
        buffer = bytearray()
        dropping = False
        while True:
            try:
                chunk = os.read(self.fd, 1 << 18)
            except InterruptedError:
                continue
            if not chunk:
                if not self.reconnects:
                    return
                buffer.clear()
                dropping = False
                self._wait_host()
                yield b""
                continue
            start = 0
            while (end := chunk.find(b"\n", start)) >= 0:
                if dropping:
                    dropping = False
                else:
                    buffer += chunk[start:end]
                    line = bytes(buffer)
                    buffer.clear()
                    if line.strip():
                        yield line
                start = end + 1
            if not dropping:
                buffer += chunk[start:]
                if len(buffer) > MAX_LINE:
                    buffer.clear()
                    dropping = True
                    yield None


class Lane:
    """An ordered queue of work with one thread and a byte bound, so one slow consumer (a
    command not reading its stdin, a frozen disk) never stalls the channel reader."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._pending = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], int] | None] = \
            queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, work: Callable[[], None], size: int) -> bool:
        with self._lock:
            if self._pending and self._pending + size > self._limit:
                return False
            self._pending += size
        self._queue.put((work, size))
        return True

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work, size = item
            try:
                work()
            except Exception as exc:  # a bug in one item must not stop the lane
                _log(f"lane work failed: {exc!r}")
            finally:
                with self._lock:
                    self._pending -= size


# -- the workspace file operations (mirroring corral/_workspace/files.py) ----------------------

def shown_name(name: str) -> str:
    try:
        raw = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return name.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def to_relative(path: object) -> str:
    if not isinstance(path, str) or not path:
        raise AgentError("refused", f"path must be a non-empty string, got {path!r}")
    if "\x00" in path:
        raise AgentError("refused", "path contains a NUL byte")
    try:
        encoded = path.encode()
    except UnicodeEncodeError:
        raise AgentError("refused", f"path '{shown_name(path)}' is not valid UTF-8") from None
    if len(encoded) > 4096:
        raise AgentError("refused", "path is longer than 4096 bytes")
    if path.startswith("/"):
        normal = posixpath.normpath(path)
        if normal == WORKSPACE:
            return "."
        if not normal.startswith(WORKSPACE + "/"):
            raise AgentError("refused", f"{path!r} is outside {WORKSPACE}; only {WORKSPACE} "
                             "is reachable")
        rel = normal[len(WORKSPACE) + 1:]
    else:
        rel = posixpath.normpath(path)
    if rel == ".." or rel.startswith("../"):
        raise AgentError("refused", f"{path!r} climbs out of {WORKSPACE} with '..'")
    return rel


def _display(rel: str) -> str:
    return WORKSPACE if rel == "." else f"{WORKSPACE}/{shown_name(rel)}"


@contextlib.contextmanager
def _mapped(rel: str) -> Iterator[None]:
    """OS errors as the contract's error kinds, naming the sandbox path."""
    shown = _display(rel)
    try:
        yield
    except OSError as exc:
        code = exc.errno
        if code == errno.ENOENT:
            raise AgentError("not_found", f"{shown} does not exist") from None
        if code in (errno.EXDEV, errno.ELOOP):
            raise AgentError("refused", f"{shown} goes through a symlink that leaves {WORKSPACE}"
                             " (or is a symlink where a file or directory is needed); refused"
                             ) from None
        if code in (errno.ENOSPC, errno.EDQUOT):
            raise AgentError("no_space", f"the workspace is full while writing {shown}; delete "
                             "files or use a larger resource tier") from None
        if code == errno.ENOTDIR:
            raise AgentError("not_dir", f"a component of {shown} is not a directory") from None
        if code == errno.EISDIR:
            raise AgentError("is_dir", f"{shown} is a directory") from None
        if code == errno.EEXIST:
            raise AgentError("exists", f"{shown} already exists and is not a directory") from None
        if code == errno.ENOTEMPTY:
            raise AgentError("io", f"{shown} is not empty") from None
        if code == errno.ENAMETOOLONG:
            raise AgentError("refused", f"a name in {shown} is too long") from None
        raise AgentError("io", f"{shown}: {exc.strerror}") from None


def _kind(mode: int) -> str:
    if stat_mod.S_ISREG(mode):
        return "file"
    if stat_mod.S_ISDIR(mode):
        return "dir"
    if stat_mod.S_ISLNK(mode):
        return "symlink"
    return "other"


def _entry(name: str, path: str, st: os.stat_result, link: str | None = None) -> Message:
    return {"name": shown_name(name), "path": path, "kind": _kind(st.st_mode),
            "size": st.st_size, "mode": stat_mod.S_IMODE(st.st_mode), "mtime": st.st_mtime,
            "link_target": None if link is None else shown_name(link)}


def _link_of(name: str, dir_fd: int, st: os.stat_result) -> str | None:
    if not stat_mod.S_ISLNK(st.st_mode):
        return None
    with contextlib.suppress(OSError):
        return os.readlink(name, dir_fd=dir_fd)
    return None


@dataclass
class WriteHandle:
    dir_fd: int
    leaf: str
    rel: str
    tmp: str
    fd: int
    lane: Lane


class Files:
    def __init__(self, root: str) -> None:
        self.root = root

    @contextlib.contextmanager
    def _root_fd(self) -> Iterator[int]:
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise AgentError("io", f"the workspace is not available: {exc.strerror}") from None
        try:
            yield fd
        finally:
            os.close(fd)

    def _open(self, root_fd: int, rel: str, flags: int) -> int:
        for _ in range(16):
            try:
                return openat2(root_fd, rel, flags)
            except OSError as exc:
                if exc.errno != errno.EAGAIN:  # a concurrent rename; the kernel asks to retry
                    raise
        raise AgentError("io", f"{_display(rel)} kept changing while being opened; try again")

    @contextlib.contextmanager
    def _parent(self, rel: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
        if rel == ".":
            raise AgentError("refused", f"this operation needs a path inside {WORKSPACE}, not "
                             f"{WORKSPACE}")
        parent, leaf = posixpath.split(rel)
        with self._root_fd() as root_fd:
            if create and parent:
                self._make_dirs(root_fd, parent)
            fd = self._open(root_fd, parent or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            yield fd, leaf
        finally:
            os.close(fd)

    def _make_dirs(self, root_fd: int, rel: str) -> bool:
        made = False
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        fd = os.dup(root_fd)
        try:
            for i, part in enumerate(parts):
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    os.chown(part, USER_ID, USER_ID, dir_fd=fd, follow_symlinks=False)
                    made = True
                except FileExistsError:
                    pass
                nxt = self._open(root_fd, "/".join(parts[: i + 1]), os.O_RDONLY | os.O_DIRECTORY)
                os.close(fd)
                fd = nxt
        finally:
            os.close(fd)
        return made

    def _stat_entry(self, dir_fd: int, leaf: str, rel: str) -> Message:
        st = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
        return _entry(leaf, _display(rel), st, _link_of(leaf, dir_fd, st))

    def stat(self, path: object) -> Message:
        rel = to_relative(path)
        if rel == ".":
            with self._root_fd() as fd:
                return _entry("workspace", WORKSPACE, os.fstat(fd))
        with _mapped(rel), self._parent(rel) as (dir_fd, leaf):
            return self._stat_entry(dir_fd, leaf, rel)

    def exists(self, path: object) -> bool:
        try:
            self.stat(path)
        except AgentError as exc:
            if exc.kind in ("not_found", "not_dir"):
                return False
            raise
        return True

    def readlink(self, path: object) -> str:
        rel = to_relative(path)
        with _mapped(rel), self._parent(rel) as (dir_fd, leaf):
            try:
                return shown_name(os.readlink(leaf, dir_fd=dir_fd))
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    raise AgentError("io", f"{_display(rel)} is not a symlink") from None
                raise

    def read(self, path: object, offset: object, length: object) -> Message:
        rel = to_relative(path)
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise AgentError("protocol", "fs.read: offset must be an integer >= 0")
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise AgentError("protocol", "fs.read: length must be an integer >= 0")
        if length > MAX_READ:
            raise AgentError("too_large", f"fs.read reads at most {MAX_READ} bytes at a time; "
                             "read the file in chunks")
        with _mapped(rel), self._root_fd() as root_fd:
            fd = self._open(root_fd, rel, os.O_RDONLY | os.O_NONBLOCK)
            try:
                st = os.fstat(fd)
                if stat_mod.S_ISDIR(st.st_mode):
                    raise AgentError("is_dir", f"{_display(rel)} is a directory; use list()")
                if not stat_mod.S_ISREG(st.st_mode):
                    raise AgentError("io", f"{_display(rel)} is not a regular file")
                data = os.pread(fd, length, offset) if length else b""
                return {"data": base64.b64encode(data).decode(), "size": st.st_size}
            finally:
                os.close(fd)

    def listing(self, path: object) -> Iterator[Message]:
        rel = to_relative(path)
        with _mapped(rel), self._root_fd() as root_fd:
            fd = self._open(root_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
            try:
                with os.scandir(fd) as it:
                    names = sorted(item.name for item in it)
                if len(names) > MAX_WALK_ENTRIES:
                    raise AgentError("too_large", f"{_display(rel)} has over "
                                     f"{MAX_WALK_ENTRIES} entries")
                for name in names:
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    child = name if rel == "." else f"{rel}/{name}"
                    yield _entry(name, _display(child), st, _link_of(name, fd, st))
            finally:
                os.close(fd)

    def walk(self, path: object) -> Iterator[Message]:
        """Depth first, sorted, parents first; never follows a link, never leaves the tree."""
        rel = to_relative(path)
        with _mapped(rel), self._root_fd() as root_fd:
            top = self._open(root_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
        count = 0
        # An explicit stack: a hostile tree may nest deeper than Python's recursion limit.
        stack: list[tuple[int, str, Iterator[str]]] = []
        try:
            stack.append((top, "", iter(self._names(top, rel))))
            while stack:
                dir_fd, prefix, names = stack[-1]
                name = next(names, None)
                if name is None:
                    stack.pop()
                    os.close(dir_fd)
                    continue
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    sub = None
                    if stat_mod.S_ISDIR(st.st_mode):
                        sub = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY
                                      | os.O_CLOEXEC, dir_fd=dir_fd)
                        st = os.fstat(sub)
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EINVAL,
                                     errno.ENXIO, errno.EAGAIN):
                        continue  # vanished or swapped for another type meanwhile
                    raise AgentError("io", f"{_display(rel)}: {exc.strerror}") from None
                kind = _kind(st.st_mode)
                if kind == "other":
                    if sub is not None:
                        os.close(sub)
                    continue
                count += 1
                if count > MAX_WALK_ENTRIES:
                    if sub is not None:
                        os.close(sub)
                    raise AgentError("too_large", f"{_display(rel)} has over "
                                     f"{MAX_WALK_ENTRIES} entries; walk a subdirectory")
                link = os.readlink(name, dir_fd=dir_fd) if kind == "symlink" else None
                entry = _entry(name, shown_name(prefix + name), st, link)
                if kind != "file":
                    entry["size"] = 0
                if kind == "symlink":
                    entry["mode"] = 0o777
                yield entry
                if sub is not None:
                    if len(stack) >= MAX_WALK_DEPTH:
                        os.close(sub)
                        raise AgentError("too_large", f"{_display(rel)} is nested over "
                                         f"{MAX_WALK_DEPTH} directories deep")
                    stack.append((sub, prefix + name + "/", iter(self._names(sub, rel))))
        finally:
            for dir_fd, _, _ in stack:
                os.close(dir_fd)

    @staticmethod
    def _names(dir_fd: int, rel: str) -> list[str]:
        with _mapped(rel), os.scandir(dir_fd) as it:
            return sorted(entry.name for entry in it)

    def make_dir(self, path: object) -> bool:
        rel = to_relative(path)
        if rel == ".":
            return False
        with _mapped(rel), self._root_fd() as root_fd:
            return self._make_dirs(root_fd, rel)

    def remove(self, path: object) -> None:
        rel = to_relative(path)
        with _mapped(rel), self._parent(rel) as (dir_fd, leaf):
            st = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
            if stat_mod.S_ISDIR(st.st_mode):
                self._remove_tree(dir_fd, leaf)
            else:
                os.unlink(leaf, dir_fd=dir_fd)

    @staticmethod
    def _remove_tree(parent_fd: int, name: str) -> None:
        """rm -r without recursion (a sandbox can nest deeper than the stack), each level
        opened through its parent's descriptor with O_NOFOLLOW."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        stack: list[tuple[int, str]] = [(os.open(name, flags, dir_fd=parent_fd), name)]
        try:
            while stack:
                fd, own_name = stack[-1]
                with os.scandir(fd) as it:
                    entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
                sub = None
                for child, is_dir in entries:
                    if is_dir:
                        if len(stack) > 4096:
                            raise OSError(errno.ELOOP, "directory tree too deep to remove")
                        sub = (os.open(child, flags, dir_fd=fd), child)
                        break
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(child, dir_fd=fd)
                if sub is not None:
                    stack.append(sub)
                    continue
                stack.pop()
                os.close(fd)
                owner = stack[-1][0] if stack else parent_fd
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(own_name, dir_fd=owner)
        finally:
            for fd, _ in stack:
                os.close(fd)

    def rename(self, src: object, dst: object) -> Message:
        rel_src, rel_dst = to_relative(src), to_relative(dst)
        with _mapped(rel_src), self._parent(rel_src) as (src_fd, src_leaf):
            os.stat(src_leaf, dir_fd=src_fd, follow_symlinks=False)
            with _mapped(rel_dst), self._parent(rel_dst, create=True) as (dst_fd, dst_leaf):
                os.rename(src_leaf, dst_leaf, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
                return self._stat_entry(dst_fd, dst_leaf, rel_dst)

    def symlink(self, path: object, target: object) -> Message:
        rel = to_relative(path)
        if (not isinstance(target, str) or not target or "\x00" in target
                or len(target.encode("utf-8", "surrogateescape")) > 4095):
            raise AgentError("refused", f"symlink target {target!r} for {_display(rel)} is "
                             "not usable")
        with _mapped(rel), self._parent(rel, create=True) as (dir_fd, leaf):
            tmp = f".corral-tmp-{secrets.token_hex(6)}"
            os.symlink(target, tmp, dir_fd=dir_fd)
            try:
                os.chown(tmp, USER_ID, USER_ID, dir_fd=dir_fd, follow_symlinks=False)
                os.rename(tmp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
            return self._stat_entry(dir_fd, leaf, rel)

    def _symlink_target(self, dir_fd: int, leaf: str, rel: str) -> str | None:
        try:
            st = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat_mod.S_ISLNK(st.st_mode):
            return None
        with self._root_fd() as root_fd:
            try:
                fd = self._open(root_fd, rel, os.O_PATH)
            except FileNotFoundError:
                link = os.readlink(leaf, dir_fd=dir_fd)
                joined = link if link.startswith("/") else posixpath.join(
                    posixpath.dirname(rel), link)
                if joined.startswith("/"):
                    raise AgentError("refused", f"{_display(rel)} is an absolute symlink; "
                                     "refused") from None
                return to_relative(joined)
            try:
                real = os.readlink(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
        inside = os.path.relpath(real, os.path.realpath(self.root))
        if inside == "." or inside.startswith(".."):
            raise AgentError("refused", f"{_display(rel)} is a symlink that leaves {WORKSPACE}")
        return inside

    def write_begin(self, path: object, mode: object, follow: bool, lane: Lane) -> WriteHandle:
        if not isinstance(mode, int) or isinstance(mode, bool):
            raise AgentError("protocol", "fs.write_begin: mode must be an integer")
        rel = to_relative(path)
        for _ in range(8):  # symlink hops, like the kernel's own nesting limit
            with _mapped(rel), self._parent(rel, create=True) as (dir_fd, leaf):
                target = self._symlink_target(dir_fd, leaf, rel) if follow else None
                if target is None:
                    tmp = f".corral-tmp-{secrets.token_hex(6)}"
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, mode & 0o777, dir_fd=dir_fd)
                    try:
                        os.fchown(fd, USER_ID, USER_ID)
                        os.fchmod(fd, mode & 0o777)  # not the agent's umask
                    except BaseException:
                        os.close(fd)
                        os.unlink(tmp, dir_fd=dir_fd)
                        raise
                    return WriteHandle(os.dup(dir_fd), leaf, rel, tmp, fd, lane)
            rel = target
        raise AgentError("refused", f"{_display(rel)}: too many levels of symlinks")

    @staticmethod
    def write_chunk(handle: WriteHandle, data: bytes) -> None:
        with _mapped(handle.rel):
            view = memoryview(data)
            while view:
                view = view[os.write(handle.fd, view):]

    def write_end(self, handle: WriteHandle, mtime: object) -> Message:
        with _mapped(handle.rel):
            if mtime is not None:
                if not isinstance(mtime, int | float) or isinstance(mtime, bool):
                    raise AgentError("protocol", "fs.write_end: mtime must be a number or null")
                os.utime(handle.fd, (mtime, mtime))
            os.close(handle.fd)
            handle.fd = -1
            os.rename(handle.tmp, handle.leaf, src_dir_fd=handle.dir_fd,
                      dst_dir_fd=handle.dir_fd)
            entry = self._stat_entry(handle.dir_fd, handle.leaf, handle.rel)
            if _libc.syncfs(handle.dir_fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            return entry

    @staticmethod
    def write_abort(handle: WriteHandle) -> None:
        if handle.fd >= 0:
            os.close(handle.fd)
            handle.fd = -1
        with contextlib.suppress(OSError):
            os.unlink(handle.tmp, dir_fd=handle.dir_fd)


# -- commands ------------------------------------------------------------------------------------

def _read_int(path: str, key: str | None = None) -> int:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return 0
    if key is None:
        return int(text.strip()) if text.strip().isdigit() else 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _cgroup_pids(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []


@dataclass
class Command:
    id: int
    cgroup: str
    proc: subprocess.Popen[bytes]
    pid: int
    leader: int | None
    master: int | None = None
    stdin: int | None = None
    stdin_lane: Lane | None = None
    killed: bool = False
    detached: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    listener: socket.socket | None = None
    conns: set[int] = field(default_factory=set)
    tag: str | None = None  # the host's command id: a kill from another host process names it

    def close_fds(self) -> None:
        """Close stdin and the PTY; only ever run on the stdin lane."""
        for fd in {self.master, self.stdin} - {None}:
            assert fd is not None
            with contextlib.suppress(OSError):
                os.close(fd)
        self.master = self.stdin = None

    def kill_tree(self) -> None:
        with contextlib.suppress(OSError):
            _write(os.path.join(self.cgroup, "cgroup.kill"), "1")


@dataclass
class Conn:
    id: int
    sock: socket.socket
    command: Command | None  # None: a port connection the host opened (outlives commands)
    lane: Lane
    opened: threading.Event = field(default_factory=threading.Event)
    refused: bool = False
    guest_eof: bool = False
    host_eof: bool = False
    closed: bool = False
    # Port connections: bytes sent to the host that it has not yet delivered to its client.
    unacked: int = 0
    acked: threading.Condition = field(default_factory=threading.Condition)


class Agent:
    def __init__(self, config: Config, channel: Channel) -> None:
        self.config = config
        self.channel = channel
        self.files = Files(config.workspace)
        self.lock = threading.Lock()
        self.commands: dict[int, Command] = {}
        self.handles: dict[int, WriteHandle] = {}
        self.conns: dict[int, Conn] = {}
        # Execs between their request and ``started``, and the kills that arrived meanwhile.
        self.starting: set[int] = set()
        self.kill_pending: set[int] = set()
        self.cmd_root = os.path.join(config.cgroup_root, "cmd")
        self._inflight = threading.BoundedSemaphore(MAX_INFLIGHT)
        self._next = 0
        self.session = 0
        # The guest's /tmp is made 64 MiB at boot (init.c); sized to the tier's on first exec.
        self._tmp_lock = threading.Lock()
        self._tmp_size = 64 << 20

    def new_id(self) -> int:
        with self.lock:
            self._next += 1
            return self._next

    # -- setup and the main loop

    def setup(self) -> None:
        try:
            _write("/proc/self/oom_score_adj", "-1000")
        except OSError as exc:
            _log(f"cannot set oom_score_adj: {exc.strerror}")
        os.makedirs(self.cmd_root, exist_ok=True)
        try:
            _write(os.path.join(self.cmd_root, "cgroup.subtree_control"), "+pids +memory +cpu")
        except OSError as exc:
            (_log if self.config.strict else lambda _t: None)(
                f"cannot enable controllers for commands: {exc.strerror}")

    def ready(self) -> None:
        self.channel.send({"id": 0, "ready": {"release": os.uname().release,
                                              "agent": AGENT_VERSION}})

    def serve(self) -> None:
        self.ready()
        for line in self.channel.lines():
            if line is None:
                self.channel.send({"id": None, "error": {
                    "kind": "protocol", "message": f"a line over {MAX_LINE} bytes was dropped"}})
            elif line == b"":
                self.ready()
            else:
                self.dispatch(line)

    def shutdown(self) -> None:
        with self.lock:
            commands = list(self.commands.values())
        for command in commands:
            command.kill_tree()
        for command in commands:
            command.done.wait(10)

    def reply(self, rid: Any, ok: Any) -> None:
        self.channel.send({"id": rid, "ok": ok})

    def fail(self, rid: Any, kind: str, message: str) -> None:
        self.channel.send({"id": rid, "error": {"kind": kind, "message": message}})

    def dispatch(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            self.fail(None, "protocol", "the line is not JSON")
            return
        if not isinstance(message, dict):
            self.fail(None, "protocol", "a message must be a JSON object")
            return
        if "conn" in message and "op" not in message:
            self.tunnel_from_host(message)
            return
        if "conn" in message and message.get("op") == "tcp.connect":
            self.port_connect(message)
            return
        rid = message.get("id")
        op = message.get("op")
        if not isinstance(rid, int) or isinstance(rid, bool) or not isinstance(op, str):
            self.fail(rid if isinstance(rid, int) else None, "protocol",
                      "a request needs an integer 'id' and a string 'op'")
            return
        inline = _INLINE.get(op)
        threaded = _THREADED.get(op)
        if inline is None and threaded is None:
            self.fail(rid, "protocol", f"unknown op {op!r}")
            return
        try:
            if inline is not None:
                inline(self, rid, message)
                return
        except AgentError as exc:
            self.fail(rid, exc.kind, exc.message)
            return
        assert threaded is not None
        if op == "exec":
            with self.lock:  # here, so a kill read right after the exec finds it
                self.starting.add(rid)
            threading.Thread(target=self._exec_thread, args=(rid, message), daemon=True).start()
            return
        if not self._inflight.acquire(blocking=False):
            self.fail(rid, "busy", f"over {MAX_INFLIGHT} operations are in flight; retry")
            return
        threading.Thread(target=self._threaded, args=(threaded, rid, message),
                         daemon=True).start()

    def _threaded(self, handler: Callable[[Agent, int, Message], None], rid: int,
                  message: Message) -> None:
        try:
            handler(self, rid, message)
        except AgentError as exc:
            self.fail(rid, exc.kind, exc.message)
        except Exception as exc:
            self.fail(rid, "io", f"{message.get('op')} failed: {exc!r}")
        finally:
            self._inflight.release()

    # -- exec

    def _exec_thread(self, rid: int, request: Message) -> None:
        try:
            self.exec(rid, request)
        except AgentError as exc:
            self.fail(rid, exc.kind, exc.message)
        except Exception as exc:
            self.fail(rid, "io", f"exec failed: {exc!r}")
        finally:
            with self.lock:
                self.starting.discard(rid)
                self.kill_pending.discard(rid)

    def _make_cgroup(self, rid: int, request: Message) -> str:
        path = os.path.join(self.cmd_root, str(rid))
        for n in range(1, 1000):
            try:
                os.mkdir(path)
                break
            except FileExistsError:
                path = os.path.join(self.cmd_root, f"{rid}.{n}")
        else:
            raise AgentError("busy", f"no free cgroup name for command {rid}")
        limits = [("pids.max", str(request["pids"])),
                  ("memory.max", str(request["memory_bytes"])),
                  ("memory.swap.max", "0")]
        try:
            for name, value in limits:
                target = os.path.join(path, name)
                if not os.path.exists(target):
                    if self.config.strict and name != "memory.swap.max":
                        raise AgentError("io", f"the guest cgroup has no {name}: the kernel "
                                         "or init did not enable the controller")
                    continue
                _write(target, value)
        except BaseException:
            with contextlib.suppress(OSError):
                os.rmdir(path)
            raise
        return path

    def _validate_exec(self, request: Message) -> tuple[list[str], str, dict[str, str]]:
        argv = request.get("argv")
        if (not isinstance(argv, list) or not argv
                or not all(isinstance(a, str) and a for a in argv[:1])
                or not all(isinstance(a, str) for a in argv)):
            raise AgentError("protocol", "exec: 'argv' must be a non-empty list of strings")
        env = request.get("env")
        if not isinstance(env, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise AgentError("protocol", "exec: 'env' must be an object of strings")
        if any("=" in k or not k for k in env):
            raise AgentError("protocol", "exec: an env name is empty or contains '='")
        strings = argv + [f"{k}={v}" for k, v in env.items()]
        if any("\x00" in s for s in strings):
            raise AgentError("protocol", "exec: argv and env must not contain NUL bytes")
        sizes = [len(s.encode("utf-8", "surrogateescape")) + 1 for s in strings]
        if max(sizes) > MAX_ARG_STRLEN or sum(sizes) > MAX_ARGS_TOTAL:
            raise AgentError("e2big", f"the arguments and environment are too large (at most "
                             f"{MAX_ARG_STRLEN} bytes each and {MAX_ARGS_TOTAL} in all)")
        cwd = request.get("cwd")
        if not isinstance(cwd, str) or not cwd.startswith("/") or "\x00" in cwd:
            raise AgentError("protocol", "exec: 'cwd' must be an absolute path")
        timeout = request.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float)
                                    or isinstance(timeout, bool) or timeout <= 0):
            raise AgentError("protocol", "exec: 'timeout' must be a number of seconds > 0")
        if request.get("stdin") not in ("pipe", "null"):
            raise AgentError("protocol", "exec: 'stdin' must be \"pipe\" or \"null\"")
        pty = request.get("pty")
        if pty is not None and not (isinstance(pty, list) and len(pty) == 2 and all(
                isinstance(n, int) and not isinstance(n, bool) and 0 < n < 65536 for n in pty)):
            raise AgentError("protocol", "exec: 'pty' must be null or [rows, cols]")
        for key in ("tmp_bytes", "pids", "memory_bytes"):
            value = request.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise AgentError("protocol", f"exec: {key!r} must be an integer > 0")
        port = request.get("egress_port")
        if port is not None and (not isinstance(port, int) or isinstance(port, bool)
                                 or not 0 < port < 65536):
            raise AgentError("protocol", "exec: 'egress_port' must be null or a TCP port")
        return argv, cwd, env

    def _seccomp_file(self, request: Message) -> str:
        """The file of the exec's syscall filter (the other tiers' own, compiled by the host),
        written once per distinct program; "-" only in the host-side test mode."""
        program = request.get("seccomp")
        if program is None:
            if self.config.strict:
                raise AgentError("protocol", "exec: 'seccomp' (the syscall filter) is required")
            return "-"
        try:
            data = base64.b64decode(program if isinstance(program, str) else "!", validate=True)
        except (binascii.Error, ValueError):
            raise AgentError("protocol", "exec: 'seccomp' must be base64") from None
        if not data or len(data) % 8 or len(data) > 65536:
            raise AgentError("protocol", "exec: 'seccomp' is not a BPF program")
        path = f"/run/corral/seccomp-{hashlib.sha256(data).hexdigest()[:16]}.bpf"
        if not os.path.exists(path):
            os.makedirs("/run/corral", mode=0o755, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        return path

    def _tmp_argument(self, size: int) -> str:
        """run's TMP_BYTES: in the guest, "-SIZE" (commands share the guest's /tmp, which
        lives as long as the sandbox; sized here to the tier's, once); in the host-side test
        mode, "SIZE" (a fresh /tmp per command: the host's own is no sandbox's)."""
        if not self.config.strict:
            return str(size)
        with self._tmp_lock:
            if self._tmp_size != size:
                data = f"size={size},mode=1777".encode()
                if _libc.mount(b"tmpfs", b"/tmp", None, _MS_REMOUNT | _MS_NOSUID | _MS_NODEV,
                               data) != 0:
                    err = ctypes.get_errno()
                    raise AgentError("io", f"cannot size /tmp: {os.strerror(err)}")
                self._tmp_size = size
        return f"-{size}"

    def _host_cwd(self, cwd: str) -> str:
        """The guest's own path; in test mode /workspace is the override directory."""
        normal = posixpath.normpath(cwd)
        if self.config.workspace != WORKSPACE and (
                normal == WORKSPACE or normal.startswith(WORKSPACE + "/")):
            return self.config.workspace + normal[len(WORKSPACE):]
        return normal

    def exec(self, rid: int, request: Message) -> None:
        argv, cwd, env = self._validate_exec(request)
        started = time.monotonic()
        timeout = request.get("timeout")
        deadline = None if timeout is None else started + float(timeout)
        cgroup = self._make_cgroup(rid, request)
        child_fds: list[int] = []
        ours: list[int] = []
        master: int | None = None
        stdin_w: int | None = None
        try:
            info_r, info_w = os.pipe2(os.O_CLOEXEC)
            status_r, status_w = os.pipe2(os.O_CLOEXEC)
            ours += [info_r, status_r]
            child_fds += [info_w, status_w]
            pty = request.get("pty")
            if pty is not None:
                master, slave = os.openpty()
                os.set_inheritable(master, False)
                child_fds.append(slave)
                fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", pty[0], pty[1], 0, 0))
                stdio: tuple[int, int, int] = (slave, slave, slave)
                outputs = [("stdout", master)]
            else:
                out_r, out_w = os.pipe2(os.O_CLOEXEC)
                err_r, err_w = os.pipe2(os.O_CLOEXEC)
                ours += [out_r, err_r]
                child_fds += [out_w, err_w]
                if request["stdin"] == "pipe":
                    in_r, stdin_w = os.pipe2(os.O_CLOEXEC)
                    child_fds.append(in_r)
                else:
                    in_r = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                    child_fds.append(in_r)
                stdio = (in_r, out_w, err_w)
                outputs = [("stdout", out_r), ("stderr", err_r)]
            run_argv = [self.config.run, cgroup, self._host_cwd(cwd),
                        self._tmp_argument(int(request["tmp_bytes"])), str(info_w), str(status_w),
                        "1" if pty is not None else "0", self._seccomp_file(request),
                        "--", *argv]
            try:
                proc = subprocess.Popen(run_argv, env=env, stdin=stdio[0], stdout=stdio[1],
                                        stderr=stdio[2], pass_fds=(info_w, status_w))
            except OSError as exc:
                raise AgentError("io", f"cannot start {self.config.run}: {exc.strerror}") from None
            for fd in child_fds:
                os.close(fd)
            child_fds = []
            self._await_start(proc, info_r, cgroup, argv[0], cwd, deadline)
            leader = self._command_pid(cgroup)
            tag = request.get("tag")
            command = Command(rid, cgroup, proc, leader or proc.pid, leader, master=master,
                              stdin=stdin_w if pty is None else master,
                              tag=tag if isinstance(tag, str) else None)
            if master is not None or stdin_w is not None:
                # The lane owns these descriptors from here: it closes them after its last
                # write, so no op can reach a number the kernel has handed out again.
                command.stdin_lane = Lane(STDIN_PENDING)
                master = stdin_w = None
            with self.lock:
                self.commands[rid] = command
                self.starting.discard(rid)
                if rid in self.kill_pending:  # killed before it was placed
                    self.kill_pending.discard(rid)
                    command.killed = True
                    command.kill_tree()
            self.channel.send({"id": rid, "started": {"pid": command.pid}})
            pumps = [threading.Thread(target=self._pump, args=(command, name, fd), daemon=True)
                     for name, fd in outputs]
            for pump in pumps:
                pump.start()
            if request.get("egress_port") is not None:
                self._listen(command, int(request["egress_port"]))
            self._wait(command, deadline, started, pumps, status_r)
        except BaseException:
            with self.lock:
                self.commands.pop(rid, None)
                self.starting.discard(rid)
                self.kill_pending.discard(rid)
            with contextlib.suppress(OSError):
                _write(os.path.join(cgroup, "cgroup.kill"), "1")
            self._remove_cgroup(cgroup)
            raise
        finally:
            for leftover in (*child_fds, *ours, master, stdin_w):
                if leftover is not None:
                    with contextlib.suppress(OSError):
                        os.close(leftover)

    def _await_start(self, proc: subprocess.Popen[bytes], info_r: int, cgroup: str,
                     program: str, cwd: str, deadline: float | None) -> None:
        """Read the launcher's info pipe: EOF alone means the program was exec'd."""
        data = b""
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([info_r], [], [], wait)
            if not ready:
                _write(os.path.join(cgroup, "cgroup.kill"), "1")
                proc.wait()
                raise AgentError("io", "the command did not start before its timeout")
            chunk = os.read(info_r, 4096)
            if not chunk:
                break
            data += chunk[:4096]
        if not data:
            return
        proc.wait()
        kind, _, rest = data.decode(errors="replace").strip().partition(" ")
        code_text, _, what = rest.partition(" ")
        code = int(code_text) if code_text.isdigit() else 0
        reason = os.strerror(code) if code else "unknown error"
        self._remove_cgroup(cgroup)
        if kind == "cwd":
            raise AgentError("cwd", f"cannot enter the working directory {cwd}: {reason}")
        if kind == "exec":
            if code == errno.E2BIG:
                raise AgentError("e2big", f"{program!r}: the arguments and environment are "
                                 "too large")
            if code in (errno.ENOENT, errno.ENOTDIR):
                raise AgentError("not_found", f"{program!r} was not found (not a file, nor on "
                                 "the PATH given in env)")
            raise AgentError("not_found", f"{program!r} cannot be executed: {reason}")
        raise AgentError("io", f"the command launcher failed to {what or kind}: {reason}")

    @staticmethod
    def _command_pid(cgroup: str) -> int | None:
        """The command's pid here: the process of its group that is pid 2 of its namespace
        (1 is the launcher's init); it leads the command's session and process group."""
        for pid in _cgroup_pids(cgroup):
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("NSpid:"):
                            if line.split()[-1] == "2":
                                return pid
                            break
            except OSError:
                continue
        return None

    def _pump(self, command: Command, name: str, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, CHUNK)
            except InterruptedError:
                continue
            except OSError:  # EIO: the PTY's last slave end closed
                return
            if not data:
                return
            if not command.detached:  # after a restore the output has no reader: drain it
                self.channel.send({"id": command.id, "out": name,
                                   "data": base64.b64encode(data).decode()})

    def _wait(self, command: Command, deadline: float | None, started: float,
              pumps: list[threading.Thread], status_r: int) -> None:
        timed_out = False
        # Woken by the exit itself (a pidfd): Popen.wait(timeout) polls with sleeps that
        # double up to 50 ms, which a short command pays in full under emulation.
        try:
            exited: int | None = os.pidfd_open(command.proc.pid)
        except OSError:
            exited = None
        try:
            while True:
                wait = None if deadline is None or command.detached else max(
                    0.0, deadline - time.monotonic())
                if timed_out and wait is not None:
                    wait = 0.05  # killed: its tree is going; look again shortly
                try:
                    if exited is None:
                        command.proc.wait(timeout=wait)
                        break
                    if select.select([exited], [], [], wait)[0]:
                        command.proc.wait()
                        break
                except subprocess.TimeoutExpired:
                    pass
                if command.detached:
                    continue
                timed_out = True
                command.kill_tree()
        finally:
            if exited is not None:
                os.close(exited)
        # Whatever the command left behind dies before exit is reported.
        command.kill_tree()
        events = os.path.join(command.cgroup, "cgroup.events")
        settle = time.monotonic() + 10
        while _read_int(events, "populated") and time.monotonic() < settle:
            time.sleep(0.005)
        for pump in pumps:
            pump.join(timeout=5)
        if command.stdin_lane is not None:
            command.stdin_lane.submit(command.close_fds, 0)
            command.stdin_lane.close()
        self._close_tunnel(command)
        status = b""
        with contextlib.suppress(OSError):
            os.set_blocking(status_r, False)
            status = os.read(status_r, 64)
        word, _, number = status.decode(errors="replace").strip().partition(" ")
        signal_no: int | None = None
        if word == "exit" and number.isdigit():
            code = int(number)
        elif word == "signal" and number.isdigit():
            signal_no = int(number)
            code = 128 + signal_no
        elif command.killed or timed_out:
            signal_no, code = 9, 137
        else:
            returncode = command.proc.returncode
            code = returncode if returncode >= 0 else 128 - returncode
            signal_no = -returncode if returncode < 0 else None
        sync_error = None
        try:
            syncfs(self.config.workspace)
        except OSError as exc:
            sync_error = exc.strerror
        cpu = _read_int(os.path.join(command.cgroup, "cpu.stat"), "usage_usec") / 1e6
        peak = _read_int(os.path.join(command.cgroup, "memory.peak"))
        oom = _read_int(os.path.join(command.cgroup, "memory.events"), "oom_kill") > 0
        self._remove_cgroup(command.cgroup)
        with self.lock:
            if self.commands.get(command.id) is command:
                del self.commands[command.id]
        if not command.detached:
            if sync_error is not None:
                _log(f"syncfs of the workspace failed: {sync_error}")
            self.channel.send({"id": command.id, "exit": {
                "code": code, "signal": signal_no, "timed_out": timed_out,
                "wall_s": round(time.monotonic() - started, 6), "cpu_s": cpu,
                "peak_memory_bytes": peak, "oom_killed": oom}})
        command.done.set()

    @staticmethod
    def _remove_cgroup(path: str) -> None:
        for _ in range(200):
            try:
                os.rmdir(path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)
        _log(f"cannot remove cgroup {path}")

    def running(self, request: Message) -> Command | None:
        target, tag = request.get("target"), request.get("tag")
        with self.lock:
            if isinstance(tag, str):
                return next((c for c in self.commands.values() if c.tag == tag), None)
            return self.commands.get(target) if isinstance(target, int) else None

    # -- egress tunnel

    def _listen(self, command: Command, port: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(64)
        except OSError as exc:
            sock.close()
            _log(f"cannot listen on 127.0.0.1:{port} for command {command.id}: {exc.strerror}")
            return
        command.listener = sock
        threading.Thread(target=self._accept, args=(command, sock, port), daemon=True).start()

    def _accept(self, command: Command, listener: socket.socket, port: int) -> None:
        while not command.done.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was shut down with the command
            if command.done.is_set() or len(command.conns) >= MAX_CONNS_PER_COMMAND:
                client.close()
                continue
            conn = Conn(self.new_id(), client, command, Lane(CONN_PENDING))
            with self.lock:
                self.conns[conn.id] = conn
                command.conns.add(conn.id)
            threading.Thread(target=self._conn_reader, args=(conn, port), daemon=True).start()

    def _conn_reader(self, conn: Conn, port: int) -> None:
        self.channel.send({"conn": conn.id, "op": "tcp.open", "port": port})
        if not conn.opened.wait(30) or conn.refused:
            self._conn_close(conn, notify=not conn.refused and not conn.closed,
                             error="the host did not open the tunnel")
            return
        self._relay_to_host(conn)

    def _relay_to_host(self, conn: Conn) -> None:
        """What the guest end of an open connection sends, until its EOF (or an error)."""
        while True:
            if conn.command is None:
                with conn.acked:
                    while conn.unacked >= PORT_WINDOW and not conn.closed:
                        conn.acked.wait()
            try:
                data = conn.sock.recv(CHUNK)
            except OSError as exc:
                self._conn_close(conn, notify=True, error=exc.strerror)
                return
            if conn.closed:
                return
            if not data:
                conn.guest_eof = True
                self.channel.send({"conn": conn.id, "eof": True})
                if conn.host_eof:
                    self._conn_close(conn, notify=True)
                return
            if conn.command is None:
                with conn.acked:
                    conn.unacked += len(data)
            self.channel.send({"conn": conn.id, "data": base64.b64encode(data).decode()})

    def _conn_close(self, conn: Conn, *, notify: bool, error: str | None = None,
                    kind: str | None = None) -> None:
        with self.lock:
            if conn.closed:
                return
            conn.closed = True
            self.conns.pop(conn.id, None)
            if conn.command is not None:
                conn.command.conns.discard(conn.id)
        conn.opened.set()
        with conn.acked:
            conn.acked.notify_all()
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
        conn.sock.close()
        conn.lane.close()
        if notify:
            message: Message = {"conn": conn.id, "closed": True}
            if error:
                message["error"] = error
            if kind:
                message["kind"] = kind
            self.channel.send(message)

    def _close_tunnel(self, command: Command) -> None:
        if command.listener is not None:
            with contextlib.suppress(OSError):
                command.listener.shutdown(socket.SHUT_RDWR)
            command.listener.close()
        with self.lock:
            conns = [self.conns[c] for c in command.conns if c in self.conns]
        for conn in conns:
            self._conn_close(conn, notify=not command.detached, error="the command ended")

    # -- port connections (the host's, to a server in the guest)

    def port_connect(self, message: Message) -> None:
        """Register the connection at once, so a ``closed`` the host sends while it is being
        made finds it; connect on a thread of its own (a full backlog can take seconds)."""
        cid, port, timeout = message.get("conn"), message.get("port"), message.get("timeout", 5)
        if not isinstance(cid, int) or isinstance(cid, bool) or cid >= 0:
            self.fail(None, "protocol", "tcp.connect: 'conn' must be a negative integer (the "
                      "host's ids; the guest's own are positive)")
            return
        with self.lock:
            taken = cid in self.conns
            open_ports = sum(c.command is None for c in self.conns.values())
        if taken:  # never a ``closed`` for it: the host would take it for the live one's
            self.fail(None, "protocol", f"tcp.connect: conn {cid} is already open")
            return

        def refuse(kind: str, text: str) -> None:
            self.channel.send({"conn": cid, "closed": True, "kind": kind, "error": text})

        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            refuse("protocol", "tcp.connect: 'port' must be a TCP port")
            return
        if (not isinstance(timeout, int | float) or isinstance(timeout, bool)
                or not 0 < timeout <= 300):
            refuse("protocol", "tcp.connect: 'timeout' must be seconds in (0, 300]")
            return
        if open_ports >= MAX_PORT_CONNS:
            refuse("busy", f"{MAX_PORT_CONNS} port connections are open, the most a microVM "
                   "may have")
            return
        conn = Conn(cid, socket.socket(socket.AF_INET, socket.SOCK_STREAM), None,
                    Lane(CONN_PENDING))
        with self.lock:
            self.conns[cid] = conn
        threading.Thread(target=self._port_open, args=(conn, port, float(timeout)),
                         daemon=True).start()

    def _port_open(self, conn: Conn, port: int, timeout: float) -> None:
        try:
            conn.sock.settimeout(timeout)
            conn.sock.connect(("127.0.0.1", port))
            conn.sock.settimeout(None)
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            timed_out = isinstance(exc, TimeoutError)
            closed = timed_out or exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET)
            self._conn_close(conn, notify=True, kind="port_closed" if closed else "io",
                             error="timed out" if timed_out else (exc.strerror or str(exc)))
            return
        with self.lock:
            if conn.closed:  # the host gave up meanwhile
                return
            conn.opened.set()
        self.channel.send({"conn": conn.id, "opened": True})
        self._relay_to_host(conn)

    def tunnel_from_host(self, message: Message) -> None:
        cid = message.get("conn")
        with self.lock:
            conn = self.conns.get(cid) if isinstance(cid, int) else None
        if conn is None:
            return  # closed meanwhile: the host learns it from our closed message
        if message.get("opened") is True:
            conn.opened.set()
        elif message.get("closed") is True:
            conn.refused = not conn.opened.is_set()
            self._conn_close(conn, notify=False)
        elif (isinstance(message.get("ack"), int) and not isinstance(message["ack"], bool)
              and conn.command is None):
            with conn.acked:
                conn.unacked = max(0, conn.unacked - message["ack"])
                conn.acked.notify_all()
        elif message.get("eof") is True:
            def half_close() -> None:
                conn.host_eof = True
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_WR)
                if conn.guest_eof:
                    self._conn_close(conn, notify=True)
            conn.lane.submit(half_close, 0)
        elif isinstance(message.get("data"), str):
            try:
                data = base64.b64decode(message["data"], validate=True)
            except (binascii.Error, ValueError):
                self._conn_close(conn, notify=True, error="the host sent data that is not "
                                 "base64")
                return

            def deliver() -> None:
                if conn.closed:
                    return
                try:
                    conn.sock.sendall(data)
                except OSError as exc:
                    self._conn_close(conn, notify=True, error=exc.strerror)
                    return
                if conn.command is None:
                    self.channel.send({"conn": conn.id, "ack": len(data)})
            if not conn.lane.submit(deliver, len(data)):
                self._conn_close(conn, notify=True, error=f"the guest side is not reading "
                                 f"(over {CONN_PENDING} bytes pending)")

    # -- write handles

    def handle(self, request: Message) -> tuple[int, WriteHandle]:
        hid = request.get("handle")
        with self.lock:
            handle = self.handles.get(hid) if isinstance(hid, int) else None
        if handle is None or not isinstance(hid, int):
            raise AgentError("protocol", f"no open write handle {hid!r} (it ended, failed or "
                             "was aborted)")
        return hid, handle

    def drop_handle(self, hid: int, handle: WriteHandle) -> None:
        with self.lock:
            self.handles.pop(hid, None)
        Files.write_abort(handle)
        with contextlib.suppress(OSError):
            os.close(handle.dir_fd)
        handle.lane.close()

    def freeze_groups(self, frozen: bool) -> None:
        for name in sorted(os.listdir(self.cmd_root)):
            path = os.path.join(self.cmd_root, name, "cgroup.freeze")
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                _write(path, "1" if frozen else "0")


# -- the ops -------------------------------------------------------------------------------------

Handler = Callable[[Agent, int, Message], None]


def _op_ping(agent: Agent, rid: int, request: Message) -> None:
    agent.reply(rid, True)


def _op_stdin(agent: Agent, rid: int, request: Message) -> None:
    command = agent.running(request)
    data_text = request.get("data")
    if not isinstance(data_text, str):
        raise AgentError("protocol", "stdin: 'data' must be base64 text")
    try:
        data = base64.b64decode(data_text, validate=True)
    except (binascii.Error, ValueError):
        raise AgentError("protocol", "stdin: 'data' is not base64") from None
    if command is None or command.stdin_lane is None:
        agent.reply(rid, False)
        return
    target = command

    def deliver() -> None:
        fd = target.stdin
        if fd is None:
            agent.reply(rid, False)
            return
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            agent.reply(rid, True)
        except OSError:  # the command closed its stdin or ended
            agent.reply(rid, False)
    if not command.stdin_lane.submit(deliver, len(data)):
        agent.fail(rid, "busy", f"the command is not reading its stdin (over {STDIN_PENDING} "
                   "bytes pending); wait for earlier writes to be acknowledged")


def _op_stdin_close(agent: Agent, rid: int, request: Message) -> None:
    command = agent.running(request)
    if command is None or command.stdin_lane is None:
        agent.reply(rid, False)
        return
    target = command

    def close() -> None:
        if target.master is not None:
            # A PTY has no half-close: the line discipline's EOF character (^D) is its end.
            with contextlib.suppress(OSError):
                os.write(target.master, b"\x04")
        elif target.stdin is not None:
            with contextlib.suppress(OSError):
                os.close(target.stdin)
            target.stdin = None
        agent.reply(rid, True)
    command.stdin_lane.submit(close, 0)


def _op_resize(agent: Agent, rid: int, request: Message) -> None:
    rows, cols = request.get("rows"), request.get("cols")
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 < n < 65536
               for n in (rows, cols)):
        raise AgentError("protocol", "resize: 'rows' and 'cols' must be integers 1..65535")
    command = agent.running(request)
    if command is None or command.master is None or command.stdin_lane is None:
        agent.reply(rid, False)
        return
    target = command

    def resize() -> None:
        if target.master is None:
            agent.reply(rid, False)
            return
        try:
            fcntl.ioctl(target.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        except OSError:
            agent.reply(rid, False)
            return
        agent.reply(rid, True)
    command.stdin_lane.submit(resize, 0)


def _op_signal(agent: Agent, rid: int, request: Message) -> None:
    number = request.get("signal")
    if not isinstance(number, int) or isinstance(number, bool) or not 0 < number < 65:
        raise AgentError("protocol", "signal: 'signal' must be a signal number 1..64")
    command = agent.running(request)
    if command is None:
        agent.reply(rid, False)
        return
    leader = command.leader or Agent._command_pid(command.cgroup)
    if leader is None:  # never the launcher: its death would end the command's accounting
        agent.reply(rid, False)
        return
    command.leader = leader
    try:
        os.killpg(leader, number)
    except ProcessLookupError:
        try:  # it left its process group: the command itself still gets it
            os.kill(leader, number)
        except ProcessLookupError:
            agent.reply(rid, False)
            return
    agent.reply(rid, True)


def _op_kill(agent: Agent, rid: int, request: Message) -> None:
    command = agent.running(request)
    if command is None:
        with agent.lock:
            starting = request.get("target") in agent.starting
            if starting:
                agent.kill_pending.add(request["target"])
        agent.reply(rid, starting)  # a command still starting dies as soon as it is placed
        return
    command.killed = True
    command.kill_tree()
    agent.reply(rid, True)


def _op_procs(agent: Agent, rid: int, request: Message) -> None:
    with agent.lock:
        known = {c.cgroup: c.id for c in agent.commands.values()}
    orphans = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(agent.cmd_root):
            path = os.path.join(agent.cmd_root, name)
            if os.path.isdir(path) and path not in known:
                orphans += len(_cgroup_pids(path))
    agent.reply(rid, {"commands": sorted(known.values()), "orphans": orphans})


def _op_freeze(agent: Agent, rid: int, request: Message) -> None:
    frozen = request.get("frozen")
    if not isinstance(frozen, bool):
        raise AgentError("protocol", "freeze: 'frozen' must be true or false")
    try:
        agent.freeze_groups(frozen)
    except OSError as exc:
        raise AgentError("io", f"cannot {'freeze' if frozen else 'thaw'} the commands: "
                         f"{exc.strerror}") from None
    agent.reply(rid, True)


def _op_write_chunk(agent: Agent, rid: int, request: Message) -> None:
    hid, handle = agent.handle(request)
    text = request.get("data")
    try:
        data = base64.b64decode(text if isinstance(text, str) else "!", validate=True)
    except (binascii.Error, ValueError):
        raise AgentError("protocol", "fs.write_chunk: 'data' must be base64 text") from None

    def work() -> None:
        if handle.fd < 0:
            agent.fail(rid, "protocol", f"no open write handle {hid}")
            return
        try:
            Files.write_chunk(handle, data)
        except AgentError as exc:
            agent.drop_handle(hid, handle)
            agent.fail(rid, exc.kind, exc.message)
            return
        agent.reply(rid, True)
    if not handle.lane.submit(work, len(data)):
        agent.fail(rid, "busy", f"over {WRITE_PENDING} bytes are pending on handle {hid}; wait "
                   "for earlier chunks to be acknowledged")


def _op_write_end(agent: Agent, rid: int, request: Message) -> None:
    hid, handle = agent.handle(request)
    mtime = request.get("mtime")

    def work() -> None:
        if handle.fd < 0:
            agent.fail(rid, "protocol", f"no open write handle {hid}")
            return
        try:
            entry = agent.files.write_end(handle, mtime)
        except AgentError as exc:
            agent.fail(rid, exc.kind, exc.message)
            agent.drop_handle(hid, handle)
            return
        with agent.lock:
            agent.handles.pop(hid, None)
        with contextlib.suppress(OSError):
            os.close(handle.dir_fd)
        handle.lane.close()
        agent.reply(rid, entry)
    handle.lane.submit(work, 0)


def _op_write_abort(agent: Agent, rid: int, request: Message) -> None:
    hid, handle = agent.handle(request)

    def work() -> None:
        agent.drop_handle(hid, handle)
        agent.reply(rid, True)
    handle.lane.submit(work, 0)


_INLINE: dict[str, Handler] = {
    "ping": _op_ping, "stdin": _op_stdin, "stdin_close": _op_stdin_close,
    "resize": _op_resize, "signal": _op_signal, "kill": _op_kill, "procs": _op_procs,
    "freeze": _op_freeze, "fs.write_chunk": _op_write_chunk, "fs.write_end": _op_write_end,
    "fs.write_abort": _op_write_abort,
}


def _send_entries(agent: Agent, rid: int, entries: Iterator[Message]) -> None:
    batch: list[Message] = []
    for entry in entries:
        batch.append(entry)
        if len(batch) >= BATCH_ENTRIES:
            agent.channel.send({"id": rid, "more": batch})
            batch = []
    agent.reply(rid, batch)


def _op_fs(agent: Agent, rid: int, request: Message) -> None:
    op = request["op"]
    files = agent.files
    path = request.get("path")
    if op == "fs.stat":
        agent.reply(rid, files.stat(path))
    elif op == "fs.exists":
        agent.reply(rid, files.exists(path))
    elif op == "fs.list":
        _send_entries(agent, rid, files.listing(path))
    elif op == "fs.walk":
        _send_entries(agent, rid, files.walk(path))
    elif op == "fs.readlink":
        agent.reply(rid, files.readlink(path))
    elif op == "fs.read":
        agent.reply(rid, files.read(path, request.get("offset", 0), request.get("length")))
    elif op == "fs.symlink":
        agent.reply(rid, files.symlink(path, request.get("target")))
    elif op == "fs.remove":
        files.remove(path)
        agent.reply(rid, True)
    elif op == "fs.rename":
        agent.reply(rid, files.rename(request.get("src"), request.get("dst")))
    elif op == "fs.mkdir":
        agent.reply(rid, files.make_dir(path))
    elif op == "fs.write_begin":
        with agent.lock:
            if len(agent.handles) >= MAX_HANDLES:
                raise AgentError("busy", f"over {MAX_HANDLES} file writes are open; end some")
        follow = request.get("follow_symlinks", True)
        if not isinstance(follow, bool):
            raise AgentError("protocol", "fs.write_begin: 'follow_symlinks' must be a bool")
        handle = files.write_begin(path, request.get("mode", 0o644), follow,
                                   Lane(WRITE_PENDING))
        hid = agent.new_id()
        with agent.lock:
            agent.handles[hid] = handle
        agent.reply(rid, {"handle": hid})


def _op_resume(agent: Agent, rid: int, request: Message) -> None:
    seed_text = request.get("seed")
    time_ns = request.get("time_ns")
    hostname = request.get("hostname", "sandbox")
    try:
        seed = base64.b64decode(seed_text if isinstance(seed_text, str) else "!", validate=True)
    except (binascii.Error, ValueError):
        raise AgentError("protocol", "resume: 'seed' must be base64") from None
    if len(seed) != 64:
        raise AgentError("protocol", "resume: 'seed' must be 64 bytes")
    if not isinstance(time_ns, int) or isinstance(time_ns, bool) or time_ns <= 0:
        raise AgentError("protocol", "resume: 'time_ns' must be an integer > 0")
    if not isinstance(hostname, str) or not 0 < len(hostname) <= 64:
        raise AgentError("protocol", "resume: 'hostname' must be 1..64 characters")
    # The restored kernel's pool is the snapshot's, shared by every sibling: mix in fresh bytes.
    # Credited bytes only reach the input pool; the generator that getrandom() reads reseeds
    # from it on its own schedule (seconds to a minute), so siblings would keep drawing the
    # same stream until then. Force the reseed now.
    info = struct.pack("ii", len(seed) * 8, len(seed)) + seed
    try:
        with open("/dev/urandom", "wb", buffering=0) as f:
            fcntl.ioctl(f.fileno(), _RNDADDENTROPY, info)
            fcntl.ioctl(f.fileno(), _RNDRESEEDCRNG)
    except OSError as exc:
        raise AgentError("io", f"cannot reseed the RNG: {exc.strerror}") from None
    if agent.config.strict:
        time.clock_settime_ns(time.CLOCK_REALTIME, time_ns)
        socket.sethostname(hostname)
        if agent.config.disk is not None and os.path.exists(agent.config.disk):
            fd = os.open(agent.config.disk, os.O_RDONLY | os.O_CLOEXEC)
            try:
                fcntl.ioctl(fd, _BLKFLSBUF)
            finally:
                os.close(fd)
    sandbox_id = request.get("sandbox_id")
    with agent.lock:
        agent.session += 1
        commands = list(agent.commands.values())
        agent.commands.clear()
        handles = list(agent.handles.items())
        conns = list(agent.conns.values())
    for command in commands:  # they keep running as orphans, reported by no one
        command.detached = True
    for hid, handle in handles:
        agent.drop_handle(hid, handle)
    for conn in conns:
        agent._conn_close(conn, notify=False)
    if isinstance(sandbox_id, str):
        with contextlib.suppress(OSError):
            os.makedirs("/run/corral", exist_ok=True)
            _write("/run/corral/sandbox_id", sandbox_id)
    agent.reply(rid, True)


def _op_mount(agent: Agent, rid: int, request: Message) -> None:
    fresh = request.get("fresh")
    if not isinstance(fresh, bool):
        raise AgentError("protocol", "mount: 'fresh' must be true or false")
    disk = agent.config.disk
    if disk is None:
        raise AgentError("io", "this agent has no workspace disk (test mode)")
    workspace = agent.config.workspace
    try:
        _mount(disk, workspace, "ext4", _MS_NOSUID | _MS_NODEV)
        if fresh:
            os.chown(workspace, USER_ID, USER_ID)
            os.chmod(workspace, 0o755)
        if agent.config.home is not None:
            _mount(workspace, agent.config.home, None, _MS_BIND)
    except OSError as exc:
        raise AgentError("io", f"cannot mount the workspace: {exc}") from None
    agent.reply(rid, True)


def _op_unmount(agent: Agent, rid: int, request: Message) -> None:
    with agent.lock:
        if agent.commands:
            raise AgentError("busy", "commands are running; the workspace stays mounted")
    try:
        syncfs(agent.config.workspace)
        if agent.config.home is not None:
            _umount(agent.config.home)
        _umount(agent.config.workspace)
    except OSError as exc:
        kind = "busy" if exc.errno == errno.EBUSY else "io"
        raise AgentError(kind, f"cannot unmount the workspace: {exc}") from None
    agent.reply(rid, True)


def _op_sync(agent: Agent, rid: int, request: Message) -> None:
    try:
        syncfs(agent.config.workspace)
    except OSError as exc:
        raise AgentError("io", f"cannot sync the workspace: {exc.strerror}") from None
    agent.reply(rid, True)


def _op_fsfreeze(agent: Agent, rid: int, request: Message) -> None:
    frozen = request.get("frozen")
    if not isinstance(frozen, bool):
        raise AgentError("protocol", "fsfreeze: 'frozen' must be true or false")
    fd = os.open(agent.config.workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _FIFREEZE if frozen else _FITHAW, 0)
    except OSError as exc:
        # Already in the asked state: EBUSY to freeze, EINVAL to thaw.
        if exc.errno != (errno.EBUSY if frozen else errno.EINVAL):
            raise AgentError("io", f"cannot {'freeze' if frozen else 'thaw'} the workspace: "
                             f"{exc.strerror}") from None
    finally:
        os.close(fd)
    agent.reply(rid, True)


_THREADED: dict[str, Handler] = {
    "exec": lambda agent, rid, request: None,  # its own thread, not counted in MAX_INFLIGHT
    **{op: _op_fs for op in ("fs.stat", "fs.exists", "fs.list", "fs.walk", "fs.readlink",
                             "fs.read", "fs.symlink", "fs.remove", "fs.rename", "fs.mkdir",
                             "fs.write_begin")},
    "resume": _op_resume, "mount": _op_mount, "unmount": _op_unmount, "sync": _op_sync,
    "fsfreeze": _op_fsfreeze,
}


def main() -> None:
    config = Config.from_env(dict(os.environ))
    channel = Channel(config.channel)
    agent = Agent(config, channel)
    agent.setup()
    try:
        agent.serve()
    finally:
        agent.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
