"""Host checks for the namespace tier: each says what is missing and how to fix it.

``check_host`` runs them now (``corral doctor``); ``host_checks`` remembers a pass for this
boot (``hostcache``), which is what a tier asks before its first sandbox in a process.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

from ..._core import linux
from ..._core.privileged import privileged_env
from ..._settings import Settings
from ...backends import HostCheck
from ...errors import BackendUnavailable
from .hostcache import HostKey, TierChecks, which

__all__ = ["CHECKS_VERSION", "USERNS_SYSCTLS", "check_host", "checks_path", "host_checks",
           "host_key", "sysctl_values"]

# Bump when a check changes what it accepts (edits of this file change every key anyway).
CHECKS_VERSION = "1"
# Programs the checks vet; a change of any makes the tier check again.
_PROGRAMS = ("bwrap", "mkfs.ext4", "mount", "setpriv", "setsid", "unshare")
USERNS_SYSCTLS = ("/proc/sys/user/max_user_namespaces",
                  "/proc/sys/kernel/apparmor_restrict_unprivileged_userns")

_APT = "apt-get install -y bubblewrap libseccomp2 e2fsprogs mount"


def _check_root() -> HostCheck:
    if os.geteuid() == 0:
        return HostCheck("root", True, "running as root (needed to give each sandbox its own uid)")
    return HostCheck(
        "root", False, "not running as root",
        "run Corral as root: it drops every sandbox to its own unprivileged host uid, which "
        "needs root to set up; bwrap alone as a normal user shares your uid with the sandbox",
    )


def _check_tool(name: str, package: str) -> HostCheck:
    path = shutil.which(name)
    if path:
        return HostCheck(name, True, path)
    return HostCheck(name, False, f"{name} not found on PATH", f"apt-get install -y {package}")


def _check_bwrap() -> HostCheck:
    path = shutil.which("bwrap")
    if not path:
        return HostCheck("bwrap", False, "bubblewrap is not installed",
                         "apt-get install -y bubblewrap")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10,
                             env=privileged_env(), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return HostCheck("bwrap", False, f"bwrap does not run: {exc}", _APT)
    version = out.stdout.strip().split()[-1] if out.stdout.strip() else "?"
    try:
        parts = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        parts = (0, 0)
    if parts < (0, 8):
        return HostCheck("bwrap", False, f"bubblewrap {version} lacks --disable-userns",
                         "install bubblewrap 0.8 or newer (Debian 12 has it)")
    if os.stat(path).st_mode & 0o4000:
        return HostCheck("bwrap", False, f"{path} is setuid root",
                         "use a non-setuid bwrap (chmod u-s); Corral drops privileges itself")
    return HostCheck("bwrap", True, f"bubblewrap {version} at {path}")


def _check_userns() -> HostCheck:
    try:
        with open("/proc/sys/user/max_user_namespaces") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        limit = -1
    if limit == 0:
        return HostCheck("user namespaces", False, "user.max_user_namespaces is 0",
                         "sysctl -w user.max_user_namespaces=65536")
    try:
        with open("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") as f:
            if f.read().strip() == "1":
                return HostCheck(
                    "user namespaces", False,
                    "AppArmor restricts unprivileged user namespaces",
                    "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or add an "
                    "AppArmor profile allowing userns for /usr/bin/bwrap",
                )
    except OSError:
        pass
    return HostCheck("user namespaces", True, f"max_user_namespaces={limit}")


def _check_seccomp() -> HostCheck:
    from .seccomp import compile_filter

    try:
        program = compile_filter()
    except BackendUnavailable as exc:
        return HostCheck("seccomp", False, exc.message, "apt-get install -y libseccomp2")
    with open("/proc/self/status") as f:
        if not any(line.startswith("Seccomp:") for line in f):
            return HostCheck("seccomp", False, "the kernel has no seccomp support",
                             "use a kernel built with CONFIG_SECCOMP_FILTER")
    return HostCheck("seccomp", True, f"filter compiled ({len(program) // 8} BPF instructions)")


def _check_cgroups(settings: Settings) -> HostCheck:
    from .cgroups import detect_cgroups

    try:
        driver = detect_cgroups(f"corral-{settings.instance}")
    except BackendUnavailable as exc:
        return HostCheck("cgroups", False, exc.message, "see the message")
    return HostCheck("cgroups", True, driver.describe())


def _check_openat2() -> HostCheck:
    try:
        fd = linux.openat2(os.open("/", os.O_PATH), ".", os.O_PATH, 0, linux.RESOLVE_BENEATH)
        os.close(fd)
    except OSError as exc:
        if exc.errno == errno.ENOSYS:
            return HostCheck("openat2", False, "the kernel lacks openat2 (Linux < 5.6)",
                             "use Linux 5.6 or newer; file access into sandboxes needs it")
    return HostCheck("openat2", True, "RESOLVE_BENEATH available for safe file access")


def _check_loop() -> HostCheck:
    if os.path.exists("/dev/loop-control"):
        return HostCheck("loop devices", True, "/dev/loop-control present")
    return HostCheck("loop devices", False, "/dev/loop-control is missing",
                     "load the loop module (modprobe loop); workspaces are loop-mounted images")


def _check_overlay() -> HostCheck:
    try:
        with open("/proc/filesystems") as f:
            known = f.read().split()
    except OSError:
        known = []
    if "overlay" not in known:
        subprocess.run(["modprobe", "overlay"], capture_output=True, check=False,
                       env=privileged_env(), stdin=subprocess.DEVNULL)
        with open("/proc/filesystems") as f:
            known = f.read().split()
    if "overlay" in known:
        return HostCheck("overlayfs", True, "workspaces stack snapshot layers with overlayfs")
    return HostCheck("overlayfs", False, "the kernel has no overlay filesystem",
                     "load it (modprobe overlay) or use a kernel with CONFIG_OVERLAY_FS")


def _check_idmap(settings: Settings) -> HostCheck:
    """Forks and shared snapshots show one uid's files as another's through idmapped mounts."""
    if os.geteuid() != 0:
        return HostCheck("idmapped mounts", False, "not checked (needs root)", "run as root")
    import tempfile

    from ..._core.idmap import idmap_supported

    base = settings.home if settings.home.is_dir() else Path(tempfile.gettempdir())
    try:
        with tempfile.TemporaryDirectory(dir=base, prefix=".idmap-check-") as probe:
            ok, detail = idmap_supported(probe)
    except OSError as exc:
        ok, detail = False, str(exc)
    if ok:
        return HostCheck("idmapped mounts", True, "forks share snapshot layers without copying")
    return HostCheck("idmapped mounts", False, f"idmapped bind mounts fail: {detail}",
                     "use Linux 5.19 or newer (forks and snapshots used by another sandbox "
                     "need idmapped overlayfs layers)")


def check_host(settings: Settings) -> list[HostCheck]:
    """Every check, in the order a fix is best applied. Never raises."""
    return [
        _check_root(),
        _check_bwrap(),
        _check_userns(),
        _check_seccomp(),
        _check_cgroups(settings),
        _check_openat2(),
        _check_loop(),
        _check_overlay(),
        _check_idmap(settings),
        _check_tool("mkfs.ext4", "e2fsprogs"),
        _check_tool("mount", "mount"),
        _check_tool("setpriv", "util-linux"),
        _check_tool("setsid", "util-linux"),
        _check_tool("unshare", "util-linux"),
    ]


def checks_path(settings: Settings, tier: str) -> Path:
    """Where a tier's passing checks are recorded: per data directory, as some checks look at
    it (idmapped mounts on its filesystem, its cgroups)."""
    return settings.home / "hostchecks" / f"{tier}.json"


def sysctl_values(paths: tuple[str, ...] = USERNS_SYSCTLS) -> dict[str, str]:
    """The current values of ``paths`` (cheap to read; a sysctl can change within a boot)."""
    values = {}
    for path in paths:
        try:
            values[path] = Path(path).read_text().strip()
        except OSError:
            values[path] = "absent"
    return values


def host_key(settings: Settings) -> HostKey:
    return HostKey(tier="namespace", version=CHECKS_VERSION, programs=which(*_PROGRAMS),
                   values=sysctl_values())


def host_checks(settings: Settings) -> TierChecks:
    """The namespace tier's checks, remembered for this boot (see ``hostcache``)."""
    return TierChecks(checks_path(settings, "namespace"), key=lambda: host_key(settings),
                      run=lambda: check_host(settings))
