"""The guest agent inside a real microVM guest (TCG here): the parts the host-side unit tests
cannot reach (cgroup controllers, limits, peak memory, oom, the workspace disk, fsfreeze,
resume's clock, the virtio-serial channel and its reconnection).

Until ``vm.py`` is on ``main`` this boots QEMU itself, minimally: the cached guest kernel, a
sparse copy of a cached root image (``CORRAL_AGENT_TEST_ROOT_IMAGE`` names another) with this
tree's ``agent.py`` and ``run`` written into it (debugfs), a fresh 64 MiB ext4 workspace disk,
256 MiB, one vCPU. Skipped unless the kernel and a root image are cached and
``CORRAL_MICROVM_ALLOW_TCG=1``. QEMU is killed in teardown.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.test_microvm_agent import AGENT, RUN_C, Client, b64

pytestmark = [pytest.mark.needs_root, pytest.mark.slow, pytest.mark.timeout(600)]

CACHE = Path("/var/lib/corral/microvm")


def _cached(pattern: str) -> str | None:
    found = sorted(glob.glob(str(CACHE / pattern)), key=os.path.getmtime)
    return found[-1] if found else None


@pytest.fixture
def vm() -> Iterator[tuple[Client, socket.socket, Path]]:
    kernel = _cached("kernels/*/vmlinux")
    image = os.environ.get("CORRAL_AGENT_TEST_ROOT_IMAGE") or _cached("images/*.ext4")
    if os.environ.get("CORRAL_MICROVM_ALLOW_TCG") != "1" or not kernel or not image:
        pytest.skip("needs a cached guest kernel and root image and CORRAL_MICROVM_ALLOW_TCG=1")
    work = Path(tempfile.mkdtemp(prefix="corral-agent-vm-", dir="/var/tmp"))
    qemu = None
    try:
        subprocess.run(["cp", "--sparse=always", image, work / "root.ext4"], check=True)
        subprocess.run(["gcc", "-static", "-Os", "-Wall", "-o", work / "run", RUN_C],
                       check=True, timeout=120)
        script = (f"rm /corral/agent.py\nwrite {AGENT} /corral/agent.py\nrm /corral/run\n"
                  f"write {work / 'run'} /corral/run\nsif /corral/run mode 0100755\n")
        subprocess.run(["debugfs", "-w", "-f", "-", work / "root.ext4"], input=script.encode(),
                       check=True, capture_output=True, timeout=60)
        subprocess.run(["truncate", "-s", "64M", work / "ws.raw"], check=True)
        # -m 0: no blocks reserved for root, or the agent's file writes (as root) would go on
        # past the point where the user's commands get ENOSPC.
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", work / "ws.raw"], check=True,
                       timeout=60)
        qemu = subprocess.Popen([
            "qemu-system-x86_64", "-nodefaults", "-no-user-config", "-nic", "none",
            "-display", "none", "-no-reboot", "-accel", "tcg", "-cpu", "max", "-smp", "1",
            "-m", "256M", "-M", "microvm,acpi=off,x-option-roms=off", "-kernel", kernel,
            "-append", "root=/dev/vda ro rootfstype=ext4 init=/corral/init console=ttyS0 "
            "panic=-1 reboot=t quiet",
            "-chardev", f"file,id=serial,path={work}/serial.log", "-serial", "chardev:serial",
            "-device", "virtio-rng-device", "-device", "virtio-serial-device",
            "-chardev", f"socket,id=agent,path={work}/agent.sock,server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=corral.agent",
            "-drive", f"file={work}/root.ext4,if=none,id=root,format=raw,readonly=on",
            "-device", "virtio-blk-device,drive=root",
            "-drive", f"file={work}/ws.raw,if=none,id=ws,format=raw",
            "-device", "virtio-blk-device,drive=ws"])
        sock = _connect(work / "agent.sock")
        client = Client(sock)
        assert client.get(0, timeout=300)["ready"]["agent"] == 1
        yield client, sock, work
        sock.close()
    finally:
        if qemu is not None:
            qemu.kill()
            qemu.wait()
        shutil.rmtree(work, ignore_errors=True)


def _connect(path: Path) -> socket.socket:
    deadline = time.monotonic() + 60
    while True:
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.connect(str(path))
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_in_the_guest_limits_usage_disk_and_lifecycle(vm: tuple[Client, socket.socket, Path],
                                                      ) -> None:
    c, sock, work = vm
    assert c.ok("mount", fresh=True) is True
    placed = c.run(["sh", "-c", "id -u; cat /proc/self/cgroup; stat -c %u /workspace; "
                    "cat /sys/fs/cgroup/cmd/cgroup.subtree_control"], timeout=120)
    lines = placed["stdout"].decode().split("\n")
    assert lines[0] == "1000" and lines[1].startswith("0::/cmd/") and lines[2] == "1000"
    assert set(lines[3].split()) >= {"memory", "pids"}
    assert placed["exit"]["peak_memory_bytes"] > 0 and placed["exit"]["cpu_s"] > 0
    oom = c.run(["python3", "-c", "b = bytearray(120 << 20)"], timeout=120,
                memory_bytes=32 << 20)["exit"]
    assert oom["oom_killed"] is True and oom["signal"] == 9
    assert oom["peak_memory_bytes"] <= 32 << 20
    forks = c.run(["sh", "-c", "for i in $(seq 50); do sleep 5 & done; wait"], timeout=60,
                  pids=16)
    assert b"fork" in forks["stderr"] and forks["exit"]["code"] != 0
    full = c.run(["sh", "-c", "head -c 100M /dev/zero > /workspace/big"], timeout=120)
    assert b"No space left" in full["stderr"]
    handle = c.ok("fs.write_begin", path="more", mode=0o644, follow_symlinks=True)["handle"]
    reply = c.request("fs.write_chunk", handle=handle, data=b64(b"x" * (1 << 20)))
    assert reply["error"]["kind"] == "no_space"
    assert c.ok("fs.remove", path="big") is True
    assert c.ok("fsfreeze", frozen=True) is True and c.ok("fsfreeze", frozen=False) is True
    now = time.time_ns() + 3600 * 10**9
    assert c.ok("resume", seed=b64(os.urandom(64)), time_ns=now, hostname="sandbox",
                sandbox_id="sbx_test") is True
    clock = c.run(["date", "+%s"], timeout=60)["stdout"]
    assert abs(int(clock) - now // 10**9) < 60
    assert c.ok("unmount") is True
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    second = _connect(work / "agent.sock")
    again = Client(second)
    # A new host end is served at once (ping); ``ready`` comes again only when the guest saw
    # the hang-up, which a quick reconnection can hide, so it is not waited for here.
    assert again.ok("ping") is True
    second.shutdown(socket.SHUT_RDWR)
    second.close()
