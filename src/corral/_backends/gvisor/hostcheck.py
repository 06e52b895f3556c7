"""Host checks for the gVisor tier: runsc, its platform, a real sandbox start, and the pieces
it shares with the namespace tier (cgroups, network namespaces, workspaces)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from ..._core.privileged import privileged_env
from ..._settings import Settings
from ...backends import HostCheck
from .._linux import hostcheck as linux_hostcheck
from .._linux.template import load_template
from .bundle import build_config, ensure_rootfs, runtime_uid, write_config
from .launcher import reap_orphans
from .runsc import MIN_VERSION, Runsc, find_runsc, runsc_version

__all__ = ["check_host", "gvisor_dir", "probe_sandbox"]

# The namespace tier's checks that do not apply here: commands run in gVisor, not bwrap, and the
# seccomp filter is enforced by gVisor from the OCI spec (no libseccomp needed).
_NOT_NEEDED = {"bwrap", "seccomp"}
_PROBE_UID = 65534  # nobody: the probe touches no file, so any unprivileged uid will do


def gvisor_dir(settings: Settings) -> Path:
    return settings.home / "gvisor"


def _check_runsc() -> tuple[HostCheck, str | None]:
    path = find_runsc()
    if path is None:
        return HostCheck("runsc", False, "runsc (gVisor) is not installed",
                         Runsc.install_hint), None
    version, date = runsc_version(path)
    if date is None:
        return HostCheck("runsc", False, f"{path}: cannot tell its version ({version})",
                         Runsc.install_hint), None
    if date < MIN_VERSION:
        return HostCheck(
            "runsc", False,
            f"{path} is {version}, older than {MIN_VERSION} (its statx is broken: `ls` fails)",
            Runsc.install_hint), None
    return HostCheck("runsc", True, f"{version} at {path}"), path


def _check_platform() -> HostCheck:
    with open("/proc/self/status") as f:
        if not any(line.startswith("Seccomp:") for line in f):
            return HostCheck("gvisor platform", False,
                             "the kernel has no seccomp, which gVisor's systrap platform needs",
                             "use a kernel built with CONFIG_SECCOMP_FILTER")
    kvm = ("/dev/kvm is present but not used" if os.path.exists("/dev/kvm")
           else "no /dev/kvm, not needed")
    return HostCheck("gvisor platform", True, f"systrap (system calls trapped by seccomp; {kvm})")


def probe_sandbox(runsc_path: str) -> str | None:
    """Start one real gVisor sandbox running ``true`` with the tier's flags and spec; None when
    it worked, else what went wrong.

    Everything lives in a temporary directory (state, bundle, root skeleton, a curated ``/etc``),
    removed afterwards, so a host check writes nothing into the data directory. It must be
    traversable: the gofer runs as an unprivileged uid.
    """
    work = Path(tempfile.mkdtemp(prefix="corral-gvisor-probe-"))
    runsc = Runsc(runsc_path, work / "state")
    container_id = f"probe.{os.getpid()}.{secrets.token_hex(4)}"
    bundle = work / container_id
    try:
        os.chmod(work, 0o711)
        runsc.prepare()
        template = load_template("base", work / "templates")
        config = build_config(
            rootfs=ensure_rootfs(work, template), template=template, workspace=None,
            netns=None, uid=_PROBE_UID, argv=["/usr/bin/true"], cwd="/", env={"PATH": "/usr/bin"},
            tmp_bytes=1 << 20, pids=16, terminal=False)
        write_config(bundle, config)
        proc = subprocess.run(runsc.run_argv(bundle=bundle, container_id=container_id,
                                             network="none"),
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
                              env=privileged_env())
        if proc.returncode != 0:
            detail = Runsc.error_of(bundle) or proc.stderr.decode(errors="replace").strip()
            return f"exit {proc.returncode}: {detail or 'no message'}"
        return None
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        return str(exc)
    except Exception as exc:  # a host check never raises; it reports
        return f"{type(exc).__name__}: {exc}"
    finally:
        reap_orphans(runtime_uid(_PROBE_UID))
        shutil.rmtree(work, ignore_errors=True)


def _check_sandbox(settings: Settings, runsc_path: str | None) -> HostCheck:
    if runsc_path is None:
        return HostCheck("gvisor sandbox", False, "not tried: runsc is missing or too old",
                         "fix the runsc line first")
    if os.geteuid() != 0:
        return HostCheck("gvisor sandbox", False, "not tried: not running as root",
                         "run Corral as root")
    started = time.monotonic()
    problem = probe_sandbox(runsc_path)
    if problem is not None:
        return HostCheck(
            "gvisor sandbox", False, f"runsc could not start a sandbox: {problem}",
            "check that user namespaces are allowed and runsc runs "
            "(`runsc --network=none do true`); see `runsc --debug --debug-log=/tmp/runsc/ ...`")
    return HostCheck("gvisor sandbox", True,
                     f"started and stopped one in {(time.monotonic() - started) * 1000:.0f} ms")


def check_host(settings: Settings) -> list[HostCheck]:
    """Every check, in the order a fix is best applied. Never raises."""
    runsc_line, runsc_path = _check_runsc()
    shared = [c for c in linux_hostcheck.check_host(settings) if c.name not in _NOT_NEEDED]
    return [
        *shared[:1],  # root first, as in the namespace tier
        runsc_line,
        _check_platform(),
        *shared[1:],
        _check_sandbox(settings, runsc_path),
    ]
