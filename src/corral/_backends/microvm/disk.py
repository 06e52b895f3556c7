"""The workspace disk of a microVM: a qcow2 chain the guest sees as ``/dev/vdb`` (ext4 inside).

    base-<size>.qcow2   an empty ext4 of that size, formatted once, cached (root-owned, 0644)
    layer files         sealed snapshot layers, read-only backing files (root-owned, 0644)
    top                 the one writable file of a sandbox (owned by its uid, 0600)

Every file names its backing file by absolute path, so a layer is usable from any sandbox's
top. Sealing is O(1): the top is renamed to the layer's path and a fresh empty top is made over
it. A chain deeper than a bound is squashed into one standalone layer (``qemu-img convert``),
because every read that misses walks the chain and QEMU keeps every file of it open. The quota
is the filesystem's size: a full workspace gives ENOSPC inside the guest, as on the other tiers.

All of this is offline (the VM is stopped or the disk is not in use); ``vm.Vm.seal_live`` is
the live variant. The host never mounts a disk a guest has.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from ..._core.privileged import privileged_env
from ...errors import BackendError, BackendUnavailable, UsageError

__all__ = ["MAX_DEPTH", "base_disk", "chain", "create_top", "disks_dir", "rebase", "remove", "seal",
           "squash"]

MAX_DEPTH = 16  # backing files below a top before seal squashes them
_TIMEOUT_S = 120
_MIN_BYTES = 16 << 20
_UID, _GID = 1000, 1000  # the guest's `user`: owner of the workspace's root directory


def disks_dir(home: Path) -> Path:
    return home / "microvm" / "disks"


def _qemu_img(*args: str, what: str, timeout: float = _TIMEOUT_S) -> str:
    exe = shutil.which("qemu-img")
    if exe is None:
        raise BackendUnavailable("qemu-img is missing; apt-get install -t bookworm-backports "
                                 "qemu-utils")
    try:
        result = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout,
                                check=False, env=privileged_env(), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise BackendError(f"qemu-img took longer than {timeout:.0f} s to {what}") from exc
    if result.returncode != 0:
        raise BackendError(f"qemu-img could not {what}: {result.stderr.strip()[-600:]}")
    return result.stdout


def _publish_readonly(tmp: Path, final: Path) -> None:
    os.chown(tmp, 0, 0)
    os.chmod(tmp, 0o644)
    os.rename(tmp, final)


def base_disk(size_bytes: int, cache: Path) -> Path:
    """The empty formatted workspace of ``size_bytes`` (rounded up to MiB), made once.

    Raises:
        UsageError: smaller than 16 MiB.
        BackendUnavailable: mkfs.ext4 or qemu-img is missing.
    """
    if size_bytes < _MIN_BYTES:
        raise UsageError(f"a microVM workspace needs at least {_MIN_BYTES >> 20} MiB "
                         f"(got {size_bytes} bytes)")
    mib = (size_bytes + (1 << 20) - 1) >> 20
    final = cache / f"base-{mib}m.qcow2"
    if final.is_file():
        return final
    cache.mkdir(parents=True, exist_ok=True, mode=0o755)
    work = Path(tempfile.mkdtemp(prefix=".base-", dir=cache))
    try:
        raw = work / "fs.raw"
        with raw.open("wb") as f:
            f.truncate(mib << 20)
        # No reserved blocks: the sandbox's user should get the whole quota. The root directory
        # is the user's; lost+found stays root's.
        try:
            result = subprocess.run(
                ["mkfs.ext4", "-q", "-F", "-m", "0", "-L", "workspace",
                 "-E", f"root_owner={_UID}:{_GID},lazy_itable_init=0,nodiscard", str(raw)],
                capture_output=True, text=True, timeout=_TIMEOUT_S, check=False,
                env=privileged_env(), stdin=subprocess.DEVNULL)
        except FileNotFoundError as exc:
            raise BackendUnavailable("mkfs.ext4 is missing; apt-get install e2fsprogs") from exc
        if result.returncode != 0:
            raise BackendError(f"mkfs.ext4 failed for the workspace base: {result.stderr[-600:]}")
        out = work / "base.qcow2"
        _qemu_img("convert", "-f", "raw", "-O", "qcow2", str(raw), str(out),
                  what="convert the workspace base to qcow2")
        try:
            _publish_readonly(out, final)
        except OSError:
            if not final.is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def create_top(path: Path, backing: Path, *, uid: int, gid: int) -> Path:
    """A new empty writable top at ``path`` over ``backing`` (owned by ``uid``, mode 0600)."""
    if not backing.is_file():
        raise BackendError(f"the backing disk {backing} is missing")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    _qemu_img("create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(backing), str(tmp),
              what=f"create a workspace disk over {backing}")
    os.chown(tmp, uid, gid)
    os.chmod(tmp, 0o600)
    os.rename(tmp, path)
    return path


def chain(path: Path) -> list[dict[str, Any]]:
    """``qemu-img info --backing-chain`` of ``path``: the top first, then each backing file.

    ``-U``: the top may be open in a running QEMU, which holds a lock on it.
    """
    out = _qemu_img("info", "-U", "--backing-chain", "--output=json", str(path),
                    what=f"read the disk chain of {path}")
    try:
        info = json.loads(out)
    except ValueError as exc:
        raise BackendError(f"qemu-img info gave no JSON for {path}") from exc
    return info if isinstance(info, list) else [info]


def seal(top: Path, layer_path: Path, *, uid: int, gid: int) -> Path:
    """Make the current contents of ``top`` the read-only layer ``layer_path`` and give ``top``
    a fresh empty file over it (offline: no VM has ``top`` open). Returns ``top``.

    When the chain below would be deeper than ``MAX_DEPTH``, the layer is written squashed
    (standalone) instead, so a sandbox sealed many times stays fast.
    """
    if layer_path.exists():
        raise BackendError(f"the layer {layer_path} exists already")
    depth = len(chain(top))
    if depth > MAX_DEPTH:
        squash(top, layer_path)
        remove(top)
    else:
        _publish_readonly_rename(top, layer_path)
    return create_top(top, layer_path, uid=uid, gid=gid)


def _publish_readonly_rename(top: Path, layer_path: Path) -> None:
    os.rename(top, layer_path)
    os.chown(layer_path, 0, 0)
    os.chmod(layer_path, 0o644)


def squash(image: Path, out: Path) -> Path:
    """Write ``image`` with its whole backing chain folded in as the standalone layer ``out``
    (root-owned, 0644). The base's formatted filesystem comes along, so ``out`` has no backing
    file at all."""
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        _qemu_img("convert", "-U", "-O", "qcow2", str(image), str(tmp),
                  what=f"squash the disk chain of {image}", timeout=_TIMEOUT_S * 5)
        _publish_readonly(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def rebase(top: Path, backing: Path) -> None:
    """Point ``top`` at ``backing`` without copying: only when the two hold the same data (a
    layer that moved, or was squashed)."""
    _qemu_img("rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b", str(backing), str(top),
              what=f"point {top} at {backing}")


def remove(path: Path) -> None:
    """Remove a disk file; idempotent."""
    path.unlink(missing_ok=True)
