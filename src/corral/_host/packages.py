"""The Debian packages a Corral host needs, and installing the missing ones (``corral setup``).

One table for every way in: ``scripts/bootstrap`` (a clone) runs ``corral setup``, and so does
an operator after ``pip install 'corral[host]'``. Each group says why it is there; a group that
cannot be installed on this system (no apt, no bookworm-backports) is reported with the tiers
it leaves off, never silently skipped: ``corral doctor`` then says what is missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._core.privileged import privileged_env
from ..errors import ConfigError

__all__ = ["PackageGroup", "SetupStep", "groups_for", "install"]


@dataclass(frozen=True)
class PackageGroup:
    """Packages installed together, and why."""

    name: str
    why: str
    packages: tuple[str, ...]
    # "bookworm-backports": installed from there (newer than bookworm's own) when missing;
    # ``_missing`` also counts a QEMU older than ``_MIN_QEMU_MAJOR`` as missing.
    suite: str | None = None
    tests_only: bool = False


HOST = PackageGroup(
    "host",
    "the namespace tier (bubblewrap), the syscall filter (libseccomp2), workspace filesystems "
    "(e2fsprogs, mount, util-linux), processes (procps), the base template's python3, and "
    "template builds and image pulls (mmdebstrap, skopeo)",
    ("bubblewrap", "libseccomp2", "e2fsprogs", "mount", "util-linux", "procps", "python3",
     "mmdebstrap", "skopeo"))
MICROVM_BUILD = PackageGroup(
    "microvm-build",
    "the microVM tier's guest kernel (built from Debian's kernel source) and its root images "
    "(gcc -static)",
    ("linux-source-6.1", "flex", "bison", "bc", "libelf-dev", "make", "gcc", "libc6-dev",
     "xz-utils"))
TIERS = PackageGroup(
    "tiers",
    "the gVisor tier (runsc, with checkpoint/restore) and the microVM tier (QEMU >= 10: "
    "read-only template memory files; bookworm's 7.2 lacks them)",
    ("runsc", "qemu-system-x86", "qemu-utils"), suite="bookworm-backports")
TESTS = PackageGroup(
    "tests",
    "the test suite: a loopback registry and image tools, node for the E2B JS SDKs, attack and "
    "HTTP tools used inside sandboxes, the interpreter kernels on the host, and Chromium for "
    "the browser tests",
    ("docker-registry", "busybox-static", "umoci", "nodejs", "strace", "iproute2", "curl",
     "python3-pip", "python3-requests", "python3-ipython", "python3-numpy", "python3-pandas",
     "python3-matplotlib", "node-typescript", "r-base-core", "chromium"),
    tests_only=True)

_ALL = (HOST, MICROVM_BUILD, TIERS, TESTS)
_MIN_QEMU_MAJOR = 10
_PROXY_VARIABLES = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                    "NO_PROXY")


def groups_for(*, tests: bool) -> list[PackageGroup]:
    return [group for group in _ALL if tests or not group.tests_only]


@dataclass
class SetupStep:
    """What setup found and did for one group, for the report and ``--json``."""

    group: str
    why: str
    missing: list[str] = field(default_factory=list)
    installed: list[str] = field(default_factory=list)
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None


def _installed(package: str) -> bool:
    try:
        status = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package],
                                capture_output=True, text=True, check=False,
                                env=privileged_env()).stdout
    except FileNotFoundError:
        return False
    return "install ok installed" in status


def _qemu_major() -> int:
    try:
        version = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True,
                                 text=True, check=False, env=privileged_env()).stdout
    except FileNotFoundError:
        return 0
    found = re.search(r"QEMU emulator version (\d+)", version)
    return int(found.group(1)) if found else 0


def _missing(group: PackageGroup) -> list[str]:
    if group is TIERS:
        missing = [] if shutil.which("runsc") else ["runsc"]
        if _qemu_major() < _MIN_QEMU_MAJOR:
            missing += ["qemu-system-x86", "qemu-utils"]
        return missing
    return [package for package in group.packages if not _installed(package)]


def _codename() -> str:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return ""
    found = re.search(r"^VERSION_CODENAME=(\S+)", text, re.MULTILINE)
    return found.group(1) if found else ""


_BACKPORTS_LIST = Path("/etc/apt/sources.list.d/bookworm-backports.list")


def _backports_configured() -> bool:
    sources = [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]
    for source in sources:
        try:
            if "bookworm-backports" in source.read_text():
                return True
        except (OSError, UnicodeDecodeError):
            continue
    return False


def _apt(arguments: Sequence[str]) -> None:
    # The operator's proxy, if any, reaches the mirrors; nothing else of its environment.
    env = privileged_env(inherit=_PROXY_VARIABLES)
    env["DEBIAN_FRONTEND"] = "noninteractive"
    done = subprocess.run(["apt-get", *arguments], env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ConfigError(f"apt-get {' '.join(arguments[:2])} failed: {' / '.join(tail)}")


def install(groups: Sequence[PackageGroup], *, dry_run: bool,
            progress: Callable[[str], None]) -> list[SetupStep]:
    """Install what ``groups`` miss (nothing with ``dry_run``); idempotent: a host that has it
    all only gets checked. Raises ConfigError when apt itself is missing (not Debian)."""
    steps = [SetupStep(group.name, group.why, missing=_missing(group)) for group in groups]
    if dry_run or not any(step.missing for step in steps):
        return steps
    if shutil.which("apt-get") is None:
        raise ConfigError("corral setup installs Debian packages with apt-get, which this "
                          "system lacks: install the packages `corral setup --dry-run` lists "
                          "with the system's own package manager, then run `corral doctor`")
    updated = False
    for group, step in zip(groups, steps, strict=True):
        if not step.missing:
            continue
        target: list[str] = []
        if group.suite == "bookworm-backports":
            if _codename() != "bookworm":
                step.problem = (f"{', '.join(step.missing)} come from bookworm-backports on "
                                "Debian 12; on this system install them from its own sources "
                                "(runsc from gVisor's apt repository, QEMU >= 10): until then "
                                "`corral doctor` reports the gVisor and microVM tiers off")
                continue
            if not _backports_configured():
                progress("adding bookworm-backports to the apt sources")
                _BACKPORTS_LIST.write_text(
                    "deb http://deb.debian.org/debian bookworm-backports main\n")
                updated = False
            target = ["-t", "bookworm-backports"]
        if not updated:
            progress("apt-get update")
            _apt(["update", "-qq"])
            updated = True
        progress(f"installing {group.name}: {' '.join(step.missing)}")
        try:
            _apt(["install", "-y", "-qq", "--no-install-recommends", *target, *step.missing])
        except ConfigError as exc:
            step.problem = exc.message
            continue
        step.installed, step.missing = step.missing, _missing(group)
        if step.missing:
            step.problem = f"still missing after apt-get install: {', '.join(step.missing)}"
    return steps
