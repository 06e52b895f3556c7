"""The host side of a microVM, against real QEMU guests (TCG here: the test setting must allow
it). At most two VMs run at once, each 256 MiB and one vCPU; every wait has a deadline and every
QEMU is killed in teardown."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from corral._backends._linux.template import load_template
from corral._backends.microvm import disk, rootimage, warm
from corral._backends.microvm.accel import Accel, choose_accel
from corral._backends.microvm.kernel import GuestKernel, find_kernel
from corral._backends.microvm.vm import Vm, VmConfig, kernel_cmdline, tsc_khz
from corral._settings import Settings
from corral._templates import BUILTIN_SPECS, build_template
from corral.errors import BackendError, BackendUnavailable, UsageError

pytestmark = [pytest.mark.needs_root, pytest.mark.timeout(600)]


def _seccomp() -> str:
    """The tier's syscall filter, which the guest's launcher requires with every exec."""
    from corral._backends._linux.seccomp import compile_filter

    return base64.b64encode(compile_filter()).decode()

# Where the kernel and the microvm-base template are cached on this host (builds take minutes).
CACHE_HOME = Settings().microvm_cache
MEMORY_MIB = 256
BOOT_S = 120.0  # a cold boot under TCG on a shared host
WORKSPACE_BYTES = 64 << 20


@pytest.fixture(scope="module")
def kernel() -> GuestKernel:
    if os.environ.get("CORRAL_MICROVM_ALLOW_TCG") != "1" and not Path("/sys/module/kvm_intel")\
            .exists() and not Path("/sys/module/kvm_amd").exists():
        pytest.skip("no hardware KVM here and CORRAL_MICROVM_ALLOW_TCG=1 is not set")
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (scripts/bootstrap installs it)")
    from corral._backends.microvm.prepare import wait_for_prepare

    wait_for_prepare(CACHE_HOME, timeout_s=1200)
    built = find_kernel(CACHE_HOME)
    if built is None:
        pytest.skip("the guest kernel is not built: python -m corral._backends.microvm.kernel")
    return built


@pytest.fixture(scope="module")
def accel(kernel: GuestKernel) -> Accel:
    return choose_accel(allow_tcg=os.environ.get("CORRAL_MICROVM_ALLOW_TCG") == "1")


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="corral-microvm-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def image(kernel: GuestKernel, scratch: Path) -> rootimage.RootImage:
    templates = CACHE_HOME / "templates"
    started = time.monotonic()
    build = build_template(BUILTIN_SPECS[rootimage.BASE_SPEC], templates)
    template_s = time.monotonic() - started
    made = rootimage.root_image(load_template(rootimage.BASE_SPEC, templates), scratch / "img")
    print(f"\nmicrovm-base: template {'cached' if build.cached else f'{template_s:.0f} s'}, "
          f"{build.template.size_bytes >> 20} MiB; root image {made.build_s:.1f} s, "
          f"{made.size_bytes >> 20} MiB")
    return made


@pytest.fixture(scope="module")
def ids(settings: Settings) -> tuple[int, int]:
    # An unprivileged uid of the session's range that no sandbox of this session gets.
    uid = settings.uid_start + settings.uid_count - 1
    return uid, uid


_agents: list[Agent] = []


@pytest.fixture
def vms() -> Iterator[list[Vm]]:
    """VMs a test starts go in here; all are killed and checked gone at teardown."""
    started: list[Vm] = []
    yield started
    while _agents:
        _agents.pop().close()
    for vm in started:
        vm.kill()
    for vm in started:
        assert not vm.alive, f"QEMU {vm.pid} outlived its test"
        assert not vm.channel_path.exists()


def config(kernel: GuestKernel, image: rootimage.RootImage, accel: Accel, run: Path,
           ids: tuple[int, int], top: Path | None = None,
           backing: tuple[Path, ...] = ()) -> VmConfig:
    return VmConfig(kernel=kernel.vmlinux, root_image=image.path, run_dir=run, accel=accel,
                    memory_mib=MEMORY_MIB, top_disk=top, backing=backing, uid=ids[0],
                    gid=ids[1])


def contract_agent() -> bool:
    """True when the image carries the contract agent (commands as uid 1000 in their own
    namespaces, `mount`/`resume` ops) rather than the draft one (commands as root)."""
    return "run" in rootimage.skeleton_sources()


class Agent:
    """The agent channel, for the draft agent and the contract agent alike."""

    def __init__(self, vm: Vm, deadline: float) -> None:
        self.vm = vm
        self.sock = vm.connect(deadline)
        self.buf = bytearray()
        self.next_id = 1
        _agents.append(self)

    def ready(self, deadline: float) -> dict[str, object]:
        return self.vm.read_line(self.sock, self.buf, deadline, "the ready line")

    def request(self, op: str, deadline_s: float = 60.0, **fields: object) -> tuple[
            dict[str, object], bytes]:
        deadline = time.monotonic() + deadline_s
        rid, self.next_id = self.next_id, self.next_id + 1
        self.sock.sendall(json.dumps({"id": rid, "op": op, **fields}).encode() + b"\n")
        out = b""
        while True:
            message = self.vm.read_line(self.sock, self.buf, deadline, f"{op} {fields}")
            if message.get("id") != rid:
                continue
            if "data" in message:
                out += base64.b64decode(str(message["data"]))
            elif any(key in message for key in ("exit", "ok", "error", "pong")):
                return message, out

    def run(self, script: str, deadline_s: float = 60.0, cwd: str = "/workspace") -> tuple[
            int, str]:
        message, out = self.request(
            "exec", deadline_s, argv=["/bin/sh", "-c", script], cwd=cwd,
            env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": "/workspace"},
            timeout=deadline_s, stdin="null", pty=None, tmp_bytes=16 << 20, pids=64,
            memory_bytes=64 << 20, egress_port=None, seccomp=_seccomp())
        if "error" in message:
            raise AssertionError(f"exec failed: {message['error']}")
        code = message["exit"]
        if isinstance(code, dict):
            code = code["code"]
        return int(str(code)), out.decode(errors="replace")

    def _op_or_shell(self, op: str, script: str, **fields: object) -> None:
        if contract_agent():
            message, _ = self.request(op, **fields)
            assert message.get("ok") is True, message
        else:
            assert self.run(script, cwd="/") == (0, "")

    def mount(self, fresh: bool = False) -> None:
        self._op_or_shell("mount", "mount /dev/vdb /workspace", fresh=fresh)

    def unmount(self) -> None:
        self._op_or_shell("unmount", "sync && umount /workspace")

    def resume(self, sandbox_id: str = "sbx_test") -> None:
        """What follows a restore: fresh RNG seed and clock, and the block caches dropped (the
        guest probed another disk as /dev/vdb when the warm snapshot was made). The agent
        keeps ``sandbox_id`` in guest RAM (/run/corral/sandbox_id, tmpfs)."""
        self._op_or_shell("resume", "blockdev --flushbufs /dev/vdb",
                          seed=base64.b64encode(os.urandom(64)).decode(),
                          time_ns=time.time_ns(), hostname="sandbox", sandbox_id=sandbox_id)

    def close(self) -> None:
        self.sock.close()


def cold(kernel: GuestKernel, image: rootimage.RootImage, accel: Accel, run: Path,
         ids: tuple[int, int], vms: list[Vm], **kwargs: object) -> tuple[Vm, Agent, float]:
    started = time.monotonic()
    deadline = started + BOOT_S
    vm = Vm.boot(config(kernel, image, accel, run, ids, **kwargs), deadline)  # type: ignore[arg-type]
    vms.append(vm)
    agent = Agent(vm, deadline)
    assert "ready" in agent.ready(deadline)
    return vm, agent, time.monotonic() - started


def test_cold_boot_is_the_guest_kernel_with_no_devices_but_its_disks(
        kernel: GuestKernel, image: rootimage.RootImage, accel: Accel, tmp_path: Path,
        ids: tuple[int, int], vms: list[Vm]) -> None:
    base = disk.base_disk(WORKSPACE_BYTES, tmp_path / "disks")
    top = disk.create_top(tmp_path / "top.qcow2", base, uid=ids[0], gid=ids[1])
    vm, agent, boot_s = cold(kernel, image, accel, tmp_path / "run", ids, vms, top=top,
                             backing=(base,))
    print(f"\ncold boot to agent ready: {boot_s:.2f} s")
    code, release = agent.run("uname -r")
    assert (code, release.strip()) == (0, kernel.release)
    assert release.strip() != os.uname().release
    # A command has no /sys and a minimal /dev of its own (as on the other tiers): the guest's
    # devices are seen through /proc.
    code, out = agent.run("tail -n +3 /proc/net/dev | cut -d: -f1; echo --; "
                          "tail -n +3 /proc/partitions | awk '{print $4}'; echo --; "
                          "ls /dev | grep -c '^kvm$'; cat /proc/mounts")
    net, blocks, rest = out.split("--\n")
    assert net.split() == ["lo"]
    assert blocks.split() == ["vda", "vdb"]
    lines = rest.splitlines()
    assert lines[0] == "0"  # no /dev/kvm
    mounts = {line.split()[1]: line.split() for line in lines[1:]}
    assert mounts["/"][0] == "/dev/root" and mounts["/"][3].startswith("ro")
    assert {"/proc", "/sys", "/sys/fs/cgroup", "/dev", "/dev/pts", "/tmp", "/run"} <= set(mounts)
    # Init and the agent are never the guest OOM killer's pick (a command's own PID namespace
    # may hide them: then nothing to check from here).
    code, out = agent.run("for p in $(pgrep -x -f '/usr/bin/python3 -I -S /corral/agent.pyz'); "
                          "do cat /proc/$p/oom_score_adj; done; "
                          "[ \"$(cat /proc/1/cmdline | tr '\\0' ' ')\" = '/corral/init ' ] && "
                          "cat /proc/1/oom_score_adj; true")
    assert code == 0 and set(out.split()) <= {"-1000"}
    if "run" not in rootimage.skeleton_sources():  # commands run in the agent's namespaces
        assert out.split() == ["-1000", "-1000"]
    # QEMU itself: the unprivileged uid, no capabilities, its own PID namespace.
    status = Path(f"/proc/{vm.pid}/status").read_text()
    assert f"Uid:\t{ids[0]}\t{ids[0]}\t{ids[0]}\t{ids[0]}" in status
    assert "CapEff:\t0000000000000000" in status and "NoNewPrivs:\t1" in status
    assert os.readlink(f"/proc/{vm.pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
    assert os.readlink(f"/proc/{vm.pid}/ns/net") == os.readlink("/proc/self/ns/net")
    agent.close()
    vm.quit(time.monotonic() + 10)
    assert not vm.alive


def test_attach_sees_qemu_before_the_guest_runs_and_qemu_keeps_the_netns(
        kernel: GuestKernel, image: rootimage.RootImage, accel: Accel, tmp_path: Path,
        ids: tuple[int, int], vms: list[Vm]) -> None:
    name = f"corral-microvm-test-{os.getpid()}"
    # The memory controller's hierarchy: v1's on hybrid hosts (this one), else the v2 root.
    memory_v1 = Path("/sys/fs/cgroup/memory")
    cgroup = (memory_v1 if (memory_v1 / "cgroup.procs").exists() else Path("/sys/fs/cgroup")) / name
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    cgroup.mkdir()
    seen: list[tuple[int, bool]] = []
    run = tmp_path / "run,with,commas"  # QEMU's option syntax: escaped, not split
    serial = run / "serial.log"

    def attach(pid: int) -> None:
        # The guest has not run: no kernel line on its console yet.
        seen.append((pid, serial.exists() and serial.stat().st_size > 0))
        (cgroup / "cgroup.procs").write_text(str(pid))

    try:
        cfg = replace(config(kernel, image, accel, run, ids),
                      netns=Path("/run/netns") / name, attach=attach)
        deadline = time.monotonic() + BOOT_S
        vm = Vm.boot(cfg, deadline)
        vms.append(vm)
        agent = Agent(vm, deadline)
        assert "ready" in agent.ready(deadline)
        assert seen == [(vm.pid, False)]
        assert f":/{name}\n" in Path(f"/proc/{vm.pid}/cgroup").read_text()
        assert os.stat(f"/proc/{vm.pid}/ns/net").st_ino == os.stat(
            f"/run/netns/{name}").st_ino
        # The guest's memory is charged to the cgroup the caller chose.
        usage = cgroup / "memory.current"
        if not usage.exists():
            usage = cgroup / "memory.usage_in_bytes"
        assert int(usage.read_text()) > 16 << 20
        agent.close()
        vm.kill()
    finally:
        for vm in vms:
            vm.kill()
        subprocess.run(["ip", "netns", "delete", name], check=False, timeout=30)
        deadline = time.monotonic() + 10
        while cgroup.exists():
            try:
                cgroup.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def test_workspace_chain_seals_offline_and_live(
        kernel: GuestKernel, image: rootimage.RootImage, accel: Accel, tmp_path: Path,
        ids: tuple[int, int], vms: list[Vm]) -> None:
    base = disk.base_disk(WORKSPACE_BYTES, tmp_path / "disks")
    assert disk.base_disk(WORKSPACE_BYTES, tmp_path / "disks") == base  # formatted once
    assert (base.stat().st_uid, base.stat().st_mode & 0o777) == (0, 0o644)
    top = disk.create_top(tmp_path / "top.qcow2", base, uid=ids[0], gid=ids[1])
    assert (top.stat().st_uid, top.stat().st_mode & 0o777) == (ids[0], 0o600)
    vm, agent, _ = cold(kernel, image, accel, tmp_path / "run", ids, vms, top=top,
                        backing=(base,))
    agent.mount(fresh=True)
    code, out = agent.run("stat -c %u /workspace && echo one > /workspace/a")
    assert (code, out.split()) == (0, ["1000"])
    agent.unmount()
    agent.close()
    vm.quit(time.monotonic() + 10)

    layer1 = tmp_path / "layer1.qcow2"
    disk.seal(top, layer1, uid=ids[0], gid=ids[1])
    assert [Path(i["filename"]) for i in disk.chain(top)] == [top, layer1, base]
    assert (layer1.stat().st_uid, layer1.stat().st_mode & 0o777) == (0, 0o644)

    vm, agent, _ = cold(kernel, image, accel, tmp_path / "run", ids, vms, top=top,
                        backing=(layer1, base))
    agent.mount()
    code, out = agent.run("cat /workspace/a && echo two > /workspace/b && sync")
    assert (code, out) == (0, "one\n")
    # Live: the guest pauses, the new top goes over the running one, the guest continues.
    deadline = time.monotonic() + 30
    layer2 = tmp_path / "layer2.qcow2"
    new_top = vm.config.run_dir / "new-top.qcow2"
    vm.pause(deadline)
    vm.seal_live(new_top, layer2, deadline)
    vm.cont(deadline)
    code, out = agent.run("echo three > /workspace/c && cat /workspace/b")
    assert (code, out) == (0, "two\n")
    agent.unmount()
    agent.close()
    vm.quit(time.monotonic() + 10)
    # The old top is the layer now; the new top names it by the layer's path.
    os.rename(top, layer2)
    chain = disk.chain(new_top)
    assert [Path(i["filename"]) for i in chain] == [new_top, layer2, layer1, base]
    squashed = disk.squash(layer2, tmp_path / "squashed.qcow2")
    assert len(disk.chain(squashed)) == 1


def test_warm_restore_is_faster_and_shares_memory(
        kernel: GuestKernel, image: rootimage.RootImage, accel: Accel, tmp_path: Path,
        ids: tuple[int, int], vms: list[Vm]) -> None:
    snap = warm.warm_snapshot(kernel, image, MEMORY_MIB, tmp_path / "warm", accel=accel,
                              uid=ids[0], gid=ids[1], disks=tmp_path / "disks")
    assert warm.warm_snapshot(kernel, image, MEMORY_MIB, tmp_path / "warm", accel=accel,
                              uid=ids[0], gid=ids[1], disks=tmp_path / "disks").build_s == 0.0
    assert (snap.ram.stat().st_uid, snap.ram.stat().st_mode & 0o777) == (0, 0o644)
    assert (snap.state.stat().st_uid, snap.state.stat().st_mode & 0o777) == (0, 0o644)
    # Published whole: nothing of the build (its run dir, its placeholder disk) is left.
    assert sorted(p.name for p in (tmp_path / "warm").iterdir()) == [snap.key]
    assert sorted(p.name for p in snap.ram.parent.iterdir()) == ["ram", "state", "warm.json"]
    base = disk.base_disk(WORKSPACE_BYTES, tmp_path / "disks")
    restores: list[float] = []
    agents = []
    for n in range(2):
        top = disk.create_top(tmp_path / f"top{n}.qcow2", base, uid=ids[0], gid=ids[1])
        started = time.monotonic()
        deadline = started + 60
        vm = Vm.restore_warm(config(kernel, image, accel, tmp_path / f"run{n}", ids, top=top,
                                    backing=(base,)), snap, deadline)
        vms.append(vm)
        agent = Agent(vm, deadline)
        agent.resume()
        code, out = agent.run("awk '$4 == \"vdb\" {print $3 * 2}' /proc/partitions; uname -r",
                              deadline_s=30)
        restores.append(time.monotonic() - started)
        agents.append(agent)
        # The guest sees the sandbox's disk size, not the warm snapshot's placeholder's.
        assert (code, out.split()) == (0, [str(WORKSPACE_BYTES // 512), kernel.release])
        # What the agent's `resume` does (contract: BLKFLSBUF), then its `mount`: the guest
        # sees the sandbox's filesystem, not the placeholder's (16 MiB) it probed when warm.
        agent.mount(fresh=True)
        code, out = agent.run("ls /workspace && df -k --output=size /workspace | tail -1")
        agent.unmount()
        assert code == 0 and out.split()[0] == "lost+found"
        assert int(out.split()[1]) > (WORKSPACE_BYTES >> 10) * 3 // 4
    time.sleep(1)  # idle
    rss = [vm.rss_bytes() >> 20 for vm in vms]
    pss = [vm.pss_bytes() >> 20 for vm in vms]
    print(f"\nwarm snapshot made in {snap.build_s:.2f} s; restore to agent answering: "
          + ", ".join(f"{s * 1000:.0f} ms" for s in restores)
          + f"; idle RSS {rss} MiB, PSS {pss} MiB")
    assert max(restores) < snap.build_s
    # A restored VM has not touched most of the RAM file: far below its cold RSS.
    assert all(0 < r < MEMORY_MIB for r in rss)
    for agent in agents:
        agent.close()


def test_memory_snapshot_with_its_disk_layer_restores_into_two_vms(
        kernel: GuestKernel, image: rootimage.RootImage, accel: Accel, tmp_path: Path,
        ids: tuple[int, int], vms: list[Vm]) -> None:
    # The contract's memory snapshot: stop, seal the top live, save RAM + devices, cont.
    base = disk.base_disk(WORKSPACE_BYTES, tmp_path / "disks")
    top = disk.create_top(tmp_path / "top.qcow2", base, uid=ids[0], gid=ids[1])
    vm, agent, _ = cold(kernel, image, accel, tmp_path / "run", ids, vms, top=top,
                        backing=(base,))
    # State in guest RAM (the agent keeps the sandbox id on /run, tmpfs; a command's /tmp and
    # /dev/shm are its own) and in the mounted workspace, not synced: the dirty pages are in the
    # memory image, the rest in the layer, both of one instant.
    agent.mount(fresh=True)
    code, token = agent.run("head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \\n' | "
                            "tee /workspace/token")
    assert code == 0 and len(token) == 16
    agent.resume(sandbox_id=f"sbx_{token}")
    deadline = time.monotonic() + 60
    layer = tmp_path / "layer.qcow2"
    memory = tmp_path / "memory.img"
    started = time.monotonic()
    vm.pause(deadline)
    vm.seal_live(vm.config.run_dir / "top.qcow2", layer, deadline)
    vm.save_memory(memory, deadline)
    vm.cont(deadline)
    print(f"\nmemory snapshot (stop, live seal, save {memory.stat().st_size >> 20} MiB, cont): "
          f"{(time.monotonic() - started) * 1000:.0f} ms")
    os.rename(top, layer)  # the sealed top is the layer now; the source reads it as backing
    os.chown(layer, 0, 0)
    os.chmod(layer, 0o644)
    assert (memory.stat().st_uid, memory.stat().st_mode & 0o777) == (0, 0o644)
    assert agent.run("cat /run/corral/sandbox_id; echo more >> /workspace/token") == (
        0, f"sbx_{token}")
    assert disk.chain(layer)[0]["backing-filename"] == str(base)
    agent.close()
    vm.quit(time.monotonic() + 10)
    children = []
    for n in range(2):
        started = time.monotonic()
        child_top = disk.create_top(tmp_path / f"child{n}.qcow2", layer, uid=ids[0],
                                    gid=ids[1])
        child = Vm.restore_memory(config(kernel, image, accel, tmp_path / f"child{n}", ids,
                                         top=child_top, backing=(layer, base)),
                                  memory, started + 60)
        vms.append(child)
        child_agent = Agent(child, started + 60)
        # Both from the one instant: what the source wrote after it is in neither.
        assert child_agent.run("cat /run/corral/sandbox_id; echo; cat /workspace/token") == (
            0, f"sbx_{token}\n{token}")
        print(f"memory restore {n} to agent answering: "
              f"{(time.monotonic() - started) * 1000:.0f} ms")
        children.append(child_agent)
    for n, child_agent in enumerate(children):
        child_agent.resume(sandbox_id=f"sbx_{token}{n}")
        assert child_agent.run(f"echo {n} >> /workspace/token; sync")[0] == 0
    for n, child_agent in enumerate(children):
        assert child_agent.run("cat /run/corral/sandbox_id; echo; cat /workspace/token") == (
            0, f"sbx_{token}{n}\n{token}{n}\n")
        child_agent.close()


def test_a_paused_or_dead_qemu_fails_every_wait_at_once(
        kernel: GuestKernel, image: rootimage.RootImage, accel: Accel, tmp_path: Path,
        ids: tuple[int, int], vms: list[Vm]) -> None:
    vm, agent, _ = cold(kernel, image, accel, tmp_path / "run", ids, vms)
    # A stop nobody asked for (what an emulation error or werror=stop does), through HMP so
    # our own `stop` accounting does not see it.
    vm._qmp_cmd("human-monitor-command", time.monotonic() + 10, **{"command-line": "stop"})
    started = time.monotonic()
    with pytest.raises(BackendError, match="STOP"):
        agent.run("true", deadline_s=60)
    assert time.monotonic() - started < 2
    agent.close()
    vm.kill()

    # QEMU dies (a crash, the OOM killer) while a command runs: the wait ends at once.
    vm, agent, _ = cold(kernel, image, accel, tmp_path / "run2", ids, vms)
    killer = threading.Timer(0.5, os.kill, (vm.pid, signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(BackendError, match="QEMU exited|channel closed"):
            agent.run("sleep 30", deadline_s=60)
    finally:
        killer.cancel()
    assert time.monotonic() - started < 5
    agent.close()
    vm.kill()

    if contract_agent():
        return  # commands cannot reach the agent (their own PID namespace, uid 1000)
    # The guest's agent dies: init powers the guest off and QEMU exits (-no-reboot).
    vm, agent, _ = cold(kernel, image, accel, tmp_path / "run3", ids, vms)
    started = time.monotonic()
    with pytest.raises(BackendError, match="serial log tail") as caught:
        agent.run("kill -9 $PPID; sleep 30", deadline_s=60)
    assert time.monotonic() - started < 30
    assert "agent exited" in str(caught.value) or "QEMU exited" in str(caught.value)
    agent.close()
    deadline = time.monotonic() + 10
    while vm.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not vm.alive


def test_bad_inputs_say_what_to_do(tmp_path: Path, accel: Accel) -> None:
    with pytest.raises(UsageError, match="python3"):
        (tmp_path / "root" / "usr" / "bin").mkdir(parents=True)
        rootimage.root_image(tmp_path / "root", tmp_path / "img")
    with pytest.raises(UsageError, match="at least 16 MiB"):
        disk.base_disk(1 << 20, tmp_path / "disks")
    with pytest.raises(BackendError, match="backing disk .* is missing"):
        disk.create_top(tmp_path / "top.qcow2", tmp_path / "nope.qcow2", uid=0, gid=0)
    assert rootimage.template_name("base") == "microvm-base"
    with pytest.raises(UsageError, match="too long"):
        Vm.boot(VmConfig(kernel=Path("/k"), root_image=Path("/r"), accel=accel,
                         run_dir=tmp_path / ("x" * 120)), time.monotonic() + 5)


def test_a_deep_chain_is_squashed_when_sealed(tmp_path: Path) -> None:
    if shutil.which("qemu-img") is None:
        pytest.skip("qemu-img is not installed (scripts/bootstrap installs it)")
    base = disk.base_disk(16 << 20, tmp_path / "disks")
    top = disk.create_top(tmp_path / "top.qcow2", base, uid=1000, gid=1000)
    depths = []
    for n in range(disk.MAX_DEPTH + 2):
        disk.seal(top, tmp_path / f"layer{n}.qcow2", uid=1000, gid=1000)
        depths.append(len(disk.chain(top)))
    assert max(depths) == disk.MAX_DEPTH + 1
    assert depths[-1] < disk.MAX_DEPTH  # squashed: the chain restarted from one layer
    assert (top.stat().st_uid, top.stat().st_mode & 0o777) == (1000, 0o600)
    with pytest.raises(BackendError, match="exists already"):
        disk.seal(top, tmp_path / "layer0.qcow2", uid=1000, gid=1000)


def test_the_guest_clock_comes_from_the_hosts_invariant_tsc(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\ncpu MHz\t\t: 2596.150\n"
                       "flags\t\t: fpu tsc constant_tsc nonstop_tsc tsc_known_freq\n")
    assert tsc_khz(cpuinfo) == 2_596_150
    line = kernel_cmdline(2_596_150).split()
    # lpj: TSC cycles per jiffy at the guest's HZ=100.
    assert {"tsc_early_khz=2596150", "lpj=25961500", "tsc=reliable", "root=/dev/vda", "ro",
            "init=/corral/init", "console=ttyS0", "panic=-1"} <= set(line)
    cpuinfo.write_text("cpu MHz\t\t: 2596.150\nflags\t\t: fpu tsc\n")
    with pytest.raises(BackendUnavailable, match="invariant TSC"):
        tsc_khz(cpuinfo)
    assert tsc_khz() > 100_000  # this host's


def test_no_qemu_left(tmp_path: Path) -> None:
    mine = subprocess.run(["pgrep", "-f", "corral-microvm-test-|pytest-of"], capture_output=True,
                          text=True, check=False).stdout.split()
    qemus = [p for p in mine
             if Path(f"/proc/{p}/comm").exists()
             and Path(f"/proc/{p}/comm").read_text().startswith("qemu")]
    assert qemus == []
