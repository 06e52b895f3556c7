"""Workspace storage: read-only layers under one writable, size-limited layer, joined by overlayfs.

Each sandbox's writable layer is a sparse ext4 image, loop-mounted on the host. Why an image and
not a directory: its size is a hard disk limit that needs no quota support in the kernel (this
project's development kernels have none), its inode count bounds file counts, and a separate
filesystem means nothing in the workspace can be a hard link to a host file and no rename can
move a path out of it. The image is sparse, so an empty 10 GiB workspace costs a few MiB.

Snapshots are O(1) in the workspace's size: sealing remounts the writable image read-only and
moves it, as it is, into the layer store; the sandbox gets a fresh empty image on top. A layer is
shared by every sandbox built on it, through one read-only mount, which is released (unmounted,
its loop device with it) once no sandbox stands on it: a stored snapshot holds no kernel
resource (``release_layer``). Files in a layer keep the host
uid of the sandbox that wrote them; a sandbox running as another uid sees them through an
idmapped bind (see ``_core.idmap``), so forks need no chown either.

Host layout (``root`` is ``$CORRAL_HOME/sandboxes``, ``layers_root`` ``$CORRAL_HOME/layers``)::

    sandboxes/<id>/upper.img          writable layer image (root-only)
    sandboxes/<id>/priv/disk          its mount: upper/ (the sandbox's changes) and work/
    sandboxes/<id>/priv/l<N>          idmapped binds of lower layers written by another uid
    sandboxes/<id>/workspace          the overlay: what the sandbox sees as /workspace
    sandboxes/<id>/mounts/            its volumes and data mounts, bound for it (``volumes``)
    sandboxes/<id>/scratch/tmp        its /tmp: a tmpfs as long as the sandbox lives
    sandboxes/.ready.<owner>.<size>.<n>   a plain workspace made ahead, root's until a create
                                      claims it by renaming it to <id> (``ready``); being
                                      made: .making.<owner>.<size>.<n>
    layers/<layer>/layer.img, owner   a sealed layer image and the uid that wrote it
    layers/<layer>/root               its read-only mount

Mounts survive the Corral process; after a reboot ``ensure_mounted`` rebuilds all of them.
A destroy returns once the sandbox's mounts are out of the tree (``detach_behind``); the
kernel's sync of the disk and release of its loop device finish on a helper thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..._core import flocks, linux
from ..._core.diskfull import disk_full_as_error, free_bytes, insufficient
from ..._core.failpoints import failpoint
from ..._core.fsafe import remove_special
from ..._core.idmap import bind_idmapped
from ..._core.privileged import privileged_env
from ...backends import SandboxSpec, SealResult
from ...errors import BackendError, BackendUnavailable, SandboxBusy
from . import loop

__all__ = ["MAX_LAYERS", "SealResult", "WorkspaceStore"]

logger = logging.getLogger(__name__)

# Lookups walk every layer; past this depth a seal squashes the chain into one layer.
MAX_LAYERS = 16
_MS_RDONLY = 0x1
_MS_REMOUNT = 0x20
_MS_MOVE = 0x2000
_MS_NOSUID, _MS_NODEV = 0x2, 0x4
_MOUNT_OPTIONS = "loop,nodev,nosuid,noatime"
_MIN_FREE = 64 * 1024 * 1024


def run_tool(argv: list[str], what: str) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                              env=privileged_env(), stdin=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise BackendUnavailable(
            f"{argv[0]} is missing; install it with `apt-get install e2fsprogs mount`"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise BackendError(f"{what} timed out") from exc
    if proc.returncode != 0:
        raise BackendError(f"{what} failed: {proc.stderr.strip() or proc.stdout.strip()}")


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_STATX = 332 if platform.machine() == "x86_64" else 291
_AT_SYMLINK_NOFOLLOW = 0x100
_STATX_ATTR_MOUNT_ROOT = 0x2000
_STATX_ATTRIBUTES_OFFSET, _STATX_ATTRIBUTES_MASK_OFFSET = 8, 56


def is_mount(point: Path) -> bool:
    """Whether ``point`` is the root of a mount (never following a symlink). By the kernel's
    word (statx, Linux 5.8+), not by comparing devices with the parent: a bind of a directory
    of the same filesystem (a data mount beside the data directory) has the parent's device."""
    buf = ctypes.create_string_buffer(256)
    if _libc.syscall(_SYS_STATX, -100, os.fsencode(point), _AT_SYMLINK_NOFOLLOW, 0, buf) == 0:
        mask = int.from_bytes(buf.raw[_STATX_ATTRIBUTES_MASK_OFFSET:][:8], "little")
        if mask & _STATX_ATTR_MOUNT_ROOT:
            attributes = int.from_bytes(buf.raw[_STATX_ATTRIBUTES_OFFSET:][:8], "little")
            return bool(attributes & _STATX_ATTR_MOUNT_ROOT)
    elif ctypes.get_errno() != errno.ENOSYS:
        return False
    try:
        return os.path.ismount(point)
    except OSError:
        return False


def _umount(point: Path, *, lazy: bool = False) -> None:
    if not is_mount(point):
        return
    try:
        linux.umount(str(point), linux.MNT_DETACH if lazy else 0)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            raise SandboxBusy(f"{point} is in use; stop what uses the workspace and retry") from exc
        raise BackendError(f"cannot unmount {point}: {exc}") from exc


_MNT_EXPIRE = 0x4


def _detach_unsynced(point: Path) -> None:
    """Unmount the overlay at ``point`` without waiting for the writeback of what was written
    through it.

    The last reference to an overlay's superblock syncs its upper filesystem (the workspace's
    ext4 image, which flushes its loop device, which fsyncs the image on the host disk): after
    a command wrote 300 MB, a plain umount waited 0.4-1.8 s for that I/O, though nothing in a
    seal needs it. So: refuse if anything holds the mount (``MNT_EXPIRE`` is EBUSY then, as a
    plain umount would be), then detach it from a helper thread. The kernel finishes a
    detached mount (and its sync) on the thread's return from ``umount2``, so this thread
    waits only until the mount is gone from the tree; the writeback goes on behind it. The
    data is in the page cache of the image's own superblock, which the sealed layer keeps
    mounted, so every later reader sees it; like any workspace write, it is durable once the
    writeback (bounded by the dirty data, seconds at most) is done.
    """
    if not is_mount(point):
        return
    try:
        linux.umount(str(point), _MNT_EXPIRE)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            raise SandboxBusy(f"{point} is in use; stop what uses the workspace and retry") from exc
        if exc.errno != errno.EAGAIN:  # EAGAIN: not in use, now marked expired
            raise BackendError(f"cannot unmount {point}: {exc}") from exc
    else:
        return  # already expired and now unmounted (synchronously, as before)
    detach_behind([point])


_DETACHERS = 4
_detacher_lock = threading.Lock()
_detacher: ThreadPoolExecutor | None = None


def _detach_all(points: list[Path]) -> None:
    for point in points:
        linux.umount(str(point), linux.MNT_DETACH)


def detach_behind(points: list[Path]) -> None:
    """Detach the mounts at ``points`` from the tree, in order, on a helper thread, and
    return once the last is gone from it; the kernel's teardown of what the last one held
    goes on behind, on that thread.

    A detached mount is finished (its superblock released) on its detaching thread's return
    from ``umount2``. For a workspace that is the sync of its ext4 disk (which flushes the
    loop device, which writes the image on the host disk) and the loop device's release:
    ~2 ms of a ~4 ms destroy on the development VM, and 0.4-1.8 s after a command wrote
    300 MB. Nothing of it is needed before the mounts are out of every path: no name
    reaches them, nothing can enter them anew. Give the overlay last: it holds clones of
    the mounts below it, so theirs are cheap and all the teardown runs at its own.

    Up to ``_DETACHERS`` helpers, so a burst of destroys never queues behind one teardown.
    """
    points = [p for p in points if is_mount(p)]
    if not points:
        return
    global _detacher
    with _detacher_lock:
        if _detacher is None:
            # At the normal priority: the destroy waits for the detach, which is the start of
            # the same umount2 call whose end is the teardown left behind.
            _detacher = ThreadPoolExecutor(max_workers=_DETACHERS,
                                           thread_name_prefix="corral-detach")
        pool = _detacher
    try:
        job = pool.submit(_detach_all, points)
    except RuntimeError:  # the interpreter is exiting: no new threads
        _detach_all(points)
        return
    deadline = time.monotonic() + 10.0
    while is_mount(points[-1]) and not job.done() and time.monotonic() < deadline:
        time.sleep(0.0001)
    if job.done() and job.exception() is not None:
        failed = job.exception()
        what = failed.strerror if isinstance(failed, OSError) else str(failed)
        raise BackendError(f"cannot unmount: {what}") from failed
    still = [p for p in points if is_mount(p)]
    if still:
        raise BackendError(f"cannot unmount {still[0]}: still mounted after 10 s")


def mount_disk(image: Path, point: Path, *, read_only: bool, reuse: bool = False) -> None:
    """Loop-mount the ext4 ``image`` on ``point`` (nodev, nosuid, noatime); ``reuse``: see
    ``loop.mount_image`` (mount(8), the fallback, reuses a loop device of the image itself)."""
    try:
        loop.mount_image(str(image), str(point), read_only=read_only, reuse=reuse)
    except OSError as exc:
        logger.debug("in-process loop mount failed (%s); using mount(8)", exc)
        run_tool(["mount", "-o", _MOUNT_OPTIONS + (",ro" if read_only else ""), str(image),
                  str(point)], f"mounting {image}")


def unescape_mountinfo(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts_under(path: Path) -> list[Path]:
    """Every mount point at or below ``path`` in this mount namespace, deepest first (the
    order they can be unmounted in); a point with mounts stacked on it is there once per
    mount."""
    # The kernel's paths are resolved: a data directory reached through a symlink must match.
    prefix = os.path.realpath(path).rstrip("/") + "/"
    found: list[Path] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = unescape_mountinfo(line.split(" ", 5)[4])
            if point == prefix[:-1] or point.startswith(prefix):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


@contextlib.contextmanager
def flock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        # Held for a mount, a seal or a reset (a squashing seal copies a workspace: seconds).
        flocks.acquire(fd, timeout_s=120.0, busy=f"{path} has been locked for 120 s by a "
                       "mount, seal or reset that does not end (its process stopped or "
                       f"stuck: `fuser {path}` names it); retry once it is done")
        yield
    finally:
        os.close(fd)


class WorkspaceStore:
    """Creates, mounts, seals, resets and removes layered workspaces. One per data directory."""

    def __init__(self, root: Path, layers_root: Path | None = None) -> None:
        self.root = root
        self.layers_root = layers_root or root.parent / "layers"
        self._spares = _SparePool(root / ".spare")
        for path in (self.root, self.layers_root):
            if any(c in str(path) for c in ",:\\\n"):
                raise BackendUnavailable(
                    f"the data directory path {path} holds a character overlayfs options cannot "
                    "carry (, : \\ or newline); choose another CORRAL_HOME")

    # -- paths -----------------------------------------------------------------------------

    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    def mount_point(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id / "workspace"

    def _image(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id / "upper.img"

    def image_path(self, sandbox_id: str) -> Path:
        """The sandbox's writable workspace image (an ext4 file, mounted through a loop
        device while the sandbox has its pieces)."""
        return self._image(sandbox_id)

    def _priv(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id / "priv"

    def _disk(self, sandbox_id: str) -> Path:
        return self._priv(sandbox_id) / "disk"

    def tmp_dir(self, sandbox_id: str) -> Path:
        """The sandbox's ``/tmp`` on the host: a tmpfs of its own (``ensure_tmp``)."""
        return self.root / sandbox_id / "scratch" / "tmp"

    def _layer_dir(self, layer_id: str) -> Path:
        return self.layers_root / layer_id

    def _layer_mount(self, layer_id: str) -> Path:
        return self.layers_root / layer_id / "root"

    # -- create / mount ----------------------------------------------------------------------

    def create(self, spec: SandboxSpec) -> Path:
        """Make and mount a fresh workspace for ``spec`` (on its layers, if any)."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o711)
        base = self.sandbox_dir(spec.id)
        # Traversable (not listable) because bwrap, running as the sandbox's uid, must reach
        # the mount point; the image and private mounts beside it stay root-only.
        base.mkdir()
        base.chmod(0o711)
        self._priv(spec.id).mkdir(mode=0o700)
        self.mount_point(spec.id).mkdir(mode=0o755)
        self._new_upper(spec)
        return self.ensure_mounted(spec, fresh=True)

    def _new_upper(self, spec: SandboxSpec) -> None:
        self._prepare_upper(spec, self._image(spec.id))

    def _prepare_upper(self, spec: SandboxSpec, target: Path) -> None:
        """A fresh, empty writable image at ``target`` (claimed from the spares, or made); one
        already there (a seal or restore cut short made it, and nothing ever mounted it) is
        kept. Refused before anything changes when the disk is full."""
        if target.exists():
            return
        free = free_bytes(self.root)
        if free < _MIN_FREE:
            raise insufficient(self.root, f"{free // (1024 * 1024)} MiB free, a workspace "
                               f"needs {_MIN_FREE // (1024 * 1024)} MiB")
        with disk_full_as_error(self.root):
            if not self._spares.claim(spec.tier.disk_bytes, target):
                self._spares.make(spec.tier.disk_bytes, target)
        self._spares.refill(spec.tier.disk_bytes)

    def _next(self, sandbox_id: str) -> Path:
        """The writable image a seal or restore makes before it drops the current one."""
        return self.root / sandbox_id / "upper.next.img"

    def is_mounted(self, sandbox_id: str) -> bool:
        return is_mount(self.mount_point(sandbox_id))

    def ensure_mounted(self, spec: SandboxSpec, *, fresh: bool = False) -> Path:
        """The workspace's host path, mounting whatever a reboot, a crash or a seal left
        unmounted (``fresh``: its writable image was just made, no filesystem of it can be
        alive anywhere)."""
        point = self.mount_point(spec.id)
        if is_mount(point):
            return point
        if not self._image(spec.id).exists():
            raise BackendError(
                f"the workspace image of sandbox {spec.id} is missing ({self._image(spec.id)}); "
                f"remove the sandbox with `corral rm {spec.id}`")
        with flock(self.sandbox_dir(spec.id) / ".lock"):
            if not is_mount(point):
                self._mount(spec, fresh=fresh)
        return point

    def ensure_tmp(self, spec: SandboxSpec, *, fresh: bool = False) -> Path:
        """The sandbox's ``/tmp``, mounted if a reboot or a restore left it unmounted: a tmpfs
        that lives as long as the sandbox (a command's files there are the next one's, as on
        any Linux host), at most the tier's ``tmp_bytes`` (ENOSPC inside past that). Its
        pages are memory, charged to the cgroup of the sandbox process that writes them, so
        it counts against the sandbox's memory limit, never the host's disk. ``fresh``: drop
        what it holds (a restore: the sandbox returns to the snapshot, which has no /tmp)."""
        point = self.tmp_dir(spec.id)
        if not fresh and is_mount(point):
            return point
        with flock(self.sandbox_dir(spec.id) / ".lock"):
            if fresh:
                _umount(point, lazy=True)
            if not is_mount(point):
                # Entered only by the sandbox's own uid (and root): another sandbox's uid that
                # somehow reached the host's mount table still finds nothing.
                point.parent.mkdir(mode=0o700, exist_ok=True)
                os.chown(point.parent, spec.uid, spec.uid)
                point.mkdir(mode=0o700, exist_ok=True)
                linux.mount("tmpfs", str(point), "tmpfs", _MS_NOSUID | _MS_NODEV,
                            f"size={spec.tier.tmp_bytes},mode=1777,uid={spec.uid},"
                            f"gid={spec.uid}")
        return point

    def _ensure_layer(self, layer_id: str) -> tuple[Path, int]:
        """Mount layer ``layer_id`` read-only if needed; return its mount and writer's uid."""
        layer = self._layer_dir(layer_id)
        try:
            owner = int((layer / "owner").read_text())
        except (OSError, ValueError) as exc:
            raise BackendError(
                f"workspace layer {layer_id} is missing or damaged ({layer}); the sandboxes and "
                "snapshots built on it cannot be mounted") from exc
        point = self._layer_mount(layer_id)
        if not is_mount(point):  # the caller holds the layer's lock (``_layer_locks``)
            _mount_layer(layer / "layer.img", point)
        return point, owner

    @contextlib.contextmanager
    def _layer_locks(self, layer_ids: tuple[str, ...]) -> Iterator[None]:
        """Hold the locks of ``layer_ids`` (in one order: never two holders waiting on each
        other) while a workspace is mounted on them: ``release_layer`` takes the same lock,
        so no layer is unmounted between ``_ensure_layer`` and the overlay's mount."""
        with contextlib.ExitStack() as held:
            for layer_id in sorted(set(layer_ids)):
                held.enter_context(flock(self._layer_dir(layer_id) / ".lock"))
            yield

    def mounted_layers(self) -> list[str]:
        """The layers mounted now, each holding a loop device and a mount."""
        root = Path(os.path.realpath(self.layers_root))
        return sorted({p.parent.name for p in mounts_under(root)
                       if p.name == "root" and p.parent.parent == root})

    def release_layer(self, layer_id: str) -> bool:
        """Unmount layer ``layer_id``, which no sandbox uses (the caller knows that), so a
        stored snapshot holds no loop device and no mount; the next mount of it (a sandbox
        made from the snapshot) mounts it again. Whether it is released (False: something
        holds it now, such as a mount being made on it; a later pass tries again).

        The layer's filesystem is made read-only first, which writes back what its seal left
        in the page cache: a later mount through another loop device (a new superblock) then
        reads it whole, and one through the same device (its superblock kept alive by a
        destroyed sandbox's mount being torn down) shares it, read-only as asked."""
        layer = self._layer_dir(layer_id)
        point = self._layer_mount(layer_id)
        if not layer.is_dir():
            return True
        with flock(layer / ".lock"):
            if not is_mount(point):
                return True
            try:
                linux.mount("none", str(point), None, _MS_REMOUNT | _MS_RDONLY
                            | loop._MS_NODEV | loop._MS_NOSUID | loop._MS_NOATIME)
                # Not lazy: EBUSY while anything (a process's cwd, a descriptor) is in it.
                linux.umount(str(point), 0)
            except OSError as exc:
                logger.debug("layer %s not released now: %s", layer_id, exc.strerror)
                return False
        return True

    def _mount(self, spec: SandboxSpec, *, fresh: bool = False) -> None:
        disk = self._disk(spec.id)
        disk.mkdir(mode=0o700, exist_ok=True)
        if not is_mount(disk):
            # An image mounted before may still have its filesystem alive, unmounted here
            # (lazily, by a crash's recovery) but held elsewhere (a sandbox process's mount
            # namespace) with writes not yet on disk: mount that one again (``reuse``), never
            # a second filesystem on the same image, which would read it stale and corrupt it.
            mount_disk(self._image(spec.id), disk, read_only=False, reuse=not fresh)
        upper, work = disk / "upper", disk / "work"
        if not upper.exists():
            # The workspace root: only the sandbox's own uid may enter, so another sandbox's
            # uid that somehow reached the host's mount table still finds nothing to read.
            upper.mkdir(mode=0o700)
            os.chown(upper, spec.uid, spec.uid)
            lost = disk / "lost+found"
            if lost.is_dir() and not any(lost.iterdir()):
                lost.rmdir()
        work.mkdir(mode=0o700, exist_ok=True)
        with self._layer_locks(spec.layers):
            self._mount_overlay(spec, upper, work)

    def _mount_overlay(self, spec: SandboxSpec, upper: Path, work: Path) -> None:
        lowers: list[str] = []
        for index, layer_id in enumerate(spec.layers):
            source, owner = self._ensure_layer(layer_id)
            if owner != spec.uid:
                bound = self._priv(spec.id) / f"l{index}"
                bound.mkdir(mode=0o700, exist_ok=True)
                if not is_mount(bound):
                    try:
                        bind_idmapped(str(source), str(bound), on_disk=owner, shown_as=spec.uid)
                    except OSError as exc:
                        raise BackendUnavailable(
                            f"cannot show layer {layer_id} to sandbox {spec.id}: {exc}. Forks "
                            "and snapshots used by another sandbox need idmapped mounts "
                            "(Linux 5.19+ with overlayfs on ext4); run `corral doctor`") from exc
                source = bound
            lowers.append(str(source / "upper"))
        if not lowers:
            # overlayfs wants a lower layer; an empty, root-owned one stands for "nothing below".
            empty = self.layers_root / ".empty"
            empty.mkdir(parents=True, exist_ok=True, mode=0o755)
            lowers.append(str(empty))
        # The layers are named by descriptor: overlayfs shows its options as given in every
        # mountinfo, the sandbox's own included, and "/proc/self/fd/N" tells it nothing of the
        # host's data directory, sandbox directories or layer ids.
        fds: list[int] = []
        try:
            def by_fd(path: Path | str) -> str:
                fds.append(os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
                return f"/proc/self/fd/{fds[-1]}"

            options = (f"lowerdir={':'.join(by_fd(lower) for lower in lowers)},"
                       f"upperdir={by_fd(upper)},workdir={by_fd(work)},"
                       "redirect_dir=on,index=off,xino=off,metacopy=off,uuid=off")
            linux.mount("overlay", str(self.mount_point(spec.id)), "overlay",
                        loop._MS_NODEV | loop._MS_NOSUID | loop._MS_NOATIME, options)
        except OSError as exc:
            raise BackendError(f"cannot mount the workspace of {spec.id}: {exc}") from exc
        finally:
            for fd in fds:
                os.close(fd)

    def _unmount_all(self, sandbox_id: str, *, lazy: bool) -> None:
        """Unmount the overlay, the lower binds and the writable disk (in that order)."""
        _umount(self.mount_point(sandbox_id), lazy=lazy)
        priv = self._priv(sandbox_id)
        if priv.is_dir():
            for entry in sorted(priv.iterdir()):
                if entry.name.startswith("l"):
                    _umount(entry, lazy=lazy)
                    with contextlib.suppress(OSError):
                        entry.rmdir()
        _umount(self._disk(sandbox_id), lazy=lazy)

    # -- snapshots ---------------------------------------------------------------------------

    def seal(self, spec: SandboxSpec, layer_id: str) -> SealResult:
        """Turn the writable layer into read-only layer ``layer_id`` and start a fresh one on
        top. The caller makes sure nothing runs in the sandbox. O(1) in the workspace's size,
        except when the chain is at ``MAX_LAYERS``: then the whole workspace is copied into one
        squashed layer (O(size), once every ``MAX_LAYERS`` seals).

        Each step leaves a state ``recover_seal`` can finish or undo after a crash: the layer
        is whole once its image is in place (moved: a rename) and, for a squash, once its
        ``sealed`` mark is written (before the old image goes)."""
        with flock(self.sandbox_dir(spec.id) / ".lock"):
            if not self.is_mounted(spec.id):
                self._mount(spec)
            layer = self._layer_dir(layer_id)
            self.layers_root.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.layers_root, 0o700)
            layer.mkdir(mode=0o700)
            failpoint("seal.layer-made")
            old = os.stat(self._image(spec.id)).st_ino
            try:
                # The fresh writable image first: a full disk refuses the seal here, before
                # the workspace's own image has moved.
                self._prepare_upper(spec, self._next(spec.id))
                if len(spec.layers) + 1 > MAX_LAYERS:
                    used = self._squash_into(spec, layer)
                    result = SealResult(layers=(layer_id,), bytes_used=used, squashed=True)
                    self._mark_sealed(spec, layer, old, used)
                    self._unmount_all(spec.id, lazy=False)
                    self._image(spec.id).unlink()
                    failpoint("seal.moved")
                else:
                    used = self._move_upper_into(spec, layer)
                    failpoint("seal.moved")
                    result = SealResult(layers=(layer_id, *spec.layers), bytes_used=used,
                                        squashed=False)
                    self._mark_sealed(spec, layer, old, used)
                failpoint("seal.marked")
            except BaseException:
                # Never lose the sandbox's changes: put its image back before dropping the layer.
                with contextlib.suppress(OSError, BackendError):
                    _umount(layer / "root", lazy=True)
                sealed = layer / "layer.img"
                if sealed.exists() and not self._image(spec.id).exists():
                    os.rename(sealed, self._image(spec.id))
                shutil.rmtree(layer, ignore_errors=True)
                raise
            os.rename(self._next(spec.id), self._image(spec.id))
            failpoint("seal.new-upper")
            self._mount(_with_layers(spec, result.layers), fresh=True)
        return result

    @staticmethod
    def _mark_sealed(spec: SandboxSpec, layer: Path, old_image: int, used: int) -> None:
        """The layer is whole: its writer's uid, and a mark naming the writable image it was
        made from (its inode) and its size, so ``recover_seal`` can tell that image from the
        fresh one that follows it."""
        (layer / "owner").write_text(str(spec.uid))
        (layer / "sealed").write_text(json.dumps({"image": old_image, "bytes": used}))

    def recover_seal(self, spec: SandboxSpec, layer_id: str) -> SealResult | None:
        """Finish or undo a ``seal`` of ``spec`` (its layers before the seal) that a crash cut
        short; idempotent. A whole layer (its image moved in, or a squash's mark written) is
        kept and the sandbox gets a fresh writable layer on it: the result says so. Otherwise
        the layer goes and the writable image, never moved, stays as it was: None. Either way
        every mount the seal had made is taken down; the next use mounts the workspace as the
        store then says it is."""
        layer = self._layer_dir(layer_id)
        image = self._image(spec.id)
        squash = len(spec.layers) + 1 > MAX_LAYERS
        with flock(self.sandbox_dir(spec.id) / ".lock"):
            self._unmount_all(spec.id, lazy=True)
            _umount(layer / "root", lazy=True)
            mark = _read_mark(layer / "sealed")
            whole = mark is not None if squash else (layer / "layer.img").exists()
            if not whole:
                shutil.rmtree(layer, ignore_errors=True)
                self._next(spec.id).unlink(missing_ok=True)
                return None
            if mark is None:  # moved, but not marked yet
                self._mark_sealed(spec, layer, -1, _used(layer / "layer.img"))
                mark = _read_mark(layer / "sealed")
                assert mark is not None
            if image.exists() and image.stat().st_ino == mark["image"]:
                image.unlink()  # the squashed image, copied whole into the layer already
            if not image.exists():
                self._prepare_upper(spec, self._next(spec.id))  # made before, unless cut short
                os.rename(self._next(spec.id), image)
        layers = (layer_id,) if squash else (layer_id, *spec.layers)
        return SealResult(layers=layers, bytes_used=int(mark["bytes"]), squashed=squash)

    def _move_upper_into(self, spec: SandboxSpec, layer: Path) -> int:
        disk = self._disk(spec.id)
        self._unmount_all_but_disk(spec.id)
        stat = os.statvfs(disk)
        used = (stat.f_blocks - stat.f_bfree) * stat.f_frsize
        try:
            # Read-only at the mount, not the superblock: the latter would first write back
            # every dirty page (O(recent writes)); with no writable mount left, nothing can
            # change the layer either way. (overlayfs's work/ stays: nothing reads it.)
            linux.mount("none", str(disk), None, _MS_REMOUNT | linux.MS_BIND | _MS_RDONLY
                        | loop._MS_NODEV | loop._MS_NOSUID | loop._MS_NOATIME)
        except OSError as exc:
            raise BackendError(f"cannot seal the workspace of {spec.id}: {exc}") from exc
        point = layer / "root"
        point.mkdir(mode=0o755)
        try:
            # The image keeps its loop device and mount; only its mount point moves.
            linux.mount(str(disk), str(point), None, _MS_MOVE)
            moved = True
        except OSError:
            _umount(disk)  # a shared parent mount refuses moves: mount it again instead
            moved = False
        os.rename(self._image(spec.id), layer / "layer.img")
        if not moved:
            mount_disk(layer / "layer.img", point, read_only=True)
        return used

    def _unmount_all_but_disk(self, sandbox_id: str) -> None:
        _detach_unsynced(self.mount_point(sandbox_id))
        priv = self._priv(sandbox_id)
        for entry in sorted(priv.iterdir()):
            if entry.name.startswith("l"):
                _umount(entry)
                entry.rmdir()

    def _squash_into(self, spec: SandboxSpec, layer: Path) -> int:
        """Copy the workspace as the sandbox sees it (all layers merged) into a new layer."""
        image = layer / "layer.img"
        format_image(image, spec.tier.disk_bytes * (MAX_LAYERS + 1))  # sparse: room for every layer
        point = layer / "root"
        point.mkdir(mode=0o755)
        mount_disk(image, point, read_only=False)
        try:
            run_tool(["cp", "-a", "--reflink=never", "--",
                  f"{self.mount_point(spec.id)}/.", str(point / "upper")],
                 "squashing the workspace layers")
            stat = os.statvfs(point)
            used = (stat.f_blocks - stat.f_bfree) * stat.f_frsize
            linux.mount("none", str(point), None, _MS_REMOUNT | linux.MS_BIND | _MS_RDONLY
                        | loop._MS_NODEV | loop._MS_NOSUID | loop._MS_NOATIME)
        except BaseException:
            _umount(point, lazy=True)
            raise
        return used

    def reset(self, spec: SandboxSpec) -> None:
        """Discard the writable layer and start a fresh one on ``spec.layers`` (restore).
        Idempotent: run again after a crash, it finishes what it began."""
        with flock(self.sandbox_dir(spec.id) / ".lock"):
            # The fresh image first: a full disk refuses the restore with nothing dropped.
            self._prepare_upper(spec, self._next(spec.id))
            # Lazy: the layer is being thrown away, so there is nothing to write back first.
            self._unmount_all(spec.id, lazy=True)
            self._image(spec.id).unlink(missing_ok=True)
            failpoint("restore.upper-dropped")
            os.rename(self._next(spec.id), self._image(spec.id))
            self._mount(spec, fresh=True)

    def remove_layer(self, layer_id: str) -> None:
        """Unmount and delete a layer no sandbox or snapshot uses any more. Idempotent."""
        layer = self._layer_dir(layer_id)
        if not layer.exists():
            return
        # Lazy: a sandbox being destroyed at the same moment may still hold it for a moment.
        _umount(self._layer_mount(layer_id), lazy=True)
        shutil.rmtree(layer)

    def layer_ids(self) -> list[str]:
        if not self.layers_root.exists():
            return []
        return sorted(p.name for p in self.layers_root.iterdir()
                      if p.is_dir() and not p.name.startswith("."))

    # -- removal ----------------------------------------------------------------------------

    def mounts_dir(self, sandbox_id: str) -> Path:
        """Where the sandbox's volumes and data mounts are bound for it (``volumes``)."""
        return self.root / sandbox_id / "mounts"

    def unmount(self, sandbox_id: str, *, behind: bool = True) -> None:
        # Lazy: the sandbox's processes are already dead; detaching can't fail on a stray
        # host shell sitting in the directory, and the loop device auto-clears. Behind:
        # the sync of the disk and the loop device's release need not hold up a destroy.
        # Not behind (a hibernate): returns once the kernel has let go of all of it, so the
        # next mount of the same image (a wake) never meets the old one.
        priv = self._priv(sandbox_id)
        lowers = sorted(e for e in priv.iterdir() if e.name.startswith("l")) \
            if priv.is_dir() else []
        # /tmp first: its pages are freed behind, with the workspace's teardown.
        points = [self.tmp_dir(sandbox_id), self._disk(sandbox_id), *lowers,
                  self.mount_point(sandbox_id)]
        if behind:
            detach_behind(points)
        else:
            _detach_all([p for p in points if is_mount(p)])
        for entry in lowers:
            with contextlib.suppress(OSError):
                entry.rmdir()
        if self.mounts_dir(sandbox_id).is_dir():
            # Binds only: a volume's own mount and data stay where they are.
            for point in mounts_under(self.mounts_dir(sandbox_id)):
                _umount(point, lazy=True)

    def remove(self, sandbox_id: str) -> None:
        """Unmount and delete everything of ``sandbox_id`` (not its layers). Idempotent."""
        base = self.sandbox_dir(sandbox_id)
        if not base.exists():
            return
        if remove_special(base):  # a stray FIFO (never opened: rmtree's open would block)
            return
        self.unmount(sandbox_id)
        if self.mounts_dir(sandbox_id).is_dir():
            # Never delete through a mount: below a bind are a volume's files. (The whole
            # mount table is read only here: a sandbox without mounts has no binds.)
            still = mounts_under(base)
        else:
            still = [p for p in (self.mount_point(sandbox_id), self._disk(sandbox_id),
                                 self.tmp_dir(sandbox_id)) if is_mount(p)]
        if still:
            raise BackendError(f"{still[0]} is still mounted; not deleting {base}")
        shutil.rmtree(base)

    def ids(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and not p.name.startswith("."))


def _mount_layer(image: Path, point: Path) -> None:
    """Mount a sealed layer read-only, through the loop device already backed by its image if
    there is one: its superblock may still be alive (a destroyed sandbox's mount being torn
    down holds it), and a second one on the same file could read it stale."""
    try:
        loop.mount_image(str(image), str(point), read_only=True, reuse=True)
        return
    except OSError as exc:
        found = loop.attached(str(image)) if exc.errno == errno.EBUSY else None
        if found is None:
            logger.debug("in-process loop mount failed (%s); using mount(8)", exc)
            mount_disk(image, point, read_only=True)
            return
        os.close(found[0])
    # EBUSY with a device attached: its superblock is alive and still read-write (a crash's
    # recovery unmounted the layer without releasing it). Share it, read-only at the mount.
    loop.mount_image(str(image), str(point), read_only=False, reuse=True)
    try:
        linux.mount("none", str(point), None, _MS_REMOUNT | linux.MS_BIND | _MS_RDONLY
                    | loop._MS_NODEV | loop._MS_NOSUID | loop._MS_NOATIME)
    except OSError:
        _umount(point, lazy=True)
        raise


def format_image(image: Path, size: int, *, journal: bool = False,
                 root_owner: int | None = None) -> None:
    """A new sparse ext4 image of ``size`` bytes at ``image`` (removed again on failure)."""
    with open(image, "xb") as f:
        f.truncate(size)
    extended = "lazy_itable_init=1,nodiscard"
    if root_owner is not None:
        extended += f",root_owner={root_owner}:{root_owner}"
    try:
        run_tool(["mkfs.ext4", "-q", "-F", "-m", "0", "-O",
                  "has_journal" if journal else "^has_journal", "-E", extended, str(image)],
                 f"formatting {image.name}")
    except BaseException:
        image.unlink(missing_ok=True)
        raise


_EXT4_MAGIC_AT = 1024 + 0x38  # s_magic in the superblock, which starts 1 KiB in
_EXT4_MAGIC = b"\x53\xef"
_SPARSE_SLACK = 1024 * 1024  # data the extents may show beyond the blocks allocated


def data_extents(fd: int) -> list[tuple[int, int]]:
    """The (start, end) of each run of data in the file open as ``fd``, holes left out."""
    size = os.fstat(fd).st_size
    extents: list[tuple[int, int]] = []
    offset = 0
    while offset < size:
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole from here on
                break
            raise
        offset = os.lseek(fd, data, os.SEEK_HOLE)
        extents.append((data, offset))
    return extents


def copy_sparse(source: int, target: int, extents: list[tuple[int, int]]) -> None:
    """Copy ``extents`` of the file open as ``source`` into the empty file open as
    ``target``, at the same offsets and to the same size: the holes stay holes. An empty
    ext4 image is a few hundred KiB of metadata in a sparse file of its full size, so this is
    a fraction of a millisecond."""
    os.ftruncate(target, os.fstat(source).st_size)
    for start, end in extents:
        at = start
        while at < end:
            copied = os.copy_file_range(source, target, end - at, at, at)
            if copied == 0:
                raise BackendError(f"the image being copied shrank at {at} bytes")
            at += copied


class _SparePool:
    """A few formatted, empty images per size, made in the background after each use, so a
    create, seal or restore claims an image with a rename (a fork needs two: the parent's
    fresh layer and the child's).

    Each image is a sparse copy of one blank per size, made by mkfs once: a copy costs ~0.3 ms
    of CPU where mkfs cost ~3 ms (in a burst, when the spares are gone, that is on every
    create's path). The copies share the blank's filesystem UUID and directory hash seed;
    Corral names images by path and loop device, never by UUID, and a sandbox never sees its
    block device.

    Claims are renames, so processes sharing the data directory never get the same image; an
    image (or the blank) is only named once it is complete, so a process killed mid-format
    leaves at most a ``.tmp`` file (removed by a later refill).
    """

    SLOTS = 2

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._busy: set[int] = set()
        self._lock = threading.Lock()

    def _spare(self, size: int, slot: int) -> Path:
        return self._dir / f"{size}.{slot}.img"

    def claim(self, size: int, target: Path) -> bool:
        for slot in range(self.SLOTS):
            try:
                os.rename(self._spare(size, slot), target)
            except FileNotFoundError:
                continue
            return True
        return False

    def make(self, size: int, target: Path) -> None:
        """A new empty image of ``size`` bytes at ``target`` (which must not exist)."""
        source = self._open_blank(size)
        try:
            extents = data_extents(source)
            if sum(end - start for start, end in extents) > \
                    os.fstat(source).st_blocks * 512 + _SPARSE_SLACK:
                # The filesystem reports no holes (everything reads as data): a copy would
                # write the whole size. mkfs writes only the metadata.
                format_image(target, size)
                return
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                copy_sparse(source, fd, extents)
            except BaseException:
                os.close(fd)
                target.unlink(missing_ok=True)
                raise
            os.close(fd)
        finally:
            os.close(source)

    def _open_blank(self, size: int) -> int:
        """A descriptor of the blank of ``size``, made first if need be. A damaged one (the
        wrong size, no ext4 superblock) is a cache, not data: made again, once; a second bad
        one is the disk's fault."""
        for attempt in range(2):
            blank = self._blank(size)
            source = os.open(blank, os.O_RDONLY | os.O_CLOEXEC)
            try:
                sound = (os.fstat(source).st_size == size
                         and os.pread(source, 2, _EXT4_MAGIC_AT) == _EXT4_MAGIC)
            except BaseException:
                os.close(source)
                raise
            if sound:
                return source
            os.close(source)
            if attempt == 0:
                logger.warning("the blank workspace image %s is damaged; making it again",
                               blank)
                blank.unlink(missing_ok=True)
        raise BackendError(f"the blank workspace image {blank} is damaged just after mkfs "
                           "made it; check the disk under the data directory")

    def _blank(self, size: int) -> Path:
        blank = self._dir / f"{size}.blank.img"
        if blank.exists():
            return blank
        self._dir.mkdir(mode=0o700, exist_ok=True)
        tmp = self._dir / f"{size}.blank.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.unlink(missing_ok=True)
        format_image(tmp, size)
        try:
            # Durable before it is named: every later image is copied from it.
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, blank)  # another process's blank, if it won, is just as good
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return blank

    def refill(self, size: int) -> None:
        with self._lock:
            if size in self._busy:
                return
            self._busy.add(size)
        threading.Thread(target=self._make, args=(size,), name="corral-spare-image",
                         daemon=True).start()

    def _make(self, size: int) -> None:
        try:
            self._dir.mkdir(mode=0o700, exist_ok=True)
            for stale in self._dir.glob(f"{size}.*.tmp"):
                if time.time() - stale.stat().st_mtime > 60:
                    stale.unlink(missing_ok=True)
            for slot in range(self.SLOTS):
                spare = self._spare(size, slot)
                if spare.exists():
                    continue
                tmp = self._dir / f"{size}.{os.getpid()}.{threading.get_ident()}.tmp"
                tmp.unlink(missing_ok=True)
                self.make(size, tmp)
                if spare.exists():
                    tmp.unlink()
                else:
                    os.rename(tmp, spare)
        except (OSError, BackendError) as exc:
            logger.debug("could not make a spare workspace image: %s", exc)
        finally:
            with self._lock:
                self._busy.discard(size)


def _with_layers(spec: SandboxSpec, layers: tuple[str, ...]) -> SandboxSpec:
    import dataclasses

    return dataclasses.replace(spec, layers=layers)


def _read_mark(path: Path) -> dict[str, int] | None:
    """A layer's ``sealed`` mark, or None when it is not (wholly) written."""
    try:
        mark = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return mark if isinstance(mark, dict) and {"image", "bytes"} <= set(mark) else None


def _used(image: Path) -> int:
    """The bytes an image's blocks hold (a sealed layer's size, when its mark was not written)."""
    try:
        return os.stat(image).st_blocks * 512
    except OSError:
        return 0
