"""The namespace tier: bwrap + user/PID/mount/IPC/UTS/cgroup namespaces + seccomp + cgroups,
a private network namespace per sandbox and a per-sandbox host uid.

A command runs from the sandbox's resident helper (``resident``, on by default,
``Settings.namespace_resident``): one bwrap per sandbox in use, started by its second command
(the first takes a bwrap of its own: see ``_first_command``) and stopped after
``Settings.namespace_idle_s`` with nothing running, whose zygote starts each command in fresh
PID, mount, IPC, UTS and cgroup namespaces of its own. A terminal (PTY) command, an image
build's step, and every command with the resident off run in a bwrap of their own
(``runner.CommandLauncher.run``). The resident is closed before the workspace is mounted anew
(a snapshot's seal, a restore) or after its mounts went away, and replaced when a mount it was
given or its template changed.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from ..._settings import Settings
from ...backends import BackendName, ExecOutcome, ExecRequest, HostCheck, SandboxSpec
from ...errors import BackendUnavailable
from .._linux.cgroups import detect_cgroups
from .._linux.host import HostBackedBackend
from .._linux.hostcheck import host_checks
from .._linux.ondemand import OnDemand
from .._linux.template import build_root_template
from .resident import RESIDENT_PREFIX, WARM_PREFIX, GroupRetirer, Zygote, ensure_zygote
from .runner import CommandLauncher, Launch, ensure_launch_helper

__all__ = ["NamespaceBackend"]


class NamespaceBackend(HostBackedBackend):
    """See the module docstring. One instance per process and data directory."""

    name: BackendName = "namespace"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._launcher: CommandLauncher | None = None
        self._resident_on = settings.namespace_resident
        self._lock = threading.Lock()
        # Sandboxes that ran a command in this process (see _first_command).
        self._commanded: set[str] = set()
        # A sandbox's resident, with the identity of what it was started on (see _zygote_for).
        self._zygotes: dict[str, tuple[OnDemand[Zygote], tuple[object, ...]]] = {}
        # Makes each resident's next command init while the current command runs.
        self._warmer = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1),
                                          thread_name_prefix="corral-zygote-warm")
        self._retirer: GroupRetirer | None = None  # with the cgroup driver, in _ready

    def check_host(self) -> list[HostCheck]:
        return host_checks(self._settings).fresh()

    def _ready(self) -> CommandLauncher:
        if self._launcher is None:
            # Remembered for this boot: every CLI call is a new process (see hostcache).
            failed = [c for c in host_checks(self._settings).cached() if not c.ok]
            if failed:
                lines = "; ".join(f"{c.name}: {c.detail} (fix: {c.fix})" for c in failed)
                raise BackendUnavailable(
                    f"this host cannot run namespace sandboxes safely: {lines}. "
                    "Run `corral doctor` for details."
                )
            bwrap = shutil.which("bwrap")
            assert bwrap is not None  # checked above
            cgroups = detect_cgroups(self._instance)
            self._attach_cgroups(cgroups)
            self._retirer = GroupRetirer(cgroups)
            # Commands start from a mount namespace without the mounts of the sandboxes,
            # layers, volumes and network namespaces below these (each brings its own
            # sandbox's); templates and helpers are directories, not mounts.
            self._launcher = CommandLauncher(
                bwrap=bwrap, cgroups=cgroups,
                launch_helper=functools.partial(ensure_launch_helper,
                                                self._settings.home / "helpers"),
                lean_hides=(self._store.root, self._store.layers_root,
                            self._volumes.root, self._settings.run_dir))
        return self._launcher

    def create(self, spec: SandboxSpec) -> None:
        self._create_host_pieces(spec)

    def exec(self, spec: SandboxSpec, request: ExecRequest) -> ExecOutcome:
        launcher = self._ready()
        self._close_resident_if_unmounted(spec)
        workspace = self._ensure_runtime(spec)
        template = (self._template(spec.template) if request.build_root is None
                    else build_root_template(Path(request.build_root)))
        # An image build's step has a root of its own and never a volume.
        mounts = () if request.build_root is not None else tuple(
            (str(m.source), m.target, m.read_only) for m in self._planned_mounts(spec))
        tree = self._store.sandbox_dir(spec.id)
        launch = Launch(
            uid=spec.uid, netns_path=self._netns_path(spec.id),
            template=template, workspace=workspace,
            tmp_bytes=spec.tier.tmp_bytes, group=f"{spec.id}/{self._group_name(request)}",
            request=request, env=self._command_env(spec, request), mounts=mounts,
            tmp=None if request.build_root is not None else self._store.tmp_dir(spec.id),
            # Every mount of Corral's the command binds is below the sandbox's directory
            # (its volumes and data mounts are bound there first); the rest is the host's
            # system directories and the template's.
            tree=tree if request.build_root is None and workspace.is_relative_to(tree) else None,
        )
        assert self._retirer is not None  # made with the launcher
        if (not self._resident_on or request.pty is not None or request.build_root is not None
                or template.writable or self._first_command(spec.id)):
            return launcher.run(launch, retire=self._retire_soon)
        holder = self._zygote_for(spec, launch)
        with holder.use() as zygote:
            return launcher.run_resident(zygote, launch, retire=self._retirer.retire)

    def _retire_soon(self, group: str) -> None:
        assert self._retirer is not None
        self._retirer.retire(group, soon=True)

    def _first_command(self, sandbox_id: str) -> bool:
        """True for a sandbox's first command in this process, which takes the bwrap path: a
        resident's start (bwrap, then the first init, each moved into a cgroup) costs more
        than one bwrap command, and many sandboxes run one command (a burst of creates, an
        evaluation's single check). From the second on, the resident pays for itself."""
        with self._lock:
            if sandbox_id in self._commanded:
                return False
            self._commanded.add(sandbox_id)
            return True

    def _zygote_for(self, spec: SandboxSpec, launch: Launch) -> OnDemand[Zygote]:
        """The sandbox's resident holder, made on first use. A resident keeps the mounts it
        was started with: one whose workspace, volume binds or template changed since (a
        remount, a rebuilt template) is replaced."""
        mounted = [os.stat(launch.workspace)] + [os.stat(m[0]) for m in launch.mounts] + (
            [os.stat(launch.tmp)] if launch.tmp is not None else [])
        identity: tuple[object, ...] = (
            id(launch.template), launch.mounts, launch.tmp_bytes,
            *(n for st in mounted for n in (st.st_dev, st.st_ino)))
        stale: OnDemand[Zygote] | None = None
        with self._lock:
            holder, given = self._zygotes.get(spec.id, (None, identity))
            if holder is not None and given != identity:
                stale, holder = holder, None
            if holder is None:
                holder = OnDemand(lambda: self._start_zygote(spec, launch),
                                  self._settings.namespace_idle_s)
                self._zygotes[spec.id] = (holder, identity)
        if stale is not None:
            stale.close()
        return holder

    def _start_zygote(self, spec: SandboxSpec, launch: Launch) -> Zygote:
        launcher = self._ready()
        helper = ensure_zygote(self._settings.home / "helpers")
        return Zygote(
            start=lambda fd, group: launcher.start_resident(launch, helper, fd, group),
            cgroups=launcher.cgroups, sandbox_group=spec.id, owner=self._owner,
            warmer=self._warmer)

    def _close_resident(self, sandbox_id: str, *, forget: bool = False) -> None:
        with self._lock:
            entry = self._zygotes.pop(sandbox_id, None)
            if forget:
                self._commanded.discard(sandbox_id)
        if entry is not None:
            entry[0].close()

    def _holder(self, sandbox_id: str) -> OnDemand[Zygote] | None:
        with self._lock:
            entry = self._zygotes.get(sandbox_id)
        return entry[0] if entry is not None else None

    def busy(self, spec: SandboxSpec) -> bool:
        # The resident's group and its init made ahead are no command.
        holder = self._holder(spec.id)
        if holder is not None and holder.busy:
            return True
        retiring = self._retirer.pending() if self._retirer is not None else frozenset()
        return any(not name.startswith((RESIDENT_PREFIX, WARM_PREFIX))
                   and f"{spec.id}/{name}" not in retiring
                   for name in self.cgroups.children(spec.id))

    def close(self) -> None:
        with self._lock:
            holders, self._zygotes = [h for h, _ in self._zygotes.values()], {}
        for holder in holders:
            holder.close()
        self._warmer.shutdown(wait=False, cancel_futures=True)
        if self._retirer is not None:
            self._retirer.close()
        super().close()


if TYPE_CHECKING:  # the protocol, checked by mypy
    from ...backends import IsolationBackend

    _conforms: type[IsolationBackend] = NamespaceBackend
