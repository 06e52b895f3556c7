"""Host checks for the gVisor tier: runsc, its platform, a real sandbox start, and the pieces
it shares with the namespace tier (cgroups, network namespaces, workspaces).

The sandbox start costs about a second, so a pass is remembered for this boot and this runsc
(``host_checks``, see ``_linux.hostcache``); ``check_host`` runs everything now.
"""

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
from .._linux.hostcache import HostKey, TierChecks
from .._linux.template import load_template
from .bundle import build_config, ensure_rootfs, runtime_uid, write_config
from .launcher import reap_orphans
from .runsc import MIN_VERSION, Runsc, find_runsc, runsc_version

__all__ = ["CHECKS_VERSION", "check_host", "gvisor_dir", "host_checks", "host_key",
           "probe_sandbox"]

# Bump when a check changes what it accepts (edits of the files in _SOURCES change every key).
CHECKS_VERSION = "1"
# The probe starts a sandbox from the tier's own spec: a change of it must probe again.
_SOURCES = tuple(Path(__file__).with_name(name) for name in
                 ("hostcheck.py", "bundle.py", "runsc.py", "launcher.py"))

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


def probe_sandbox(runsc_path: str, templates_dir: Path) -> str | None:
    """Start one real gVisor sandbox running ``true`` with the tier's flags and spec; None when
    it worked, else what went wrong.

    Its root is the ``base`` template of ``templates_dir``, the one sandboxes get (its curated
    ``/etc`` is made once, not copied again per probe). State, bundle and root skeleton live in
    a temporary directory removed afterwards. Both must be traversable: the gofer runs as an
    unprivileged uid.
    """
    work = Path(tempfile.mkdtemp(prefix="corral-gvisor-probe-"))
    runsc = Runsc(runsc_path, work / "state")
    container_id = f"probe.{os.getpid()}.{secrets.token_hex(4)}"
    bundle = work / container_id
    try:
        os.chmod(work, 0o711)
        runsc.prepare()
        ca = templates_dir.parent / "egress" / "ca.pem"  # as sandboxes get it: one /etc
        template = load_template("base", templates_dir,
                                 extra_ca=ca.read_bytes() if ca.exists() else None)
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


def _check_home(settings: Settings) -> HostCheck:
    """The gofer runs as the sandbox's runtime uid, with no rights on the host beyond
    "other": it must be able to walk to the templates and workspaces in the data directory."""
    home = settings.home
    for path in (home, *home.parents):
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue  # not made yet: it is made traversable (0711) when it is
        if not mode & 0o001:
            return HostCheck(
                "data directory", False,
                f"{path} is not traversable by other users (mode {mode & 0o777:o}), so "
                f"gVisor sandboxes cannot reach {home}",
                f"`chmod o+x {path}` or choose another CORRAL_HOME")
    return HostCheck("data directory", True, f"{home} is reachable by sandbox uids")


def _check_sandbox(settings: Settings, runsc_path: str | None, home: HostCheck) -> HostCheck:
    if runsc_path is None:
        return HostCheck("gvisor sandbox", False, "not tried: runsc is missing or too old",
                         "fix the runsc line first")
    if os.geteuid() != 0:
        return HostCheck("gvisor sandbox", False, "not tried: not running as root",
                         "run Corral as root")
    if not home.ok:
        return HostCheck("gvisor sandbox", False, "not tried: the data directory is not "
                         "reachable by sandbox uids", "fix the data directory line first")
    started = time.monotonic()
    problem = probe_sandbox(runsc_path, settings.home / "templates")
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
    home = _check_home(settings)
    return [
        *shared[:1],  # root first, as in the namespace tier
        runsc_line,
        _check_platform(),
        *shared[1:],
        home,
        _check_sandbox(settings, runsc_path, home),
    ]


def host_key(settings: Settings) -> HostKey:
    shared = linux_hostcheck.host_key(settings)
    programs = {name: path for name, path in shared.programs.items() if name not in _NOT_NEEDED}
    programs["runsc"] = find_runsc()
    return HostKey(tier="gvisor", version=CHECKS_VERSION, programs=programs, files=_SOURCES,
                   values=shared.values)


def host_checks(settings: Settings) -> TierChecks:
    """The gVisor tier's checks, remembered for this boot and this runsc (see hostcache)."""
    return TierChecks(linux_hostcheck.checks_path(settings, "gvisor"),
                      key=lambda: host_key(settings), run=lambda: check_host(settings))
