"""OCI bundles for runsc: one read-only root skeleton per template shape, one config per command.

A command sees the namespace tier's layout: the template's system directories and curated
``/etc`` read-only, ``/workspace`` read-write, ``/tmp`` and ``/dev/shm`` as size-limited tmpfs, no
``/sys`` (an empty read-only tmpfs hides gVisor's synthetic one), ``/proc`` and ``/dev`` from
gVisor's own kernel (nothing in them comes from the host), and the sandbox's volumes and data
mounts (``_linux.volumes``) where it asked for them.

Identity. runsc starts its sandbox (the Sentry, gVisor's kernel) and its gofer as uid 0 of the
container's user namespace, and a file that uid *n* creates inside ends up owned by *n*'s host
mapping. So one mapping decides two things:

* container uid 1000 (the only uid commands run as, ``template.SANDBOX_UID``) maps to the
  sandbox's host uid, so workspace files are owned on the host exactly as in the namespace tier;
* container uid 0 maps to the sandbox's *runtime uid*, ``uid + 2**31``: every host process of the
  sandbox (Sentry, gofer, systrap stubs) runs as a host uid of its own, never root, never shared
  with another sandbox or with ``nobody`` (runsc's default). A Sentry taken over by an exploit
  then holds only capabilities inside its own user namespace, over its own two uids, and cannot
  signal or ptrace another sandbox's processes. Sandbox uids are at most ``2**31 - 2``
  (``Settings``), so no namespace-tier sandbox of any data directory uses a runtime uid, and two
  data directories with disjoint uid ranges have disjoint runtime uids too.

Nothing here runs the workload as root: it runs as 1000 with every capability set empty,
``no_new_privs`` and the namespace tier's seccomp policy enforced by gVisor (``--oci-seccomp``), so
the filter guards gVisor's kernel the way it guards Linux in the other tier.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._linux.seccomp import DENIED_SYSCALLS
from .._linux.template import SANDBOX_GID, SANDBOX_UID, BaseTemplate

__all__ = ["RUNTIME_UID_OFFSET", "build_config", "ensure_rootfs", "runtime_uid",
           "seccomp_profile", "write_config"]

RUNTIME_UID_OFFSET = 1 << 31
_MAX_UID = 2**32 - 2  # (uid_t)-1 means "no change" to the kernel
_ROOTFS_VERSION = "7"
# Mount points every skeleton has, besides the template's own directories (``.corral``: the
# resident sandbox's launcher, see ``resident``; empty in a per-command sandbox; ``mnt``: where
# the mount points of a sandbox's volumes and data mounts are bound, see ``build_config``).
_SKELETON_DIRS = ("etc", "proc", "dev", "sys", "tmp", "workspace", "home", "home/user",
                  ".corral", "mnt")
# gVisor's /dev has these besides the usual null, zero, full, random, urandom, tty, ptmx and pts;
# a command never needs them (mounting FUSE needs privileges it lacks), so an empty read-only
# file is bound over each: less of gVisor's kernel within reach.
_HIDDEN_DEVICES = ("/dev/fuse",)
_NOFILE = (1024, 65536)

_CLONE_NEWUSER = 0x10000000
_TIOCSTI = 0x5412
_TIOCLINUX = 0x541C
_AF_NETLINK = 16
_AF_PACKET = 17
_SOCK_RAW = 3


def runtime_uid(sandbox_uid: int) -> int:
    """The host uid that runs a sandbox's gVisor processes (see the module docstring)."""
    uid = sandbox_uid + RUNTIME_UID_OFFSET
    if not 0 < sandbox_uid < RUNTIME_UID_OFFSET or uid > _MAX_UID:
        raise ValueError(f"sandbox uid {sandbox_uid} has no runtime uid; sandbox uids must be "
                         f"below {RUNTIME_UID_OFFSET}")
    return uid


def _masked(index: int, mask: int, value: int) -> dict[str, Any]:
    return {"index": index, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}


@functools.cache
def seccomp_profile() -> dict[str, Any]:
    """The namespace tier's filter (``_linux.seccomp``) as an OCI profile for gVisor.

    gVisor answers every denied call with EPERM (runc's convention; ``errnoRet`` is ignored), so
    the socket families refused with EAFNOSUPPORT in the other tier get EPERM here. ``clone3``
    needs no rule: gVisor does not implement it (ENOSYS), so libc falls back to ``clone``, whose
    flags the filter sees. 32-bit system calls do not exist in gVisor at all.
    """
    eperm: dict[str, Any] = {"action": "SCMP_ACT_ERRNO", "errnoRet": 1}
    # Masked to 32 bits where the kernel reads an int, so garbage in the upper half of the
    # register cannot dodge a rule.
    rules: list[dict[str, Any]] = [
        {"names": list(DENIED_SYSCALLS), **eperm},
        {"names": ["clone"], **eperm, "args": [_masked(0, _CLONE_NEWUSER, _CLONE_NEWUSER)]},
        {"names": ["ioctl"], **eperm, "args": [_masked(1, 0xFFFFFFFF, _TIOCSTI)]},
        {"names": ["ioctl"], **eperm, "args": [_masked(1, 0xFFFFFFFF, _TIOCLINUX)]},
        {"names": ["socket"], **eperm, "args": [_masked(0, 0xFFFFFFFF, _AF_NETLINK)]},
        {"names": ["socket"], **eperm, "args": [_masked(0, 0xFFFFFFFF, _AF_PACKET)]},
        {"names": ["socket"], **eperm, "args": [_masked(1, 0xF, _SOCK_RAW)]},
    ]
    return {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": rules}


def _skeleton_entries(template: BaseTemplate) -> list[tuple[str, str, str]]:
    # Only what the skeleton holds: link targets and mount points (not where binds come from).
    return sorted((kind, source if kind == "symlink" else "", dest)
                  for kind, source, dest in template.system)


def ensure_rootfs(parent: Path, template: BaseTemplate) -> Path:
    """The read-only root for ``template``: its symlinks plus empty mount points, made once.

    gVisor cannot mount a symlink, so merged-/usr links (``/bin -> usr/bin``) live in the root
    itself. Named after its content, and made in a private directory then renamed into place, so
    concurrent first uses cannot see each other's half-made copy. World-traversable: the gofer
    runs as the sandbox's runtime uid, which has no rights on the host beyond "other".
    """
    entries = _skeleton_entries(template)
    digest = hashlib.sha256(json.dumps([_ROOTFS_VERSION, entries]).encode()).hexdigest()[:16]
    dest = parent / f"rootfs.{digest}"
    if dest.is_dir():
        return dest
    parent.mkdir(parents=True, exist_ok=True, mode=0o711)
    empty = _empty_file(dest)
    empty.touch()
    os.chmod(empty, 0)
    tmp = Path(tempfile.mkdtemp(prefix=".rootfs-", dir=parent))
    try:
        for name in _SKELETON_DIRS:
            (tmp / name).mkdir(mode=0o755)
        for kind, source, target in entries:
            path = tmp / target.lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            if kind == "symlink":
                os.symlink(source, path)
            elif not path.exists():
                path.mkdir(mode=0o755)
        # Bind mounts need their mount point in the root on the host side too.
        for device in _HIDDEN_DEVICES:
            (tmp / device.lstrip("/")).touch(mode=0o444)
        os.chmod(tmp, 0o755)
        try:
            tmp.rename(dest)
        except OSError:
            if not dest.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _empty_file(rootfs: Path) -> Path:
    """An empty file nobody may open, beside the skeletons, bound over the devices we hide."""
    return rootfs.parent / "empty"


def _bind(source: str | Path, dest: str, *, writable: bool = False) -> dict[str, Any]:
    # Plain (not recursive) binds: whatever is mounted below the source on the host stays out.
    options = ["bind", "rw" if writable else "ro", "nosuid", "nodev"]
    return {"destination": dest, "type": "bind", "source": str(source), "options": options}


def _tmpfs(dest: str, size: int, mode: str, *, writable: bool = True) -> dict[str, Any]:
    options = [f"size={size}", f"mode={mode}", "nosuid", "nodev"]
    if not writable:
        options += ["ro", "noexec"]
    return {"destination": dest, "type": "tmpfs", "source": "tmpfs", "options": options}


def build_config(
    *,
    rootfs: Path,
    template: BaseTemplate,
    workspace: Path | None,
    netns: Path | None,
    uid: int,
    argv: Sequence[str],
    cwd: str,
    env: Mapping[str, str],
    tmp_bytes: int,
    pids: int,
    terminal: bool,
    binds: Sequence[tuple[str, str, bool]] = (),
    mount_points: Path | None = None,
    tmp: Path | None = None,
) -> dict[str, Any]:
    """The OCI ``config.json`` for one command. Pure: no I/O.

    ``workspace`` and ``netns`` are None only for the host check's probe (no ``/workspace``; a
    fresh network namespace of gVisor's own instead of the sandbox's). ``binds`` are the
    sandbox's volumes and data mounts as (host source, target, read-only), in mount order;
    ``mount_points``, a read-only tree bound at ``/mnt`` that holds the mount points of those
    under ``/mnt/`` (the root is read-only, and gVisor's file server needs a host directory
    under every mount); ``tmp``, the sandbox's own /tmp on the host (a tmpfs as long as the
    sandbox lives), else a tmpfs of ``tmp_bytes`` in gVisor's kernel.
    """
    host_runtime = runtime_uid(uid)
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        _tmpfs("/sys", 4096, "0555", writable=False),
    ]
    mounts += [_bind(source, dest) for kind, source, dest in template.system if kind == "bind"]
    mounts += [_bind(_empty_file(rootfs), device) for device in _HIDDEN_DEVICES]
    mounts += [
        _bind(template.etc, "/etc"),
        _tmpfs("/dev/shm", tmp_bytes, "1777"),
        _tmpfs("/tmp", tmp_bytes, "1777") if tmp is None else _bind(tmp, "/tmp", writable=True),
    ]
    if workspace is not None:
        mounts.append(_bind(workspace, "/workspace", writable=True))
        # E2B's home: the same workspace, where E2B's SDKs and templates expect the user's files.
        mounts.append(_bind(workspace, "/home/user", writable=True))
    if mount_points is not None:
        mounts.append(_bind(mount_points, "/mnt"))
    # After the workspace, so a target under /workspace lands on it; a symlink inside a
    # source resolves in gVisor's kernel, inside the sandbox's root.
    for source, target, read_only in binds:
        mounts.append(_bind(source, target, writable=not read_only))
        if target.startswith("/workspace/"):
            # /home/user is the same workspace: the mount shows there too.
            mounts.append(_bind(source, "/home/user/" + target.removeprefix("/workspace/"),
                                writable=not read_only))
    network: dict[str, str] = {"type": "network"}
    if netns is not None:
        network["path"] = str(netns)
    no_caps: dict[str, list[str]] = {
        kind: [] for kind in ("bounding", "effective", "inheritable", "permitted", "ambient")}
    mappings = [
        {"containerID": 0, "hostID": host_runtime, "size": 1},
        {"containerID": SANDBOX_UID, "hostID": uid, "size": 1},
    ]
    gid_mappings = [
        {"containerID": 0, "hostID": host_runtime, "size": 1},
        {"containerID": SANDBOX_GID, "hostID": uid, "size": 1},
    ]
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": terminal,
            "user": {"uid": SANDBOX_UID, "gid": SANDBOX_GID},
            "args": list(argv),
            "env": [f"{key}={value}" for key, value in env.items()],
            "cwd": cwd,
            "capabilities": no_caps,
            "noNewPrivileges": True,
            "rlimits": [
                {"type": "RLIMIT_NOFILE", "soft": _NOFILE[0], "hard": _NOFILE[1]},
                # gVisor counts tasks per uid against RLIMIT_NPROC: this is the tier's pid
                # limit as the command sees it (EAGAIN from fork and clone), enforced inside.
                {"type": "RLIMIT_NPROC", "soft": pids, "hard": pids},
                {"type": "RLIMIT_CORE", "soft": 0, "hard": 0},
            ],
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "sandbox",
        "mounts": mounts,
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
                {"type": "user"}, network,
            ],
            "uidMappings": mappings,
            "gidMappings": gid_mappings,
            "seccomp": seccomp_profile(),
        },
    }


def write_config(bundle: Path, config: Mapping[str, Any]) -> None:
    """Write ``bundle/config.json``, readable by root only (it holds the command's env)."""
    bundle.mkdir(mode=0o700)
    fd = os.open(bundle / "config.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
