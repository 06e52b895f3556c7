"""Sleep and wake (issue 40): what a frozen sandbox holds, and how fast a call wakes it.

Run as root::

    .venv/bin/python bench/bench_hibernate.py [--runs N] [--isolation namespace|gvisor]
                                              [--density N] [--out FILE]

Through the embedded SDK, on one tier, interleaved in shuffled rounds, after warm-ups:

- ``wake_to_first_command``: a sandbox with ``lifecycle={"on_timeout": "pause",
  "auto_resume": True}``, paused, then ``commands.run(["true"])``: the call resumes it and runs
  (the frozen state's wake). Target p50 <= 10 ms on the namespace tier.
- ``command`` (reference): ``commands.run(["true"])`` in a running sandbox.
- ``create_and_first_command`` (reference): ``Sandbox.create()`` then its first command.
- ``pause`` and ``resume``: the explicit calls, timed apart.
- ``hibernated_wake_to_first_command``: the same sandbox (a file in ``/tmp`` and one in the
  workspace), hibernated, then ``commands.run(["true"])``: the call wakes it (its pieces
  rebuilt, ``/tmp`` put back) and runs. Target p50 <= 30 ms (within 2x create + first
  command, measured beside it).
- ``hibernate``: the explicit call, on a sandbox with no process running.

``density``: N sandboxes created and paused, then per sandbox: the host's ``MemAvailable`` drop
(and ``Slab`` growth), processes, mounts, loop devices and network namespaces still held.

``memory_100mb``: a sandbox holding 100 MB of memory a hibernate can keep: 100 MB of
incompressible data in its ``/tmp`` (a memory filesystem, charged to the sandbox; no tier keeps
a *process's* memory yet, see docs/design/hibernation.md): hibernate time, the archive's size,
the host's ``MemAvailable`` before and after, and the wake to first command (reading it all).

``with_processes`` (the microVM tier, the one that keeps a process's memory): a sandbox with a
live Python kernel (a variable set) and a background process holding 100 MB of incompressible
memory, hibernated and woken ``--process-runs`` times: hibernate time, the memory image's
size, the wake to the first command and to the first cell (the variable read back), beside
``bare_qemu_restore``: QEMU alone restoring copies of the same state and disk.

``hibernated``: M sandboxes (default 1,000) created, given a file, and hibernated; then per
sandbox the same figures (target: no process, mount, loop device or network namespace) and its
disk (allocated bytes under its directory, and the store); how many would fit on this host by
memory and by free disk. Then a *restart*: ``corral serve`` over the data directory lists them,
is SIGKILLed and started again; the new one lists them all and wakes one at random by a
command, timed. Prints one JSON
document; everything made is removed and checked.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import emit_report, log, summarize, teardown  # noqa: E402

from corral import Lifecycle, Sandbox  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

# Apart from the other benches (2_050_... to 2_090_...) and the tests (2_100_... and up).
UID_START = 2_093_000_000
UID_COUNT = 2_000
WARMUP = 3
SLEEPY = Lifecycle(on_timeout="pause", auto_resume=True)


def _meminfo() -> dict[str, int]:
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            values[name] = int(rest.split()[0]) * 1024
    return values


def _kernel_objects() -> dict[str, int]:
    """Host-wide counts of what sandboxes hold: mounts, loop devices, network namespaces."""
    with open("/proc/self/mountinfo") as f:
        mounts = sum(1 for _ in f)
    loops = sum(1 for d in Path("/sys/block").iterdir() if d.name.startswith("loop")
                and (d / "loop" / "backing_file").exists())
    netns = len({os.readlink(f"/proc/{p}/ns/net") for p in os.listdir("/proc")
                 if p.isdigit() and os.path.exists(f"/proc/{p}/ns/net")
                 and _readable_link(f"/proc/{p}/ns/net")})
    processes = sum(1 for p in os.listdir("/proc") if p.isdigit())
    return {"mounts": mounts, "loop_devices": loops, "network_namespaces_with_a_process": netns,
            "processes": processes}


def _readable_link(path: str) -> bool:
    try:
        os.readlink(path)
    except OSError:
        return False
    return True


def _series(home: Path, isolation: str, runs: int, seed: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in (
        "wake_to_first_command", "command", "create_and_first_command", "pause", "resume",
        "hibernated_wake_to_first_command", "hibernate")}
    running = Sandbox.create(home=str(home), isolation=isolation)
    sleepy = Sandbox.create(home=str(home), isolation=isolation, lifecycle=SLEEPY)
    deep = Sandbox.create(home=str(home), isolation=isolation, lifecycle=SLEEPY)
    deep.commands.run("echo scratch > /tmp/kept && echo files > /workspace/kept")
    rng = random.Random(seed)

    def hibernated_wake() -> None:
        began = time.perf_counter()
        deep.hibernate()
        samples["hibernate"].append(time.perf_counter() - began)
        began = time.perf_counter()
        result = deep.commands.run(["true"])
        samples["hibernated_wake_to_first_command"].append(time.perf_counter() - began)
        assert result.exit_code == 0

    def wake() -> None:
        sleepy.pause()
        began = time.perf_counter()
        result = sleepy.commands.run(["true"])
        samples["wake_to_first_command"].append(time.perf_counter() - began)
        assert result.exit_code == 0

    def command() -> None:
        began = time.perf_counter()
        assert running.commands.run(["true"]).exit_code == 0
        samples["command"].append(time.perf_counter() - began)

    def create() -> None:
        began = time.perf_counter()
        sb = Sandbox.create(home=str(home), isolation=isolation)
        assert sb.commands.run(["true"]).exit_code == 0
        samples["create_and_first_command"].append(time.perf_counter() - began)
        sb.kill()

    def pause_resume() -> None:
        began = time.perf_counter()
        sleepy.pause()
        samples["pause"].append(time.perf_counter() - began)
        began = time.perf_counter()
        sleepy.resume()
        samples["resume"].append(time.perf_counter() - began)

    steps = [wake, command, create, pause_resume, hibernated_wake]
    try:
        for _ in range(WARMUP):
            for fn in steps:
                fn()
        for values in samples.values():
            values.clear()
        for round_no in range(runs):
            rng.shuffle(steps)
            for fn in steps:
                fn()
            if (round_no + 1) % 20 == 0:
                log(f"round {round_no + 1}/{runs}")
        kept = deep.commands.run("cat /workspace/kept /tmp/kept").stdout
        # A microVM command's /tmp is its own: only the workspace outlives a command there.
        assert kept == ("files\n" if isolation == "microvm" else "files\nscratch\n"), kept
    finally:
        running.kill()
        sleepy.kill()
        deep.kill()
    return samples


def _density(home: Path, isolation: str, count: int) -> dict[str, Any]:
    if count <= 0:
        return {"skipped": True}
    gc.collect()
    mem_before, objects_before = _meminfo(), _kernel_objects()
    made = []
    try:
        for _ in range(count):
            sb = Sandbox.create(home=str(home), isolation=isolation, lifecycle=SLEEPY)
            sb.pause()
            made.append(sb)
        time.sleep(1.0)  # let the kernel's counters settle
        mem_after, objects_after = _meminfo(), _kernel_objects()
    finally:
        for sb in made:
            sb.kill()
    per = {name: round((objects_after[name] - objects_before[name]) / count, 2)
           for name in objects_before}
    return {
        "sandboxes": count,
        "per_sandbox": {
            "mem_available_drop_kib": round(
                (mem_before["MemAvailable"] - mem_after["MemAvailable"]) / count / 1024, 1),
            "slab_growth_kib": round((mem_after["Slab"] - mem_before["Slab"]) / count / 1024, 1),
            **per,
        },
    }


def _memory_100mb(home: Path, isolation: str) -> dict[str, Any]:
    if isolation == "microvm":
        return {"skipped": "each microVM command has a fresh /tmp: nothing of it to keep"}
    sb = Sandbox.create(home=str(home), isolation=isolation, lifecycle=SLEEPY,
                        resources="large")
    try:
        made = sb.commands.run("head -c 100000000 /dev/urandom > /tmp/blob && sync && "
                               "sha256sum /tmp/blob", timeout=300)
        assert made.exit_code == 0, made.stderr
        time.sleep(1.0)
        before = _meminfo()
        began = time.perf_counter()
        sb.hibernate()
        hibernate_s = time.perf_counter() - began
        time.sleep(1.0)
        after = _meminfo()
        archive = home / "sandboxes" / sb.id / "priv" / "tmp.tar"
        size = archive.stat().st_size
        began = time.perf_counter()
        again = sb.commands.run("sha256sum /tmp/blob", timeout=300)
        wake_s = time.perf_counter() - began
        return {
            "hibernate_ms": round(hibernate_s * 1000, 1),
            "image_bytes": size,
            # The tmpfs's pages (Shmem) are what the sandbox held; MemAvailable also moves
            # with the archive just written (page cache, dirty until written back).
            "shmem_freed_mib": round((before["Shmem"] - after["Shmem"]) / 2**20, 1),
            "mem_available_gain_mib": round(
                (after["MemAvailable"] - before["MemAvailable"]) / 2**20, 1),
            "wake_to_first_command_reading_it_ms": round(wake_s * 1000, 1),
            "intact": again.stdout == made.stdout,
        }
    finally:
        sb.kill()


_HOLDER = ("import os, time\nheld = os.urandom(100_000_000)\nprint('ready', flush=True)\n"
           "time.sleep(86400)")


def _bare_restore(keeper_config: Any, memory: Path, top: Path) -> float:
    """QEMU alone restoring the same saved state (``-incoming defer``, ``migrate-incoming
    file:``, until the guest runs): no keeper, agent, control plane or digest. On copies of
    the state and the writable disk, so the sandbox's own stay as they were; then killed."""
    from corral._backends.microvm.accel import Accel
    from corral._backends.microvm.vm import Vm, VmConfig

    work = Path(tempfile.mkdtemp(prefix="corral-bench-restore-", dir=str(top.parent.parent)))
    try:
        shutil.copyfile(memory, work / "state")
        shutil.copyfile(top, work / "top.qcow2")
        for path in (work, work / "state", work / "top.qcow2"):
            os.chown(path, keeper_config.uid, keeper_config.uid)
        config = VmConfig(
            kernel=Path(keeper_config.kernel), root_image=Path(keeper_config.root_image),
            run_dir=work / "vm", work_dir=work,
            accel=Accel(keeper_config.accel, keeper_config.cpu_model,
                        "hardware" if keeper_config.accel == "kvm" else "none"),
            memory_mib=keeper_config.memory_mib, vcpus=keeper_config.cpus,
            top_disk=work / "top.qcow2", backing=tuple(Path(b) for b in keeper_config.backing),
            uid=keeper_config.uid, gid=keeper_config.uid)
        began = time.perf_counter()
        vm = Vm.restore_memory(config, work / "state", time.monotonic() + 300)
        took = time.perf_counter() - began
        vm.kill()
        return took
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _with_processes(home: Path, isolation: str, runs: int) -> dict[str, Any]:
    """A sandbox with a live Python kernel (a code context's variable) and a background
    process holding 100 MB of incompressible memory, hibernated and woken ``runs`` times:
    hibernate time, the memory image's size, the wake to the first command and to the first
    cell (which reads the variable), beside QEMU's own restore of the same state."""
    if isolation != "microvm":
        return {"skipped": f"the {isolation} tier keeps no process's memory (a sandbox with "
                           "processes stays paused): docs/design/hibernation.md"}
    from corral._backends.microvm.keeper import CONFIG, KeeperConfig

    manager = manager_mod.get_manager(Settings(home=home, uid_start=UID_START,
                                               uid_count=UID_COUNT))
    backend = manager.backend_for("microvm")
    samples: dict[str, list[float]] = {name: [] for name in (
        "hibernate", "wake_to_first_command", "wake_to_first_cell", "bare_qemu_restore")}
    sizes: list[int] = []
    sb = Sandbox.create(home=str(home), isolation=isolation, lifecycle=SLEEPY)
    try:
        assert sb.run_code("x = 41").error is None
        holder = sb.processes.start(["python3", "-c", _HOLDER])
        deadline = time.monotonic() + 300
        while "ready" not in "".join(t for _, _, t in holder.output()):
            assert time.monotonic() < deadline, "the holder never got its memory"
            time.sleep(0.1)
        keeper_config = KeeperConfig.load(backend._run_path(sb.id) / CONFIG)
        for n in range(runs):
            began = time.perf_counter()
            sb.hibernate()
            samples["hibernate"].append(time.perf_counter() - began)
            image = manager.store.hibernated_image(sb.id) or {}
            sizes.append(int(image.get("memory_bytes", 0)))
            samples["bare_qemu_restore"].append(_bare_restore(
                keeper_config, backend._memory_path(sb.id), backend._top(sb.id)))
            began = time.perf_counter()
            if n % 2:
                assert sb.run_code("x").text == "41"
                samples["wake_to_first_cell"].append(time.perf_counter() - began)
            else:
                assert sb.commands.run(["true"]).exit_code == 0
                samples["wake_to_first_command"].append(time.perf_counter() - began)
            log(f"with processes: round {n + 1}/{runs}")
        alive = holder.info()["state"] == "running"
    finally:
        sb.kill()
    results = {name: summarize(values) for name, values in samples.items() if values}
    return {
        "results": results,
        "memory_image_bytes": {"min": min(sizes), "max": max(sizes)},
        "process_alive_after_every_wake": alive,
        "ratio_wake_to_first_command_p50_over_bare_qemu_restore_p50": round(
            results["wake_to_first_command"]["p50_ms"]
            / results["bare_qemu_restore"]["p50_ms"], 2),
    }


def _allocated(path: Path) -> int:
    """Bytes the filesystem allocated under ``path`` (a sparse image counts what it holds)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with_stat = os.lstat(os.path.join(root, name))
            total += with_stat.st_blocks * 512
    return total


def _restart_and_wake(settings: Settings, ids: list[str], rng: random.Random) -> dict[str, Any]:
    """``corral serve`` over the data directory, SIGKILLed, and started again: the second
    lists every sandbox (all of ``ids`` hibernated) and wakes one of them by a command."""
    import httpx
    from bench_service import Server

    log_path = settings.home / "serve.log"
    first = Server(settings, log_path)
    first.start()
    before = httpx.get(f"{first.url}/v1/sandboxes", timeout=600).json()
    assert first.proc is not None
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=30)
    second = Server(settings, log_path)
    began = time.perf_counter()
    second.start()
    up_s = time.perf_counter() - began
    try:
        began = time.perf_counter()
        listed = httpx.get(f"{second.url}/v1/sandboxes", timeout=600).json()
        listed_s = time.perf_counter() - began
        chosen = rng.choice(ids)
        began = time.perf_counter()
        ran = httpx.post(f"{second.url}/v1/sandboxes/{chosen}/commands",
                         json={"cmd": "cat /workspace/kept /tmp/kept"}, timeout=600).json()
        woke_s = time.perf_counter() - began
    finally:
        second.stop()
    states = {item["id"]: item["state"] for item in listed}
    return {
        "of": len(ids),
        "listed_before_the_kill": sum(1 for item in before if item["id"] in set(ids)),
        "listed_after_the_restart": sum(1 for i in ids if i in states),
        "hibernated_after_the_restart": sum(1 for i in ids if states.get(i) == "hibernated"),
        "restart_to_healthy_ms": round(up_s * 1000, 1),
        "list_ms": round(listed_s * 1000, 1),
        "wake_one_to_first_command_ms": round(woke_s * 1000, 1),
        "woken_files_intact": ran.get("stdout", "").startswith("files\n"),
        "woken_tmp_intact": ran.get("stdout", "").endswith("scratch\n"),
    }


def _hibernated(settings: Settings, isolation: str, count: int,
                rng: random.Random) -> dict[str, Any]:
    if count <= 0:
        return {"skipped": True}
    home = settings.home
    gc.collect()
    mem_before, objects_before = _meminfo(), _kernel_objects()
    disk_before = shutil.disk_usage(home).free
    made: list[Sandbox] = []
    hibernate_s: list[float] = []
    try:
        for n in range(count):
            sb = Sandbox.create(home=str(home), isolation=isolation, lifecycle=SLEEPY)
            made.append(sb)
            sb.commands.run("echo files > /workspace/kept && echo scratch > /tmp/kept")
            began = time.perf_counter()
            sb.hibernate()
            hibernate_s.append(time.perf_counter() - began)
            if (n + 1) % 100 == 0:
                log(f"hibernated {n + 1}/{count}")
        time.sleep(1.0)  # let the kernel's counters settle
        mem_after, objects_after = _meminfo(), _kernel_objects()
        disk_used = disk_before - shutil.disk_usage(home).free
        allocated = [_allocated(home / "sandboxes" / sb.id) for sb in made]
        store_bytes = sum(p.stat().st_size for p in home.glob("*.db*"))
        restart = _restart_and_wake(settings, [sb.id for sb in made], rng)
    finally:
        for sb in made:
            sb.kill()
    per_ram = (mem_before["MemAvailable"] - mem_after["MemAvailable"]) / count
    per_disk = sum(allocated) / count + store_bytes / count
    free_disk = shutil.disk_usage(home).free
    return {
        "sandboxes": count,
        "hibernate": summarize(hibernate_s),
        "per_sandbox": {
            "mem_available_drop_kib": round(per_ram / 1024, 1),
            "slab_growth_kib": round((mem_after["Slab"] - mem_before["Slab"]) / count / 1024, 1),
            **{name: round((objects_after[name] - objects_before[name]) / count, 3)
               for name in objects_before},
            "disk_allocated_kib": round(sum(allocated) / count / 1024, 1),
            "store_kib": round(store_bytes / count / 1024, 2),
            "host_disk_free_drop_kib": round(disk_used / count / 1024, 1),
        },
        "fit_on_this_host": {
            # RAM: what a hibernated sandbox still costs in memory, measured across all of
            # them (noise around zero is reported as it is, and not extrapolated).
            "by_memory": None if per_ram <= 4096 else int(_meminfo()["MemTotal"] / per_ram),
            "by_free_disk": int(free_disk / per_disk) if per_disk > 0 else None,
        },
        "restart": restart,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="rounds (each series once each)")
    parser.add_argument("--isolation", default="namespace",
                        choices=["namespace", "gvisor", "microvm"])
    parser.add_argument("--density", type=int, default=100, help="paused sandboxes (0: skip)")
    parser.add_argument("--hibernated", type=int, default=1000,
                        help="hibernated sandboxes, then a restart (0: skip)")
    parser.add_argument("--process-runs", type=int, default=10,
                        help="hibernate/wake rounds of a sandbox with processes (microvm)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the order shuffle")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = parser.parse_args()
    if os.geteuid() != 0:
        log("bench_hibernate: run as root (sandboxes need namespaces, cgroups and mounts)")
        return 2
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    home = Path(tempfile.mkdtemp(prefix="corral-bench-sleep-"))
    settings = Settings(home=home, uid_start=UID_START, uid_count=UID_COUNT)
    manager_mod.get_manager(settings)  # registered first: Sandbox.create(home=) finds it
    started = time.time()
    load_start = os.getloadavg()[0]
    try:
        samples = _series(home, args.isolation, args.runs, seed)
        density = _density(home, args.isolation, args.density)
        memory = _memory_100mb(home, args.isolation)
        with_processes = _with_processes(home, args.isolation, args.process_runs)
        hibernated = _hibernated(settings, args.isolation, args.hibernated,
                                 random.Random(seed))
    finally:
        left = teardown(settings)
    results = {name: summarize(values) for name, values in samples.items()}
    wake = results["wake_to_first_command"]["p50_ms"]
    deep_wake = results["hibernated_wake_to_first_command"]["p50_ms"]
    create_first = results["create_and_first_command"]["p50_ms"]
    report = {
        "benchmark": "sleep and wake: a frozen sandbox's wake, beside a command and a create",
        "isolation": args.isolation,
        "runs": args.runs,
        "seed": seed,
        "load_average_start": load_start,
        "duration_s": round(time.time() - started, 1),
        "results": results,
        "ratios": {
            "wake_p50_over_command_p50": round(wake / results["command"]["p50_ms"], 2),
            "wake_p50_over_create_and_first_command_p50": round(wake / create_first, 3),
            "hibernated_wake_p50_over_create_and_first_command_p50": round(
                deep_wake / create_first, 3),
        },
        "targets": {"frozen_wake_p50_at_most_10ms": wake <= 10.0,
                    "hibernated_wake_p50_at_most_30ms": deep_wake <= 30.0,
                    "hibernated_wake_within_2x_create_and_first_command":
                        deep_wake <= 2 * create_first},
        "density": density,
        "memory_100mb": memory,
        "with_processes": with_processes,
        "hibernated": hibernated,
        "cleanup": {"ok": not left, "leftovers": left},
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
