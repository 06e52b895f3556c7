"""The namespace tier: bwrap + user/PID/mount/IPC/UTS/cgroup namespaces + seccomp + cgroups,
a private network namespace per sandbox and a per-sandbox host uid.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

from ..._settings import Settings
from ...backends import BackendName, ExecOutcome, ExecRequest, HostCheck, SandboxSpec
from ...errors import BackendError, BackendUnavailable
from . import netns
from .cgroups import CgroupDriver, detect_cgroups
from .hostcheck import check_host
from .runner import CommandLauncher, Launch
from .storage import SealResult, WorkspaceStore
from .template import BaseTemplate, load_template

__all__ = ["NamespaceBackend"]

logger = logging.getLogger(__name__)


def _proc_start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class NamespaceBackend:
    """See the module docstring. One instance per process and data directory."""

    name: BackendName = "namespace"

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._instance = f"corral-{settings.instance}"
        self._store = WorkspaceStore(settings.home / "sandboxes")
        self._templates_dir = settings.home / "templates"
        self._cgroups: CgroupDriver | None = None
        self._templates: dict[str, BaseTemplate] = {}
        # Sandboxes whose cgroup this process has already set up (the hot path skips the writes).
        self._ensured: set[str] = set()
        self._launcher: CommandLauncher | None = None
        # Command cgroups carry the owner's pid and start time, so a later process can tell a
        # crashed owner's leftovers from a live neighbour's commands.
        self._owner = f"{os.getpid()}.{_proc_start_time(os.getpid())}"

    # -- set-up ----------------------------------------------------------------------------

    def check_host(self) -> list[HostCheck]:
        return check_host(self._settings)

    def _ready(self) -> CommandLauncher:
        if self._launcher is None:
            failed = [c for c in self.check_host() if not c.ok]
            if failed:
                lines = "; ".join(f"{c.name}: {c.detail} (fix: {c.fix})" for c in failed)
                raise BackendUnavailable(
                    f"this host cannot run namespace sandboxes safely: {lines}. "
                    "Run `corral doctor` for details."
                )
            bwrap = shutil.which("bwrap")
            assert bwrap is not None  # checked above
            self._cgroups = detect_cgroups(self._instance)
            self._launcher = CommandLauncher(bwrap=bwrap, cgroups=self._cgroups)
        return self._launcher

    @property
    def cgroups(self) -> CgroupDriver:
        self._ready()
        assert self._cgroups is not None
        return self._cgroups

    def _netns_path(self, sandbox_id: str) -> Path:
        return self._settings.run_dir / f"{self._instance}-{sandbox_id}"

    # -- lifecycle -------------------------------------------------------------------------

    def _template(self, name: str) -> BaseTemplate:
        template = self._templates.get(name)
        if template is not None and not self._still_current(name, template):
            template = None  # rebuilt or removed since this process loaded it
        if template is None:
            ca = self._settings.home / "egress" / "ca.pem"
            template = self._templates[name] = load_template(
                name, self._templates_dir, extra_ca=ca.read_bytes() if ca.exists() else None)
        return template

    def _still_current(self, name: str, template: BaseTemplate) -> bool:
        """One readlink and one stat: a long-running service picks up a rebuilt template."""
        if template.root is None:
            return template.etc.is_dir()
        try:
            pointer = os.readlink(self._templates_dir / f"{name}.current")
        except OSError:
            return False
        return template.root.parent.name == pointer and template.etc.is_dir()

    def create(self, spec: SandboxSpec) -> None:
        self._ready()
        self._template(spec.template)
        try:
            self.cgroups.create_sandbox(spec.id, spec.tier)
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
            self.cgroups.create_sandbox(spec.id, spec.tier)
            self._ensured.add(spec.id)
        return self._store.ensure_mounted(spec)

    def open_listener(self, spec: SandboxSpec) -> socket.socket:
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
        # The group's name carries the owner (to tell crash leftovers from live neighbours) and
        # the command id (so a sweep can say which command was interrupted).
        group = f"{spec.id}/c.{self._owner}.{request.command_id or secrets.token_hex(4)}"
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
        return launcher.run(Launch(
            uid=spec.uid, netns_path=self._netns_path(spec.id), template=template,
            workspace=workspace, tmp_bytes=spec.tier.tmp_bytes, group=group, request=request,
            env=env,
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

    def pause(self, spec: SandboxSpec, paused: bool) -> None:
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
        self._ensured.discard(spec.id)
        with contextlib.suppress(BackendError, OSError):
            self.cgroups.freeze(spec.id, False)  # a frozen process cannot die
        self.cgroups.kill(spec.id)
        self.cgroups.remove(spec.id)
        netns.remove_netns(self._netns_path(spec.id))
        self._store.remove(spec.id)

    def sweep(self, live_ids: set[str] | Callable[[str], bool]) -> list[str]:
        """Remove runtime pieces of unknown sandboxes and commands of dead owners.

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
        if removed:
            logger.info("swept %d leftovers: %s", len(removed), ", ".join(removed))
        return removed

    def close(self) -> None:
        pass

    def remove_instance(self) -> None:
        """Remove this data directory's empty top-level cgroups (tests and uninstall)."""
        if self._cgroups is not None and not self._cgroups.children(""):
            self._cgroups.remove("")


def _owner_alive(pid: str, start_time: str) -> bool:
    try:
        return _proc_start_time(int(pid)) == start_time
    except ValueError:
        return False
