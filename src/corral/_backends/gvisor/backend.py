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

Issue 14 ("the gVisor tier made fast"): designed, prototyped and measured, **not wired in yet**
(commands still take the per-command path above). The design, in ``resident`` (host side),
``inside`` (the helper, gVisor's init) and ``run.c`` (the per-command launcher):

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

Measured 2026-12-01, same run (``bench/bench_gvisor.py --runs 12``, p50, load 2.5-3.5 from
other suites, so every number is ~1.5x the quiet machine's): ``runsc do true`` 274 ms, a
Corral gVisor command today 329 ms, a namespace-tier command 27.6 ms, ``runsc exec --user
1000:1000 true`` into a long-lived sandbox 34.0 ms, **a resident command 35.5 ms (1.29x the
namespace tier's; target 1.5x and <= 50 ms)**; starting a resident sandbox ~0.35-0.66 s
(``runsc run`` plus Python's start inside), paid once per busy period.

Left before the tier can use it (each a guarantee the per-command path keeps today):
wiring into ``exec`` with the supervise loop's streaming, output caps, interactive stdin and
PTY (the helper has neither yet), ``kill_command`` (a ``kill`` op exists), stopping the
resident sandbox after N idle seconds and restarting it on demand, OOM (one Sentry per
sandbox: a memory bomb that trips the cgroup kills every running command, not just its own),
the sweep telling a live resident's state from a crashed one's (``<id>.resident`` is removed
as a dead command's today, which is right after a crash and wrong under another live
process), and one resident per Corral process (two processes using one sandbox would run two).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

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
from ...models import ResourceTier
from .._linux.cgroups import detect_cgroups
from .._linux.host import HostBackedBackend
from .._linux.template import BaseTemplate
from .bundle import build_config, ensure_rootfs, runtime_uid
from .hostcheck import check_host, gvisor_dir
from .launcher import GvisorLauncher, Launch
from .runsc import Runsc, find_runsc

__all__ = ["GvisorBackend"]

logger = logging.getLogger(__name__)

# Host tasks a running command needs beyond its own: runsc, the gofer and the Sentry's threads
# (measured: ~35 for `sleep`). Inside, RLIMIT_NPROC holds the command to the tier's pids; the
# host cgroup only has to keep a runaway gVisor from the host, never starve a Sentry of threads.
_RUNTIME_TASKS = 64


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
            shutil.rmtree(self._bundles / container_id, ignore_errors=True)
            removed.append(Leftover("runsc", container_id.partition(".")[0], container_id))
        return removed


if TYPE_CHECKING:  # the protocol, checked by mypy
    from ...backends import IsolationBackend

    _conforms: type[IsolationBackend] = GvisorBackend
