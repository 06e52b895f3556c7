"""Host checks for the microVM tier: the accelerator (hardware KVM, or TCG only under the test
setting), QEMU with the features the tier relies on, the guest kernel, and the host pieces it
shares with the other tiers (root, bwrap around QEMU, cgroups, network namespaces).

A pass is remembered for this boot, this QEMU, this accelerator and this guest kernel
(``host_checks``, see ``_linux.hostcache``); ``check_host`` runs everything now.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from ..._core.privileged import privileged_env
from ..._settings import Settings
from ...backends import HostCheck
from .._linux import hostcheck as linux_hostcheck
from .._linux.hostcache import HostKey, TierChecks, which
from .accel import kvm_kind

__all__ = ["CHECKS_VERSION", "MIN_QEMU", "check_host", "host_checks", "host_key",
           "qemu_version"]

# Bump when a check changes what it accepts (edits of the files in _SOURCES change every key).
CHECKS_VERSION = "1"
_SOURCES = tuple(Path(__file__).with_name(name) for name in
                 ("hostcheck.py", "accel.py", "kernel.py", "guest.config"))
_PROGRAMS = ("qemu-system-x86_64", "qemu-img", "gcc", "dpkg-query")

# 8.2: memory-backend-file readonly=on,rom=off (private writable mapping of a read-only RAM
# file, so warm-restored VMs share pages and cannot write the shared file) and file: migration.
MIN_QEMU = (8, 2)
_QEMU_APT = ("apt-get install -t bookworm-backports qemu-system-x86 qemu-utils (Debian 12's own "
             "QEMU 7.2 lacks the read-only template memory the tier needs)")
_KEEP = {"root", "bwrap", "cgroups", "mkfs.ext4", "setpriv"}


def qemu_version(path: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10,
                             check=False, env=privileged_env(), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"version (\d+)\.(\d+)", out.stdout)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _check_accel(settings: Settings) -> HostCheck:
    kind = kvm_kind()
    if kind == "hardware":
        return HostCheck("kvm", True, "hardware KVM (/dev/kvm with kvm_intel or kvm_amd)")
    what = ("/dev/kvm is PVM (kvm_pvm), which runs only PVM-enabled guest kernels: a standard "
            "guest dies in KVM's instruction emulator" if kind == "pvm"
            else "no hardware KVM (/dev/kvm with kvm_intel or kvm_amd)")
    if settings.microvm_allow_tcg:
        return HostCheck("kvm", True, f"{what}; CORRAL_MICROVM_ALLOW_TCG=1 runs guests under "
                         "QEMU's TCG emulation: a TEST MODE, not an isolation boundary",
                         extra={"kvm": kind, "accel": "tcg"})
    return HostCheck("kvm", False, f"{what}, so the microVM tier refuses to run",
                     "run it on a host with hardware KVM (only for tests, "
                     "CORRAL_MICROVM_ALLOW_TCG=1 allows TCG emulation, which is no isolation "
                     "boundary)", extra={"kvm": kind})


def _check_qemu() -> HostCheck:
    path = shutil.which("qemu-system-x86_64")
    if path is None:
        return HostCheck("qemu", False, "qemu-system-x86_64 is not installed", _QEMU_APT)
    version = qemu_version(path)
    if version is None or version < MIN_QEMU:
        shown = ".".join(map(str, version)) if version else "unknown"
        return HostCheck("qemu", False, f"QEMU {shown} at {path} is older than "
                         f"{MIN_QEMU[0]}.{MIN_QEMU[1]}", _QEMU_APT)
    if shutil.which("qemu-img") is None:
        return HostCheck("qemu", False, "qemu-img is not installed", _QEMU_APT)
    return HostCheck("qemu", True, f"QEMU {version[0]}.{version[1]} at {path}")


def _check_kernel(settings: Settings) -> HostCheck:
    from .kernel import find_kernel, source_version

    kernel = find_kernel(settings.microvm_cache)
    if kernel is not None:
        return HostCheck("guest kernel", True, f"Linux {kernel.release} ({kernel.key})")
    if source_version() is None:
        return HostCheck("guest kernel", False, "linux-source-6.1 is not installed",
                         "apt-get install linux-source-6.1 flex bison bc libelf-dev make gcc, "
                         "then python -m corral._backends.microvm.kernel")
    return HostCheck("guest kernel", False, "the guest kernel is not built yet",
                     "python -m corral._backends.microvm.kernel (about 5 minutes, once)")


def check_host(settings: Settings) -> list[HostCheck]:
    """Every check, in the order a fix is best applied. Never raises."""
    shared = [c for c in linux_hostcheck.check_host(settings) if c.name in _KEEP]
    return [*shared, _check_accel(settings), _check_qemu(), _check_kernel(settings),
            linux_hostcheck._check_tool("gcc", "gcc libc6-dev")]


def host_key(settings: Settings) -> HostKey:
    from .kernel import SOURCE_TARBALL, kernels_dir

    shared = linux_hostcheck.host_key(settings)
    programs = {name: path for name, path in shared.programs.items() if name in _KEEP}
    return HostKey(
        tier="microvm", version=CHECKS_VERSION, programs={**programs, **which(*_PROGRAMS)},
        # The guest kernel: its source package, and the cache a build lands in.
        files=(*_SOURCES, SOURCE_TARBALL, kernels_dir(settings.microvm_cache)),
        values={**shared.values, "kvm": kvm_kind(),
                "allow_tcg": str(settings.microvm_allow_tcg),
                "microvm_cache": str(settings.microvm_cache)})


def host_checks(settings: Settings) -> TierChecks:
    """The microVM tier's checks, remembered for this boot (see hostcache)."""
    return TierChecks(linux_hostcheck.checks_path(settings, "microvm"),
                      key=lambda: host_key(settings), run=lambda: check_host(settings))
