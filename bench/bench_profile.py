"""Where a command's time goes: a per-stage profile of ``sandbox.commands.run(["true"])``.

Run as root::

    .venv/bin/python bench/bench_profile.py [--runs N] [--isolation namespace|gvisor] [--first]
                                            [--out F]

Prints one JSON document (progress on stderr). The bench wraps the functions a command passes
through (validation, the audit trail and its ``fdatasync``, the store, the backend, the cgroup
driver, the launch, the supervise loop...) with a timer, runs ``true`` ``--runs`` times in one
sandbox, and reports for each stage how often it ran per command and its mean and p50 time per
command. Stages nest (``backend.exec`` holds ``cgroup.*`` and ``launch.*``), so they do not
add up; ``unaccounted`` is the API call's time outside ``commands.prepare``, the audit records
and ``backend.exec``. Bare ``bwrap --unshare-all true`` (root) runs interleaved, as the
reference. A stage whose function does not exist in this version is skipped (listed under
``absent``), so the same bench profiles the code before and after a change. ``--first``
profiles a sandbox's first command instead: each run creates a sandbox (untimed), profiles its
first ``true`` and destroys it (untimed), so the stages show what a first command pays that
later ones do not (its own bwrap, its sandbox's first cgroup attach).

Wrapping adds ~1-2 us per wrapped call; the stage times are what the wrapped calls took.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from bench_sandbox import (  # noqa: E402
    BWRAP_ROOT,
    DEFAULT_UID_START,
    UID_COUNT,
    emit_report,
    percentile,
    run_checked,
    teardown,
)

from corral import Sandbox  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

# (label, module, attribute path): every function a command may pass through, old and new.
STAGES: list[tuple[str, str, str]] = [
    ("commands.prepare", "corral._control.commands", "Commands.prepare"),
    ("store.touch", "corral._control.store", "Store.touch"),
    ("audit.started", "corral._audit.recorder", "CommandRecorder.started"),
    ("audit.finished", "corral._audit.recorder", "CommandRecorder.finished"),
    ("audit.fdatasync", "os", "fdatasync"),
    ("audit.group_commit_wait", "corral._audit.log", "GroupCommit.wait"),
    ("backend.exec", "corral._backends.namespace.backend", "NamespaceBackend.exec"),
    ("backend.exec", "corral._backends.gvisor.backend", "GvisorBackend.exec"),
    ("backend.ensure_runtime", "corral._backends._linux.host",
     "HostBackedBackend._ensure_runtime"),
    ("cgroup.create_command", "corral._backends._linux.cgroups", "CgroupV1.create_command"),
    ("cgroup.create_command", "corral._backends._linux.cgroups", "CgroupV2.create_command"),
    ("cgroup.attach", "corral._backends._linux.cgroups", "CgroupV1.attach"),
    ("cgroup.attach", "corral._backends._linux.cgroups", "CgroupV2.attach"),
    ("cgroup.kill", "corral._backends._linux.cgroups", "CgroupV1.kill"),
    ("cgroup.kill", "corral._backends._linux.cgroups", "CgroupV2.kill"),
    ("cgroup.usage", "corral._backends._linux.cgroups", "CgroupV1.usage"),
    ("cgroup.usage", "corral._backends._linux.cgroups", "CgroupV2.usage"),
    ("cgroup.remove", "corral._backends._linux.cgroups", "CgroupV1.remove"),
    ("cgroup.remove", "corral._backends._linux.cgroups", "CgroupV2.remove"),
    ("cgroup.rename", "corral._backends._linux.cgroups", "CgroupV1.rename_command"),
    ("cgroup.rename", "corral._backends._linux.cgroups", "CgroupV2.rename_command"),
    ("launch.bwrap_start", "corral._backends.namespace.runner", "CommandLauncher._start"),
    ("launch.spawner_fork_exec", "corral._backends._linux.netns", "Spawner.run"),
    ("launch.bwrap_setup", "corral._backends.namespace.runner",
     "CommandLauncher._read_init_pid"),
    ("launch.supervise", "corral._backends.namespace.runner", "supervise"),
    ("launch.pump", "corral._backends._linux.supervise", "pump"),
    ("backend.resident_check", "corral._backends._linux.host",
     "HostBackedBackend._close_resident_if_unmounted"),
    ("backend.template", "corral._backends._linux.host", "HostBackedBackend._template"),
    ("backend.planned_mounts", "corral._backends._linux.host",
     "HostBackedBackend._planned_mounts"),
    ("backend.resident_holder", "corral._backends.namespace.backend",
     "NamespaceBackend._zygote_for"),
    ("backend.retire", "corral._backends.namespace.resident", "GroupRetirer.retire"),
    ("store.get", "corral._control.store", "Store.get"),
    ("audit.metrics", "corral._audit.metrics", "Metrics.command_finished"),
    ("resident.start", "corral._backends.namespace.resident", "Zygote.__init__"),
    ("resident.warm_next (beside)", "corral._backends.namespace.resident", "Zygote._warm"),
    ("resident.take_warm_init", "corral._backends.namespace.resident", "Zygote.take"),
    ("resident.request", "corral._backends.namespace.resident", "Zygote.start_command"),
    ("resident.wait_exit", "corral._backends.namespace.resident", "ZygoteProcess.wait"),
]
# Inclusive stages that the API call is made of, for ``unaccounted``.
TOP_LEVEL = ("commands.prepare", "audit.started", "audit.finished", "backend.exec")


class Probes:
    """Timers around functions, by label: the time of every call, summed per command."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = defaultdict(list)
        self.current: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.per_command: dict[str, list[float]] = defaultdict(list)
        self.count_per_command: dict[str, list[int]] = defaultdict(list)
        self.absent: list[str] = []
        self._undo: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._depth = threading.local()

    def install(self) -> None:
        for label, module_name, attr in STAGES:
            try:
                owner: Any = importlib.import_module(module_name)
            except ImportError:
                self.absent.append(f"{label} ({module_name})")
                continue
            *path, name = attr.split(".")
            try:
                for part in path:
                    owner = getattr(owner, part)
                original = getattr(owner, name)
            except AttributeError:
                self.absent.append(f"{label} ({module_name}.{attr})")
                continue
            setattr(owner, name, self._wrap(label, original))
            self._undo.append(functools.partial(setattr, owner, name, original))

    def _wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        probes = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                with probes._lock:
                    probes.current[label] += spent
                    probes.counts[label] += 1
        return timed

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()

    def reset(self) -> None:
        with self._lock:
            self.current.clear()
            self.counts.clear()

    def commit(self, total_s: float) -> None:
        """The command that just finished: its stages' sums become one sample each."""
        with self._lock:
            labels = {label for label, _, _ in STAGES if f"{label} (" not in " ".join(
                self.absent) or label in self.current}
            for label in labels:
                self.per_command[label].append(self.current.get(label, 0.0))
                self.count_per_command[label].append(self.counts.get(label, 0))
            top = sum(self.current.get(label, 0.0) for label in TOP_LEVEL)
            self.per_command["unaccounted"].append(max(0.0, total_s - top))
            self.per_command["api.run"].append(total_s)
            self.current.clear()
            self.counts.clear()


def _summary(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    return {"p50_ms": round(percentile(ms, 0.5), 3), "p90_ms": round(percentile(ms, 0.9), 3),
            "p99_ms": round(percentile(ms, 0.99), 3), "mean_ms": round(statistics.fmean(ms), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--isolation", default="namespace", choices=("namespace", "gvisor"))
    parser.add_argument("--first", action="store_true",
                        help="profile each of --runs fresh sandboxes' first command")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_profile: run as root", file=sys.stderr)
        return 2
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        print("bench_profile: bwrap is not installed", file=sys.stderr)
        return 2
    home = Path(tempfile.mkdtemp(prefix="corral-bench-"))
    settings = Settings(home=home, uid_start=int(os.environ.get(
        "CORRAL_UID_START", DEFAULT_UID_START)), uid_count=UID_COUNT)
    manager_mod.get_manager(settings)
    probes = Probes()
    bwrap_samples: list[float] = []
    try:
        sandbox = Sandbox.create(home=str(home), isolation=args.isolation)
        for _ in range(5):
            sandbox.commands.run(["true"])
        if args.first:
            sandbox.kill()
        probes.install()
        for i in range(args.runs):
            if args.first:
                sandbox = Sandbox.create(home=str(home), isolation=args.isolation)
            probes.reset()
            start = time.perf_counter()
            result = sandbox.commands.run(["true"])
            total = time.perf_counter() - start
            if result.exit_code != 0:
                raise RuntimeError(f"`true` exited {result.exit_code}: {result.stderr}")
            probes.commit(total)
            if args.first:
                sandbox.kill()
            start = time.perf_counter()
            run_checked([bwrap, *BWRAP_ROOT])
            bwrap_samples.append(time.perf_counter() - start)
            if (i + 1) % max(1, args.runs // 5) == 0:
                print(f"  {i + 1}/{args.runs}", file=sys.stderr)
        probes.uninstall()
        if not args.first:
            sandbox.kill()
    finally:
        probes.uninstall()
        left = teardown(settings)
    stages = {
        label: {**_summary(values),
                "calls_per_command": round(statistics.fmean(
                    probes.count_per_command.get(label, [1])), 2)}
        for label, values in sorted(probes.per_command.items())
        if any(values) or label in ("unaccounted", "api.run")
    }
    for label in ("unaccounted", "api.run"):
        stages[label].pop("calls_per_command", None)
    report = {
        "benchmark": ("per-command profile (`true` as a fresh sandbox's first command)"
                      if args.first else "per-command profile (`true` in an existing sandbox)"),
        "isolation": args.isolation,
        "runs": args.runs,
        "reference_bwrap_true": _summary(bwrap_samples),
        "stages": stages,
        "ratio_api_run_p50_over_bwrap_p50": round(
            percentile(sorted(probes.per_command["api.run"]), 0.5)
            / percentile(sorted(bwrap_samples), 0.5), 3),
        "absent": probes.absent,
        "cleanup": {"ok": not left, "leftovers": left},
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
