"""The microVM tier beside bare QEMU, in the same run: cold boot, warm create, a command, a
memory fork to 8 copies, idle memory per VM.

Run as root where `corral doctor` says the microVM tier can run (here: under the TCG test
setting, which this script sets for itself)::

    .venv/bin/python bench/bench_microvm.py [--runs N] [--out FILE]

Series (p50 of ``--runs`` each; the machine and its load are in the report):

* ``qemu_cold_boot`` (reference): ``vm.Vm.boot`` of the tier's kernel and root image to the
  agent's first line, driven by hand: no keeper, no control plane, no disk chain;
* ``qemu_warm_restore`` (reference): ``vm.Vm.restore_warm`` of the same warm snapshot the tier
  uses, to the agent answering one request;
* ``cold_create_first_command``: ``Sandbox.create`` with warm start off
  (``CORRAL_MICROVM_WARM=0``) and its first ``true``;
* ``warm_create_first_command``: the same with the warm snapshot (the default);
* ``command``: ``commands.run(["true"])`` in a sandbox that exists, beside ``namespace_command``,
  the namespace tier's;
* ``fork8``: ``snapshot(memory=True)`` + ``fork(8, memory=True)`` of a running sandbox until all
  eight copies have answered ``true``;
* ``idle``: resident and proportional memory (RSS, PSS) of QEMU for 4 idle sandboxes restored
  from one warm snapshot, and of their keepers.

Targets (issue 14, under TCG): warm create → first command ≤ 150 ms, command ≤ 30 ms,
fork ×8 ≤ 1.5 s, idle ≤ 50 MiB per VM. Prints one JSON document; progress goes to stderr; exits
1 when anything it made is left behind.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("CORRAL_MICROVM_ALLOW_TCG", "1")

from bench_sandbox import emit_report, log, summarize, teardown  # noqa: E402

from corral import Sandbox  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

UID_START = 2_070_000_000
UID_COUNT = 1000


def _status_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _pids(pattern: str, marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    pids = []
    for pid in out.split():
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                pids.append(int(pid))
        except OSError:
            continue
    return pids


class Reference:
    """Bare QEMU with the tier's own kernel, root image and warm snapshot."""

    def __init__(self, backend: Any, work: Path) -> None:
        from corral._backends.microvm import disk, warm
        from corral._backends.microvm.vm import VmConfig

        self.work = work
        spec_tier = 512
        image = backend._root("base")
        self.snapshot = warm.warm_snapshot(
            backend._kernel, image, spec_tier, backend._settings.microvm_cache / "warm",
            accel=backend._accel, uid=65534, gid=65534,
            disks=backend._settings.microvm_cache / "disks", disk_bytes=1 << 30)
        base = disk.base_disk(1 << 30, backend._settings.microvm_cache / "disks")
        self.top = disk.create_top(work / "top.qcow2", base, uid=65534, gid=65534)
        self.config = VmConfig(kernel=backend._kernel.vmlinux, root_image=image.path,
                               run_dir=work / "vm", accel=backend._accel, memory_mib=spec_tier,
                               top_disk=self.top, backing=(base,), uid=65534, gid=65534)

    def cold_boot(self) -> float:
        from corral._backends.microvm.vm import Vm

        started = time.perf_counter()
        deadline = time.monotonic() + 120
        with Vm.boot(self.config, deadline) as vm:
            sock = vm.connect(deadline)
            vm.read_line(sock, bytearray(), deadline, "ready")
            took = time.perf_counter() - started
            sock.close()
        return took

    def warm_restore(self) -> float:
        from corral._backends.microvm.vm import Vm

        started = time.perf_counter()
        deadline = time.monotonic() + 60
        with Vm.restore_warm(self.config, self.snapshot, deadline) as vm:
            sock = vm.connect(deadline)
            sock.sendall(b'{"id":1,"op":"procs"}\n')
            vm.read_line(sock, bytearray(), deadline, "an answer")
            took = time.perf_counter() - started
            sock.close()
        return took


def _create_first(home: str) -> tuple[float, Sandbox]:
    started = time.perf_counter()
    sb = Sandbox.create(home=home, isolation="microvm")
    result = sb.commands.run(["true"])
    took = time.perf_counter() - started
    if result.exit_code != 0:
        raise RuntimeError(f"true exited {result.exit_code}: {result.stderr}")
    return took, sb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="measured runs per series")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        log("bench_microvm: run as root")
        return 2
    homes = [Path(tempfile.mkdtemp(prefix="corral-bench-vm-")) for _ in range(2)]
    warm_settings = Settings(home=homes[0], uid_start=UID_START, uid_count=UID_COUNT)
    cold_settings = Settings(home=homes[1], uid_start=UID_START + UID_COUNT,
                             uid_count=UID_COUNT, microvm_warm=False)
    mgr = manager_mod.get_manager(warm_settings)
    manager_mod.get_manager(cold_settings)
    work = Path(tempfile.mkdtemp(prefix="corral-bench-vm-ref-", dir="/run"))
    samples: dict[str, list[float]] = {k: [] for k in (
        "qemu_cold_boot", "qemu_warm_restore", "cold_create_first_command",
        "warm_create_first_command", "command", "namespace_command", "fork8")}
    idle: dict[str, Any] = {}
    started = time.time()
    load_start = os.getloadavg()[0]
    try:
        backend = mgr.backend_for("microvm")  # type: ignore[attr-defined]
        backend._ready()
        log("bench: warming up (root image, warm snapshot)")
        _, sb = _create_first(str(homes[0]))
        sb.kill()
        reference = Reference(backend, work)
        for i in range(args.runs):
            log(f"round {i + 1}/{args.runs}")
            samples["qemu_cold_boot"].append(reference.cold_boot())
            samples["qemu_warm_restore"].append(reference.warm_restore())
            took, sb = _create_first(str(homes[1]))
            samples["cold_create_first_command"].append(took)
            sb.kill()
            took, sb = _create_first(str(homes[0]))
            samples["warm_create_first_command"].append(took)
            sb.kill()
        vm_sb = Sandbox.create(home=str(homes[0]), isolation="microvm")
        ns_sb = Sandbox.create(home=str(homes[0]), isolation="namespace")
        for target, series in ((vm_sb, "command"), (ns_sb, "namespace_command")):
            target.commands.run(["true"])
            for _ in range(max(args.runs * 5, 20)):
                t0 = time.perf_counter()
                target.commands.run(["true"])
                samples[series].append(time.perf_counter() - t0)
        ns_sb.kill()
        token = secrets.token_hex(4)
        for _ in range(max(1, args.runs // 5)):
            proc = vm_sb.processes.start(["sh", "-c", f"exec -a held-{token} sleep 600"])
            t0 = time.perf_counter()
            vm_sb.snapshot(memory=True)
            children = vm_sb.fork(8, memory=True)
            for child in children:
                child.commands.run(["true"])
            samples["fork8"].append(time.perf_counter() - t0)
            for child in children:
                child.kill()
            proc.kill()
        vm_sb.kill()
        idle_sbs = [Sandbox.create(home=str(homes[0]), isolation="microvm") for _ in range(4)]
        for s in idle_sbs:
            s.commands.run(["true"])
        time.sleep(2)
        qemus = [p for s in idle_sbs for p in _pids("qemu-system", s.id)]
        keepers = [p for s in idle_sbs for p in _pids("microvm.keeper", s.id)]
        idle = {
            "vms": len(idle_sbs),
            "qemu_rss_mib": [round(_status_kib(p, "VmRSS") / 1024, 1) for p in qemus],
            "qemu_pss_mib": [round(_pss_kib(p) / 1024, 1) for p in qemus],
            "keeper_rss_mib": [round(_status_kib(p, "VmRSS") / 1024, 1) for p in keepers],
        }
        for s in idle_sbs:
            s.kill()
    finally:
        left = teardown(warm_settings) + teardown(cold_settings)
        shutil.rmtree(work, ignore_errors=True)
    s = {name: summarize(v) for name, v in samples.items() if v}
    pss = idle.get("qemu_pss_mib") or [0.0]
    report = {
        "benchmark": "microVM tier (QEMU -M microvm under TCG here)",
        "runs": args.runs,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "machine": {"cpus": os.cpu_count(), "load_start": load_start,
                    "load_end": os.getloadavg()[0], "kernel": os.uname().release,
                    "accel": "tcg (test mode)" if os.environ.get("CORRAL_MICROVM_ALLOW_TCG")
                    else "kvm"},
        "results": s,
        "idle": idle,
        "targets": {
            "warm_create_first_command_le_150ms":
                s.get("warm_create_first_command", {}).get("p50_ms", 1e9) <= 150,
            "command_le_30ms": s.get("command", {}).get("p50_ms", 1e9) <= 30,
            "fork8_le_1500ms": s.get("fork8", {}).get("p50_ms", 1e9) <= 1500,
            "idle_pss_le_50mib": max(pss) <= 50,
        },
        "cleanup": {"ok": not left, "leftovers": left},
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
