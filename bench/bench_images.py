"""Pulling an image: Corral's pull against the daemonless tools (skopeo + umoci), in the same run.

Run as root on a host with skopeo, umoci and docker-registry (Debian packages of those names)::

    .venv/bin/python bench/bench_images.py [--runs N] [--out FILE]

Set-up, not timed: a ~100 MB image built from host directories (one layer each for
``/usr/lib/python3.11``, ``/usr/share/perl`` and ``/usr/lib/x86_64-linux-gnu/perl``, a small
busybox layer with ``/bin/true`` and ``/bin/sh``, and a top layer of a few files), and a second
image of the same four base layers under a different top layer; both pushed to a real
``docker-registry`` on 127.0.0.1 (``tests/images/registry.py``).

Series (each round runs every series once, in a freshly shuffled order, as bench_sandbox.py
does, so slow drift of the machine spreads over all of them; one warm-up round comes first):

* ``corral_cold``: ``pull_image(image1)`` into a fresh data directory (resolve the tag, fetch
  every blob with skopeo, unpack every layer, stack the template's root);
* ``tools_cold``: ``skopeo copy docker://... oci:DIR:tag`` into a fresh directory, then
  ``umoci unpack --image DIR:tag BUNDLE`` as root (Corral also runs as root and writes
  root-owned files); both together and each alone;
* ``corral_shared_base``: ``pull_image(image2)`` into a data directory that pulled image 1 just
  before (not timed): only the top layer is fetched and unpacked;
* ``tools_shared_base``: the same for the tools: image 2 copied into the layout that holds image
  1, then unpacked (umoci keeps no unpacked layers, so it unpacks all five again);
* ``create_first_command_image`` and ``create_first_command_base``: ``Sandbox.create`` on the
  pulled image's template, or on ``base``, plus the first ``commands.run(["true"])``; the kill
  after it is not timed. ``--create-pairs`` pairs a round (default 10), image and base in a
  random order within each pair. ``base`` is the comparison: no Debian-package template is
  built in the bench's data directory (building one takes minutes).

Before each timed step the bench calls ``sync()``, so that writeback of what the previous step
wrote does not land in the next one. Prints one JSON document (progress goes to stderr).

The bench uses a temporary directory for everything (registry storage, data directories, the
tools' layouts and bundles) and its own uid range (``CORRAL_UID_START`` if set, else
2_085_000_000, apart from the tests' range and the other benches'). At the end it destroys its
sandboxes, sweeps, stops the registry, removes every directory, and checks that nothing is
left (cgroups, network namespaces, mounts, directories, the registry process, skopeo's temp
files); any leftover makes the exit status 1.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Runnable from a checkout without installing the package; the test tooling (registry, OCI
# layouts) comes from the repository's tests/.
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import (  # noqa: E402
    emit_report,
    log,
    machine_info,
    percentile,
    summarize,
    teardown,
)
from tests.images.oci import (  # noqa: E402
    Member,
    busybox_root,
    layer_from_dir,
    layer_from_members,
    push,
    skopeo,
    write_layout,
)
from tests.images.registry import LocalRegistry  # noqa: E402

from corral import Sandbox  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._images.pull import PullResult, pull_image  # noqa: E402
from corral._settings import Settings  # noqa: E402

DEFAULT_UID_START = 2_085_000_000
UID_COUNT = 100
WARMUP_ROUNDS = 1
# Host directories that make the image's ~100 MB (uncompressed), one layer each.
HOST_TREES = ("usr/lib/python3.11", "usr/share/perl", "usr/lib/x86_64-linux-gnu/perl")
REPO_1, REPO_2, TAG = "bench/image-one", "bench/image-two", "v1"
LAYERS = len(HOST_TREES) + 2  # the host trees, busybox, the top layer
IMAGE_CONFIG = {"Env": ["PATH=/usr/bin:/bin"], "Cmd": ["/bin/sh"]}
# Progress lines of pull_image that open each phase (the first line starting so).
PHASES = (("resolve", "resolving "), ("fetch", "fetching "), ("unpack", "layer "),
          ("stack", "stacking "), ("end", "template "))
TARGET_COLD_RATIO = 1.2
TARGET_SHARED_SPEEDUP = 10.0
TARGET_CREATE_RATIO = 1.10

SERIES = ("corral_cold", "tools_cold", "corral_shared_base", "tools_shared_base",
          "create_first_command_image", "create_first_command_base")
PARTS = ("corral_cold.resolve", "corral_cold.fetch", "corral_cold.unpack", "corral_cold.stack",
         "tools_cold.skopeo_copy", "tools_cold.umoci_unpack",
         "corral_shared_base.resolve", "corral_shared_base.fetch",
         "corral_shared_base.unpack", "corral_shared_base.stack",
         "tools_shared_base.skopeo_copy", "tools_shared_base.umoci_unpack")


def stats(seconds: list[float]) -> dict[str, float | int]:
    """bench_sandbox's summary plus p90 (few rounds here: p90 is the honest upper figure)."""
    if not seconds:
        return {"n": 0}
    out = summarize(seconds)
    out["p90_ms"] = round(percentile(sorted(s * 1000.0 for s in seconds), 0.90), 3)
    return out


def run_checked(argv: list[str]) -> None:
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} exited {proc.returncode}: {proc.stderr.decode().strip()}")


def tool_version(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True).stdout.strip()


def du_bytes(path: Path) -> int:
    """Allocated bytes under ``path``, each hard-linked inode once (as the disk sees it)."""
    out = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return int(out.split()[0])


def count_entries(root: Path) -> int:
    return sum(len(dirs) + len(files) for _, dirs, files in os.walk(root))


# -- the images ---------------------------------------------------------------------------------


def build_images(work: Path, registry: LocalRegistry) -> dict[str, Any]:
    """Build both images from host files, push them, and describe them (not timed)."""
    layers: list[bytes] = []
    described: list[dict[str, Any]] = []
    for index, tree in enumerate(HOST_TREES):
        stage = work / f"stage-{index}"
        (stage / tree).parent.mkdir(parents=True)
        run_checked(["cp", "-a", f"/{tree}", str(stage / tree)])
        size = sum(f.stat().st_size for f in stage.rglob("*") if f.is_file()
                   and not f.is_symlink())
        blob = layer_from_dir(stage)
        described.append({"content": f"/{tree}", "files_and_dirs": count_entries(stage),
                          "file_bytes": size, "compressed_bytes": len(blob)})
        layers.append(blob)
        shutil.rmtree(stage)
    stage = work / "stage-busybox"
    busybox = layer_from_dir(busybox_root(stage))
    described.append({"content": "busybox (/bin/busybox, an applet symlink each, /etc/passwd)",
                      "files_and_dirs": count_entries(stage),
                      "file_bytes": (stage / "bin/busybox").stat().st_size,
                      "compressed_bytes": len(busybox)})
    layers.append(busybox)
    shutil.rmtree(stage)
    tops = []
    for which in (1, 2):
        tops.append(layer_from_members([
            Member("srv", kind="dir", mode=0o755),
            *(Member(f"srv/image-{which}-{i}.txt", data=f"image {which} file {i}\n".encode())
              for i in range(5)),
        ]))
    one = write_layout(work / "layout-1", [*layers, tops[0]], config=IMAGE_CONFIG, tag=TAG)
    two = write_layout(work / "layout-2", [*layers, tops[1]], config=IMAGE_CONFIG, tag=TAG)
    digests = (push(one, registry.host, REPO_1, TAG), push(two, registry.host, REPO_2, TAG))
    shutil.rmtree(work / "layout-1")
    shutil.rmtree(work / "layout-2")
    total = sum(d["file_bytes"] for d in described)
    return {
        "base_layers": described,
        "top_layer_bytes": [len(t) for t in tops],
        "layers_per_image": LAYERS,
        "file_mib_total": round(total / 2**20, 1),
        "compressed_mib_total": round(sum(len(b) for b in [*layers, tops[0]]) / 2**20, 1),
        "image_1": f"{registry.host}/{REPO_1}:{TAG}@{digests[0]}",
        "image_2": f"{registry.host}/{REPO_2}:{TAG}@{digests[1]}",
    }


# -- the bench ----------------------------------------------------------------------------------


class PhaseClock:
    """Times pull_image's phases from its progress lines (best effort: a missing line leaves
    its phase out)."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}

    def __call__(self, line: str) -> None:
        now = time.perf_counter()
        for phase, prefix in PHASES:
            if line.startswith(prefix):
                self.marks.setdefault(phase, now)

    def parts(self) -> dict[str, float]:
        names = [p for p, _ in PHASES]
        out = {}
        for this, following in zip(names, names[1:], strict=False):
            if this in self.marks and following in self.marks:
                out[this] = self.marks[following] - self.marks[this]
        return out


class Bench:
    def __init__(self, work: Path, registry: LocalRegistry, settings: Settings,
                 image_template: str, create_pairs: int) -> None:
        self.work = work
        self.host = registry.host
        self.settings = settings
        self.home = str(settings.home)
        self.image_template = image_template
        self.create_pairs = create_pairs
        self.rng = random.Random()
        self.ref1 = f"{registry.host}/{REPO_1}:{TAG}"
        self.ref2 = f"{registry.host}/{REPO_2}:{TAG}"
        self.count = 0
        self.rounds = 0
        self.samples: dict[str, list[float]] = {name: [] for name in (*SERIES, *PARTS)}
        self.failures: dict[str, int] = {}
        self.disk: dict[str, int] = {}
        self.entries: dict[str, int] = {}

    def _fresh(self, kind: str) -> Path:
        self.count += 1
        return Path(tempfile.mkdtemp(prefix=f"{kind}-{self.count}-", dir=self.work))

    def _settings(self, home: Path) -> Settings:
        return Settings(home=home, registries=self.host, uid_start=self.settings.uid_start,
                        uid_count=self.settings.uid_count)

    def _record(self, series: str, seconds: float, parts: dict[str, float],
                record: bool) -> None:
        if not record:
            return
        self.samples[series].append(seconds)
        for part, value in parts.items():
            self.samples[f"{series}.{part}"].append(value)

    def _pull(self, ref: str, settings: Settings) -> tuple[PullResult, float, dict[str, float]]:
        clock = PhaseClock()
        os.sync()
        start = time.perf_counter()
        result = pull_image(ref, settings, on_progress=clock)
        return result, time.perf_counter() - start, clock.parts()

    def _skopeo_copy(self, ref: str, layout: Path) -> None:
        # Isolated from the host's configuration (no credentials, mirrors or policy), as
        # Corral's own skopeo is.
        skopeo("copy", "--src-tls-verify=false", "--src-no-creds", f"docker://{ref}",
               f"oci:{layout}:{TAG}")

    def _tools(self, ref: str, layout: Path, bundle: Path) -> tuple[float, dict[str, float]]:
        os.sync()
        t0 = time.perf_counter()
        self._skopeo_copy(ref, layout)
        t1 = time.perf_counter()
        run_checked(["umoci", "unpack", "--image", f"{layout}:{TAG}", str(bundle)])
        t2 = time.perf_counter()
        return t2 - t0, {"skopeo_copy": t1 - t0, "umoci_unpack": t2 - t1}

    def _check_pull(self, series: str, result: PullResult, unpacked: int) -> bool:
        if result.cached or result.layers_unpacked != unpacked:
            self.failures[series] = self.failures.get(series, 0) + 1
            log(f"  {series}: cached={result.cached}, {result.layers_unpacked} layers unpacked "
                f"(expected {unpacked})")
            return False
        return True

    # Each step records its own samples when ``record``.

    def corral_cold(self, record: bool) -> None:
        home = self._fresh("cold")
        try:
            result, seconds, parts = self._pull(self.ref1, self._settings(home))
            if self._check_pull("corral_cold", result, unpacked=LAYERS):
                self._record("corral_cold", seconds, parts, record)
            if not record:
                self.disk["corral_cold_data_dir"] = du_bytes(home)
                self.entries["corral_template_root"] = count_entries(result.template.root)
        finally:
            shutil.rmtree(home, ignore_errors=True)

    def tools_cold(self, record: bool) -> None:
        work = self._fresh("tools")
        try:
            seconds, parts = self._tools(self.ref1, work / "oci", work / "bundle")
            self._record("tools_cold", seconds, parts, record)
            if not record:
                self.disk["tools_cold_layout_and_bundle"] = du_bytes(work)
                self.entries["umoci_bundle_rootfs"] = count_entries(work / "bundle" / "rootfs")
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def corral_shared_base(self, record: bool) -> None:
        home = self._fresh("shared")
        try:
            settings = self._settings(home)
            pull_image(self.ref1, settings)
            result, seconds, parts = self._pull(self.ref2, settings)
            if self._check_pull("corral_shared_base", result, unpacked=1):
                self._record("corral_shared_base", seconds, parts, record)
        finally:
            shutil.rmtree(home, ignore_errors=True)

    def tools_shared_base(self, record: bool) -> None:
        work = self._fresh("tools-shared")
        try:
            self._skopeo_copy(self.ref1, work / "oci")
            seconds, parts = self._tools(self.ref2, work / "oci", work / "bundle")
            self._record("tools_shared_base", seconds, parts, record)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _create_first(self, series: str, template: str, record: bool) -> None:
        os.sync()
        start = time.perf_counter()
        sb = Sandbox.create(template=template, home=self.home)
        try:
            result = sb.commands.run(["true"])
            seconds = time.perf_counter() - start
        finally:
            sb.kill()
        if result.exit_code != 0:
            self.failures[series] = self.failures.get(series, 0) + 1
            log(f"  {series}: `true` exited {result.exit_code} {result.stderr.strip()[:160]!r}")
        else:
            self._record(series, seconds, {}, record)

    def create_first_command(self, record: bool) -> None:
        """``create_pairs`` pairs, image and base in a random order within each pair: a create
        is cheap beside a pull, and the ratio of two ~50 ms medians needs more than one sample
        a round to mean anything."""
        for _ in range(self.create_pairs):
            pair = [("create_first_command_image", self.image_template),
                    ("create_first_command_base", "base")]
            self.rng.shuffle(pair)
            for series, template in pair:
                self._create_first(series, template, record)

    def run(self, runs: int, seed: int) -> None:
        steps = [self.corral_cold, self.tools_cold, self.corral_shared_base,
                 self.tools_shared_base, self.create_first_command]
        rng = self.rng = random.Random(seed)
        log(f"warming up ({WARMUP_ROUNDS} round of every series)")
        for _ in range(WARMUP_ROUNDS):
            for step in steps:
                step(False)
        while min(len(self.samples[s]) for s in SERIES[:4]) < runs \
                or min(len(self.samples[s]) for s in SERIES[4:]) < runs * self.create_pairs:
            if sum(self.failures.values()) > 2 * runs * self.create_pairs + 5:
                raise RuntimeError("too many failed runs; giving up")
            order = steps[:]
            rng.shuffle(order)
            for step in order:
                step(True)
            self.rounds += 1
            p50 = {s: percentile(sorted(self.samples[s] or [0.0]), 0.5) * 1000
                   for s in ("corral_cold", "tools_cold", "corral_shared_base")}
            log(f"  round {self.rounds}: p50 so far " +
                ", ".join(f"{k} {v:.0f} ms" for k, v in p50.items()))


# -- set-up and clean-up ------------------------------------------------------------------------


def var_tmp() -> set[str]:
    """skopeo buffers some blobs in $TMPDIR (default /var/tmp): what it leaves shows there."""
    try:
        return set(os.listdir("/var/tmp"))
    except FileNotFoundError:
        return set()


def bench_leftovers(work: Path, registry: LocalRegistry, registry_pid: int | None,
                    var_tmp_before: set[str]) -> list[str]:
    found = []
    if work.exists():
        found.append(str(work))
    if registry.root.exists():
        found.append(str(registry.root))
    if registry_pid is not None and Path(f"/proc/{registry_pid}").exists():
        found.append(f"docker-registry process {registry_pid}")
    with open("/proc/mounts") as f:
        found += [line.strip() for line in f if str(work) in line]
    found += [f"/var/tmp/{name}" for name in sorted(var_tmp() - var_tmp_before)
              if name.startswith(("docker-tarfile-blob", "oci-", "container_images_",
                                  "storage", "skopeo", "umoci"))]
    return found


def target(met: bool, **numbers: Any) -> dict[str, Any]:
    return {"met": met, **numbers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="measured rounds")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    parser.add_argument("--create-pairs", type=int, default=10,
                        help="create + first command pairs (image, base) per round")
    parser.add_argument("--seed", type=int, default=None, help="seed of the order shuffle")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.create_pairs < 1:
        parser.error("--runs and --create-pairs must be at least 1")
    if os.geteuid() != 0:
        log("bench_images: run as root (sandboxes need namespaces, cgroups and mounts)")
        return 2
    missing = [t for t in ("skopeo", "umoci", "docker-registry", "bwrap", "busybox")
               if shutil.which(t) is None]
    missing += [f"/{t}" for t in HOST_TREES if not Path("/", t).is_dir()]
    if missing:
        log("bench_images: missing " + ", ".join(missing))
        return 2
    bwrap = shutil.which("bwrap")
    assert bwrap is not None
    seed = args.seed if args.seed is not None else random.randrange(2**32)

    work = Path(tempfile.mkdtemp(prefix="corral-bench-images-"))
    os.chmod(work, 0o711)  # sandbox uids reach the data directory inside
    uid_start = int(os.environ.get("CORRAL_UID_START", DEFAULT_UID_START))
    started = time.time()
    load_start = os.getloadavg()[0]
    before = var_tmp()
    left: list[str] = []
    registry = LocalRegistry()
    settings: Settings | None = None
    bench: Bench | None = None
    cgroups = ""
    image: dict[str, Any] = {}
    registry_pid: int | None = None
    try:
        with registry:
            registry_pid = registry._proc.pid if registry._proc is not None else None
            log(f"bench: building the images in {work} (not timed)")
            image = build_images(work, registry)
            settings = Settings(home=work / "home", registries=registry.host,
                                uid_start=uid_start, uid_count=UID_COUNT)
            # Registered first, so Sandbox.create(home=...) finds this manager and its uids.
            mgr = manager_mod.get_manager(settings)
            pulled = pull_image(f"{registry.host}/{REPO_1}:{TAG}", settings)
            bench = Bench(work, registry, settings, pulled.template.name, args.create_pairs)
            gc.collect()
            log(f"bench: {args.runs} rounds, image template {pulled.template.name}, uids from "
                f"{uid_start}, seed {seed}")
            bench.run(args.runs, seed)
            cgroups = mgr.backend.cgroups.describe()  # type: ignore[attr-defined]
    finally:
        if settings is not None:
            left += teardown(settings)
        shutil.rmtree(work, ignore_errors=True)
        left += bench_leftovers(work, registry, registry_pid, before)
    if left:
        log("bench: leftovers after clean-up:\n  " + "\n  ".join(left))
    assert bench is not None

    s = {name: stats(values) for name, values in bench.samples.items()}
    p50 = {name: s[name]["p50_ms"] for name in SERIES}
    cold_ratio = p50["corral_cold"] / p50["tools_cold"]
    speedup_corral = p50["corral_cold"] / p50["corral_shared_base"]
    speedup_tools = p50["tools_cold"] / p50["corral_shared_base"]
    create_ratio = p50["create_first_command_image"] / p50["create_first_command_base"]
    machine = machine_info(bwrap, cgroups, load_start)
    machine["skopeo"] = tool_version(["skopeo", "--version"])
    machine["umoci"] = tool_version(["umoci", "--version"])
    report: dict[str, Any] = {
        "benchmark": "image pull: Corral against skopeo + umoci",
        "runs": args.runs,
        "create_pairs_per_round": args.create_pairs,
        "rounds": bench.rounds,
        "warmup_rounds": WARMUP_ROUNDS,
        "order": "interleaved: each round runs every series once in a shuffled order; sync() "
                 "before each timed step",
        "seed": seed,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "machine": machine,
        "image": image,
        "umoci_mode": "root (no --rootless): Corral runs as root and writes root-owned files",
        "results": {name: s[name] for name in SERIES},
        "parts": {series: {part.split(".", 1)[1]: s[part] for part in PARTS
                           if part.startswith(series + ".") and s[part]["n"]}
                  for series in ("corral_cold", "tools_cold", "corral_shared_base",
                                 "tools_shared_base")},
        "ratios": {
            "corral_cold_p50_over_tools_cold_p50": round(cold_ratio, 3),
            "tools_cold_p50_over_corral_shared_base_p50": round(speedup_tools, 2),
            "corral_cold_p50_over_corral_shared_base_p50": round(speedup_corral, 2),
            "tools_shared_base_p50_over_corral_shared_base_p50":
                round(p50["tools_shared_base"] / p50["corral_shared_base"], 2),
            "create_first_command_image_p50_over_base_p50": round(create_ratio, 3),
        },
        "targets": {
            f"corral_cold_within_{TARGET_COLD_RATIO}x_tools_cold": target(
                cold_ratio <= TARGET_COLD_RATIO, ratio=round(cold_ratio, 3),
                limit=f"<= {TARGET_COLD_RATIO}", corral_cold_p50_ms=p50["corral_cold"],
                tools_cold_p50_ms=p50["tools_cold"]),
            f"corral_shared_base_{TARGET_SHARED_SPEEDUP:g}x_faster_than_corral_cold": target(
                speedup_corral >= TARGET_SHARED_SPEEDUP, speedup=round(speedup_corral, 2),
                limit=f">= {TARGET_SHARED_SPEEDUP:g}",
                corral_shared_base_p50_ms=p50["corral_shared_base"],
                corral_cold_p50_ms=p50["corral_cold"]),
            f"corral_shared_base_{TARGET_SHARED_SPEEDUP:g}x_faster_than_tools_cold": target(
                speedup_tools >= TARGET_SHARED_SPEEDUP, speedup=round(speedup_tools, 2),
                limit=f">= {TARGET_SHARED_SPEEDUP:g}",
                corral_shared_base_p50_ms=p50["corral_shared_base"],
                tools_cold_p50_ms=p50["tools_cold"]),
            "create_first_command_image_within_10pct_of_base": target(
                create_ratio <= TARGET_CREATE_RATIO, ratio=round(create_ratio, 3),
                limit=f"<= {TARGET_CREATE_RATIO}",
                image_p50_ms=p50["create_first_command_image"],
                base_p50_ms=p50["create_first_command_base"],
                note="compared with `base`: no Debian-package template is built in the "
                     "bench's data directory"),
        },
        "disk_bytes_after_cold": bench.disk,
        "entries_unpacked": bench.entries,
        "failures": bench.failures,
        "cleanup": {"ok": not left, "leftovers": left},
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
