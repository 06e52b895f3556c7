"""Idmapped bind mounts (Linux 5.12+): show files owned by one host uid as owned by another.

A snapshot layer written by sandbox A holds files owned by A's host uid. A fork running as uid B
must see them as its own, or it could not change a file it "made" before the fork. Chowning every
file would make forks O(files); an idmapped bind of the layer makes them O(1): the kernel maps
ownership at the mount, on the fly, and nothing on disk changes. Volumes work the same way: their
files are owned by the sandbox user's uid *inside* (1000) on disk, and every sandbox that mounts
one sees them as its own host uid.

The mapping is carried by a user namespace, which needs a process to create it; it outlives the
process through the file descriptor we keep. Root stays root in every mapping (overlayfs creates
its bookkeeping files as the mounter, root).
"""

from __future__ import annotations

import collections
import ctypes
import os
import platform
import subprocess
import threading

from .privileged import privileged_env

__all__ = ["bind_idmapped", "bind_readonly", "idmap_supported"]

_SYS = {"x86_64": (428, 429, 442), "aarch64": (428, 429, 442)}
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = _SYS.get(platform.machine(), (428, 429, 442))
_OPEN_TREE_CLONE = 1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_RDONLY = 0x1
_MOUNT_ATTR_NOSUID = 0x2
_MOUNT_ATTR_NODEV = 0x4
_MOUNT_ATTR_IDMAP = 0x100000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


class _UsernsCache:
    """User namespaces by mapping, so repeated mounts for one sandbox skip the spawn (~2 ms)."""

    def __init__(self, size: int = 64) -> None:
        self._fds: collections.OrderedDict[tuple[int, int, int], int] = (
            collections.OrderedDict())
        self._size = size
        self._lock = threading.Lock()

    def get(self, on_disk: int, shown_as: int, root_shown_as: int = 0) -> int:
        key = (on_disk, shown_as, root_shown_as)
        with self._lock:
            fd = self._fds.get(key)
            if fd is not None:
                self._fds.move_to_end(key)
                return fd
        fd = _make_userns(on_disk, shown_as, root_shown_as)
        with self._lock:
            if key in self._fds:  # another thread made one meanwhile
                os.close(fd)
                return self._fds[key]
            self._fds[key] = fd
            while len(self._fds) > self._size:
                _, old = self._fds.popitem(last=False)
                os.close(old)
            return fd


def _make_userns(on_disk: int, shown_as: int, root_shown_as: int = 0) -> int:
    # The child reports once it is inside its new namespace, then waits for us to finish.
    proc = subprocess.Popen(
        ["unshare", "--user", "--", "sh", "-c", "echo; read _"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, env=privileged_env())
    try:
        assert proc.stdout is not None and proc.stdin is not None
        if not proc.stdout.readline():
            raise OSError(f"unshare --user failed (exit {proc.wait()})")
        mapping = f"0 {root_shown_as} 1\n{on_disk} {shown_as} 1\n"
        with open(f"/proc/{proc.pid}/uid_map", "w") as f:
            f.write(mapping)
        with open(f"/proc/{proc.pid}/setgroups", "w") as f:
            f.write("deny")
        with open(f"/proc/{proc.pid}/gid_map", "w") as f:
            f.write(mapping)
        return os.open(f"/proc/{proc.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


_userns = _UsernsCache()


def _bind(source: str, target: str, attr_set: int, userns: int = 0) -> None:
    """A plain (not recursive) bind of ``source`` on ``target`` whose attributes are set on the
    detached tree before it is attached: the bind is never visible without them (a read-only
    bind is never writable, even for a moment). Mounts below ``source`` stay out."""
    tree = _check(_libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, source.encode(),
                                _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC), f"open_tree {source}")
    try:
        attr = _MountAttr(attr_set | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV, 0, 0, userns)
        _check(_libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH, ctypes.byref(attr),
                             ctypes.sizeof(attr)), f"setting the attributes of {source}")
        _check(_libc.syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, target.encode(),
                             _MOVE_MOUNT_F_EMPTY_PATH), f"mounting {target}")
    finally:
        os.close(tree)


def bind_idmapped(source: str, target: str, *, on_disk: int, shown_as: int,
                  read_only: bool = True, root_shown_as: int = 0) -> None:
    """Bind ``source`` on ``target`` with files owned by ``on_disk`` shown as ``shown_as``
    (and files ``shown_as`` creates stored as ``on_disk``). Root is mapped to itself, or to
    ``root_shown_as``: for a gVisor sandbox, whose kernel creates each file as the sandbox's
    runtime uid (its root) before it gives the file to its owner, and an idmapped mount refuses
    to create a file for a uid it does not map (EOVERFLOW). Every other uid is unmapped."""
    userns = _userns.get(on_disk, shown_as, root_shown_as)
    _bind(source, target, _MOUNT_ATTR_IDMAP | (_MOUNT_ATTR_RDONLY if read_only else 0), userns)


def bind_readonly(source: str, target: str) -> None:
    """Bind ``source`` on ``target`` read-only, nosuid and nodev, ownership as it is."""
    _bind(source, target, _MOUNT_ATTR_RDONLY)


def idmap_supported(probe_dir: str) -> tuple[bool, str]:
    """Whether this kernel can idmap a bind of ``probe_dir`` (a directory on the data disk)."""
    target = os.path.join(probe_dir, ".idmap-probe")
    os.makedirs(target, exist_ok=True)
    try:
        bind_idmapped(probe_dir, target, on_disk=65533, shown_as=65532)
    except OSError as exc:
        return False, str(exc)
    finally:
        try:
            _check(_libc.umount2(target.encode(), 2), "umount probe")
        except OSError:
            pass
        os.rmdir(target)
    return True, "idmapped mounts work"
