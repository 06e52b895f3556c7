"""Volumes and data mounts: directories from outside a sandbox, mounted into it (``Mount``).

A *volume* is a sparse ext4 image of a fixed size, loop-mounted on the host when a sandbox needs
it and left mounted. Why an image, as for workspaces (``storage``): its size is a real quota
(a full volume is ENOSPC inside) with no quota support in the kernel, and nothing in it can be a
hard link to a host file. It has a journal, unlike a workspace's image: a volume is the data
that outlives its sandboxes, and must survive a crash of the host too.

Ownership. Every file of a volume is owned on disk by uid/gid 1000, the uid a sandbox's user
has *inside* its sandbox (``template.SANDBOX_UID``, the microVM guest's user too), never by a
host uid, so a volume reads the same whichever sandbox, tier or host uid wrote it. A sandbox
(host uid ``spec.uid``) sees it through an idmapped bind of its own (``_core.idmap``) that shows
1000 as ``spec.uid`` and stores what ``spec.uid`` writes as 1000 (for a gVisor sandbox it also
maps on-disk root to the sandbox's runtime uid: gVisor's kernel creates every file as that uid
before it gives the file to its owner). A read-only mount's bind is read-only on the host
already, so the sandbox's own runtime cannot write through it either. Mount points are made as
the sandbox's user, in the workspace or in the volume a target is under.

A *data mount* is one of the operator's directories (``Settings.data_mounts``), named by the
caller, never given as a path. It is bound read-only (nosuid, nodev), ownership as it is: its
files must be readable by "other" on the host (directories ``o+rx``, files ``o+r``), because a
sandbox runs as a uid of its own with no groups (gVisor's file server, as the sandbox's runtime
uid, reads it the same way). Nothing in it is copied or changed. Read-only does not stop a
``connect`` to a Unix socket or an open of a FIFO on the namespace tier: a data directory must
hold no live socket or FIFO of a host service (gVisor refuses host sockets and FIFOs itself).
Two namespace-tier sandboxes sharing a volume can likewise talk through a socket in it; they
share its data anyway.

Symlinks never resolve on the host: the tiers bind the per-sandbox directory at the target, so
a link inside a volume or data directory is followed by the sandbox's own kernel (Linux in its
mount namespace, or gVisor's) inside the sandbox's root; the binds are not recursive, so mounts
below a data directory on the host stay out.

Host layout (``root`` is ``$CORRAL_HOME/volumes``)::

    volumes/                            root-only (0700): nothing here is reachable by a sandbox uid
    volumes/<id>/volume.img             the image
    volumes/<id>/mnt                    its mount, made when a sandbox first needs it
    volumes/<id>/.lock                  held while it is mounted or removed (``_locked``)
    sandboxes/<sid>/mounts/             0711: the sandbox's uid (bwrap) or runtime uid (gVisor's
                                        file server) must reach the binds in it
    sandboxes/<sid>/mounts/m<N>         spec.mounts[N] bound for the sandbox (unbound, a root-only
                                        directory the sandbox cannot open, never an empty one it
                                        could mistake for its data)
    sandboxes/<sid>/mounts/mnt          gVisor's mount points under /mnt (``mount_points``)
    sandboxes/<sid>/mounts/.lock        held while binds are made (``ensure``)

Removing a sandbox (``WorkspaceStore.remove``) detaches its binds and refuses to delete a
directory that is still a mount, so a volume's data is never deleted with a sandbox.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import posixpath
import re
import secrets
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..._core import linux
from ..._core.idmap import bind_idmapped, bind_readonly
from ..._workspace.files import WorkspaceFiles
from ...backends import Mount, SandboxSpec
from ...errors import (
    BackendError,
    BackendUnavailable,
    ConfigError,
    FileError,
    QuotaExceeded,
    UsageError,
    VolumeError,
    VolumeInUse,
    VolumeNotFound,
)
from . import loop
from .storage import flock, format_image, is_mount, mount_disk
from .template import SANDBOX_UID

__all__ = ["MIN_VOLUME_BYTES", "BoundMount", "VolumeKit", "check_target"]

# Settings.volume_max_bytes's own floor; ext4 fits (without a journal, below 2 MiB).
MIN_VOLUME_BYTES = 1024 * 1024
_MIN_FREE = 64 * 1024 * 1024
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")

# How long a removal waits for a mount namespace that is going away to let go of a volume.
_HELD_GRACE_S = 3.0


@dataclass(frozen=True, slots=True)
class BoundMount:
    """One of ``spec.mounts`` as a tier mounts it: bind ``source`` (a host path) at ``target``
    inside the sandbox, read-only or not."""

    source: Path
    target: str
    read_only: bool


def check_target(target: str) -> str:
    """``target`` if it is a normalised absolute path strictly under ``/mnt/`` or
    ``/workspace/`` (the control plane validates too; this is the host's own line)."""
    if (not isinstance(target, str) or not target.startswith("/") or len(target) > 1024
            or any(ord(c) < 0x20 or c == "\x7f" for c in target)
            or posixpath.normpath(target) != target or ".." in target.split("/")
            or not target.startswith(("/mnt/", "/workspace/"))):
        raise UsageError(f"mount target {str(target)[:80]!r} is refused: it must be a normalised "
                         "absolute path under /mnt/ or /workspace/, without '..'")
    return target


def _check_id(volume_id: str) -> str:
    if not _ID.fullmatch(volume_id):
        raise UsageError(f"volume id {volume_id[:64]!r} is refused: use 1-128 of A-Z, a-z, "
                         "0-9, _ and -")
    return volume_id


def _identity(path: Path | str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


@contextlib.contextmanager
def _locked(directory: Path, volume_id: str) -> Iterator[None]:
    """The volume's lock (mounts, removal, across processes). A volume removed while we
    waited has no directory: its lock file cannot be made again, and that is the answer; one
    removed and made again has a new lock file, which is the one to hold."""
    while True:
        try:
            fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            raise VolumeNotFound(f"volume {volume_id} does not exist") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.stat(directory / ".lock")
            except FileNotFoundError:
                raise VolumeNotFound(f"volume {volume_id} does not exist") from None
            held = os.fstat(fd)
            if (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
                yield
                return
        finally:
            os.close(fd)


class VolumeKit:
    """Stores volumes and binds volumes and data mounts for sandboxes. One per data directory;
    safe to share between threads and processes (every change holds the volume's lock)."""

    def __init__(self, root: Path, data_mounts: Mapping[str, Path]) -> None:
        self.root = root
        self._data = dict(data_mounts)

    def _dir(self, volume_id: str) -> Path:
        return self.root / _check_id(volume_id)

    def _image(self, volume_id: str) -> Path:
        return self._dir(volume_id) / "volume.img"

    def _mount_point(self, volume_id: str) -> Path:
        return self._dir(volume_id) / "mnt"

    # -- storage (VolumeStorage) ---------------------------------------------------------------

    def create(self, volume_id: str, size_bytes: int) -> None:
        """An empty volume of ``size_bytes``, its root owned by 1000 and private to it."""
        final = self._dir(volume_id)
        if size_bytes < MIN_VOLUME_BYTES:
            raise UsageError(f"a volume needs at least {MIN_VOLUME_BYTES // 2**20} MiB; "
                             f"{size_bytes} bytes asked")
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        if self.exists(volume_id):
            raise VolumeError(f"volume {volume_id} already exists")
        if final.exists():
            self.remove(volume_id)  # what an interrupted removal left of it
        free = shutil.disk_usage(self.root).free
        if free < _MIN_FREE:
            raise QuotaExceeded(f"only {free // 2**20} MiB free under {self.root}; free disk "
                                "space before creating volumes")
        # Made whole under a private name, then renamed: a crash leaves only a dot-directory
        # (which ``ids`` never lists), never a volume without its image.
        tmp = self.root / f".new-{volume_id}-{secrets.token_hex(4)}"
        tmp.mkdir(mode=0o700)
        try:
            format_image(tmp / "volume.img", size_bytes, journal=True, root_owner=SANDBOX_UID)
            point = tmp / "mnt"
            point.mkdir(mode=0o700)
            mount_disk(tmp / "volume.img", point, read_only=False)
            try:
                # The root is the sandbox user's alone, as a workspace's is; lost+found would
                # be root's, in every sandbox's way (e2fsck makes it again if it needs it).
                os.chmod(point, 0o700)
                with contextlib.suppress(OSError):
                    (point / "lost+found").rmdir()
            finally:
                linux.umount(str(point))
            os.rename(tmp, final)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise VolumeError(f"volume {volume_id} already exists") from None
            raise BackendError(f"cannot create volume {volume_id}: {exc}") from exc
        finally:
            if tmp.exists():
                with contextlib.suppress(OSError):
                    linux.umount(str(tmp / "mnt"), linux.MNT_DETACH)
                shutil.rmtree(tmp, ignore_errors=True)

    def remove(self, volume_id: str) -> None:
        """Unmount and delete a volume no sandbox mounts. Idempotent."""
        directory = self._dir(volume_id)
        if not directory.exists():
            return
        try:
            with _locked(directory, volume_id):
                point = self._mount_point(volume_id)
                if is_mount(point):
                    holders = self._binds_of(volume_id)
                    if holders:
                        raise VolumeInUse(f"volume {volume_id} is mounted by "
                                          f"{_sandbox_of(holders[0])}; destroy it first")
                    try:
                        linux.umount(str(point))
                    except OSError as exc:
                        raise VolumeInUse(f"volume {volume_id} is in use on the host "
                                          f"({exc.strerror}); retry once nothing uses it") from exc
                # A process that made a mount namespace of its own while the volume was
                # mounted holds a copy of this mount (the host's mounts are private here, so
                # the umount above did not reach it); removing the mount point detaches such
                # copies (Linux >= 3.18) and leaves a sandbox's own bind, made elsewhere, be.
                with contextlib.suppress(FileNotFoundError):
                    point.rmdir()
                if self._still_held(volume_id):
                    # A mount of it lives on in some mount namespace (a command still
                    # running?): its writes would go to a deleted file.
                    raise VolumeInUse(f"volume {volume_id} is still held by a process; retry "
                                      "once the sandboxes that mounted it have stopped")
                shutil.rmtree(directory)
        except VolumeNotFound:
            return  # removed by someone else meanwhile

    def _still_held(self, volume_id: str) -> bool:
        """Whether a mount of the volume lives on after ``_HELD_GRACE_S``: a sandbox destroyed
        a moment ago (by another process, whose resident helper dies with it) lets go of its
        mount namespace only once its last process is gone."""
        deadline = time.monotonic() + _HELD_GRACE_S
        while self._still_attached(volume_id):
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.05)
        return False

    def usage(self, volume_id: str) -> int:
        """Bytes used in the volume, as ``df`` inside would say (mounts it if needed)."""
        point = self.ensure_mounted(volume_id)
        stat = os.statvfs(point)
        return (stat.f_blocks - stat.f_bfree) * stat.f_frsize

    def ids(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if not p.name.startswith(".") and (p / "volume.img").is_file())

    def exists(self, volume_id: str) -> bool:
        return self._image(volume_id).is_file()

    # -- the volume's own mount ----------------------------------------------------------------

    def ensure_mounted(self, volume_id: str) -> Path:
        """The volume's host mount, mounted now if a reboot (or nothing yet) left it not."""
        point = self._mount_point(volume_id)
        if is_mount(point):
            return point
        directory = self._dir(volume_id)
        if not self.exists(volume_id):
            raise VolumeNotFound(f"volume {volume_id} does not exist")
        with _locked(directory, volume_id):
            if not is_mount(point):
                point.mkdir(mode=0o700, exist_ok=True)
                # ``reuse``: a detached mount of it still alive keeps the one superblock.
                mount_disk(self._image(volume_id), point, read_only=False, reuse=True)
        return point

    def _binds_of(self, volume_id: str) -> list[Path]:
        """Mounts in this namespace of the volume's filesystem other than its own mount."""
        point = self._mount_point(volume_id)
        device = _device_of(point)
        return [p for p, dev in _mounts_with_device() if dev == device and p != Path(
            os.path.realpath(point))]

    def _still_attached(self, volume_id: str) -> bool:
        """Whether a loop device still backs the image, waiting a moment for the one just
        unmounted: the kernel clears an autoclear device after its last user, not at once."""
        image = self._image(volume_id)
        deadline = time.monotonic() + 2.0
        while True:
            found = loop.attached(str(image)) if image.exists() else None
            if found is None:
                return False
            os.close(found[0])
            if time.monotonic() > deadline:
                return True
            time.sleep(0.01)

    # -- per sandbox ---------------------------------------------------------------------------

    def plan(self, spec: SandboxSpec, mounts_dir: Path) -> list[BoundMount]:
        """What a tier binds for ``spec.mounts`` (no I/O beyond the checks of names)."""
        targets: set[str] = set()
        planned = []
        for index, mount in enumerate(spec.mounts):
            target = check_target(mount.target)
            if target in targets:
                raise UsageError(f"two mounts at {target}")
            targets.add(target)
            if mount.kind == "data":
                self._data_dir(mount.source)
            elif mount.kind == "volume":
                _check_id(mount.source)
            else:
                raise UsageError(f"unknown mount kind {str(mount.kind)[:32]!r}")
            planned.append(BoundMount(mounts_dir / f"m{index}", target,
                                      mount.read_only or mount.kind == "data"))
        return planned

    def ensure(self, spec: SandboxSpec, mounts_dir: Path, workspace: Path, *,
               root_uid: int = 0) -> list[BoundMount]:
        """Mount what ``spec.mounts`` needs and bind it for the sandbox under ``mounts_dir``
        (each bind checked against its source, so a stale one after a remount is replaced),
        with its mount point made in what holds it; return ``plan``'s list. ``root_uid`` is
        the host uid a volume's root-owned files are shown as and the sandbox's root creates
        files as (``bind_idmapped``)."""
        planned = self.plan(spec, mounts_dir)
        if not planned:
            return planned
        if not mounts_dir.is_dir():
            mounts_dir.mkdir(mode=0o711, exist_ok=True)
            os.chmod(mounts_dir, 0o711)
        for index, (mount, bound) in enumerate(zip(spec.mounts, planned, strict=True)):
            self._make_mount_point(spec, index, workspace)
            source = self._source(spec, mount)
            if _bound(bound, source):
                continue
            # Concurrent commands of one sandbox (after a reboot, say) must not stack binds.
            with flock(mounts_dir / ".lock"):
                if not _bound(bound, source):
                    self._bind(spec, mount, bound, source, root_uid)
        return planned

    def _make_mount_point(self, spec: SandboxSpec, index: int, workspace: Path) -> None:
        """Make ``spec.mounts[index]``'s mount point as the sandbox's user would, in the
        workspace or the earlier mount it is under (bwrap would make it as the user, but
        gVisor's file server makes it as the runtime uid: a directory of root's in the user's
        workspace or volume). Through ``WorkspaceFiles``, so a symlink on the way is followed
        only while it stays inside. Under a read-only mount it must exist already; under /mnt
        itself there is nothing to make (bwrap's tmpfs root, or ``mount_points``)."""
        target = spec.mounts[index].target
        outer: Mount | None = None
        for earlier in spec.mounts[:index]:
            if target.startswith(earlier.target + "/") and (
                    outer is None or len(earlier.target) > len(outer.target)):
                outer = earlier
        if outer is not None:
            rest = target.removeprefix(outer.target + "/")
            if outer.kind == "data" or outer.read_only:
                root = (self._data_dir(outer.source) if outer.kind == "data"
                        else self.ensure_mounted(outer.source))
                self._require_dir(root, rest, target, outer)
                return
            files = WorkspaceFiles(self.ensure_mounted(outer.source), SANDBOX_UID)
        elif target.startswith("/workspace/"):
            rest = target.removeprefix("/workspace/")
            files = WorkspaceFiles(workspace, spec.uid)
        else:
            return
        try:
            files.make_dir(rest)
        except FileError as exc:
            raise FileError(f"cannot make the mount point {target}: {exc.message}") from None

    @staticmethod
    def _require_dir(root: Path, rest: str, target: str, outer: Mount) -> None:
        kind: str
        try:
            kind = WorkspaceFiles(root, 0).stat(rest).type
        except FileError:
            kind = "missing"
        if kind not in ("dir", "symlink"):
            raise FileError(f"the mount point {target} must be a directory in {outer.kind} "
                            f"{outer.source}, which is mounted read-only above it ({kind})")

    def _source(self, spec: SandboxSpec, mount: Mount) -> Path:
        """The host directory ``mount`` binds: the volume's mount (mounted now if need be) or
        the operator's data directory."""
        if mount.kind == "data":
            return self._data_dir(mount.source)
        if not self.exists(mount.source):
            raise VolumeNotFound(f"volume {mount.source} does not exist; sandbox {spec.id} "
                                 "cannot mount it")
        return self.ensure_mounted(mount.source)

    @staticmethod
    def _bind(spec: SandboxSpec, mount: Mount, bound: BoundMount, source: Path,
              root_uid: int) -> None:
        point = bound.source
        if is_mount(point):
            # Bound to a mount of the source that is gone (a remount): bind it afresh.
            linux.umount(str(point), linux.MNT_DETACH)
        # Root-only while nothing is bound on it: a sandbox reaching it unbound fails.
        point.mkdir(mode=0o700, exist_ok=True)
        try:
            if mount.kind == "volume":
                bind_idmapped(str(source), str(point), on_disk=SANDBOX_UID, shown_as=spec.uid,
                              read_only=bound.read_only, root_shown_as=root_uid)
            else:
                bind_readonly(str(source), str(point))
        except OSError as exc:
            raise BackendUnavailable(
                f"cannot mount {mount.kind} {mount.source} for sandbox {spec.id}: {exc}. "
                "Volumes need idmapped mounts (Linux 5.12+); run `corral doctor`") from exc

    def _data_dir(self, name: str) -> Path:
        path = self._data.get(name)
        if path is None:
            known = ", ".join(sorted(self._data)) or "none are set"
            raise ConfigError(f"no data mount is named {name[:64]!r} (the operator's "
                              f"CORRAL_DATA_MOUNTS: {known})")
        try:
            st = os.stat(path)
        except OSError as exc:
            raise ConfigError(f"data mount {name!r}: {path} is missing ({exc.strerror}); the "
                              "operator must create it or fix CORRAL_DATA_MOUNTS") from None
        if not os.path.isdir(path):
            raise ConfigError(f"data mount {name!r}: {path} is not a directory")
        if not st.st_mode & 0o001:
            raise ConfigError(f"data mount {name!r}: {path} is not traversable by other users "
                              f"(mode {st.st_mode & 0o777:o}), and sandboxes read it as other "
                              f"users; `chmod o+rx {path}` (and o+r on its files)")
        return path

    @staticmethod
    def mount_points(planned: list[BoundMount], mounts_dir: Path) -> Path | None:
        """A root-owned tree holding the mount points of the targets under /mnt/ (gVisor binds
        it read-only at /mnt: its root is read-only, and its file server needs a host
        directory under every mount). None when no target is under /mnt/."""
        under = [b.target for b in planned if b.target.startswith("/mnt/")]
        if not under:
            return None
        tree = mounts_dir / "mnt"
        for index, target in enumerate(under):
            if any(target.startswith(t + "/") for t in under[:index]):
                continue  # its mount point is in the mount it is under
            path = tree
            for part in ("", *target.removeprefix("/mnt/").split("/")):
                path = path / part if part else path
                if not path.is_dir():
                    path.mkdir(mode=0o755, exist_ok=True)
                    os.chmod(path, 0o755)
        return tree


def _bound(bound: BoundMount, source: Path) -> bool:
    """Whether the sandbox's bind is in place: a mount of ``source`` itself (not of an earlier
    mount of it), read-only as asked."""
    point = bound.source
    return (is_mount(point) and _identity(point) == _identity(source)
            and bool(os.statvfs(point).f_flag & os.ST_RDONLY) == bound.read_only)


def _sandbox_of(bind: Path) -> str:
    # sandboxes/<sid>/mounts/m<N>
    parts = bind.parts
    return f"sandbox {parts[-3]}" if len(parts) >= 3 and parts[-2] == "mounts" else str(bind)


def _device_of(point: Path) -> str:
    real = os.path.realpath(point)
    for path, device in _mounts_with_device():
        if str(path) == real:
            return device
    return ""


def _mounts_with_device() -> list[tuple[Path, str]]:
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split(" ", 5)
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            found.append((Path(point), fields[2]))
    return found
