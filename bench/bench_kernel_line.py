"""A kernel that writes one very long line to its protocol stream: what it costs the service.

Run as root::

    .venv/bin/python bench/bench_kernel_line.py [--mib N] [--no-newline] [--out FILE]

Embedded (the service is this process), base template, the namespace tier. A cell writes
``N`` MiB (default 256) of ``x`` without a newline straight to the driver's protocol
descriptor (as user code in the kernel can), then, unless ``--no-newline``, one newline.
Measured around that cell, for this process only (the sandbox's own processes are not
counted): its CPU time (user + system), its RSS before and after, and its peak RSS during the
cell (``VmHWM``, reset through ``/proc/self/clear_refs`` first). Then the next cell must
work. Prints one JSON document (progress on stderr); everything it made is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import log, teardown  # noqa: E402

from corral import Sandbox  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

UID_START = 2_076_000_000

# The driver's protocol file is a global of its module, reachable from its stream class.
HOSTILE_CELL = """
import os, sys
fd = type(sys.stdout).write.__globals__["_PROTO"].fileno()
block = b"x" * (1 << 20)
for _ in range({mib}):
    view = memoryview(block)
    while view:
        view = view[os.write(fd, view):]
if {newline}:
    os.write(fd, b"\\n")
print("written")
"""


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(sb: Sandbox, mib: int, newline: bool, timeout: float) -> dict[str, Any]:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    rss_before = _status_kib("VmRSS")
    cpu, wall = _cpu_s(), time.monotonic()
    run = sb.run_code(HOSTILE_CELL.format(mib=mib, newline=newline), timeout=timeout)
    cpu, wall = _cpu_s() - cpu, time.monotonic() - wall
    after = sb.run_code("6 * 7")
    return {
        "mib_written": mib, "newline": newline,
        "service_cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
        "rss_before_mib": round(rss_before / 1024, 1),
        "rss_peak_mib": round(_status_kib("VmHWM") / 1024, 1),
        "rss_after_mib": round(_status_kib("VmRSS") / 1024, 1),
        "cell_error": None if run.error is None else f"{run.error.name}: {run.error.value}",
        "cell_stdout": "".join(run.logs.stdout),
        "next_cell": after.text if after.error is None else f"error {after.error.name}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB written without a newline")
    parser.add_argument("--no-newline", action="store_true",
                        help="end the long line with the driver's next message, not a newline")
    parser.add_argument("--timeout", type=float, default=60, help="the cell's timeout (s)")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    settings = Settings(home=Path(tempfile.mkdtemp(prefix="corral-bench-line-")),
                        uid_start=UID_START, uid_count=1000)
    manager_mod.get_manager(settings)
    report: dict[str, Any] = {}
    try:
        with Sandbox.create(home=str(settings.home)) as sb:
            assert sb.run_code("1 + 1").text == "2"  # the kernel is up before the clock starts
            log(f"writing {args.mib} MiB without a newline")
            report = measure(sb, args.mib, not args.no_newline, args.timeout)
    finally:
        report["leftovers"] = teardown(settings)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if not report["leftovers"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
