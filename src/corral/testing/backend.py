"""An in-memory isolation backend, for tests that need the backend protocol without root.

**It isolates nothing.** ``MemoryBackend`` never starts a process: a command is read by a tiny
built-in interpreter (``echo``, ``cat``, ``true``, ``false``, ``exit N``, ``sleep S``, ``pwd``,
``env``, ``;``-separated, ``>`` into a workspace file) over an in-memory workspace. It exists so
control-plane and SDK behaviour (validation, audit, quotas, files, archives, snapshots as layer
bookkeeping) can run in unit tests on any machine; it must never serve untrusted code.

What it keeps of the contract: ``exec`` streams through the callbacks and caps output like the
host tiers (same marker, same exit codes: 124 on timeout, 127 with ``corral: command not found:
NAME``); ``files`` returns a ``WorkspaceFS`` with the same paths and errors as ``WorkspaceFiles``;
``sweep`` returns ``Leftover`` records; ``destroy`` is idempotent.

``MemoryVMBackend`` adds the ``MemorySnapshots`` capability (the microvm tier's), as
bookkeeping: an image records the layer it was taken over, a sandbox created (or reset) with
``spec.memory_image`` starts with that layer's workspace, and ``resumed_from`` tells a test which
image a sandbox resumed. No memory or process is saved: there are none.
"""

from __future__ import annotations

import os
import posixpath
import shlex
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from .._core.resources import get_tier
from .._workspace.files import MAX_FILE_BYTES, WORKSPACE, to_relative
from ..backends import (
    BackendName,
    EgressEndpoint,
    ExecOutcome,
    ExecRequest,
    HostCheck,
    Leftover,
    OutputCut,
    SandboxSpec,
    SealResult,
    TreeItem,
    WatchEvent,
    WatchOp,
    WorkspaceFS,
)
from ..errors import (
    BackendError,
    FileError,
    FileNotFound,
    PortClosed,
    QuotaExceeded,
    SandboxNotFound,
)
from ..models import FileEntry, ResourceTier, Usage

__all__ = ["MemoryBackend", "MemoryFS", "MemoryVMBackend", "spec_for"]

_Kind = Literal["file", "dir", "symlink"]


@dataclass
class _Node:
    kind: _Kind
    data: bytes = b""
    mode: int = 0o644
    mtime: float = field(default_factory=time.time)
    target: str = ""


def _shown(rel: str) -> str:
    return WORKSPACE if rel == "." else f"{WORKSPACE}/{rel}"


class _MemoryWatch:
    """A ``DirWatch`` of a ``MemoryFS`` directory: events are pushed by the mutations, and a
    pipe is readable while some are pending (so event loops can wait on ``fileno``)."""

    MAX_PENDING = 8192

    def __init__(self, fs: MemoryFS, rel: str, recursive: bool) -> None:
        self._fs = fs
        self._rel = rel
        self._recursive = recursive
        self._pending: list[WatchEvent] = []
        self._dropped = 0
        self._ended = False
        self._lock = threading.Lock()
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def dropped(self) -> int:
        return self._dropped

    def fileno(self) -> int:
        return self._read_fd

    def notify(self, rel: str, op: WatchOp) -> None:
        if rel == self._rel and op in ("remove", "rename"):
            self._ended = True
            self._wake()
            return
        prefix = "" if self._rel == "." else self._rel + "/"
        if not rel.startswith(prefix) or rel == self._rel:
            return
        name = rel[len(prefix):]
        if "/" in name and not self._recursive:
            return
        with self._lock:
            if len(self._pending) >= self.MAX_PENDING:
                self._dropped += 1
                return
            self._pending.append(WatchEvent(name=name, op=op))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._write_fd, b"!")
        except (BlockingIOError, OSError):
            pass  # already readable (or closed)

    def read(self) -> list[WatchEvent]:
        try:
            while os.read(self._read_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        with self._lock:
            events, self._pending = self._pending, []
        return events

    def close(self) -> None:
        if not self._ended or self._read_fd >= 0:
            self._fs._unwatch(self)
        for fd in (self._read_fd, self._write_fd):
            if fd >= 0:
                os.close(fd)
        self._read_fd = self._write_fd = -1
        self._ended = True


class MemoryFS:
    """A ``WorkspaceFS`` held in a dict of relative path -> node; thread-safe."""

    def __init__(self, nodes: dict[str, _Node] | None = None,
                 max_file_bytes: int = MAX_FILE_BYTES) -> None:
        self._nodes: dict[str, _Node] = nodes if nodes is not None else {}
        self._nodes.setdefault(".", _Node("dir", mode=0o755))
        self._max = max_file_bytes
        self._lock = threading.RLock()
        self._watches: list[_MemoryWatch] = []

    def copy(self) -> MemoryFS:
        with self._lock:
            return MemoryFS({k: _Node(v.kind, v.data, v.mode, v.mtime, v.target)
                             for k, v in self._nodes.items()}, self._max)

    # -- lookups ---------------------------------------------------------------------------

    def _entry(self, rel: str) -> FileEntry:
        node = self._nodes[rel]
        name = posixpath.basename(rel) if rel != "." else "workspace"
        return FileEntry(name=name, path=_shown(rel), type=node.kind,
                         size=len(node.data) if node.kind == "file" else 0,
                         mode=0o777 if node.kind == "symlink" else node.mode,
                         modified_at=node.mtime)

    def _get(self, rel: str) -> _Node:
        node = self._nodes.get(rel)
        if node is None:
            raise FileNotFound(f"{_shown(rel)} does not exist")
        return node

    def _resolve(self, rel: str) -> str:
        """Follow a symlink at ``rel`` (once per hop, inside the workspace only)."""
        for _ in range(16):
            node = self._nodes.get(rel)
            if node is None or node.kind != "symlink":
                return rel
            base = posixpath.dirname(rel) if rel != "." else ""
            rel = to_relative(node.target if node.target.startswith("/")
                              else posixpath.join(base, node.target) or ".")
        raise FileError(f"{_shown(rel)}: too many levels of symbolic links")

    def _make_parents(self, rel: str) -> None:
        parent = posixpath.dirname(rel)
        parts = [] if not parent else parent.split("/")
        for i in range(len(parts)):
            here = "/".join(parts[: i + 1])
            node = self._nodes.get(here)
            if node is None:
                self._nodes[here] = _Node("dir", mode=0o755)
                self._notify(here, "create")
            elif node.kind != "dir":
                raise FileError(f"a component of {_shown(rel)} is not a directory")

    def _children(self, rel: str) -> list[str]:
        prefix = "" if rel == "." else rel + "/"
        return sorted(k for k in self._nodes
                      if k != "." and k.startswith(prefix) and "/" not in k[len(prefix):])

    # -- WorkspaceFS -----------------------------------------------------------------------

    def read(self, path: str) -> bytes:
        with self._lock:
            rel = self._resolve(to_relative(path))
            node = self._get(rel)
            if node.kind == "dir":
                raise FileError(f"{_shown(rel)} is a directory")
            return node.data

    def write(self, path: str, data: bytes, *, mode: int = 0o644) -> FileEntry:
        if len(data) > self._max:
            raise QuotaExceeded(f"{len(data)} bytes is over the {self._max}-byte file limit")
        return self.write_stream(path, (data,), mode=mode)

    def write_stream(self, path: str, chunks: Iterable[bytes], *, mode: int = 0o644,
                     mtime: float | None = None, follow_symlinks: bool = True) -> FileEntry:
        data = b"".join(chunks)  # consumed first: a failing iterator changes nothing
        with self._lock:
            rel = to_relative(path)
            if follow_symlinks:
                rel = self._resolve(rel)
            if rel == "." or (self._nodes.get(rel) and self._nodes[rel].kind == "dir"):
                raise FileError(f"{_shown(rel)} is a directory")
            self._make_parents(rel)
            existed = rel in self._nodes
            self._nodes[rel] = _Node("file", data, mode & 0o777,
                                     time.time() if mtime is None else mtime)
            if not existed:
                self._notify(rel, "create")
            self._notify(rel, "write")
            return self._entry(rel)

    def symlink(self, path: str, target: str) -> FileEntry:
        with self._lock:
            rel = to_relative(path)
            self._make_parents(rel)
            self._nodes[rel] = _Node("symlink", target=target)
            self._notify(rel, "create")
            return self._entry(rel)

    def walk(self, path: str = WORKSPACE) -> Iterator[TreeItem]:
        with self._lock:
            top = to_relative(path)
            if self._get(top).kind != "dir":
                raise FileError(f"{_shown(top)} is not a directory")
            snapshot = self.copy()._nodes  # a walk sees one moment, like a held descriptor
        prefix = "" if top == "." else top + "/"

        def visit(rel: str) -> Iterator[TreeItem]:
            for child in sorted(k for k in snapshot if k != "." and k.startswith(
                    "" if rel == "." else rel + "/") and "/" not in k[len(
                    "" if rel == "." else rel + "/"):]):
                node = snapshot[child]
                shown = child[len(prefix):]
                if node.kind == "symlink":
                    yield TreeItem(shown, "symlink", 0o777, 0, node.mtime, link_target=node.target)
                elif node.kind == "dir":
                    yield TreeItem(shown, "dir", node.mode, 0, node.mtime)
                    yield from visit(child)
                else:
                    stream = iter([node.data])
                    buffer = bytearray()

                    def read(n: int, _stream: Iterator[bytes] = stream,
                             _buffer: bytearray = buffer) -> bytes:
                        if not _buffer:
                            _buffer.extend(next(_stream, b""))
                        out = bytes(_buffer[:n])
                        del _buffer[:n]
                        return out

                    yield TreeItem(shown, "file", node.mode, len(node.data), node.mtime, read=read)

        yield from visit(top)

    def list(self, path: str = WORKSPACE) -> list[FileEntry]:
        with self._lock:
            rel = self._resolve(to_relative(path))
            if self._get(rel).kind != "dir":
                raise FileError(f"a component of {_shown(rel)} is not a directory")
            return [self._entry(child) for child in self._children(rel)]

    def stat(self, path: str) -> FileEntry:
        with self._lock:
            rel = to_relative(path)
            self._get(rel)
            return self._entry(rel)

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except FileNotFound:
            return False
        return True

    def remove(self, path: str) -> None:
        with self._lock:
            rel = to_relative(path)
            if rel == ".":
                raise FileError(f"{WORKSPACE} itself cannot be removed")
            self._get(rel)
            for key in [k for k in self._nodes if k == rel or k.startswith(rel + "/")]:
                del self._nodes[key]
            self._notify(rel, "remove")

    def rename(self, src: str, dst: str) -> FileEntry:
        with self._lock:
            rel_src, rel_dst = to_relative(src), to_relative(dst)
            self._get(rel_src)
            target = self._nodes.get(rel_dst)
            if target is not None and target.kind == "dir" and self._children(rel_dst):
                raise FileError(f"{_shown(rel_dst)} is not empty")
            self._make_parents(rel_dst)
            moved = {k: v for k, v in self._nodes.items()
                     if k == rel_src or k.startswith(rel_src + "/")}
            for key in moved:
                del self._nodes[key]
            for key, node in moved.items():
                self._nodes[rel_dst + key[len(rel_src):]] = node
            self._notify(rel_src, "rename")
            self._notify(rel_dst, "create")
            return self._entry(rel_dst)

    def make_dir(self, path: str) -> bool:
        with self._lock:
            rel = to_relative(path)
            node = self._nodes.get(rel)
            if node is not None:
                if node.kind != "dir":
                    raise FileError(f"{_shown(rel)} already exists and is not a directory")
                return False
            self._make_parents(rel)
            self._nodes[rel] = _Node("dir", mode=0o755)
            self._notify(rel, "create")
            return True

    def readlink(self, path: str) -> str:
        with self._lock:
            rel = to_relative(path)
            node = self._get(rel)
            if node.kind != "symlink":
                raise FileError(f"{_shown(rel)} is not a symlink")
            return node.target

    def watch(self, path: str, *, recursive: bool = False) -> _MemoryWatch:
        with self._lock:
            rel = to_relative(path)
            if self._get(rel).kind != "dir":
                raise FileError(f"{_shown(rel)} is not a directory; only directories can be "
                                "watched")
            watch = _MemoryWatch(self, rel, recursive)
            self._watches.append(watch)
            return watch

    def _unwatch(self, watch: _MemoryWatch) -> None:
        with self._lock:
            if watch in self._watches:
                self._watches.remove(watch)

    def _notify(self, rel: str, op: WatchOp) -> None:
        for watch in list(self._watches):
            watch.notify(rel, op)


class _Cut:
    """Output capped like the host tiers' ``OutputStream`` (same marker, live and final)."""

    def __init__(self, name: str, limit: int, callback: Callable[[str], None] | None) -> None:
        self.name, self.limit, self.callback = name, limit, callback
        self.parts: list[str] = []
        self.kept = self.dropped = 0

    def feed(self, text: str) -> None:
        data = text.encode()
        if self.dropped:
            self.dropped += len(data)
            return
        room = max(self.limit - self.kept, 0)
        if len(data) <= room:
            self.kept += len(data)
            self._emit(text)
            return
        self.dropped, self.kept = len(data) - room, self.kept + room
        head = data[:room].decode(errors="replace")
        self._emit(head)
        tail = "".join(self.parts[-1:])
        self._emit(OutputCut(self.name, self.limit,
                             newline=bool(tail) and not tail.endswith("\n")))

    def _emit(self, text: str) -> None:
        if text:
            self.parts.append(text)
            if self.callback is not None:
                self.callback(text)


class _Timeout(Exception):
    pass


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


class MemoryBackend:
    """See the module docstring: a protocol-complete backend that isolates nothing."""

    name: BackendName = "namespace"  # stands in for a real tier; records say which it mimics

    def __init__(self, uid_start: int = 100_000, uid_count: int = 1000) -> None:
        self._uid_start, self._uid_count = uid_start, uid_count
        self._workspaces: dict[str, MemoryFS] = {}
        self._layers: dict[str, MemoryFS] = {}
        self._running: dict[str, set[str]] = {}
        self._paused: set[str] = set()
        self._lock = threading.Lock()

    def check_host(self) -> list[HostCheck]:
        return [HostCheck("isolation", False, "the in-memory test backend isolates nothing",
                          "use the namespace or gvisor tier for anything untrusted")]

    def allocate_uid(self, taken: Set[int]) -> int:
        for uid in range(self._uid_start, self._uid_start + self._uid_count):
            if uid not in taken:
                return uid
        raise QuotaExceeded(f"all {self._uid_count} sandbox uids are in use")

    def create(self, spec: SandboxSpec) -> None:
        with self._lock:
            self._workspaces[spec.id] = self._fresh(spec)

    def _fresh(self, spec: SandboxSpec) -> MemoryFS:
        if spec.layers:
            top = self._layers.get(spec.layers[0])
            if top is None:
                raise BackendError(f"workspace layer {spec.layers[0]} is missing")
            return top.copy()
        return MemoryFS()

    def files(self, spec: SandboxSpec) -> WorkspaceFS:
        return self._workspace(spec)

    def _workspace(self, spec: SandboxSpec) -> MemoryFS:
        with self._lock:
            fs = self._workspaces.get(spec.id)
        if fs is None:
            raise SandboxNotFound(f"sandbox {spec.id} has no in-memory workspace")
        return fs

    def egress_endpoint(self, spec: SandboxSpec) -> EgressEndpoint:
        raise BackendError("the in-memory test backend has no network; use network='none'")

    def open_port(self, spec: SandboxSpec, port: int, timeout_s: float) -> socket.socket:
        raise PortClosed(f"the in-memory test backend runs no servers (port {port})")

    def exec(self, spec: SandboxSpec, request: ExecRequest) -> ExecOutcome:
        fs = self._workspace(spec)
        out = _Cut("stdout", request.output_limit_bytes, request.on_stdout)
        err = _Cut("stderr", request.output_limit_bytes, request.on_stderr)
        started = time.monotonic()
        deadline = started + request.timeout_s
        with self._lock:
            self._running.setdefault(spec.id, set()).add(request.command_id)
        try:
            argv = list(request.argv)
            if argv[:2] in (["/bin/bash", "-c"], ["bash", "-c"], ["sh", "-c"]) and len(argv) > 2:
                lines = [shlex.split(part) for part in argv[2].split(";") if part.strip()]
            else:
                lines = [argv]
            code, timed_out = 0, False
            env = {"HOME": WORKSPACE, "CORRAL_SANDBOX_ID": spec.id, **request.env}
            stdin = request.stdin or b""
            try:
                for words in lines:
                    code = self._run(words, fs, request.cwd, env, stdin, out, err, deadline)
            except _Exit as done:
                code = done.code
            except _Timeout:
                timed_out, code = True, 124
        finally:
            with self._lock:
                self._running.get(spec.id, set()).discard(request.command_id)
        return ExecOutcome(
            exit_code=code, stdout="".join(out.parts), stderr="".join(err.parts),
            timed_out=timed_out,
            usage=Usage(wall_s=time.monotonic() - started, cpu_s=0.0, peak_memory_bytes=0,
                        oom_killed=False),
            stdout_truncated=out.dropped, stderr_truncated=err.dropped)

    def _run(self, words: list[str], fs: MemoryFS, cwd: str, env: dict[str, str],
             stdin: bytes, out: _Cut, err: _Cut, deadline: float) -> int:
        if not words:
            return 0
        target: str | None = None
        if len(words) >= 2 and words[-2] == ">":
            target, words = posixpath.join(cwd, words[-1]), words[:-2]
        sink: list[str] = []
        emit: Callable[[str], None] = sink.append if target is not None else out.feed
        program, args = words[0], words[1:]
        if program == "echo":
            emit(" ".join(env.get(a[1:], "") if a.startswith("$") else a for a in args) + "\n")
        elif program == "cat":
            for name in args or ["-"]:
                emit(stdin.decode(errors="replace") if name == "-"
                     else fs.read(posixpath.join(cwd, name)).decode(errors="replace"))
        elif program == "pwd":
            emit(cwd + "\n")
        elif program == "env":
            emit("".join(f"{k}={v}\n" for k, v in sorted(env.items())))
        elif program in ("true", ":"):
            pass
        elif program == "false":
            return 1
        elif program == "exit":
            raise _Exit(int(args[0]) if args else 0)
        elif program == "sleep":
            wanted, remaining = float(args[0]) if args else 0.0, deadline - time.monotonic()
            time.sleep(max(min(wanted, remaining), 0.0))
            if wanted > remaining:
                raise _Timeout
        else:
            err.feed(f"corral: command not found: {program}\n")
            return 127
        if target is not None:
            fs.write(target, "".join(sink).encode())
        return 0

    def seal_workspace(self, spec: SandboxSpec, layer_id: str) -> SealResult:
        fs = self._workspace(spec)
        with self._lock:
            sealed = self._layers[layer_id] = fs.copy()
        size = sum(len(n.data) for n in sealed._nodes.values())
        return SealResult(layers=(layer_id, *spec.layers), bytes_used=size, squashed=False)

    def recover_seal(self, spec: SandboxSpec, layer_id: str) -> SealResult | None:
        # A seal here is one step under the lock: the layer is whole whenever it exists.
        with self._lock:
            sealed = self._layers.get(layer_id)
        if sealed is None:
            return None
        size = sum(len(n.data) for n in sealed._nodes.values())
        return SealResult(layers=(layer_id, *spec.layers), bytes_used=size, squashed=False)

    def reset_workspace(self, spec: SandboxSpec) -> None:
        fresh = self._fresh(spec)
        with self._lock:
            self._workspaces[spec.id] = fresh

    def remove_layer(self, layer_id: str) -> None:
        with self._lock:
            self._layers.pop(layer_id, None)

    def layer_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._layers)

    def pause(self, spec: SandboxSpec, paused: bool) -> None:
        with self._lock:
            (self._paused.add if paused else self._paused.discard)(spec.id)

    def busy(self, spec: SandboxSpec) -> bool:
        with self._lock:
            return bool(self._running.get(spec.id))

    def kill_command(self, spec: SandboxSpec, command_id: str) -> bool:
        return False  # built-in commands run on the caller's thread and finish by themselves

    def destroy(self, spec: SandboxSpec) -> None:
        with self._lock:
            self._workspaces.pop(spec.id, None)
            self._running.pop(spec.id, None)
            self._paused.discard(spec.id)

    def sweep(self, live_ids: set[str] | Callable[[str], bool]) -> list[Leftover]:
        is_live = live_ids.__contains__ if isinstance(live_ids, set) else live_ids
        removed = []
        with self._lock:
            for sandbox_id in sorted(self._workspaces):
                if not is_live(sandbox_id):
                    del self._workspaces[sandbox_id]
                    removed.append(Leftover("workspace", sandbox_id, sandbox_id))
        return removed

    def close(self) -> None:
        pass


class MemoryVMBackend(MemoryBackend):
    """A ``MemoryBackend`` with memory snapshots (see the module docstring)."""

    def __init__(self, uid_start: int = 100_000, uid_count: int = 1000) -> None:
        super().__init__(uid_start, uid_count)
        self._images: dict[str, str] = {}  # image -> the layer it was taken over
        self._resumed: dict[str, str] = {}  # sandbox -> the image it resumed
        #: Every ``snapshot_memory`` call: (sandbox, layer, image, busy at that instant).
        self.memory_snapshots: list[tuple[str, str, str, bool]] = []

    def snapshot_memory(self, spec: SandboxSpec, layer_id: str, image_id: str) -> SealResult:
        busy = self.busy(spec)  # allowed: the point is to catch what runs
        result = self.seal_workspace(spec, layer_id)
        with self._lock:
            self._images[image_id] = layer_id
            self.memory_snapshots.append((spec.id, layer_id, image_id, busy))
            self._resumed.pop(spec.id, None)  # it runs on; its workspace is no longer the image's
        return result

    def remove_memory_image(self, image_id: str) -> None:
        with self._lock:
            self._images.pop(image_id, None)

    def memory_image_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._images)

    def resumed_from(self, sandbox_id: str) -> str | None:
        """The memory image sandbox ``sandbox_id`` was last started or reset from, if any."""
        with self._lock:
            return self._resumed.get(sandbox_id)

    def _resume(self, spec: SandboxSpec) -> None:
        with self._lock:
            if spec.memory_image is None:
                self._resumed.pop(spec.id, None)
                return
            layer = self._images.get(spec.memory_image)
            if layer is None:
                raise BackendError(f"memory image {spec.memory_image} is missing")
            if spec.layers[:1] != (layer,):
                raise BackendError(f"memory image {spec.memory_image} was taken over layer "
                                   f"{layer}, not {spec.layers[:1]}")
            self._resumed[spec.id] = spec.memory_image

    def create(self, spec: SandboxSpec) -> None:
        self._resume(spec)
        super().create(spec)

    def reset_workspace(self, spec: SandboxSpec) -> None:
        self._resume(spec)
        super().reset_workspace(spec)

    def destroy(self, spec: SandboxSpec) -> None:
        super().destroy(spec)
        with self._lock:
            self._resumed.pop(spec.id, None)


def spec_for(sandbox_id: str, *, uid: int = 100_000, tier: ResourceTier | None = None,
             layers: tuple[str, ...] = ()) -> SandboxSpec:
    """A ``SandboxSpec`` for tests (the ``small`` tier unless told)."""
    return SandboxSpec(id=sandbox_id, uid=uid, template="base",
                       tier=tier or get_tier("small"), layers=layers)


if TYPE_CHECKING:  # the protocol, checked by mypy
    from ..backends import IsolationBackend, MemorySnapshots

    _conforms: type[IsolationBackend] = MemoryBackend
    _capable: type[MemorySnapshots] = MemoryVMBackend
