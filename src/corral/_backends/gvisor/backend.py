"""The gVisor tier: every command runs in a fresh gVisor sandbox (``runsc run``), a user-space
kernel between the command and the host, on top of the namespace tier's per-sandbox pieces.

A sandbox's runtime is the same as in the namespace tier, built by the same code and laid out
under the same names (so either tier's sweep recognises it): a network namespace holding only
``lo``, a cgroup with the tier's limits, and the layered workspace. What differs is how a command
runs: runsc with an OCI bundle (``bundle``), as uid 1000 inside, its gVisor processes as the
sandbox's own runtime uid outside.

Choices, measured on the development machines (2 cores, Linux 6.18, cgroup v1, no nested KVM,
runsc 20240729, other test suites running alongside; ``bench/bench_gvisor.py`` repeats them):

* **A fresh sandbox per command, not a long-lived one with ``runsc exec``.** ``runsc exec`` into a
  running sandbox costs ~28 ms against ~170 ms for ``runsc run``, but booting a long-lived sandbox
  (``runsc create`` + ``start``) takes ~210 ms, so create + first command would be ~240 ms, about
  1.8x bare ``runsc do true`` (~130 ms) where the target is 1.5x; a fresh ``runsc run`` gives
  ~195-200 ms (create ~10 ms). A long-lived sandbox would also keep a Sentry (~40 MB) alive per
  idle sandbox where the namespace tier keeps nothing, and its commands would share one kernel,
  process table and PID namespace, so neither "each command its own PID namespace" nor "whatever
  a command leaves behind dies with it" would hold without more machinery inside. One sandbox
  per command keeps the namespace tier's semantics exactly: a command's cgroup holds its whole
  sandbox, so timeouts, ``kill_command``, pause and usage work the same way.
* **Network: ``--network=host`` inside the sandbox's network namespace.** gVisor's own network
  stack (``sandbox``/``none``) has a loopback of its own, so the egress gateway's listener, bound
  to 127.0.0.1 in the sandbox's namespace, is unreachable from it; bridging it would need a relay
  process inside every sandbox, and two commands (a background server and its client) could not
  talk over loopback. With ``host``, gVisor hands socket calls to the host kernel in a namespace
  that holds only ``lo``, exactly the namespace tier's network: no route, no resolver, the
  gateway (and only it) at ``127.0.0.1:<port>``, and one command's server reachable from the
  next. The price, measured: ~30 ms per command (runsc ships precompiled seccomp filters only
  for gVisor's own network stack and compiles the host-network one at every start), which puts
  create + first command at ~1.5x bare ``runsc do`` instead of ~1.25x; and the Sentry's own
  filter is wider (socket calls reach the host kernel, confined to that namespace). Raw and
  packet sockets stay off (``--net-raw=false``) and netlink is refused by the command's filter.
* **Platform: systrap** (see ``runsc``); KVM is not available on the development machines.

Issue 14 ("the gVisor tier made fast"): designed, measured, and wired in **only as an
experimental opt-in** (``CORRAL_GVISOR_RESIDENT=1``; by default every command still takes the
per-command path above). The design, in ``resident`` (host side), ``inside`` (the helper,
gVisor's init) and ``run.c`` (the per-command launcher):

* One *resident* sandbox per Corral sandbox in use: one attached ``runsc run`` (``create``
  cannot be given pipes: the sandbox inherits them and ``create`` waits for their EOF forever),
  its init a small helper speaking JSON lines over runsc's stdin/stdout.
* Not ``runsc exec``: measured here (``bench/bench_gvisor.py``, ``long_lived``), a ``runsc
  exec`` process reports ``Seccomp: 0`` and may ``unshare(CLONE_NEWUSER)``: the OCI profile
  covers the container's init only. It also runs as root inside unless given ``--user``, and
  shares the init's mount and PID namespace (one ``/tmp`` for all commands).
* Per command the helper spawns the static launcher with ``posix_spawn`` (a fork of the
  Python helper costs 20-45 ms in gVisor's systrap, ``posix_spawn`` ~12 ms, the whole
  launcher ~30 ms): own mount and PID namespace, a fresh size-limited ``/tmp`` and
  ``/dev/shm`` (the namespace tier's semantics, kept), a namespace init that reaps and whose
  exit kills the rest of the tree, and the command as 1000:1000 with no capabilities,
  ``no_new_privs``, its rlimits and the namespace tier's own BPF filter (``_linux.seccomp``)
  installed as the last step before exec. The helper holds KILL, SETGID, SETUID, SETPCAP and
  SYS_ADMIN in gVisor's kernel only.
* Usage per command comes from the namespace init's ``wait4`` (CPU of every reaped process,
  peak as the largest single process's RSS: weaker than the cgroup's peak of the whole tree).
* The helper sets up the next command's launcher while nothing runs (namespaces, mounts,
  init), so a command waits only for its request, a vfork and its exec.

Measured 2026-12-01, same run (``bench/bench_gvisor.py --runs 30``, p50, load 1.8-3.0 from
other suites): ``runsc do true`` 207 ms, a Corral gVisor command on the per-command path 236
ms, a namespace-tier command 22.0 ms, ``runsc exec --user=1000:1000 true`` into a long-lived
sandbox 31.6 ms, the resident mechanism alone 21.5 ms, and **a Corral gVisor command on the
resident path 31.8 ms: 1.45x the namespace tier's** (target 1.5x), against 207 ms for
``runsc do true`` (the issue's target: at most 50 ms per command). Other runs that day gave
1.29x-1.49x (1.29x at 35.5 ms before the launcher was set up ahead, under heavier load).
Starting a resident sandbox takes 0.4-0.9 s (``runsc run`` plus Python's start inside), once
per busy period.

With the opt-in, a plain command (no PTY, no interactive or given stdin: those keep the
per-command path) runs in the sandbox's resident sandbox, started on demand (``OnDemand``) in
a group ``c.<owner>.resident`` of the sandbox cgroup (placed before runsc runs, like a
command; so limits, pause and ``destroy`` hold it, and a crashed owner's is swept as a
command's, its runsc state with it), stopped after ``RESIDENT_IDLE_S`` with nothing running.
``kill_command``, ``busy`` and timeouts (exit 124) go through the helper. Left before it can be
the default (each a guarantee the per-command path keeps):

* PTY and interactive stdin in the helper (today those commands take the old path);
* OOM: one Sentry for all commands, so a memory bomb that trips the cgroup can take the others
  with it; the group's OOM counter is cumulative, so the resident is replaced after one;
* peak memory is the largest process's RSS (``wait4``), not the whole tree's;
* no host process is left *between* commands only after the idle stop: within
  ``RESIDENT_IDLE_S`` the Sentry stays (``test_gvisor.py``'s host-side "nothing lingers"
  check fails in this mode; inside, the command's PID namespace is gone on return);
* one resident per Corral process: two processes using one sandbox run two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from .._linux.host import HostBackedBackend
from .._linux.notfound import exec_failure
from .._linux.process_io import OutputStream
from .._linux.supervise import TIMEOUT_EXIT_CODE
from .._linux.template import BaseTemplate
from .bundle import build_config, ensure_rootfs, runtime_uid
from .hostcheck import check_host, gvisor_dir
from .launcher import _SHIM, GvisorLauncher, Launch, reap_orphans
from .resident import OnDemand, Resident, ensure_launcher
from .runsc import Runsc, find_runsc

__all__ = ["GvisorBackend"]

_KILLED_EXIT_CODE = 128 + 9
_RESIDENT_PREFIX = "resident-"

logger = logging.getLogger(__name__)

# Host tasks a running command needs beyond its own: runsc, the gofer and the Sentry's threads
# (measured: ~35 for `sleep`). Inside, RLIMIT_NPROC holds the command to the tier's pids; the
# host cgroup only has to keep a runaway gVisor from the host, never starve a Sentry of threads.
_RUNTIME_TASKS = 64
# EXPERIMENTAL (issue 14, see the module docstring): "1" runs plain commands (no PTY, no
# interactive or given stdin) in a resident sandbox per Corral sandbox; anything else, or unset,
# keeps the per-command sandbox.
RESIDENT_ENV = "CORRAL_GVISOR_RESIDENT"
# A resident sandbox with nothing running for this long is stopped (no process left).
RESIDENT_IDLE_S = 10.0


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
        self._resident_on = os.environ.get(RESIDENT_ENV) == "1"
        self._residents: dict[str, OnDemand] = {}
        self._resident_groups: dict[str, str] = {}  # sandbox id -> its resident's group
        self._resident_starts = 0

    # -- set-up ----------------------------------------------------------------------------

    def check_host(self) -> list[HostCheck]:
        return check_host(self._settings)

    def _ready(self) -> GvisorLauncher:
        if self._launcher is not None:
            return self._launcher
        with self._lock:
            if self._launcher is None:
                failed = [c for c in self.check_host() if not c.ok]
                if failed:
                    lines = "; ".join(f"{c.name}: {c.detail} (fix: {c.fix})" for c in failed)
                    raise BackendUnavailable(
                        f"this host cannot run gVisor sandboxes: {lines}. Run `corral doctor` "
                        "for details; the namespace tier (isolation=\"namespace\") may still "
                        "work here."
                    )
                _check_traversable(self._settings.home)
                path = find_runsc()
                assert path is not None  # checked above
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
        self._rootfs_for(self._template(spec.template))
        self._create_host_pieces(spec)

    def exec(self, spec: SandboxSpec, request: ExecRequest) -> ExecOutcome:
        launcher = self._ready()
        workspace = self._ensure_runtime(spec)
        template = self._template(spec.template)
        rootfs = self._rootfs_for(template)
        group_name = self._group_name(request)
        container_id = _container_id(spec.id, group_name)
        env = self._command_env(spec, request)
        if any("\0" in item for pair in env.items() for item in pair):
            raise CommandError("environment names and values may not contain NUL bytes")
        if (self._resident_on and request.pty is None and not request.interactive
                and request.stdin is None and request.on_start is None):
            return self._exec_resident(spec, request, env, workspace, template, rootfs)
        # runsc creates a missing working directory (as the runtime uid); the control plane has
        # checked that it exists, so only a concurrent command removing it in between can leave
        # such an (empty) directory behind.
        config = build_config(
            rootfs=rootfs, template=template, workspace=workspace,
            netns=self._netns_path(spec.id), uid=spec.uid, argv=request.argv, cwd=request.cwd,
            env=env, tmp_bytes=spec.tier.tmp_bytes, pids=spec.tier.pids,
            terminal=request.pty is not None)
        return launcher.run(Launch(
            uid=spec.uid, netns_path=self._netns_path(spec.id), group=f"{spec.id}/{group_name}",
            container_id=container_id, bundle=self._bundles / container_id, config=config,
            request=request,
        ))

    # -- the resident sandbox (experimental, RESIDENT_ENV) ---------------------------------------

    def _resident_group(self) -> str:
        # Named like a command's group (c.<owner>.<name>): a crashed owner's is swept as one,
        # and the runsc state named after it goes with it (_remove_runsc_leftovers). A new
        # name per start: runsc must never meet a container id it may still hold state for.
        self._resident_starts += 1
        return f"c.{self._owner}.{_RESIDENT_PREFIX}{self._resident_starts}"

    def _exec_resident(self, spec: SandboxSpec, request: ExecRequest, env: dict[str, str],
                       workspace: Path, template: BaseTemplate, rootfs: Path) -> ExecOutcome:
        with self._lock:
            holder = self._residents.get(spec.id)
            if holder is None:
                config = build_config(
                    rootfs=rootfs, template=template, workspace=workspace,
                    netns=self._netns_path(spec.id), uid=spec.uid, argv=["true"],
                    cwd="/workspace", env={}, tmp_bytes=spec.tier.tmp_bytes,
                    pids=spec.tier.pids, terminal=False)
                holder = self._residents[spec.id] = OnDemand(
                    lambda: self._start_resident(spec, config), RESIDENT_IDLE_S)
        stdout = OutputStream("stdout", request.output_limit_bytes, request.on_stdout,
                              stream_past_limit=request.stream_past_limit)
        stderr = OutputStream("stderr", request.output_limit_bytes, request.on_stderr,
                              stream_past_limit=request.stream_past_limit)
        started = time.monotonic()
        try:
            # gVisor counts a task against RLIMIT_NPROC under the uid it was created with; the
            # command is created as root and becomes 1000 after, so it is not in the count.
            result = holder.run(
                list(request.argv), env=env, cwd=request.cwd, tmp_bytes=spec.tier.tmp_bytes,
                nproc=max(1, spec.tier.pids - 1), timeout=request.timeout_s,
                key=request.command_id,
                on_output=lambda name, data: (stdout if name == "stdout" else stderr).feed(data))
        except BackendError as exc:
            group = f"{spec.id}/{self._resident_groups.get(spec.id, '')}"
            if "could not start" in str(exc) and "chdir" in str(exc):
                raise CommandError(
                    f"cannot enter the working directory {request.cwd}: {exc}") from None
            with contextlib.suppress(BackendError, OSError):
                if self.cgroups.usage(group).oom_killed:
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
        oom_killed = False
        group = f"{spec.id}/{self._resident_groups.get(spec.id, '')}"
        with contextlib.suppress(BackendError, OSError):
            oom_killed = self.cgroups.usage(group).oom_killed
        if oom_killed:
            # One Sentry for all commands: the OOM kill counts for the whole group, so the
            # resident sandbox is replaced (the next command starts a fresh one and group).
            holder.close()
        return ExecOutcome(
            exit_code=exit_code, stdout=stdout.finish(), stderr=stderr.finish(),
            timed_out=result.timed_out,
            usage=Usage(wall_s=time.monotonic() - started, cpu_s=result.cpu_s,
                        peak_memory_bytes=result.peak_rss_bytes, oom_killed=oom_killed),
            stdout_truncated=stdout.dropped, stderr_truncated=stderr.dropped,
            stdout_bytes=bytes(stdout.raw), stderr_bytes=bytes(stderr.raw))

    def _start_resident(self, spec: SandboxSpec, config: dict[str, Any]) -> Resident:
        """Start the resident sandbox in its own group of the sandbox's cgroup, placed there
        before runsc runs (the FIFO shim, as ``launcher`` does for a command)."""
        launcher = self._ready()
        with self._lock:
            name = self._resident_groups[spec.id] = self._resident_group()
        group = f"{spec.id}/{name}"
        container_id = _container_id(spec.id, name)
        bundle = self._bundles / container_id
        self.cgroups.create_command(group)
        fifo = self._bundles / f"{container_id}.release"

        releases: list[int] = []

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

        try:
            return Resident(launcher.runsc, bundle, container_id, config,
                            ensure_launcher(self._dir), spawn, on_close=closed)
        except BaseException:
            closed()
            raise
        finally:
            for release in releases:
                os.close(release)
            fifo.unlink(missing_ok=True)

    def _close_resident(self, sandbox_id: str) -> None:
        with self._lock:
            holder = self._residents.pop(sandbox_id, None)
            self._resident_groups.pop(sandbox_id, None)
        if holder is not None:
            holder.close()

    def busy(self, spec: SandboxSpec) -> bool:
        # The resident's group is no command: it alone does not make the sandbox busy.
        with self._lock:
            holder = self._residents.get(spec.id)
        if holder is not None and holder.busy:
            return True
        return any(not name.rsplit(".", 1)[-1].startswith(_RESIDENT_PREFIX)
                   for name in self.cgroups.children(spec.id))

    def kill_command(self, spec: SandboxSpec, command_id: str) -> bool:
        with self._lock:
            holder = self._residents.get(spec.id)
        if holder is not None and holder.kill(command_id):
            return True
        return super().kill_command(spec, command_id)

    def close(self) -> None:
        with self._lock:
            holders, self._residents = list(self._residents.values()), {}
        for holder in holders:
            holder.close()
        super().close()

    # -- the tier's own leftovers --------------------------------------------------------------

    def _destroy_extra(self, spec: SandboxSpec) -> None:
        self._close_resident(spec.id)
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
            shutil.rmtree(self._bundles / container_id, ignore_errors=True)
            removed.append(Leftover("runsc", container_id.partition(".")[0], container_id))
        return removed


if TYPE_CHECKING:  # the protocol, checked by mypy
    from ...backends import IsolationBackend

    _conforms: type[IsolationBackend] = GvisorBackend
