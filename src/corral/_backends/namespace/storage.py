"""Workspace storage: one sparse ext4 image per sandbox, loop-mounted on the host.

Why an image and not a directory: the image's size is a hard disk limit that needs no quota
support in the kernel (this project's development kernels have none), its inode count bounds file
counts, and a separate filesystem means nothing in the workspace can be a hard link to a host file
and no rename can move a path out of it. The image is sparse, so an empty 10 GiB workspace costs
a few MiB. Mounts survive the Corral process; after a reboot ``ensure_mounted`` mounts it again.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from ..._core import linux
from ...errors import BackendError, BackendUnavailable, QuotaExceeded
from . import loop

__all__ = ["WorkspaceStore"]

_MOUNT_OPTIONS = "loop,nodev,nosuid,noatime"

logger = logging.getLogger(__name__)


def _run(argv: list[str], what: str) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except FileNotFoundError as exc:
        raise BackendUnavailable(
            f"{argv[0]} is missing; install it with `apt-get install e2fsprogs mount`"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise BackendError(f"{what} timed out after 60 s") from exc
    if proc.returncode != 0:
        raise BackendError(f"{what} failed: {proc.stderr.strip() or proc.stdout.strip()}")


class WorkspaceStore:
    """Creates, mounts, unmounts and removes per-sandbox workspace filesystems under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    def mount_point(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id / "workspace"

    def _image(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id / "workspace.img"

    def create(self, sandbox_id: str, *, uid: int, size_bytes: int) -> Path:
        """Make and mount a fresh workspace owned by ``uid``; return its host path."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o711)
        base = self.sandbox_dir(sandbox_id)
        # Traversable (not listable) because bwrap, running as the sandbox's uid, must reach
        # the mount point; the image beside it stays root-only.
        base.mkdir()
        base.chmod(0o711)
        image = self._image(sandbox_id)
        free = shutil.disk_usage(self.root).free
        if free < 64 * 1024 * 1024:
            raise QuotaExceeded(
                f"only {free // (1024 * 1024)} MiB free under {self.root}; free disk space "
                "before creating more sandboxes"
            )
        with open(image, "xb") as f:
            f.truncate(size_bytes)
        _run(
            ["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal",
             "-E", f"lazy_itable_init=1,nodiscard,root_owner={uid}:{uid}", str(image)],
            "formatting the workspace",
        )
        self.mount_point(sandbox_id).mkdir(mode=0o755)
        self.ensure_mounted(sandbox_id)
        return self.mount_point(sandbox_id)

    def is_mounted(self, sandbox_id: str) -> bool:
        point = self.mount_point(sandbox_id)
        try:
            return os.stat(point).st_dev != os.stat(point.parent).st_dev
        except FileNotFoundError:
            return False

    def ensure_mounted(self, sandbox_id: str) -> Path:
        point = self.mount_point(sandbox_id)
        if not self.is_mounted(sandbox_id):
            image = self._image(sandbox_id)
            if not image.exists():
                raise BackendError(
                    f"the workspace image of sandbox {sandbox_id} is missing ({image}); "
                    f"remove the sandbox with `corral rm {sandbox_id}`"
                )
            try:
                loop.mount_image(str(image), str(point))
            except OSError as exc:
                logger.debug("in-process loop mount failed (%s); using mount(8)", exc)
                _run(["mount", "-o", _MOUNT_OPTIONS, str(image), str(point)],
                     f"mounting the workspace of {sandbox_id}")
            lost = point / "lost+found"
            if lost.is_dir() and not any(lost.iterdir()):
                lost.rmdir()
            # Only the sandbox's own uid may enter: another sandbox's uid that somehow reached
            # the host's mount table still finds nothing to read.
            os.chmod(point, 0o700)
        return point

    def unmount(self, sandbox_id: str) -> None:
        if self.is_mounted(sandbox_id):
            # Lazy: the sandbox's processes are already dead; detaching can't fail on a stray
            # host shell sitting in the directory, and the loop device auto-clears.
            try:
                linux.umount(str(self.mount_point(sandbox_id)), linux.MNT_DETACH)
            except OSError as exc:
                raise BackendError(f"cannot unmount the workspace of {sandbox_id}: {exc}") from exc

    def remove(self, sandbox_id: str) -> None:
        """Unmount and delete everything of ``sandbox_id``. Idempotent."""
        self.unmount(sandbox_id)
        base = self.sandbox_dir(sandbox_id)
        if base.exists():
            if self.is_mounted(sandbox_id):
                raise BackendError(f"workspace of {sandbox_id} is still mounted; not deleting it")
            shutil.rmtree(base)

    def ids(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())
