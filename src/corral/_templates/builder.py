"""Builds a template's root filesystem with ``mmdebstrap`` and caches it by the spec's hash.

One build per spec hash at a time (``flock``); a second builder of the same spec waits and then
finds the first one's result. The root is built in a temporary directory next to its final
place and renamed in whole, so an interrupted or failed build leaves no half-built template,
and the temporary directory is removed on the way out (or by the next build of the same spec
if this process was killed outright).
"""

from __future__ import annotations

import collections
import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from .._core.privileged import privileged_env
from ..errors import BackendError, BackendUnavailable
from .catalog import (
    METADATA,
    BuiltTemplate,
    build_dir,
    locked,
    name_lock,
    read_build,
    set_current,
)
from .spec import DEBIAN_MIRROR, DEBIAN_SUITE, TemplateSpec

__all__ = ["BuildResult", "build_template", "mmdebstrap_argv"]

Progress = Callable[[str], None]

# Keeps roots small: no recommends, no translations, no manuals or docs (licences stay).
# No fsync per unpacked file either: an interrupted build is thrown away whole, never resumed.
_APT_OPTIONS = ('Apt::Install-Recommends "false"', 'Acquire::Languages "none"')
_DPKG_OPTIONS = (
    "force-unsafe-io",
    "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*", "path-include=/usr/share/locale/locale.alias",
)
# Setup commands get a clean environment, not the builder's (which may hold the operator's
# tokens); network works through the resolv.conf mmdebstrap copies in for the build.
_SETUP_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
              "HOME=/root", "LANG=C.UTF-8", "DEBIAN_FRONTEND=noninteractive")
_STOP_GRACE_S = 30.0
_PROXY_VARIABLES = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                    "NO_PROXY")


@dataclass(frozen=True, slots=True)
class BuildResult:
    template: BuiltTemplate
    cached: bool  # True: an existing build was reused and mmdebstrap did not run
    duration_s: float


def mmdebstrap_argv(spec: TemplateSpec, root: Path, files_dir: Path | None) -> list[str]:
    """The mmdebstrap command line for ``spec``. Pure: no I/O."""
    # unshare mode as root: no user namespace, but mmdebstrap's /proc, /sys and /dev mounts
    # live in a mount namespace of its own, so even a killed build leaves no mount behind.
    argv = ["mmdebstrap", "--mode=unshare", "--variant=apt", "--format=directory", "--verbose"]
    argv += [f"--aptopt={opt}" for opt in _APT_OPTIONS]
    argv += [f"--dpkgopt={opt}" for opt in _DPKG_OPTIONS]
    if spec.packages:
        argv.append("--include=" + ",".join(spec.packages))
    if files_dir is not None:
        argv.append(f"--customize-hook=sync-in {shlex.quote(str(files_dir))} /")
    for command in spec.setup:
        argv.append(f'--customize-hook=chroot "$1" /usr/bin/env -i {" ".join(_SETUP_ENV)} '
                    f"/bin/sh -ec {shlex.quote(command)}")
    return [*argv, DEBIAN_SUITE, str(root), DEBIAN_MIRROR]


def _check_host() -> str:
    if os.geteuid() != 0:
        raise BackendUnavailable("building a template needs root (mmdebstrap installs packages "
                                 "as root into the new root); run it as root")
    path = shutil.which("mmdebstrap")
    if path is None:
        raise BackendUnavailable("mmdebstrap is not installed; `apt-get install mmdebstrap` "
                                 "(`corral setup` does it)")
    return path


def _stage_files(spec: TemplateSpec, work: Path) -> Path | None:
    if not spec.files:
        return None
    staging = work / "files"
    staging.mkdir(mode=0o755)
    for f in spec.files:
        target = staging / f.path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        target.write_text(f.content, encoding="utf-8")
        os.chmod(target, f.mode)
    for directory in [staging, *(p for p in staging.rglob("*") if p.is_dir())]:
        os.chmod(directory, 0o755)  # sync-in copies these modes onto /etc, /usr, ...
    return staging


def _stop(proc: subprocess.Popen[str]) -> None:
    """Ask mmdebstrap to clean up, then make sure its whole process group is gone."""
    for sig, wait_s in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    if proc.stdout is not None:
        proc.stdout.close()


def _run(argv: list[str], spec: TemplateSpec, progress: Progress) -> None:
    tail: collections.deque[str] = collections.deque(maxlen=15)
    apt_errors: list[str] = []
    # Corral's fixed environment, not the service's: mmdebstrap runs as root. Only the
    # operator's proxy settings (Corral's own environment, never a caller's) pass through, so
    # a build behind a proxy still reaches the mirror.
    env = {**privileged_env(inherit=_PROXY_VARIABLES), "LC_ALL": "C.UTF-8"}
    # The tool is found on Corral's own PATH (the operator's choice), not the helper's fixed one.
    argv = [shutil.which(argv[0]) or argv[0], *argv[1:]]
    # Our own process group, so an interrupt reaches every process of the build; the parent
    # death signal stops mmdebstrap if this process is killed outright.
    proc = subprocess.Popen(
        ["setpriv", "--pdeathsig", "KILL", "--", *argv] if shutil.which("setpriv") else argv,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, errors="replace", env=env, start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            tail.append(line)
            if line.startswith("E: ") and line != "E: mmdebstrap failed to run":
                apt_errors.append(line[3:])
            elif line.startswith("dpkg: error") or "No space left on device" in line:
                # apt's own E: line only says its dpkg "returned an error code"; the cause
                # (a full disk, a failing maintainer script) is in dpkg's lines before it.
                apt_errors.append(line)
            progress(line)
        code = proc.wait()
        proc.stdout.close()
    except BaseException:
        _stop(proc)
        raise
    if code != 0:
        detail = "; ".join(apt_errors[:8]) or "\n".join(tail)
        raise BackendError(f"building template {spec.name!r} failed (mmdebstrap exited with "
                           f"{code}): {detail}")


# Host-specific or secret-bearing files a build leaves behind (the build copies the host's
# resolv.conf and hostname in so apt can resolve names; setup commands may leave caches).
_REMOVE = ("etc/resolv.conf", "etc/hostname", "var/lib/dbus/machine-id",
           "var/cache/debconf/passwords.dat", "root/.bash_history", "root/.wget-hsts",
           "root/.lesshst", "root/.python_history", "root/.node_repl_history")
_EMPTY = ("etc/ssl/private", "var/lib/apt/lists", "var/cache/apt", "var/log", "tmp",
          "var/tmp", "run", "root/.cache", "root/.npm", "root/.ssh", "root/.gnupg")


def _scrub(root: Path) -> None:
    for rel in _REMOVE:
        (root / rel).unlink(missing_ok=True)
    for rel in _EMPTY:
        directory = root / rel
        if directory.is_symlink() or not directory.is_dir():
            continue
        for entry in directory.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    for key in (root / "etc" / "ssh").glob("ssh_host_*"):
        key.unlink()
    machine_id = root / "etc" / "machine-id"
    if machine_id.exists():
        machine_id.write_text("")  # systemd's "not yet initialised"; never the host's
    # Device nodes the build created: a sandbox gets its own minimal /dev, and a device node
    # has no business in a read-only image others may mount differently.
    for entry in (root / "dev").rglob("*"):
        mode = entry.lstat().st_mode
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            entry.unlink()


def _disk_usage(root: Path) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _installed_packages(root: Path) -> int:
    try:
        status = (root / "var" / "lib" / "dpkg" / "status").read_text(errors="replace")
    except OSError:
        return 0
    return status.count("\nStatus: install ok installed") + status.startswith(
        "Status: install ok installed")


def _sweep_leftovers(templates_dir: Path, key: str) -> None:
    """Remove what killed builds of ``key`` and killed removals left. Hold ``key``'s lock."""
    for entry in templates_dir.iterdir():
        if entry.name.startswith((f".build-{key}-", ".trash-")):
            shutil.rmtree(entry, ignore_errors=True)


def build_template(spec: TemplateSpec, templates_dir: Path, *,
                   on_progress: Progress | None = None) -> BuildResult:
    """Build ``spec`` unless a build of the same hash exists; make it ``spec.name``'s current.

    ``on_progress`` gets mmdebstrap's output line by line (its own ``I:`` phase lines, apt's
    and dpkg's), plus Corral's own ``I: corral: ...`` lines.

    Raises:
        BackendUnavailable: not root, or mmdebstrap missing.
        BackendError: the build failed (unknown package, mirror unreachable, setup failed).
    """
    progress = on_progress or (lambda line: None)
    started = time.monotonic()
    mmdebstrap = _check_host()
    templates_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
    key = f"{spec.name}-{spec.hash}"
    final = build_dir(templates_dir, spec.name, spec.hash)

    def waiting() -> None:
        progress(f"I: corral: waiting for another build of {key} to finish")

    with locked(templates_dir / ".locks" / f"{key}.lock", on_wait=waiting):
        with name_lock(templates_dir, spec.name):
            existing = read_build(final)
            if existing is not None:
                set_current(templates_dir, spec.name, spec.hash)
                progress(f"I: corral: {key} is already built; nothing to do")
                return BuildResult(template=replace(existing, current=True), cached=True,
                                   duration_s=time.monotonic() - started)
        _sweep_leftovers(templates_dir, key)
        work = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=templates_dir))
        try:
            # apt downloads as user _apt (its sandbox) and must reach the new root; sandboxes
            # run as unprivileged uids and must reach it later.
            os.chmod(work, 0o755)
            root = work / "root"
            argv = [mmdebstrap, *mmdebstrap_argv(spec, root, _stage_files(spec, work))[1:]]
            progress(f"I: corral: building {key} from {DEBIAN_SUITE} "
                     f"({', '.join(spec.packages) or 'no extra packages'})")
            _run(argv, spec, progress)
            progress("I: corral: removing host-specific files from the new root")
            _scrub(root)
            shutil.rmtree(work / "files", ignore_errors=True)
            build_s = time.monotonic() - started
            meta = {
                "name": spec.name, "hash": spec.hash, "built_at": time.time(),
                "build_s": build_s, "size_bytes": _disk_usage(root),
                "installed_packages": _installed_packages(root), "spec": spec.to_dict(),
            }
            (work / METADATA).write_text(json.dumps(meta, indent=2) + "\n")
            os.chmod(work / METADATA, 0o644)
            os.chmod(root, 0o755)
            with name_lock(templates_dir, spec.name):
                if os.path.lexists(final):  # damaged (no metadata): never a valid build
                    trash = templates_dir / f".trash-{work.name[1:]}"
                    os.rename(final, trash)
                    shutil.rmtree(trash, ignore_errors=True)
                os.rename(work, final)
                set_current(templates_dir, spec.name, spec.hash)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    built = read_build(final)
    if built is None:  # removed between our rename and now: report, do not pretend
        raise BackendError(f"template {key} was removed while it was being built; build again")
    progress(f"I: corral: built {key} in {build_s:.1f} s")
    return BuildResult(template=replace(built, current=True), cached=False,
                       duration_s=time.monotonic() - started)
