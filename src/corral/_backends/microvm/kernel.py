"""The microVM guest kernel: built from Debian's ``linux-source-6.1`` and cached by content.

A build is keyed by a hash of (the source package's version, the config fragment, this recipe's
version), so a new Debian kernel upload or a changed fragment makes a new kernel next to the old
one, and two hosts with the same inputs build the same configuration. The build runs with the
``KBUILD_BUILD_*`` stamps fixed, so the banner (``uname -v``) names the key, not the machine.

Run it by hand (it takes minutes, so nothing builds it implicitly)::

    python -m corral._backends.microvm.kernel [--jobs N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..._core.privileged import privileged_env
from ...errors import BackendError, BackendUnavailable

__all__ = ["FRAGMENT", "GuestKernel", "build_kernel", "find_kernel", "kernel_key",
           "kernels_dir", "source_version"]

log = logging.getLogger(__name__)

SOURCE_PACKAGE = "linux-source-6.1"
SOURCE_TARBALL = Path("/usr/src/linux-source-6.1.tar.xz")
FRAGMENT = Path(__file__).with_name("guest.config")
_RECIPE = "1"  # bump when the build steps below change what comes out
_INSTALL_HINT = ("apt-get install linux-source-6.1 flex bison bc libelf-dev make xz-utils gcc "
                 "(the guest kernel is built from Debian's kernel source)")


@dataclass(frozen=True, slots=True)
class GuestKernel:
    """A built guest kernel in the cache."""

    key: str
    vmlinux: Path  # uncompressed ELF with the PVH note: what -M microvm boots
    bzimage: Path
    release: str  # `uname -r` inside the guest
    build_seconds: float


def kernels_dir(cache: Path) -> Path:
    """Where built kernels live under the microVM cache (``Settings.microvm_cache``): one per
    host, shared by every data directory."""
    return cache / "kernels"


def source_version() -> str | None:
    """The installed ``linux-source-6.1`` package version, or None when it is not installed."""
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}\t${Version}", SOURCE_PACKAGE],
            capture_output=True, text=True, timeout=30, check=False, env=privileged_env(),
            stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    status, _, version = out.stdout.partition("\t")
    if out.returncode != 0 or not status.endswith(" installed") or not SOURCE_TARBALL.is_file():
        return None
    return version


def kernel_key(version: str, fragment: bytes) -> str:
    digest = hashlib.sha256()
    for part in (_RECIPE.encode(), version.encode(), fragment):
        digest.update(len(part).to_bytes(8, "big") + part)
    return digest.hexdigest()[:16]


def _current_key() -> str | None:
    version = source_version()
    return None if version is None else kernel_key(version, FRAGMENT.read_bytes())


def _load(path: Path) -> GuestKernel | None:
    try:
        meta = json.loads((path / "build.json").read_text())
        kernel = GuestKernel(key=path.name, vmlinux=path / "vmlinux", bzimage=path / "bzImage",
                             release=str(meta["release"]),
                             build_seconds=float(meta["build_seconds"]))
    except (OSError, ValueError, KeyError):
        return None
    return kernel if kernel.vmlinux.is_file() else None


def find_kernel(cache: Path) -> GuestKernel | None:
    """The cached kernel for the installed source and the current fragment, if built."""
    key = _current_key()
    return None if key is None else _load(kernels_dir(cache) / key)


def _wanted(fragment: str) -> dict[str, str]:
    wanted = {}
    for line in fragment.splitlines():
        line = line.strip()
        if line.startswith("CONFIG_"):
            name, _, value = line.partition("=")
            wanted[name] = value
    return wanted


def _check_config(config: str, fragment: str) -> None:
    have: dict[str, str] = {}
    for line in config.splitlines():
        if line.startswith("CONFIG_"):
            name, _, value = line.partition("=")
            have[name] = value
        elif line.startswith("# CONFIG_") and line.endswith(" is not set"):
            have[line[2:-len(" is not set")]] = "n"
    missing = [f"{name}={value} (got {have.get(name, 'n')})"
               for name, value in _wanted(fragment).items() if have.get(name, "n") != value]
    if missing:
        raise BackendError(
            "the guest kernel configuration dropped options the fragment asks for (a dependency "
            f"is missing from {FRAGMENT.name}): " + ", ".join(missing))


def _run(argv: list[str], cwd: Path, env: dict[str, str], logfile: Path) -> None:
    with logfile.open("ab") as out:
        out.write(f"$ {' '.join(argv)}\n".encode())
        out.flush()
        result = subprocess.run(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                timeout=3600, check=False)
    if result.returncode != 0:
        tail = logfile.read_text(errors="replace").splitlines()[-15:]
        raise BackendError(f"guest kernel build step failed ({' '.join(argv)}, exit "
                           f"{result.returncode}); last lines of {logfile}:\n" + "\n".join(tail))


def build_kernel(cache: Path, *, jobs: int | None = None) -> GuestKernel:
    """Build (or return the cached) guest kernel for the installed source and fragment.

    Raises:
        BackendUnavailable: the kernel source package or a build tool is missing.
        BackendError: a build step failed (the message quotes the build log).
    """
    version = source_version()
    if version is None:
        raise BackendUnavailable(f"{SOURCE_PACKAGE} is not installed; {_INSTALL_HINT}")
    for tool in ("make", "gcc", "flex", "bison", "bc", "tar", "xz"):
        if shutil.which(tool) is None:
            raise BackendUnavailable(f"{tool} is missing to build the guest kernel; "
                                     f"{_INSTALL_HINT}")
    fragment = FRAGMENT.read_text()
    key = kernel_key(version, fragment.encode())
    parent = kernels_dir(cache)
    cached = _load(parent / key)
    if cached is not None:
        return cached
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=parent))
    logfile = work / "build.log"
    started = time.monotonic()
    try:
        _run(["tar", "-xf", str(SOURCE_TARBALL), "-C", str(work)], work, dict(os.environ),
             logfile)
        src = work / "linux-source-6.1"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work), "LC_ALL": "C",
            "ARCH": "x86_64",
            # Fixed stamps: the same inputs give the same banner on every host.
            "KBUILD_BUILD_TIMESTAMP": "1970-01-01", "KBUILD_BUILD_USER": "corral",
            "KBUILD_BUILD_HOST": key, "KBUILD_BUILD_VERSION": "1",
        }
        (work / "guest.config").write_text(fragment)
        _run(["make", "tinyconfig"], src, env, logfile)
        _run(["scripts/kconfig/merge_config.sh", "-m", ".config", str(work / "guest.config")],
             src, env, logfile)
        _run(["make", "olddefconfig"], src, env, logfile)
        _check_config((src / ".config").read_text(), fragment)
        _run(["make", f"-j{jobs or os.cpu_count() or 1}", "vmlinux", "bzImage"], src, env,
             logfile)
        release = subprocess.run(["make", "-s", "kernelrelease"], cwd=src, env=env,
                                 capture_output=True, text=True, timeout=120,
                                 check=True).stdout.strip()
        out = work / "out"
        out.mkdir()
        shutil.copy2(src / "vmlinux", out / "vmlinux")
        shutil.copy2(src / "arch/x86/boot/bzImage", out / "bzImage")
        shutil.copy2(src / ".config", out / "config")
        shutil.copy2(logfile, out / "build.log")
        seconds = round(time.monotonic() - started, 1)
        (out / "build.json").write_text(json.dumps({
            "source_package": SOURCE_PACKAGE, "source_version": version, "recipe": _RECIPE,
            "release": release, "build_seconds": seconds, "jobs": jobs or os.cpu_count(),
        }, indent=2) + "\n")
        try:
            out.rename(parent / key)
        except OSError:
            if _load(parent / key) is None:
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    built = _load(parent / key)
    if built is None:
        raise BackendError(f"the guest kernel build {key} left no usable vmlinux in {parent}")
    log.info("built guest kernel %s (%s) in %.0f s", key, built.release, built.build_seconds)
    return built


def main(argv: list[str] | None = None) -> int:
    from ..._settings import Settings

    parser = argparse.ArgumentParser(prog="python -m corral._backends.microvm.kernel",
                                     description="Build the microVM guest kernel (cached).")
    parser.add_argument("--jobs", type=int, default=None, help="parallel make jobs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kernel = build_kernel(Settings().microvm_cache, jobs=args.jobs)
    sys.stdout.write(json.dumps({"key": kernel.key, "release": kernel.release,
                                 "vmlinux": str(kernel.vmlinux),
                                 "build_seconds": kernel.build_seconds}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
