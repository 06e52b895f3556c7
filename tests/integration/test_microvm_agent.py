"""The guest agent inside a real microVM guest (TCG here): the parts the host-side unit tests
cannot reach (cgroup controllers, limits, peak memory, oom, the workspace disk, fsfreeze,
resume's clock, the virtio-serial channel and its reconnection).

The guest is the tier's own, without the keeper and the control plane: ``vm.Vm.boot`` of the
cached guest kernel and the ``microvm-base`` root image (this tree's agent and launcher in it),
a 64 MiB workspace disk, 256 MiB, one vCPU, the agent driven by hand over its channel with the
real seccomp filter in every exec. Skipped unless the tier can run (``CORRAL_MICROVM_ALLOW_TCG=1``
here). QEMU is killed in teardown.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral._settings import Settings
from tests.unit.test_microvm_agent import Client, b64

pytestmark = [pytest.mark.needs_root, pytest.mark.slow, pytest.mark.timeout(600)]


class _GuestClient(Client):
    """The unit tests' client, sending the tier's syscall filter as the backend does."""

    def start(self, argv: list[str], **fields: Any) -> int:
        from corral._backends._linux.seccomp import compile_filter

        fields.setdefault("seccomp", b64(compile_filter()))
        return super().start(argv, **fields)


@pytest.fixture
def vm(settings: Settings, microvm_problems: list[str]) -> Iterator[tuple[Client, Any, Path]]:
    if microvm_problems:
        pytest.skip("the microVM tier cannot run here: " + "; ".join(microvm_problems))
    from corral._backends.microvm import disk
    from corral._backends.microvm.accel import choose_accel
    from corral._backends.microvm.backend import MicrovmBackend
    from corral._backends.microvm.kernel import find_kernel
    from corral._backends.microvm.vm import Vm, VmConfig

    kernel = find_kernel(settings.microvm_cache)
    assert kernel is not None
    image = MicrovmBackend(settings)._root("base")
    work = Path(tempfile.mkdtemp(prefix="corral-agent-vm-", dir="/run"))
    try:
        base = disk.base_disk(64 << 20, settings.microvm_cache / "disks")
        top = disk.create_top(work / "ws.qcow2", base, uid=65534, gid=65534)
        config = VmConfig(kernel=kernel.vmlinux, root_image=image.path, run_dir=work / "vm",
                          accel=choose_accel(allow_tcg=True), memory_mib=256, top_disk=top,
                          backing=(base,), uid=65534, gid=65534)
        deadline = time.monotonic() + 300
        with Vm.boot(config, deadline) as guest:
            sock = guest.connect(deadline)
            client = _GuestClient(sock)
            assert client.get(0, timeout=300)["ready"]["agent"] == 1
            yield client, guest, work
            sock.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_in_the_guest_limits_usage_disk_and_lifecycle(vm: tuple[Client, Any, Path]) -> None:
    c, guest, work = vm
    assert c.ok("mount", fresh=True) is True
    # (commands have no /sys of their own: the controllers are seen through their effects)
    placed = c.run(["sh", "-c", "id -u; cat /proc/self/cgroup; stat -c %u /workspace"],
                   timeout=120)
    lines = placed["stdout"].decode().split("\n")
    assert lines[0] == "1000" and lines[1].startswith("0::/cmd/") and lines[2] == "1000"
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
    c.sock.shutdown(socket.SHUT_RDWR)
    c.sock.close()
    second = guest.connect(time.monotonic() + 60)
    again = Client(second)
    # A new host end is served at once (ping); ``ready`` comes again only when the guest saw
    # the hang-up, which a quick reconnection can hide, so it is not waited for here.
    assert again.ok("ping") is True
    second.shutdown(socket.SHUT_RDWR)
    second.close()
