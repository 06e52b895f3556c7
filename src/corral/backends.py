"""The isolation backend protocol: one interface for every isolation tier.

The control plane decides what a sandbox is (id, limits, lifetime) and stores it; a backend
decides how it runs. A backend owns the runtime of a sandbox (network namespace, cgroups, the
workspace filesystem) and must be able to rebuild it from a ``SandboxSpec`` alone, because the
control plane may restart at any time.

Nothing here is a host location: the control plane reaches a sandbox's files through the
``WorkspaceFS`` its backend returns, and its egress gateway through the ``EgressEndpoint`` the
backend opens (a listener plus the proxy URL the sandbox must use), so a tier whose sandbox is a
VM or lives on another node implements the same protocol. Host uids are a host tier's own
business (``allocate_uid``); the store only records the number.

Contract:
    * ``create`` builds everything a sandbox needs; on failure it leaves nothing behind.
    * ``exec`` runs one command and returns only after every process it started is gone.
    * ``destroy`` is idempotent and succeeds on a half-built or already-removed sandbox.
    * ``sweep`` removes runtime pieces of sandboxes that are not in ``live_ids`` (crash leftovers)
      and commands whose owning process died, and says what it removed as ``Leftover`` records.
    * Every method raises only ``corral.errors`` exceptions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from .models import FileEntry, ResourceTier, Usage

__all__ = [
    "BackendName",
    "Connection",
    "DirWatch",
    "EgressEndpoint",
    "ExecOutcome",
    "ExecRequest",
    "Hibernated",
    "Hibernation",
    "HostCheck",
    "IsolationBackend",
    "LayerMounts",
    "Leftover",
    "Listener",
    "MemorySnapshots",
    "Mount",
    "OutputCallback",
    "OutputCut",
    "ProcessIO",
    "SandboxSpec",
    "SealResult",
    "TreeItem",
    "VolumeStorage",
    "WatchEvent",
    "WatchOp",
    "WatchableFS",
    "WorkspaceFS",
]

# The one place a tier's name is declared: ``_backends.BACKENDS`` maps each to its class (a test
# holds the two equal), and ``Settings.backend`` is typed by it.
BackendName = Literal["namespace", "gvisor", "microvm"]
OutputCallback = Callable[[str], None]


class OutputCut(str):  # noqa: SLOT000 - a str with two read-only attributes
    """The one line that says a stream reached its cap, handed to an ``OutputCallback`` the
    moment it happens and kept in the result at the same place, so live output and the result
    read the same. ``stream`` and ``limit`` let a caller that knows tell it apart from output
    (the HTTP stream sends it as its own event); a callback that only prints still shows it.
    ``newline`` starts it on a line of its own when the output before it did not end one."""

    stream: str
    limit: int

    def __new__(cls, stream: str, limit: int, *, newline: bool = False) -> OutputCut:
        note = super().__new__(cls, ("\n" if newline else "") + f"[corral: {stream} truncated "
                                    f"after {limit} bytes; the rest is dropped]\n")
        note.stream, note.limit = stream, limit
        return note


@dataclass(frozen=True, slots=True)
class Mount:
    """A directory from outside the sandbox, mounted at ``target`` (under ``/mnt/`` or
    ``/workspace/``, validated by the control plane) when the sandbox is built.

    Attributes:
        kind: ``volume``, a persistent named volume (``VolumeStorage``; ``source`` is its id),
            or ``data``, one of the operator's approved host directories (``source`` is its
            name in ``Settings.data_mounts``, never a path an API caller chose).
        read_only: writes fail with ``EROFS`` inside. Data mounts are always read-only.
    """

    kind: Literal["volume", "data"]
    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """Everything a backend needs to build or rebuild a sandbox's runtime."""

    id: str
    # The tier's own number for the sandbox (a host uid for host-backed tiers), chosen by its
    # ``allocate_uid`` and recorded by the store so a rebuild finds the same one.
    uid: int
    template: str
    tier: ResourceTier
    # Read-only workspace layers under the writable one, top first (snapshots and forks).
    layers: tuple[str, ...] = ()
    # A memory image (``MemorySnapshots``) the sandbox resumes from: memory, processes and
    # device state at one instant, over ``layers`` (whose top is the image's own layer), with a
    # fresh RNG seed, clock and identity. None: a fresh boot over ``layers``.
    memory_image: str | None = None
    # Volumes and data mounts, in the order they are mounted (a later target may be under an
    # earlier one). A tier that cannot mount them refuses ``create`` with ``BackendUnavailable``.
    mounts: tuple[Mount, ...] = ()


class ProcessIO(Protocol):
    """Handed to ``ExecRequest.on_start`` for interactive and PTY commands, from any thread."""

    def write(self, data: bytes) -> None:
        """Send bytes to the command's stdin (or its terminal)."""
        ...

    def close_stdin(self) -> None: ...

    def resize(self, rows: int, cols: int) -> None:
        """Change the terminal size (PTY commands only; the command gets SIGWINCH)."""
        ...


@dataclass(frozen=True, slots=True)
class ExecRequest:
    """One command, already validated by the control plane.

    ``cwd`` is a path inside the sandbox (under ``/workspace``); ``timeout_s`` is final (the control
    plane has already capped it by the tier and the sandbox's remaining lifetime).
    """

    argv: Sequence[str]
    cwd: str
    env: Mapping[str, str]
    timeout_s: float
    stdin: bytes | None = None
    output_limit_bytes: int = 1 << 20
    # Past the limit, keep handing output to the callbacks (the result stays capped): for
    # long-lived commands whose reader bounds what it keeps (background processes, kernels).
    stream_past_limit: bool = False
    # Hand the callbacks text that re-encodes to the very bytes written (``surrogateescape``
    # for what is not UTF-8): for a surface whose wire carries bytes (E2B's process streams).
    # Without it, and always in the result, such bytes read as U+FFFD.
    lossless_output: bool = False
    on_stdout: OutputCallback | None = None
    on_stderr: OutputCallback | None = None
    command_id: str = ""
    # Interactive: stdin stays open and is written through the ProcessIO given to on_start.
    interactive: bool = False
    # A terminal of (rows, cols): stdin, stdout and stderr are one PTY (output is "stdout").
    pty: tuple[int, int] | None = None
    on_start: Callable[[ProcessIO], None] | None = None
    # An image build's step (corral._images.build): this host directory, owned by the
    # sandbox's uid, is the command's whole root, writable, and the command is root in its
    # user namespace (still that uid on the host, without capabilities). Namespace tier only.
    build_root: str | None = None


@dataclass(frozen=True, slots=True)
class ExecOutcome:
    """What ``exec`` observed."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    usage: Usage
    stdout_truncated: int = 0
    stderr_truncated: int = 0
    #: The kept bytes exactly as the command wrote them (``stdout`` is their UTF-8 reading).
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""


@dataclass(frozen=True, slots=True)
class SealResult:
    """What sealing a writable layer made: the sandbox's new lower chain (top first), the new
    layer's size, and whether the chain was squashed into one layer to bound its depth."""

    layers: tuple[str, ...]
    bytes_used: int
    squashed: bool


@dataclass(frozen=True, slots=True)
class Leftover:
    """One runtime piece ``sweep`` removed.

    Attributes:
        kind: ``workspace``, ``netns``, ``cgroup``, ``command``, ``spare`` (a workspace made
            ahead, its sandbox_id empty) or a tier's own (``runsc``).
        sandbox_id: the sandbox it belonged to.
        name: the piece's own name (a netns pin, ``sandbox/group`` for a command).
        command_id: for ``command``, the interrupted command when it had one.
    """

    kind: str
    sandbox_id: str
    name: str
    command_id: str | None = None

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


class Listener(Protocol):
    """A listening stream socket on the control plane's side (``socket.socket`` is one)."""

    def fileno(self) -> int: ...

    def getsockname(self) -> Any: ...

    def close(self) -> None: ...


class Connection(Protocol):
    """A connected stream socket on the control plane's side (``socket.socket`` is one; a
    tier may hand out a Unix socket that its own relay joins to the sandbox's TCP port)."""

    def fileno(self) -> int: ...

    def setblocking(self, flag: bool) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class EgressEndpoint:
    """Where a sandbox reaches the egress gateway: ``listener`` for the gateway to serve (the
    caller owns and closes it) and ``proxy_url``, what the sandbox's proxy variables say."""

    listener: Listener
    proxy_url: str


@dataclass(frozen=True, slots=True)
class TreeItem:
    """One entry met by ``WorkspaceFS.walk``.

    Attributes:
        path: relative to the walked directory, ``/``-separated (``a/b.txt``).
        kind: what the entry is (never following a link).
        mode: permission bits.
        size: bytes, for files.
        mtime: modification time.
        link_target: the text of a symlink, else None.
        read: for files, reads up to ``n`` bytes more of the file (``b""`` at its end); owned by
            the walk and valid only until the walk advances; else None.
    """

    path: str
    kind: Literal["file", "dir", "symlink", "other"]
    mode: int
    size: int
    mtime: float
    link_target: str | None = None
    read: Callable[[int], bytes] | None = None


class WorkspaceFS(Protocol):
    """File operations on one sandbox's ``/workspace``; paths are sandbox paths (absolute under
    ``/workspace`` or relative to it). Every operation stays inside the workspace and raises
    ``PathRefused``, ``FileNotFound``, ``FileError`` or ``TooLarge`` otherwise."""

    def read(self, path: str) -> bytes: ...

    def write(self, path: str, data: bytes, *, mode: int = 0o644) -> FileEntry: ...

    def write_stream(self, path: str, chunks: Iterable[bytes], *, mode: int = 0o644,
                     mtime: float | None = None, follow_symlinks: bool = True) -> FileEntry: ...

    def symlink(self, path: str, target: str) -> FileEntry: ...

    def walk(self, path: str = "/workspace") -> Iterator[TreeItem]: ...

    def list(self, path: str = "/workspace") -> list[FileEntry]: ...

    def stat(self, path: str) -> FileEntry: ...

    def exists(self, path: str) -> bool: ...

    def remove(self, path: str) -> None: ...

    def rename(self, src: str, dst: str) -> FileEntry: ...

    def make_dir(self, path: str) -> bool: ...

    def readlink(self, path: str) -> str:
        """The text of the symlink ``path`` (never resolved); ``FileError`` if not a link."""
        ...


WatchOp = Literal["create", "write", "remove", "rename", "chmod"]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change under a watched directory.

    Attributes:
        name: the changed entry, relative to the watched directory (``a/b.txt``).
        op: what happened to it. A rename shows as ``rename`` of the old name and ``create`` of
            the new one (the model of Go's fsnotify, which E2B's SDKs are written against).
    """

    name: str
    op: WatchOp


class DirWatch(Protocol):
    """A live watch of one directory (``WatchableFS.watch``). The caller owns it and must
    ``close`` it. It is bounded: events that arrive faster than they are read past the tier's
    own queue limit are dropped (``dropped`` counts them), never buffered without end."""

    @property
    def ended(self) -> bool:
        """True once the watched directory is gone (removed, moved away, unmounted)."""
        ...

    @property
    def dropped(self) -> int: ...

    def fileno(self) -> int:
        """A descriptor on the control plane's side that is readable while ``read`` has
        something to return (for an event loop's ``add_reader``)."""
        ...

    def read(self) -> list[WatchEvent]:
        """The events since the last call, oldest first; never blocks (``[]`` when none)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class WatchableFS(Protocol):
    """An optional capability of a ``WorkspaceFS``: watching a directory for changes made by
    anything (the sandbox's own processes included). Never follows a symlink: a link to a
    directory is reported as an entry, not watched through."""

    def watch(self, path: str, *, recursive: bool = False) -> DirWatch:
        """Start watching the directory ``path`` (and, with ``recursive``, every directory
        under it, including ones created later).

        Raises:
            FileNotFound: ``path`` does not exist.
            FileError: ``path`` is not a directory, or the watch cannot be set up.
            PathRefused: ``path`` leaves the workspace.
        """
        ...


@dataclass(frozen=True, slots=True)
class HostCheck:
    """One line of ``corral doctor``: what was checked, whether it passed, how to fix it."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    extra: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class LayerMounts(Protocol):
    """An optional capability of an ``IsolationBackend`` whose sealed layers are kernel mounts
    (each a loop device): a layer no sandbox uses is released, so stored snapshots hold no
    kernel resource and their number is bounded by the disk, not by the loop devices."""

    def mounted_layers(self) -> list[str]:
        """The layers mounted now."""
        ...

    def release_layer(self, layer_id: str) -> bool:
        """Unmount layer ``layer_id``, which no sandbox uses; a later mount of a sandbox on it
        mounts it again. Whether it is released (False: in use now; try again later)."""
        ...


@runtime_checkable
class MemorySnapshots(Protocol):
    """An optional capability of an ``IsolationBackend`` (the microvm tier): snapshots of a
    *running* sandbox, memory and processes included. A sandbox whose ``SandboxSpec`` names a
    ``memory_image`` (``create``, or ``reset_workspace`` for a restore) resumes from it."""

    def snapshot_memory(self, spec: SandboxSpec, layer_id: str, image_id: str) -> SealResult:
        """Seal the writable workspace into layer ``layer_id`` and save the running sandbox's
        memory and device state as memory image ``image_id``, at one instant; the sandbox
        keeps running (commands too) on a fresh writable layer."""
        ...

    def remove_memory_image(self, image_id: str) -> None:
        """Delete a memory image nothing uses any more. Idempotent."""
        ...

    def memory_image_ids(self) -> list[str]:
        """Every memory image this tier holds."""
        ...


@dataclass(frozen=True, slots=True)
class Hibernated:
    """What a hibernate left on disk: the sandbox's ``/tmp`` (a memory filesystem while it
    runs) as an archive of ``tmp_bytes`` whose SHA-256 is ``digest``, beside its workspace
    image. The control plane keeps the digest in the store; ``wake`` refuses an archive that
    no longer matches it."""

    tmp_bytes: int
    digest: str
    #: The size of the saved memory and devices of a tier that keeps processes (0: none).
    memory_bytes: int = 0


@runtime_checkable
class Hibernation(Protocol):
    """An optional capability of an ``IsolationBackend``: hibernate a sandbox with no process
    running (``busy`` false), releasing every piece of it the kernel holds (processes,
    mounts, loop devices, cgroup, network namespace) and keeping only files: its workspace
    image and its ``/tmp``, archived. ``wake`` rebuilds them as a reboot's recovery would and
    puts ``/tmp`` back; until then the sandbox costs disk and a row in the store."""

    #: Whether a process running in the sandbox survives: its memory is saved, and it goes on
    #: after the wake (the commands the waking Corral process follows, attached again).
    keeps_processes: bool

    def hibernate(self, spec: SandboxSpec) -> Hibernated:
        """Release the sandbox's kernel pieces, its files kept. Refused (``SandboxBusy``)
        while a process of it runs, before anything changed, unless ``keeps_processes``. Cut
        short (a crash, an error) at any later point, it is made whole by
        ``recover_hibernate``."""
        ...

    def recover_hibernate(self, spec: SandboxSpec) -> Hibernated | None:
        """Make whole a hibernate cut short: finish it (its image), or, when it had released
        nothing yet, undo it (None: the sandbox is paused as before, no archive left)."""
        ...

    def wake(self, spec: SandboxSpec, image: Hibernated) -> None:
        """Rebuild a hibernated sandbox's pieces and put its ``/tmp`` back. Refused
        (``BackendError``) when the archive is missing or does not match ``image``; the
        files on disk are then left as they are."""
        ...


@runtime_checkable
class VolumeStorage(Protocol):
    """An optional capability of an ``IsolationBackend``: persistent named volumes, each a
    filesystem of a fixed size (a full volume is ``ENOSPC`` inside) that outlives sandboxes,
    restarts and crashes, mounted by ``SandboxSpec.mounts``. Volumes are the control plane's to
    name, own and lock (one writer or many readers); a tier only stores them."""

    def create_volume(self, volume_id: str, size_bytes: int) -> None:
        """Make an empty volume; on failure nothing of it is left."""
        ...

    def remove_volume(self, volume_id: str) -> None:
        """Delete a volume no sandbox mounts. Idempotent."""
        ...

    def volume_usage(self, volume_id: str) -> int:
        """Bytes used in the volume."""
        ...

    def volume_ids(self) -> list[str]:
        """Every volume on disk (to find ones a crash left without a record)."""
        ...


class IsolationBackend(Protocol):
    """One isolation tier. See the module docstring for the contract."""

    name: BackendName

    def check_host(self) -> list[HostCheck]:
        """Inspect the host; never raises. Used by ``corral doctor`` and at start-up."""
        ...

    def allocate_uid(self, taken: Set[int]) -> int:
        """The number a new sandbox gets (``SandboxSpec.uid``), not one of ``taken`` (what the
        store records for every other sandbox); raises ``QuotaExceeded`` when none is free."""
        ...

    def create(self, spec: SandboxSpec) -> None:
        """Build the runtime of a new sandbox."""
        ...

    def exec(self, spec: SandboxSpec, request: ExecRequest) -> ExecOutcome:
        """Run one command to completion (or timeout) and return what happened."""
        ...

    def egress_endpoint(self, spec: SandboxSpec) -> EgressEndpoint:
        """A listener the sandbox (and only it) can reach, for the egress gateway to serve one
        command, and the proxy URL the sandbox uses to reach it."""
        ...

    def files(self, spec: SandboxSpec) -> WorkspaceFS:
        """The sandbox's ``/workspace``, ready for file operations."""
        ...

    def open_port(self, spec: SandboxSpec, port: int, timeout_s: float) -> Connection:
        """A blocking stream socket connected to ``127.0.0.1:port`` as the sandbox sees it
        (its own loopback, never the host's), for the port proxy to relay; the caller owns and
        closes it. Raises ``PortClosed`` when nothing accepts there within ``timeout_s``."""
        ...

    def seal_workspace(self, spec: SandboxSpec, layer_id: str) -> SealResult:
        """Make the writable workspace layer read-only layer ``layer_id`` and give the sandbox a
        fresh writable layer on top (snapshots, forks). Nothing of the sandbox may be running."""
        ...

    def recover_seal(self, spec: SandboxSpec, layer_id: str) -> SealResult | None:
        """Finish or undo a ``seal_workspace(spec, layer_id)`` a crash cut short (``spec``:
        the sandbox as before the seal). The result when layer ``layer_id`` holds the sealed
        workspace (the sandbox then has a fresh writable layer on it), None when the seal was
        undone (the writable layer as before, the layer gone). Idempotent; nothing of the
        sandbox runs (the control plane's recovery calls it before any use)."""
        ...

    def reset_workspace(self, spec: SandboxSpec) -> None:
        """Drop the writable layer and start a fresh one on ``spec.layers`` (restore).
        Idempotent: after a crash in the middle, running it again finishes it."""
        ...

    def remove_layer(self, layer_id: str) -> None:
        """Delete a layer nothing uses any more. Idempotent."""
        ...

    def layer_ids(self) -> list[str]:
        """Every layer on disk (to find ones a crash left without a record)."""
        ...

    def pause(self, spec: SandboxSpec, paused: bool) -> None:
        """Freeze (or thaw) every process of the sandbox; files stay reachable."""
        ...

    def busy(self, spec: SandboxSpec) -> bool:
        """True while any command of the sandbox runs (from any process)."""
        ...

    def kill_command(self, spec: SandboxSpec, command_id: str) -> bool:
        """Kill one running command's whole process tree; False when it is not running."""
        ...

    def destroy(self, spec: SandboxSpec) -> None:
        """Kill everything and remove every trace of the sandbox's runtime."""
        ...

    def sweep(self, live_ids: set[str] | Callable[[str], bool]) -> list[Leftover]:
        """Remove leftovers not belonging to ``live_ids``; return what was removed."""
        ...

    def close(self) -> None:
        """Release process-local resources (not sandboxes)."""
        ...
