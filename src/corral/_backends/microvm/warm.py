"""The warm snapshot of a (root image, kernel, RAM size, QEMU version): a guest booted once to
its agent's ready line and paused, from which ``create`` restores in tens of milliseconds.

It is made with guest RAM on a file mapped shared (``memory-backend-file,share=on``), so when
QEMU saves the device state with the ``x-ignore-shared`` capability the RAM is not copied: the
file *is* the RAM. Restores map that file read-only and private
(``readonly=on,rom=off,share=off``): each VM's writes go to its own copy-on-write pages, every
page it never writes stays shared with all the other VMs restored from the same file, and the
sandbox's unprivileged QEMU cannot change the file. Published root-owned 0644 by rename, so a
reader sees a whole snapshot or none.

The snapshot has a workspace disk device (``/dev/vdb``, a throwaway empty disk that is never
mounted), because a restored machine must have the devices it was saved with; a restore
attaches the sandbox's own disk in its place and ``Vm.restore_warm`` tells the guest its size.

Layout of the cache directory::

    <key>/ram      guest RAM (sparse, memory_mib)
    <key>/state    device state (a ``file:`` migration stream without the RAM)
    <key>/warm.json
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..._core.privileged import privileged_env
from ...errors import BackendError
from . import disk
from .accel import Accel
from .kernel import GuestKernel
from .rootimage import RootImage
from .vm import QEMU, Vm, VmConfig

__all__ = ["WarmSnapshot", "find_warm", "qemu_version", "warm_dir", "warm_key",
           "warm_snapshot"]

_RECIPE = "1"
_PLACEHOLDER_BYTES = 16 << 20
_BOOT_TIMEOUT_S = 120.0  # a cold boot under TCG on a busy host


@dataclass(frozen=True, slots=True)
class WarmSnapshot:
    ram: Path
    state: Path
    key: str
    memory_mib: int
    build_s: float  # 0.0 when it came from the cache


def warm_dir(home: Path) -> Path:
    return home / "microvm" / "warm"


@functools.cache
def qemu_version() -> str:
    """``qemu-system-x86_64 --version``'s first line: a saved state loads only into the QEMU
    that wrote it."""
    try:
        out = subprocess.run([QEMU, "--version"], capture_output=True, text=True, timeout=30,
                             check=True, env=privileged_env(), stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BackendError(f"cannot run {QEMU} --version: {exc}") from exc
    return out.splitlines()[0].strip() if out else "unknown"


def warm_key(kernel: GuestKernel, root_image: RootImage, memory_mib: int, accel: Accel,
             disk_bytes: int = _PLACEHOLDER_BYTES) -> str:
    digest = hashlib.sha256()
    # The disk's size is in the key: the guest learnt vdb's capacity when it booted, and a
    # restored guest keeps it, so it must be the size of the disk it is restored with.
    for part in (_RECIPE, kernel.key, root_image.key, str(memory_mib), qemu_version(),
                 accel.name, accel.cpu, str(disk_bytes)):
        data = part.encode()
        digest.update(len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()[:16]


def find_warm(cache: Path, key: str) -> WarmSnapshot | None:
    path = cache / key
    try:
        meta = json.loads((path / "warm.json").read_text())
        snap = WarmSnapshot(ram=path / "ram", state=path / "state", key=key,
                            memory_mib=int(meta["memory_mib"]), build_s=0.0)
    except (OSError, ValueError, KeyError):
        return None
    if not (snap.ram.is_file() and snap.state.is_file()):
        return None
    try:
        os.utime(path / "warm.json")  # used now: the cache sweep removes the least recent first
    except OSError:
        pass
    return snap


def warm_snapshot(kernel: GuestKernel, root_image: RootImage, memory_mib: int, cache: Path, *,
                  accel: Accel, uid: int, gid: int, disks: Path,
                  disk_bytes: int = _PLACEHOLDER_BYTES,
                  deadline: float | None = None) -> WarmSnapshot:
    """The warm snapshot for these inputs, made now (one cold boot) unless cached.

    ``uid``/``gid`` run the one QEMU that makes it; ``disks`` is the workspace base cache.

    Raises:
        BackendError: the guest did not come up (the message has the serial log's tail).
    """
    key = warm_key(kernel, root_image, memory_mib, accel, disk_bytes)
    cached = find_warm(cache, key)
    if cached is not None:
        return cached
    started = time.monotonic()
    deadline = deadline if deadline is not None else started + _BOOT_TIMEOUT_S
    cache.mkdir(parents=True, exist_ok=True, mode=0o755)
    work = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=cache))
    # QEMU's sockets need a short path (108 bytes), which a cache deep in a home may not give.
    run_dir = Path(tempfile.mkdtemp(prefix="corral-warm-"))
    try:
        os.chmod(work, 0o755)
        ram = work / "ram"
        with ram.open("wb") as f:
            f.truncate(memory_mib << 20)
        os.chown(ram, uid, gid)
        os.chmod(ram, 0o600)
        base = disk.base_disk(disk_bytes, disks)
        placeholder = disk.create_top(work / "placeholder.qcow2", base, uid=uid, gid=gid)
        config = VmConfig(kernel=kernel.vmlinux, root_image=root_image.path,
                          run_dir=run_dir, accel=accel, memory_mib=memory_mib,
                          top_disk=placeholder, backing=(base,),
                          uid=uid, gid=gid)
        with Vm.boot(config, deadline, memory_file=ram) as vm:
            sock = vm.connect(deadline)
            try:
                ready = vm.read_line(sock, bytearray(), deadline, "the agent's ready line")
                if "ready" not in ready:
                    raise BackendError(f"the guest agent's first line was not ready: {ready}")
                # Saved with the host still connected: a restored agent sees no hang-up, so
                # it answers the host's first request (`resume`) at once. (Hung up first, the
                # agent would resend `ready` on the next connection, but only after its
                # hang-up poll notices: measured 1.3 s after a restore against 0.4 s.)
                state = work / "state"
                vm.save_memory(state, deadline, ignore_shared=True)
            finally:
                sock.close()
            vm.quit(deadline)
        for path in (ram, state):
            os.chown(path, 0, 0)
            os.chmod(path, 0o644)
        build_s = round(time.monotonic() - started, 2)
        (work / "warm.json").write_text(json.dumps({
            "key": key, "kernel": kernel.key, "root_image": root_image.key,
            "memory_mib": memory_mib, "qemu": qemu_version(), "accel": accel.name,
            "build_s": build_s, "built_at": time.time()}, indent=2) + "\n")
        os.chmod(work / "warm.json", 0o644)
        (work / "placeholder.qcow2").unlink()
        try:
            os.rename(work, cache / key)
        except OSError:
            if find_warm(cache, key) is None:
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    found = find_warm(cache, key)
    if found is None:
        raise BackendError(f"the warm snapshot {key} vanished from {cache} after it was made")
    return WarmSnapshot(ram=found.ram, state=found.state, key=key, memory_mib=memory_mib,
                        build_s=build_s)
