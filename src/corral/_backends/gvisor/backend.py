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
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import secrets
import shutil
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from ..._settings import Settings
from ...backends import BackendName, ExecOutcome, ExecRequest, HostCheck, SandboxSpec, SealResult
from ...errors import BackendError, BackendUnavailable, CommandError, ConfigError
from ...models import ResourceTier
from ..namespace import netns
from ..namespace.cgroups import CgroupDriver, detect_cgroups
from ..namespace.storage import WorkspaceStore
from ..namespace.template import BaseTemplate, load_template
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


def _proc_start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(pid: str, start_time: str) -> bool:
    try:
        return _proc_start_time(int(pid)) == start_time
    except ValueError:
        return False


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


class GvisorBackend:
    """See the module docstring. One instance per process and data directory."""

    name: BackendName = "gvisor"

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._instance = f"corral-{settings.instance}"
        self._store = WorkspaceStore(settings.home / "sandboxes")
        self._templates_dir = settings.home / "templates"
        self._dir = gvisor_dir(settings)
        self._bundles = self._dir / "bundles"
        self._cgroups: CgroupDriver | None = None
        self._runsc: Runsc | None = None
        self._templates: dict[str, BaseTemplate] = {}
        self._rootfs: dict[tuple[tuple[str, str, str], ...], Path] = {}
        # Sandboxes whose cgroup this process has already set up (the hot path skips the writes).
        self._ensured: set[str] = set()
        self._launcher: GvisorLauncher | None = None
        self._lock = threading.Lock()
        # Command cgroups carry the owner's pid and start time, as in the namespace tier.
        self._owner = f"{os.getpid()}.{_proc_start_time(os.getpid())}"

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
                self._cgroups = detect_cgroups(self._instance)
                self._launcher = GvisorLauncher(self._runsc, self._cgroups)
        return self._launcher

    @property
    def cgroups(self) -> CgroupDriver:
        self._ready()
        assert self._cgroups is not None
        return self._cgroups

    def _netns_path(self, sandbox_id: str) -> Path:
        return self._settings.run_dir / f"{self._instance}-{sandbox_id}"

    def _template(self, name: str) -> BaseTemplate:
        template = self._templates.get(name)
        if template is None:
            ca = self._settings.home / "egress" / "ca.pem"
            template = self._templates[name] = load_template(
                name, self._templates_dir, extra_ca=ca.read_bytes() if ca.exists() else None)
        return template

    def _rootfs_for(self, template: BaseTemplate) -> Path:
        rootfs = self._rootfs.get(template.system)
        if rootfs is None or not rootfs.is_dir():
            rootfs = self._rootfs[template.system] = ensure_rootfs(self._dir, template)
        return rootfs

    # -- lifecycle -------------------------------------------------------------------------

    def create(self, spec: SandboxSpec) -> None:
        self._ready()
        try:
            runtime_uid(spec.uid)
        except ValueError as exc:
            raise BackendError(str(exc)) from exc
        self._rootfs_for(self._template(spec.template))
        try:
            self.cgroups.create_sandbox(spec.id, _host_limits(spec.tier))
            self._ensured.add(spec.id)
            netns.create_netns(self._netns_path(spec.id))
            self._store.create(spec)
        except BaseException:
            with contextlib.suppress(BackendError, OSError):
                self.destroy(spec)
            raise

    def _ensure_runtime(self, spec: SandboxSpec) -> Path:
        """Rebuild what a reboot or crash removed (netns pin, cgroup, mount)."""
        path = self._netns_path(spec.id)
        if not netns.is_pinned(path):
            path.unlink(missing_ok=True)
            netns.create_netns(path)
        if spec.id not in self._ensured:
            self.cgroups.create_sandbox(spec.id, _host_limits(spec.tier))
            self._ensured.add(spec.id)
        return self._store.ensure_mounted(spec)

    def open_listener(self, spec: SandboxSpec) -> socket.socket:
        """A listener in the sandbox's network namespace: with ``--network=host``, gVisor's
        sockets are that namespace's sockets, so commands reach it at ``127.0.0.1:<port>``."""
        launcher = self._ready()
        self._ensure_runtime(spec)

        def bind() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind(("127.0.0.1", 0))
                sock.listen(128)
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
            return sock

        return launcher.spawner.run(self._netns_path(spec.id), bind)

    def workspace_root(self, spec: SandboxSpec) -> Path:
        self._ready()
        return self._store.ensure_mounted(spec)

    def exec(self, spec: SandboxSpec, request: ExecRequest) -> ExecOutcome:
        launcher = self._ready()
        workspace = self._ensure_runtime(spec)
        template = self._template(spec.template)
        rootfs = self._rootfs_for(template)
        # The group's name carries the owner (to tell crash leftovers from live neighbours) and
        # the command id (so a sweep can say which command was interrupted).
        group_name = f"c.{self._owner}.{request.command_id or secrets.token_hex(4)}"
        container_id = _container_id(spec.id, group_name)
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin",
            "HOME": "/workspace",
            "USER": "user",
            "LOGNAME": "user",
            "SHELL": "/bin/bash",
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "TMPDIR": "/tmp",
            "CORRAL_SANDBOX_ID": spec.id,
            **request.env,
        }
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

    # -- workspace layers --------------------------------------------------------------------

    def seal_workspace(self, spec: SandboxSpec, layer_id: str) -> SealResult:
        self._ready()
        return self._store.seal(spec, layer_id)

    def reset_workspace(self, spec: SandboxSpec) -> None:
        self._ready()
        self._store.reset(spec)

    def remove_layer(self, layer_id: str) -> None:
        self._store.remove_layer(layer_id)

    def layer_ids(self) -> list[str]:
        return self._store.layer_ids()

    # -- running commands --------------------------------------------------------------------

    def pause(self, spec: SandboxSpec, paused: bool) -> None:
        """Freeze every process of every running command (runsc, gofer, Sentry, stubs) with
        the cgroup freezer: gVisor's kernel stops with its processes, mid-instruction."""
        self._ready()
        self._ensure_runtime(spec)
        self.cgroups.freeze(spec.id, paused)

    def busy(self, spec: SandboxSpec) -> bool:
        self._ready()
        return bool(self.cgroups.children(spec.id))

    def kill_command(self, spec: SandboxSpec, command_id: str) -> bool:
        self._ready()
        for name in self.cgroups.children(spec.id):
            if name.endswith(f".{command_id}"):
                self.cgroups.kill(f"{spec.id}/{name}")
                return True
        return False

    def destroy(self, spec: SandboxSpec) -> None:
        self._ready()
        assert self._runsc is not None
        self._ensured.discard(spec.id)
        with contextlib.suppress(BackendError, OSError):
            self.cgroups.freeze(spec.id, False)  # a frozen process cannot die
        self.cgroups.kill(spec.id)
        self.cgroups.remove(spec.id)
        self._remove_runsc_leftovers(lambda sandbox_id: sandbox_id != spec.id)
        netns.remove_netns(self._netns_path(spec.id))
        self._store.remove(spec.id)

    def _remove_runsc_leftovers(self, is_live: Callable[[str], bool]) -> list[str]:
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
            removed.append(f"runsc {container_id}")
        return removed

    def sweep(self, live_ids: set[str] | Callable[[str], bool]) -> list[str]:
        """Remove runtime pieces of unknown sandboxes, commands of dead owners and runsc state
        of commands that no longer run.

        ``live_ids`` may be a callable asked just before each removal: a sandbox created while
        the sweep runs must not lose its pieces to a list of ids read before it existed.
        """
        self._ready()
        is_live: Callable[[str], bool] = (
            live_ids.__contains__ if isinstance(live_ids, set) else live_ids)
        removed: list[str] = []
        for sandbox_id in self._store.ids():
            if not is_live(sandbox_id):
                self._store.remove(sandbox_id)
                removed.append(f"workspace {sandbox_id}")
        run_dir = self._settings.run_dir
        prefix = f"{self._instance}-"
        if run_dir.exists():
            for entry in run_dir.iterdir():
                if entry.name.startswith(prefix) and not is_live(entry.name[len(prefix):]):
                    netns.remove_netns(entry)
                    removed.append(f"netns {entry.name}")
        for sandbox_id in self.cgroups.children(""):
            if not is_live(sandbox_id):
                self.cgroups.kill(sandbox_id)
                self.cgroups.remove(sandbox_id)
                removed.append(f"cgroup {sandbox_id}")
                continue
            for command in self.cgroups.children(sandbox_id):
                owner = command.split(".")
                if len(owner) >= 3 and _owner_alive(owner[1], owner[2]):
                    continue
                group = f"{sandbox_id}/{command}"
                self.cgroups.kill(group)
                self.cgroups.remove(group)
                removed.append(f"command {group}")
        removed += self._remove_runsc_leftovers(is_live)
        if removed:
            logger.info("swept %d leftovers: %s", len(removed), ", ".join(removed))
        return removed

    def close(self) -> None:
        pass

    def remove_instance(self) -> None:
        """Remove this data directory's empty top-level cgroups (tests and uninstall)."""
        if self._cgroups is not None and not self._cgroups.children(""):
            self._cgroups.remove("")
