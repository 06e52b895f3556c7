"""What every tier gives a sandbox on the host, built, rebuilt and swept the same way.

A sandbox's network namespace (only ``lo``), its cgroup, its layered workspace and its template
do not depend on how commands run, so the namespace and gVisor tiers share them: one class,
``HostBackedBackend``, owns those pieces and implements the parts of the backend protocol that
only touch them. A tier subclasses it and adds what is its own: host checks, starting commands,
and (through the ``_limits``/``_destroy_extra``/``_sweep_extra`` hooks) its own leftovers.
Both tiers lay pieces out under the same names, so either one's sweep recognises the other's.

Volumes and data mounts (``SandboxSpec.mounts``, ``volumes``) are host pieces too: a sandbox's
binds of them are made with its workspace and rebuilt with it; the tier only says where inside
they go. Its volumes are stored here for every host tier of the data directory alike.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Set
from pathlib import Path
from typing import Any, Protocol

from ..._core.failpoints import failpoint
from ..._core.owner import owner_alive, this_owner
from ..._settings import Settings
from ..._templates import catalog
from ..._workspace.files import WorkspaceFiles
from ...backends import (
    EgressEndpoint,
    ExecRequest,
    Hibernated,
    Leftover,
    SandboxSpec,
    SealResult,
    WorkspaceFS,
)
from ...errors import BackendError, BackendUnavailable, ConfigError, PortClosed, SandboxBusy
from ...models import ResourceTier
from . import netns
from .cgroups import CgroupDriver, CgroupNow, detect_cgroups
from .loop import attached
from .ondemand import OnDemand
from .ready import ReadyWorkspaces
from .storage import WorkspaceStore, is_mount
from .template import BaseTemplate, load_template
from .tmparchive import archive_tree, digest_of, restore_tree
from .uids import lowest_free_uid
from .volumes import BoundMount, VolumeKit

__all__ = ["HostBackedBackend", "TierLauncher"]

logger = logging.getLogger(__name__)


class TierLauncher(Protocol):
    """What a tier's ``_ready`` returns: its command launcher, which owns the thread that
    enters the sandboxes' network namespaces."""

    @property
    def spawner(self) -> netns.Spawner: ...


def require_host_access(home: Path) -> None:
    """What every host-backed tier needs before anything else: root, and a data directory the
    sandboxes' own uids can reach."""
    if os.geteuid() != 0:
        raise BackendUnavailable(
            "Corral must run as root: each sandbox gets its own unprivileged host uid, and "
            "setting that up needs root. Run `corral doctor` for the full host check."
        )
    home.mkdir(parents=True, exist_ok=True, mode=0o711)
    os.chmod(home, 0o711)
    for parent in home.parents:
        # bwrap runs as the sandbox's uid and must reach the template and the workspace.
        if not os.stat(parent).st_mode & 0o001:
            raise ConfigError(
                f"{parent} is not traversable by other users (mode "
                f"{os.stat(parent).st_mode & 0o777:o}), so sandboxes cannot reach "
                f"{home}; `chmod o+x {parent}` or choose another CORRAL_HOME")


class HostBackedBackend:
    """The shared half of a tier. Subclasses call ``_attach_cgroups`` from ``_ready`` and
    implement ``_ready`` (returning their ``TierLauncher``), ``check_host`` and ``exec``."""

    def __init__(self, settings: Settings) -> None:
        require_host_access(settings.home)
        self._settings = settings
        self._instance = f"corral-{settings.instance}"
        self._store = WorkspaceStore(settings.home / "sandboxes")
        self._volumes = VolumeKit(settings.home / "volumes", settings.data_mounts)
        self._templates_dir = settings.home / "templates"
        self._cgroups: CgroupDriver | None = None
        self._templates: dict[str, BaseTemplate] = {}
        # Sandboxes whose cgroup this process has already set up (the hot path skips the writes).
        self._ensured: set[str] = set()
        # Command cgroups carry the owner's pid and start time, so a later process can tell a
        # crashed owner's leftovers from a live neighbour's commands.
        self._owner = this_owner()
        self._ready_workspaces = ReadyWorkspaces(self._store, self._owner)
        self._spare_netns = netns.SpareNamespaces()
        self._unmounted_lock = threading.Lock()
        # A listener bound in each new sandbox's namespace as it was made, for its first
        # egress listener (``egress_endpoint``); closed with the sandbox if never taken.
        self._listeners: dict[str, socket.socket] = {}
        self._listeners_lock = threading.Lock()

    # -- hooks --------------------------------------------------------------------------------

    def _holder(self, sandbox_id: str) -> OnDemand[Any] | None:
        """The sandbox's resident helper (a tier that keeps one per sandbox in use), if any."""
        return None

    def _close_resident(self, sandbox_id: str, *, forget: bool = False) -> None:
        """Stop the sandbox's resident helper, if any (``forget``: the sandbox goes)."""

    def _ready(self) -> TierLauncher:
        raise NotImplementedError

    def _spawner(self) -> netns.Spawner:
        return self._ready().spawner

    def _limits(self, tier: ResourceTier) -> ResourceTier:
        """The sandbox cgroup's limits for ``tier`` (a tier may need room for its runtime)."""
        return tier

    def _destroy_extra(self, spec: SandboxSpec) -> None:
        """Remove the tier's own pieces of ``spec`` (after its processes are dead)."""

    def _sweep_extra(self, is_live: Callable[[str], bool]) -> list[Leftover]:
        """Remove the tier's own leftovers of sandboxes that are not live."""
        return []

    def _volume_root_uid(self, spec: SandboxSpec) -> int:
        """The host uid a volume's root-owned files are shown to the sandbox as, and its root
        creates files as (root itself; gVisor's kernel creates them as the runtime uid)."""
        return 0

    def _keep_group(self, sandbox_id: str, name: str) -> bool:
        """True for a child group of a live sandbox that is the tier's own and still in use
        (not a command of a dead owner), so the sweep leaves it.

        Any tier's sweep walks every sandbox's groups (they share one tree), and a group not
        named after its owner process (``<kind>.<pid>.<start>...``) belongs to a tier that
        tells for itself: the microVM tier's ``vm`` holds QEMU, which a namespace process's
        sweep once killed. Only that tier's sweep decides about it (its override)."""
        return len(name.split(".")) < 3

    # -- shared pieces ------------------------------------------------------------------------

    def _attach_cgroups(self, cgroups: CgroupDriver) -> None:
        self._cgroups = cgroups
        # A process that ends without closing its backend (every CLI call) removes the data
        # directory's groups too, once no sandbox has one in them.
        atexit.register(self._remove_instance_group, cgroups)

    @property
    def cgroups(self) -> CgroupDriver:
        self._ready()
        assert self._cgroups is not None
        return self._cgroups

    def _netns_path(self, sandbox_id: str) -> Path:
        return self._settings.run_dir / f"{self._instance}-{sandbox_id}"

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
            pointer = os.readlink(catalog.pointer(self._templates_dir, name))
        except OSError:
            return False
        return template.root.parent.name == pointer and template.etc.is_dir()

    def _group_name(self, request: ExecRequest) -> str:
        # The group's name carries the owner (to tell crash leftovers from live neighbours) and
        # the command id (so a sweep can say which command was interrupted).
        return f"c.{self._owner}.{request.command_id or secrets.token_hex(4)}"

    @staticmethod
    def _command_env(spec: SandboxSpec, request: ExecRequest) -> dict[str, str]:
        """The whole environment of a command: built from scratch, never the host's."""
        return {
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

    # -- lifecycle ----------------------------------------------------------------------------

    def _create_host_pieces(self, spec: SandboxSpec) -> None:
        self._ready()
        self._template(spec.template)
        self._planned_mounts(spec)  # a refused target or name fails before anything is built
        try:
            self.cgroups.create_sandbox(spec.id, self._limits(spec.tier))
            self._ensured.add(spec.id)
            # The network namespace is made beside the workspace: neither needs the other.
            pinned = self._spare_netns.start(self._netns_path(spec.id))
            try:
                workspace = self._ready_workspaces.claim(spec) or self._store.create(spec)
            except BaseException:
                with contextlib.suppress(Exception):
                    # Finished before the destroy below, which removes it.
                    made = pinned()
                    if made is not None:
                        made.close()
                raise
            listener = pinned()
            if listener is not None:
                with self._listeners_lock:
                    self._listeners[spec.id] = listener
            self._store.ensure_tmp(spec)
            self._ensure_mounts(spec, workspace)
        except BaseException:
            with contextlib.suppress(BackendError, OSError):
                self.destroy(spec)
            raise

    def _ensure_runtime(self, spec: SandboxSpec) -> Path:
        """Rebuild what a reboot or crash removed (netns pin, cgroup, mounts)."""
        self._ensure_netns_and_cgroup(spec)
        workspace = self._store.ensure_mounted(spec)
        self._store.ensure_tmp(spec)
        self._ensure_mounts(spec, workspace)
        return workspace

    def _ensure_mounts(self, spec: SandboxSpec, workspace: Path) -> list[BoundMount]:
        """The sandbox's volumes and data mounts, mounted and bound for it."""
        return self._volumes.ensure(spec, self._store.mounts_dir(spec.id), workspace,
                                    root_uid=self._volume_root_uid(spec))

    def _planned_mounts(self, spec: SandboxSpec) -> list[BoundMount]:
        """``_ensure_mounts``'s list without touching a mount (after ``_ensure_runtime``)."""
        return self._volumes.plan(spec, self._store.mounts_dir(spec.id))

    def _ensure_netns_and_cgroup(self, spec: SandboxSpec) -> None:
        """The pieces every tier's sandbox has on the host, rebuilt if a reboot or crash
        removed them: the pinned network namespace and the sandbox's cgroup."""
        path = self._netns_path(spec.id)
        if not netns.is_pinned(path):
            path.unlink(missing_ok=True)
            netns.create_netns(path)
        if spec.id not in self._ensured:
            self.cgroups.create_sandbox(spec.id, self._limits(spec.tier))
            self._ensured.add(spec.id)

    def allocate_uid(self, taken: Set[int]) -> int:
        return lowest_free_uid(taken, self._settings.uid_start, self._settings.uid_count)

    def egress_endpoint(self, spec: SandboxSpec) -> EgressEndpoint:
        """A listener on 127.0.0.1 *inside* the sandbox's network namespace, bound from here
        (setns on the spawner thread), so no helper runs in the sandbox."""
        sock = self._open_listener(spec)
        return EgressEndpoint(listener=sock, proxy_url=f"http://127.0.0.1:{sock.getsockname()[1]}")

    def _open_listener(self, spec: SandboxSpec) -> socket.socket:
        with self._listeners_lock:
            made = self._listeners.pop(spec.id, None)
        if made is not None:
            return made
        spawner = self._spawner()
        self._ensure_netns_and_cgroup(spec)  # what the bind needs (the exec ensures the rest)

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

        return spawner.run(self._netns_path(spec.id), bind)

    def open_port(self, spec: SandboxSpec, port: int, timeout_s: float) -> socket.socket:
        """A socket made inside the sandbox's network namespace (a socket keeps the
        namespace it was made in), connected from this thread: the spawner thread only makes
        it, so a slow connect never holds up other sandboxes' commands. gVisor runs with
        ``--network=host`` in that namespace, so its loopback is this one too."""
        spawner = self._spawner()
        self._ensure_netns_and_cgroup(spec)
        sock = spawner.run(self._netns_path(spec.id),
                           lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        try:
            sock.settimeout(timeout_s)
            sock.connect(("127.0.0.1", port))
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            sock.close()
            reason = "timed out" if isinstance(exc, TimeoutError) else (
                exc.strerror or str(exc))
            raise PortClosed(f"nothing in sandbox {spec.id} accepts connections on port "
                             f"{port} ({reason}); start a server listening on 0.0.0.0:{port} "
                             f"or 127.0.0.1:{port} there") from None
        return sock

    def usage_now(self, spec: SandboxSpec) -> CgroupNow | None:
        """The sandbox's CPU time so far and memory now, from its cgroup (None when it has
        none: paused mid-teardown, or gone)."""
        try:
            return self.cgroups.now(spec.id)
        except (OSError, ValueError):
            return None

    def files(self, spec: SandboxSpec) -> WorkspaceFS:
        return WorkspaceFiles(self.workspace_root(spec), spec.uid)

    def workspace_root(self, spec: SandboxSpec) -> Path:
        """Host path of the sandbox's ``/workspace``, mounted (this kit's own, not protocol)."""
        self._ready()
        return self._store.ensure_mounted(spec)

    # -- workspace layers ---------------------------------------------------------------------

    def seal_workspace(self, spec: SandboxSpec, layer_id: str) -> SealResult:
        self._ready()
        self._close_resident(spec.id)  # nothing runs (the caller's promise); its mount goes
        return self._store.seal(spec, layer_id)

    def recover_seal(self, spec: SandboxSpec, layer_id: str) -> SealResult | None:
        self._ready()
        self._close_resident(spec.id)
        return self._store.recover_seal(spec, layer_id)

    def reset_workspace(self, spec: SandboxSpec) -> None:
        self._ready()
        self._close_resident(spec.id)
        self._store.reset(spec)
        self._store.ensure_tmp(spec, fresh=True)

    def _close_resident_if_unmounted(self, spec: SandboxSpec) -> None:
        """A resident keeps the mounts it was started with alive in its mount namespace. If
        the host's went away under it (a reboot of the mounts, an operator's umount), the
        resident must be gone before they are mounted again: a second mount beside the one
        it holds (the overlay on the same upper directory, an ext4 image on a second loop
        device) would fail or lose what the first has not written back."""
        with self._unmounted_lock:  # a close under way elsewhere finishes first
            holder = self._holder(spec.id)
        if holder is None or not holder.running:
            return
        points = [self._store.mount_point(spec.id), self._store.tmp_dir(spec.id),
                  *(m.source for m in self._planned_mounts(spec))]
        # statx's word, not a device comparison with the parent: a data mount's bind of a
        # directory of the parent's filesystem has the parent's device.
        if all(is_mount(point) for point in points):
            return
        # Held while the resident closes: a command beside this one must not mount the image
        # again before the old mount is gone with the resident.
        with self._unmounted_lock:
            self._close_resident(spec.id)

    def remove_layer(self, layer_id: str) -> None:
        self._store.remove_layer(layer_id)

    def layer_ids(self) -> list[str]:
        return self._store.layer_ids()

    def mounted_layers(self) -> list[str]:
        return self._store.mounted_layers()

    def release_layer(self, layer_id: str) -> bool:
        return self._store.release_layer(layer_id)

    # -- volumes (VolumeStorage) ---------------------------------------------------------------

    def create_volume(self, volume_id: str, size_bytes: int) -> None:
        self._volumes.create(volume_id, size_bytes)

    def remove_volume(self, volume_id: str) -> None:
        self._volumes.remove(volume_id)

    def volume_usage(self, volume_id: str) -> int:
        return self._volumes.usage(volume_id)

    def volume_ids(self) -> list[str]:
        return self._volumes.ids()

    # -- running commands ---------------------------------------------------------------------

    def pause(self, spec: SandboxSpec, paused: bool) -> None:
        self._ready()
        # A resident frozen mid-start would time out under its own lock (and hold up the
        # destroy that waits for that lock): a start under way finishes first.
        holder = self._holder(spec.id)
        if paused and holder is not None:
            holder.settle()
        self._ensure_runtime(spec)
        self.cgroups.freeze(spec.id, paused)

    def busy(self, spec: SandboxSpec) -> bool:
        self._ready()
        return bool(self.cgroups.children(spec.id))

    def kill_command(self, spec: SandboxSpec, command_id: str) -> bool:
        self._ready()
        for name in self.cgroups.children(spec.id):
            if name.endswith(f".{command_id}"):
                group = f"{spec.id}/{name}"
                # An empty group is no running command: named for it a moment before its
                # process joins, or ended and waiting to be removed. A kill then killed
                # nothing and said it had; "not running" lets the caller try again.
                if not any(_read_pids(path) for path in self.cgroups.procs_files(group)):
                    return False
                self.cgroups.kill(group)
                return True
        return False

    def destroy(self, spec: SandboxSpec) -> None:
        self._ready()
        # Thawed first: a frozen process cannot die, so a paused sandbox's resident would
        # not stop (its close waited out every kill's deadline) and its destroy stuck.
        with contextlib.suppress(BackendError, OSError):
            self.cgroups.freeze(spec.id, False)
        # Then a resident still starting is waited for and stopped, so it never makes its
        # group inside a cgroup being removed.
        self._close_resident(spec.id, forget=True)
        self._release_host_pieces(spec)
        self._store.remove(spec.id)

    def _release_host_pieces(self, spec: SandboxSpec) -> None:
        """What every tier's sandbox holds on the host beside its files, gone: the egress
        listener made ahead for it, its cgroup (and what still runs in it), the tier's own
        pieces, its pinned network namespace. A destroy and a hibernate both end so."""
        self._ensured.discard(spec.id)
        self._drop_listener(spec.id)
        self.cgroups.kill(spec.id)
        self.cgroups.remove(spec.id)
        self._destroy_extra(spec)
        netns.remove_netns(self._netns_path(spec.id))

    # -- hibernation (backends.Hibernation) ---------------------------------------------------

    def _tmp_archive(self, sandbox_id: str) -> Path:
        return self._store.sandbox_dir(sandbox_id) / "priv" / "tmp.tar"

    def _released_mark(self, sandbox_id: str) -> Path:
        """Written by a hibernate that saw the workspace's filesystem gone from every loop
        device: its wake may mount the image anew without looking for one to reuse (a scan
        of every loop device: ~10 ms on a host with a thousand of them)."""
        return self._store.sandbox_dir(sandbox_id) / "priv" / "released"

    #: No host tier keeps a process's memory on disk (docs/design/hibernation.md says why).
    keeps_processes = False

    def hibernate(self, spec: SandboxSpec) -> Hibernated:
        self._ready()
        if self.busy(spec):
            raise SandboxBusy(f"sandbox {spec.id} has processes running; hibernating would end "
                              "them (this tier does not keep a process's memory on "
                              "disk; the microvm tier does): stop them, or leave it paused")
        return self._hibernate(spec)

    def recover_hibernate(self, spec: SandboxSpec) -> Hibernated | None:
        self._ready()
        tmp, archive = self._store.tmp_dir(spec.id), self._tmp_archive(spec.id)
        whole = all(path.exists() for path in self.cgroups.procs_files(spec.id))
        if whole and is_mount(tmp):  # cut short before it released anything: as it was
            archive.unlink(missing_ok=True)
            archive.with_name(archive.name + ".part").unlink(missing_ok=True)
            return None
        return self._hibernate(spec)

    def _hibernate(self, spec: SandboxSpec) -> Hibernated:
        """Every step may be taken again: a hibernate cut short at any point is finished by
        running it once more (``recover_hibernate``)."""
        # Thawed, so that its resident (which is no command) can be stopped.
        with contextlib.suppress(BackendError, OSError):
            self.cgroups.freeze(spec.id, False)
        self._close_resident(spec.id, forget=True)
        tmp, archive = self._store.tmp_dir(spec.id), self._tmp_archive(spec.id)
        self._released_mark(spec.id).unlink(missing_ok=True)
        if is_mount(tmp) and not os.listdir(tmp):
            archive.unlink(missing_ok=True)  # an empty /tmp: nothing to keep
            image = Hibernated(tmp_bytes=0, digest="")
        else:
            if is_mount(tmp):
                size = archive_tree(tmp, archive)
            elif archive.exists():  # a hibernate cut short after the archive: it is /tmp
                size = archive.stat().st_size
            else:  # no /tmp since a reboot: an empty one
                self._store.ensure_tmp(spec)
                size = archive_tree(tmp, archive)
            image = Hibernated(tmp_bytes=size, digest=digest_of(archive))
        failpoint("hibernate.archived")
        self._release_host_pieces(spec)
        self._store.unmount(spec.id, behind=False)
        if attached(str(self._store.image_path(spec.id))) is None:
            self._released_mark(spec.id).touch(mode=0o600)
        failpoint("hibernate.released")
        return image

    def wake(self, spec: SandboxSpec, image: Hibernated) -> None:
        self._ready()
        archive = self._tmp_archive(spec.id)
        if image.digest:
            if not archive.exists():
                raise BackendError(f"the hibernated /tmp of sandbox {spec.id} is missing "
                                   f"({archive}); its workspace is intact: `corral rm` it, or "
                                   "ask the operator")
            if digest_of(archive) != image.digest:
                raise BackendError(f"the hibernated image of sandbox {spec.id} was changed on "
                                   f"disk since it hibernated ({archive} no longer matches "
                                   f"{image.digest}); it is not woken and left as it is")
        released = self._released_mark(spec.id)
        if released.exists():
            self._store.ensure_mounted(spec, fresh=True)
            released.unlink()
        self._ensure_runtime(spec)
        tmp = self._store.ensure_tmp(spec, fresh=True)
        if image.digest:
            restore_tree(archive, tmp, spec.uid)
            archive.unlink()

    def _drop_listener(self, sandbox_id: str) -> None:
        with self._listeners_lock:
            made = self._listeners.pop(sandbox_id, None)
        if made is not None:
            made.close()

    def sweep(self, live_ids: set[str] | Callable[[str], bool]) -> list[Leftover]:
        """Remove runtime pieces of unknown sandboxes and commands of dead owners.

        ``live_ids`` may be a callable asked just before each removal: a sandbox created while
        the sweep runs must not lose its pieces to a list of ids read before it existed.
        """
        self._ready()
        is_live: Callable[[str], bool] = (
            live_ids.__contains__ if isinstance(live_ids, set) else live_ids)
        removed: list[Leftover] = []
        with self._listeners_lock:
            held = list(self._listeners)
        for sandbox_id in held:  # never taken, and the sandbox destroyed by another process
            if not is_live(sandbox_id):
                self._drop_listener(sandbox_id)
        for sandbox_id in self._store.ids():
            if not is_live(sandbox_id):
                self._store.remove(sandbox_id)
                removed.append(Leftover("workspace", sandbox_id, sandbox_id))
        for name in self._ready_workspaces.stale(owner_alive):
            self._store.remove(name)
            removed.append(Leftover("spare", "", name))
        run_dir = self._settings.run_dir
        prefix = f"{self._instance}-"
        if run_dir.exists():
            for entry in run_dir.iterdir():
                sandbox_id = entry.name[len(prefix):]
                if entry.name.startswith(prefix) and not is_live(sandbox_id):
                    netns.remove_netns(entry)
                    removed.append(Leftover("netns", sandbox_id, entry.name))
        for sandbox_id in self.cgroups.children(""):
            if not is_live(sandbox_id):
                self.cgroups.kill(sandbox_id)
                self.cgroups.remove(sandbox_id)
                removed.append(Leftover("cgroup", sandbox_id, sandbox_id))
                continue
            for command in self.cgroups.children(sandbox_id):
                owner = command.split(".")
                if len(owner) >= 3 and owner_alive(owner[1], owner[2]):
                    continue
                if self._keep_group(sandbox_id, command):
                    continue
                group = f"{sandbox_id}/{command}"
                try:
                    self.cgroups.kill(group)
                except BackendError as exc:
                    # Its sandbox is paused (a frozen process takes no SIGKILL): left for a
                    # sweep after it wakes (or its destroy), never the end of this sweep.
                    logger.info("leftover command group %s left for now: %s", group, exc)
                    continue
                self.cgroups.remove(group)
                # The group is named c.<owner pid>.<start time>.<command id> (_group_name).
                command_id = command.rsplit(".", 1)[-1]
                removed.append(Leftover("command", sandbox_id, group,
                                        command_id if command_id.startswith("cmd_") else None))
        removed += self._sweep_extra(is_live)
        if removed:
            logger.info("swept %d leftovers: %s", len(removed), ", ".join(map(str, removed)))
        return removed

    def close(self) -> None:
        self._ready_workspaces.close()
        self._spare_netns.close()
        self._remove_instance_group(self._cgroups)

    def remove_instance(self) -> None:
        """Remove this data directory's spare workspaces and empty top-level cgroups (tests
        and uninstall)."""
        self._ready_workspaces.close()
        cgroups = self._cgroups
        if cgroups is None:  # this process never set the tier up: look for them anyway
            with contextlib.suppress(BackendUnavailable):
                cgroups = detect_cgroups(self._instance)
        self._remove_instance_group(cgroups)

    @staticmethod
    def _remove_instance_group(cgroups: CgroupDriver | None) -> None:
        """The data directory's ``corral-<instance>`` groups, if no sandbox has a group in
        them (a clean shutdown, an uninstall): nothing else removes them. A sandbox another
        process makes meanwhile keeps them (never removed from under it)."""
        if cgroups is None:
            return
        try:
            cgroups.remove_if_empty("")
        except BackendError as exc:
            logger.info("the data directory's cgroups were not removed: %s", exc)


def _read_pids(path: Path) -> bool:
    """Whether a ``cgroup.procs`` file lists a process (a group gone meanwhile: none)."""
    try:
        return bool(path.read_text().strip())
    except OSError:
        return False
