"""The gVisor tier: commands run in gVisor (``runsc``), a user-space kernel between them and the
host, on top of the namespace tier's per-sandbox pieces.

A sandbox's runtime is the same as in the namespace tier, built by the same code and laid out
under the same names (so either tier's sweep recognises it): a network namespace holding only
``lo``, a cgroup with the tier's limits, and the layered workspace. What differs is how a command
runs: in a gVisor sandbox made from an OCI bundle (``bundle``), as uid 1000 inside, its gVisor
processes as the sandbox's own runtime uid outside.

**How a command runs: in the sandbox's resident gVisor sandbox** (``resident``, ``inside``,
``run.c``; on by default, ``Settings.gvisor_resident``), issue 14's "gVisor made fast":

* One *resident* gVisor sandbox per Corral sandbox while it is in use: one attached ``runsc
  run`` (``create`` cannot be given pipes: the sandbox inherits them and ``create`` waits for
  their EOF forever), its init a small helper speaking JSON lines over runsc's stdin/stdout.
  Started on demand (``OnDemand``) by the first command, in a group ``c.<owner>.resident-N``
  of the sandbox cgroup, placed there before runsc runs, like a command (so limits, pause and
  ``destroy`` hold it, and a crashed owner's is swept as a command's, its runsc state with
  it); stopped after ``Settings.gvisor_idle_s`` with nothing running, so an idle sandbox costs
  no process. Closed before the workspace is mounted anew (a snapshot's seal, a restore), and
  replaced when the mount it was given is not the workspace's any more.
* Not ``runsc exec``: measured here (``bench/bench_gvisor.py``, ``long_lived``), a ``runsc
  exec`` process reports ``Seccomp: 0`` and may ``unshare(CLONE_NEWUSER)``: the OCI profile
  covers the container's init only. It also runs as root inside unless given ``--user``, and
  shares the init's mount and PID namespace (one ``/tmp`` for all commands).
* Per command the helper spawns the static launcher with ``posix_spawn`` (a fork of the
  Python helper costs 20-45 ms in gVisor's systrap, ``posix_spawn`` ~12 ms): own mount and
  PID namespace, a fresh size-limited ``/tmp`` and ``/dev/shm`` (the namespace tier's
  semantics, kept), a namespace init that reaps and whose exit kills the rest of the tree
  (its real uid 0, without a capability, so that the command cannot stop or kill it: gVisor
  does not shield a namespace's init from its own namespace as Linux does), and the command
  as 1000:1000 with no capabilities, ``no_new_privs``, its rlimits and the
  namespace tier's own BPF filter (``_linux.seccomp``) installed as the last step before exec.
  The helper holds KILL, SETGID, SETUID, SETPCAP and SYS_ADMIN in gVisor's kernel only. The
  helper sets up the next command's launcher while nothing runs, so a command waits only for
  its request, a vfork and its exec. Given stdin and interactive stdin go through the helper,
  which buffers and never blocks on a command that does not read.
* ``kill_command``, ``busy`` and timeouts (exit 124) go through the helper; the tree of a
  command is gone when it returns (its PID namespace dies with its init).

What differs from a gVisor sandbox per command, each said where it shows:

* memory: the commands of one sandbox share one gVisor kernel. The sandbox's memory limit
  holds as before (the host cgroup), but a command that exhausts it takes down the Sentry and
  with it the sandbox's other running commands: each ends as OOM-killed (137), and the next
  command starts a fresh resident. Per command, peak memory is the largest single process's
  RSS (the namespace init's ``wait4``), not the whole tree's;
* a terminal (PTY) command takes a gVisor sandbox of its own (the path below): a terminal is a
  long session whose start (~200 ms) is paid once; its processes do not see the resident's;
* between commands, within ``gvisor_idle_s``, the resident's host processes (runsc, gofer,
  Sentry) stay: "nothing lingers" holds inside at once, on the host after the idle stop;
* one resident per Corral process: two processes using one sandbox run two (each in its own
  group, under the same sandbox limits).

Measured 2026-12-02, same run (``bench/bench_gvisor.py --runs 30``, p50, idle 2-core VM):
``runsc do true`` 141 ms, a gVisor sandbox per command 172 ms, a namespace-tier command
15.6 ms, and **a Corral gVisor command on the resident path 18.0 ms: 1.16x the namespace
tier's** (1.32x in a second run; target 1.5x, and at most 50 ms). Two changes made it so
(31.8-34 ms before): the resident is pinned to its tier's CPUs once up
(``Settings.gvisor_pin_cpus``, ``_linux.cpus``: gVisor's thread hand-offs across CPUs cost
more than the whole command on a VM), and the launcher's init takes the command's identity and
filter ahead, with the launcher gone before the command runs (``run.c``). Back to back, with
no pause for the next launcher's set-up, a command takes ~60 ms. Starting a resident takes
0.35-0.9 s (``runsc run`` plus Python's start inside), once per busy period.

**A gVisor sandbox per command** (PTY commands; every command with ``gvisor_resident`` off):

* ``runsc run`` of a fresh sandbox (~195-200 ms against ~130-200 ms for bare ``runsc do
  true``), its whole sandbox in the command's cgroup, so timeouts, ``kill_command``, pause and
  usage work exactly as in the namespace tier, and a memory bomb ends only its own command.

Shared by both:

* **Network: ``--network=host`` inside the sandbox's network namespace.** gVisor's own network
  stack (``sandbox``/``none``) has a loopback of its own, so the egress gateway's listener, bound
  to 127.0.0.1 in the sandbox's namespace, is unreachable from it; bridging it would need a relay
  process inside every sandbox, and two commands (a background server and its client) could not
  talk over loopback. With ``host``, gVisor hands socket calls to the host kernel in a namespace
  that holds only ``lo``, exactly the namespace tier's network: no route, no resolver, the
  gateway (and only it) at ``127.0.0.1:<port>``, and one command's server reachable from the
  next. The price, measured: ~30 ms per gVisor start (runsc ships precompiled seccomp filters
  only for gVisor's own network stack and compiles the host-network one at every start); and
  the Sentry's own filter is wider (socket calls reach the host kernel, confined to that
  namespace). Raw and packet sockets stay off (``--net-raw=false``) and netlink is refused by
  the command's filter.
* **Platform: systrap** (see ``runsc``); KVM is not available on the development machines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._core import linux
from ..._core.fsafe import remove_tree
from ..._core.privileged import privileged_env
from ..._settings import Settings
from ...backends import (
    BackendName,
    ExecOutcome,
    ExecRequest,
    HostCheck,
    Leftover,
    SandboxSpec,
)
from ...errors import BackendError, BackendUnavailable, CommandError, ConfigError
from ...models import ResourceTier, Usage
from .._linux.cgroups import detect_cgroups
from .._linux.cpus import CpuPlacer, pin_tasks
from .._linux.host import HostBackedBackend
from .._linux.notfound import exec_failure
from .._linux.process_io import OutputStream
from .._linux.supervise import TIMEOUT_EXIT_CODE
from .._linux.template import BaseTemplate, template_python
from .bundle import build_config, ensure_rootfs, runtime_uid
from .hostcheck import gvisor_dir, host_checks
from .launcher import _SHIM, GvisorLauncher, Launch, reap_orphans
from .resident import OnDemand, Resident, ResidentDied, ensure_launcher
from .runsc import Runsc, find_runsc

__all__ = ["GvisorBackend"]

_KILLED_EXIT_CODE = 128 + 9
_RESIDENT_PREFIX = "resident-"

logger = logging.getLogger(__name__)

# Host tasks a running command needs beyond its own: runsc, the gofer and the Sentry's threads
# (measured: ~35 for `sleep`). Inside, RLIMIT_NPROC holds the command to the tier's pids; the
# host cgroup only has to keep a runaway gVisor from the host, never starve a Sentry of threads.
_RUNTIME_TASKS = 64

_RESOLVE_IN_ROOT = 0x10


def _check_traversable(home: Path) -> None:
    """The gofer runs as the sandbox's runtime uid, with no rights on the host beyond "other":
    it must be able to walk to the root skeleton, the templates and the workspace."""
    for path in (home, *home.parents):
        if not os.stat(path).st_mode & 0o001:
            raise ConfigError(
                f"{path} is not traversable by other users (mode "
                f"{os.stat(path).st_mode & 0o777:o}), so gVisor sandboxes cannot reach {home}; "
                f"`chmod o+x {path}` or choose another CORRAL_HOME")


def _host_limits(tier: ResourceTier) -> ResourceTier:
    """The sandbox cgroup's limits: memory and CPU as the tier says (gVisor's own kernel counts
    against them), host tasks with room for the runtime of a few concurrent commands."""
    return dataclasses.replace(tier, pids=2 * tier.pids + 2 * _RUNTIME_TASKS)


def _container_id(sandbox_id: str, group_name: str) -> str:
    # Short and derived from the command's cgroup: runsc puts a socket named after it in its
    # state directory (sun_path holds 107 bytes), and a sweep finds the group from the id.
    return f"{sandbox_id}.{hashlib.sha256(group_name.encode()).hexdigest()[:12]}"


class GvisorBackend(HostBackedBackend):
    """See the module docstring. One instance per process and data directory."""

    name: BackendName = "gvisor"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._dir = gvisor_dir(settings)
        self._bundles = self._dir / "bundles"
        self._runsc: Runsc | None = None
        self._rootfs: dict[tuple[tuple[str, str, str], ...], Path] = {}
        self._launcher: GvisorLauncher | None = None
        self._lock = threading.Lock()
        self._resident_on = settings.gvisor_resident
        # At most this many residents start ahead at once (``create``): one per core.
        self._prestarts = threading.Semaphore(max(1, os.cpu_count() or 1))
        # sandbox id -> its resident and the identity of the workspace mount it was given
        self._residents: dict[str, tuple[OnDemand, tuple[int, ...]]] = {}
        self._oom_groups: set[str] = set()  # "sandbox/group" of residents the OOM killer hit
        self._resident_starts = 0
        # Residents are pinned to ceil(tier cpus) CPUs once up (see _linux.cpus for why).
        self._cpus = CpuPlacer() if settings.gvisor_pin_cpus else None

    # -- set-up ----------------------------------------------------------------------------

    def check_host(self) -> list[HostCheck]:
        return host_checks(self._settings).fresh()

    def _ready(self) -> GvisorLauncher:
        if self._launcher is not None:
            return self._launcher
        with self._lock:
            if self._launcher is None:
                # Remembered for this boot and this runsc: the probe sandbox takes a second,
                # and every CLI call is a new process (see hostcache).
                failed = [c for c in host_checks(self._settings).cached() if not c.ok]
                if failed:
                    lines = "; ".join(f"{c.name}: {c.detail} (fix: {c.fix})" for c in failed)
                    raise BackendUnavailable(
                        f"this host cannot run gVisor sandboxes: {lines}. Run `corral doctor` "
                        "for details; the namespace tier (isolation=\"namespace\") may still "
                        "work here."
                    )
                _check_traversable(self._settings.home)
                path = find_runsc()
                if path is None:  # removed since the checks (or their key) looked
                    raise BackendUnavailable(
                        "runsc (gVisor) is not installed any more: install it with "
                        f"{Runsc.install_hint}, then run `corral doctor`")
                self._runsc = Runsc(path, self._dir / "state")
                self._runsc.prepare()
                self._bundles.mkdir(parents=True, exist_ok=True, mode=0o700)
                cgroups = detect_cgroups(self._instance)
                self._attach_cgroups(cgroups)
                self._launcher = GvisorLauncher(self._runsc, cgroups)
        return self._launcher

    def _rootfs_for(self, template: BaseTemplate) -> Path:
        rootfs = self._rootfs.get(template.system)
        if rootfs is None or not rootfs.is_dir():
            rootfs = self._rootfs[template.system] = ensure_rootfs(self._dir, template)
        return rootfs

    # -- lifecycle -------------------------------------------------------------------------

    def _limits(self, tier: ResourceTier) -> ResourceTier:
        return _host_limits(tier)

    def create(self, spec: SandboxSpec) -> None:
        self._ready()
        try:
            runtime_uid(spec.uid)
        except ValueError as exc:
            raise BackendError(str(exc)) from exc
        template = self._template(spec.template)
        rootfs = self._rootfs_for(template)
        self._create_host_pieces(spec)
        if self._resident_fits(template):
            # The pieces were just made: only the workspace's path is wanted here.
            self._resident_for(spec, self._store.ensure_mounted(spec), template,
                               rootfs).prestart(self._prestarts)

    def exec(self, spec: SandboxSpec, request: ExecRequest) -> ExecOutcome:
        if request.build_root is not None:
            raise BackendUnavailable("image builds run their steps on the namespace tier")
        launcher = self._ready()
        self._close_resident_if_unmounted(spec)
        workspace = self._ensure_runtime(spec)
        template = self._template(spec.template)
        rootfs = self._rootfs_for(template)
        group_name = self._group_name(request)
        container_id = _container_id(spec.id, group_name)
        env = self._command_env(spec, request)
        if any("\0" in item for pair in env.items() for item in pair):
            raise CommandError("environment names and values may not contain NUL bytes")
        if request.pty is None and self._resident_fits(template):
            return self._exec_resident(spec, request, env, workspace, template, rootfs)
        # runsc creates a missing working directory (as the runtime uid) where it can: refuse
        # one that is missing first, so only a concurrent command removing it in between can
        # leave such an (empty) directory behind. (The resident's launcher chdirs, as a shell.)
        self._check_cwd(spec, workspace, request.cwd)
        config = build_config(
            rootfs=rootfs, template=template, workspace=workspace,
            netns=self._netns_path(spec.id), uid=spec.uid, argv=request.argv, cwd=request.cwd,
            env=env, tmp_bytes=spec.tier.tmp_bytes, pids=spec.tier.pids,
            terminal=request.pty is not None, tmp=self._store.tmp_dir(spec.id),
            **self._bind_options(spec))
        return launcher.run(Launch(
            uid=spec.uid, netns_path=self._netns_path(spec.id), group=f"{spec.id}/{group_name}",
            container_id=container_id, bundle=self._bundles / container_id, config=config,
            request=request,
        ))

    def _check_cwd(self, spec: SandboxSpec, workspace: Path, cwd: str) -> None:
        """Refuse a working directory that is missing in the sandbox's own writable places
        (the only ones runsc could make it in; elsewhere the root is read-only)."""
        for inside, host in (("/workspace", workspace), ("/home/user", workspace),
                             ("/tmp", self._store.tmp_dir(spec.id))):
            if cwd != inside and not cwd.startswith(inside + "/"):
                continue
            root = os.open(host, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                # Resolved as the sandbox would: a symlink in it cannot lead out of the root.
                os.close(linux.openat2(root, cwd[len(inside):].lstrip("/") or ".",
                                       os.O_PATH | os.O_DIRECTORY, resolve=_RESOLVE_IN_ROOT))
            except OSError as exc:
                raise CommandError(f"cannot enter the working directory {cwd}: "
                                   f"{os.strerror(exc.errno or 0)}") from None
            finally:
                os.close(root)
            return

    def _volume_root_uid(self, spec: SandboxSpec) -> int:
        # gVisor's kernel makes each file as its host identity, the runtime uid, then gives it
        # to its owner: that uid must be mapped for the create to be allowed at all.
        return runtime_uid(spec.uid)

    def _bind_options(self, spec: SandboxSpec) -> dict[str, Any]:
        """``build_config``'s ``binds`` and ``mount_points`` for the sandbox's volumes and data
        mounts (after ``_ensure_runtime`` has bound them)."""
        planned = self._planned_mounts(spec)
        if not planned:
            return {}
        return {"binds": [(str(m.source), m.target, m.read_only) for m in planned],
                "mount_points": self._volumes.mount_points(
                    planned, self._store.mounts_dir(spec.id))}

    # -- the resident sandbox (Settings.gvisor_resident) ----------------------------------------

    def _resident_fits(self, template: BaseTemplate) -> bool:
        # The helper inside is Python: a root without python3 (an image) runs each command in
        # a gVisor sandbox of its own instead.
        return self._resident_on and template_python(template) is not None

    def _resident_group(self) -> str:
        # Named like a command's group (c.<owner>.<name>): a crashed owner's is swept as one,
        # and the runsc state named after it goes with it (_remove_runsc_leftovers). A new
        # name per start: runsc must never meet a container id it may still hold state for.
        self._resident_starts += 1
        return f"c.{self._owner}.{_RESIDENT_PREFIX}{self._resident_starts}"

    def _resident_for(self, spec: SandboxSpec, workspace: Path, template: BaseTemplate,
                      rootfs: Path) -> OnDemand:
        """The sandbox's resident holder, made on first use.

        A resident keeps the workspace mount it was started on; one started before the
        workspace was mounted anew (a snapshot sealed its layer, a restore reset it) would
        write into a sealed layer. Those close it first; the mount's identity catches any other
        remount (of the workspace or of a volume's bind), and the holder is replaced."""
        mounted = [os.stat(workspace), os.stat(self._store.tmp_dir(spec.id))] + [
            os.stat(m.source) for m in self._planned_mounts(spec)]
        # A volume's bind made anew (its volume remounted) also makes the resident stale.
        identity = tuple(n for st in mounted for n in (st.st_dev, st.st_ino))
        stale: OnDemand | None = None
        with self._lock:
            holder, given = self._residents.get(spec.id, (None, identity))
            if holder is not None and given != identity:
                stale, holder = holder, None
            if holder is None:
                config = build_config(
                    rootfs=rootfs, template=template, workspace=workspace,
                    netns=self._netns_path(spec.id), uid=spec.uid, argv=["true"],
                    cwd="/workspace", env={}, tmp_bytes=spec.tier.tmp_bytes,
                    pids=spec.tier.pids, terminal=False, tmp=self._store.tmp_dir(spec.id),
                    **self._bind_options(spec))
                python = template_python(template)
                assert python is not None  # callers check _resident_fits first
                holder = OnDemand(lambda: self._start_resident(spec, config, python),
                                  self._settings.gvisor_idle_s)
                self._residents[spec.id] = (holder, identity)
        if stale is not None:
            stale.close()
        return holder

    def _exec_resident(self, spec: SandboxSpec, request: ExecRequest, env: dict[str, str],
                       workspace: Path, template: BaseTemplate, rootfs: Path) -> ExecOutcome:
        holder = self._resident_for(spec, workspace, template, rootfs)
        stdout = OutputStream.for_request("stdout", request)
        stderr = OutputStream.for_request("stderr", request)
        started = time.monotonic()
        try:
            # RLIMIT_NPROC counts every task of uid 1000 in this gVisor kernel: the commands'
            # trees, their inits and the launcher set up ahead, as the namespace tier's pids
            # count bwrap's own.
            result = holder.run(
                list(request.argv), env=env, cwd=request.cwd, tmp_bytes=spec.tier.tmp_bytes,
                nproc=max(1, spec.tier.pids), timeout=request.timeout_s,
                key=request.command_id, stdin=request.stdin,
                on_start=request.on_start if request.interactive else None,
                on_output=lambda name, data: (stdout if name == "stdout" else stderr).feed(data))
        except BackendError as exc:
            if "could not start" in str(exc) and "chdir" in str(exc):
                raise CommandError(
                    f"cannot enter the working directory {request.cwd}: {exc}") from None
            if isinstance(exc, ResidentDied) and self._ended_by_oom(exc.group):
                # The OOM killer took the Sentry: every command in it died of memory.
                return ExecOutcome(
                    exit_code=_KILLED_EXIT_CODE, stdout=stdout.finish(),
                    stderr=stderr.finish(), timed_out=False,
                    usage=Usage(wall_s=time.monotonic() - started, cpu_s=0.0,
                                peak_memory_bytes=0, oom_killed=True))
            raise
        exit_code = result.exit_code
        if result.exec_errno is not None and (failed := exec_failure(
                request.argv[0], os.strerror(result.exec_errno))) is not None:
            exit_code, message = failed
            stderr.feed(message.encode())
        if result.timed_out:
            exit_code = TIMEOUT_EXIT_CODE
        oom_killed = self._ended_by_oom(result.group)
        if oom_killed:
            # One Sentry for all commands: the OOM kill counts for the whole group, so the
            # resident sandbox is replaced (the next command starts a fresh one and group).
            self._close_resident(spec.id)
        return ExecOutcome(
            exit_code=exit_code, stdout=stdout.finish(), stderr=stderr.finish(),
            timed_out=result.timed_out,
            usage=Usage(wall_s=time.monotonic() - started, cpu_s=result.cpu_s,
                        peak_memory_bytes=result.peak_rss_bytes, oom_killed=oom_killed),
            stdout_truncated=stdout.dropped, stderr_truncated=stderr.dropped,
            stdout_bytes=bytes(stdout.raw), stderr_bytes=bytes(stderr.raw))

    def _ended_by_oom(self, group: str) -> bool:
        """Whether the OOM killer acted in a resident's group. Remembered before the group is
        removed, so a command beside the one that saw it first still learns why it ended."""
        if group in self._oom_groups:
            return True
        with contextlib.suppress(BackendError, OSError):
            if self.cgroups.usage(group).oom_killed:
                with self._lock:
                    self._oom_groups.add(group)
                return True
        return False

    def _start_resident(self, spec: SandboxSpec, config: dict[str, Any],
                        python: str) -> Resident:
        """Start the resident sandbox in its own group of the sandbox's cgroup, placed there
        before runsc runs (the FIFO shim, as ``launcher`` does for a command)."""
        launcher = self._ready()
        with self._lock:
            name = self._resident_group()
        group = f"{spec.id}/{name}"
        container_id = _container_id(spec.id, name)
        bundle = self._bundles / container_id
        self.cgroups.create_command(group)
        fifo = self._bundles / f"{container_id}.release"

        releases: list[int] = []
        placed: list[frozenset[int] | None] = []

        def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
            os.mkfifo(fifo, 0o600)
            # Open (and the FIFO in place) until the helper has answered: the shim opens it by
            # name, maybe only after we wrote.
            releases.append(os.open(fifo, os.O_RDWR | os.O_CLOEXEC))
            held = [*argv[:4], launcher.sh, "-c", _SHIM, "sh", str(fifo), *argv[4:]]
            proc = launcher.spawner.run(self._netns_path(spec.id), lambda: subprocess.Popen(
                held, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, env=privileged_env(), cwd="/"))
            try:
                self.cgroups.attach(group, (proc.pid,))
                os.write(releases[0], b"go\n")
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            return proc

        def closed() -> None:
            with contextlib.suppress(BackendError, OSError):
                self.cgroups.kill(group)
            reap_orphans(runtime_uid(spec.uid))
            with contextlib.suppress(BackendError, OSError):
                self.cgroups.remove(group)
            if self._cpus is not None:
                for cpus in placed:
                    self._cpus.release(cpus)
                placed.clear()

        try:
            resident = Resident(launcher.runsc, bundle, container_id, config,
                                ensure_launcher(self._dir), spawn, on_close=closed,
                                group=group, python=python)
            if self._cpus is not None:
                # Once up, not before: see _linux.cpus (the Sentry sizes GOMAXPROCS at start).
                cpus = self._cpus.place(spec.tier.cpus)
                placed.append(cpus)
                if cpus is not None:
                    pin_tasks(self.cgroups.procs_files(group)[0], cpus)
            return resident
        except BaseException:
            closed()
            raise
        finally:
            for release in releases:
                os.close(release)
            fifo.unlink(missing_ok=True)

    def _holder(self, sandbox_id: str) -> OnDemand | None:
        with self._lock:
            entry = self._residents.get(sandbox_id)
        return entry[0] if entry is not None else None

    def _close_resident(self, sandbox_id: str, *, forget: bool = False) -> None:
        with self._lock:
            entry = self._residents.pop(sandbox_id, None)
            if forget:
                self._oom_groups = {g for g in self._oom_groups
                                    if not g.startswith(f"{sandbox_id}/")}
        if entry is not None:
            entry[0].close()

    def busy(self, spec: SandboxSpec) -> bool:
        # The resident's group is no command: it alone does not make the sandbox busy.
        holder = self._holder(spec.id)
        if holder is not None and holder.busy:
            return True
        return any(not name.rsplit(".", 1)[-1].startswith(_RESIDENT_PREFIX)
                   for name in self.cgroups.children(spec.id))

    def kill_command(self, spec: SandboxSpec, command_id: str) -> bool:
        holder = self._holder(spec.id)
        if holder is not None and holder.kill(command_id):
            return True
        return super().kill_command(spec, command_id)

    def close(self) -> None:
        with self._lock:
            holders, self._residents = [h for h, _ in self._residents.values()], {}
        for holder in holders:
            holder.close()
        super().close()

    # -- the tier's own leftovers --------------------------------------------------------------

    def _destroy_extra(self, spec: SandboxSpec) -> None:
        self._remove_runsc_leftovers(lambda sandbox_id: sandbox_id != spec.id)

    def _sweep_extra(self, is_live: Callable[[str], bool]) -> list[Leftover]:
        return self._remove_runsc_leftovers(is_live)

    def _remove_runsc_leftovers(self, is_live: Callable[[str], bool]) -> list[Leftover]:
        """runsc state files and bundles of commands that no longer run."""
        assert self._runsc is not None
        # Listed before the cgroups are: a command makes its cgroup before its bundle and
        # state, so anything listed here whose group exists below is still running.
        states = self._runsc.state_entries()
        bundles = sorted(p.name for p in self._bundles.iterdir()) if self._bundles.is_dir() else []
        running: dict[str, set[str]] = {}

        def alive(container_id: str) -> bool:
            sandbox_id, _, _ = container_id.partition(".")
            if sandbox_id == "probe":  # a host check's probe: "probe.<pid>.<random>"
                pid = container_id.split(".")[1]
                return pid.isdigit() and os.path.exists(f"/proc/{pid}")
            if not is_live(sandbox_id):
                return False
            if sandbox_id not in running:
                running[sandbox_id] = {_container_id(sandbox_id, name)
                                       for name in self.cgroups.children(sandbox_id)}
            return container_id in running[sandbox_id]

        removed = []
        for container_id in sorted(set(states) | set(bundles)):
            if alive(container_id):
                continue
            self._runsc.remove_state(container_id)
            # Never rmtree: a resident's start FIFO (``<id>.release``) may be left here, and
            # rmtree opens what it is given first (a FIFO's open waits for a writer).
            remove_tree(self._bundles / container_id)
            removed.append(Leftover("runsc", container_id.partition(".")[0], container_id))
        return removed


if TYPE_CHECKING:  # the protocol, checked by mypy
    from ...backends import IsolationBackend

    _conforms: type[IsolationBackend] = GvisorBackend
