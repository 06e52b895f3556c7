"""The control plane's composition root: one ``Manager`` per data directory wires the
services (validation, sandboxes, commands and background processes, files, snapshots and
layers, recovery, tenants) and keeps the public methods every surface calls, each a thin
delegation. The services depend one way, in this order:

    validate, tenants, registry, locks, layers
      <- sandboxes <- intents, commands <- processes <- snapshots <- recovery;  files,
      ports, volumes <- sandboxes

and nothing below holds the Manager. The one call that goes up is recovery before first use
(sandboxes and commands are handed it as a plain ``ready`` callable), because recovery itself
is built on those services.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from .._audit.auditor import Auditor
from .._settings import Settings
from ..backends import IsolationBackend, OutputCallback, ProcessIO, SandboxSpec
from ..errors import SandboxNotFound
from ..models import CommandResult, Lifecycle, SandboxInfo, SnapshotInfo
from .admission import Admission, CommandWindows
from .auditbudget import AuditBudgets
from .commands import Commands
from .egress import EgressBroker, NetworkSpec
from .files import AuditedFiles, Files
from .intents import Intents
from .layers import Layers
from .locks import WorkspaceLocks
from .owners import Owners
from .ports import Ports
from .processes import ProcessTable
from .records import SandboxRecord
from .recovery import Recovery
from .registry import BackendRegistry
from .sandboxes import Sandboxes
from .secrets import SecretStore
from .snapshots import Snapshots
from .store import Store
from .tenants import Ceiling, Tenant, TenantDirectory
from .volumes import Volumes

if TYPE_CHECKING:
    from .interpreter import Interpreter

__all__ = ["Manager", "get_manager"]

# How long a fixture's clean-up waits for a destroy (a test's, a drill's).
_CLEANUP_WAIT_S = 120.0


class Manager:
    """Owns the store, the backends and the services of one data directory."""

    def __init__(self, settings: Settings, *, backend: IsolationBackend | None = None) -> None:
        """``backend`` replaces the default tier's (tests: ``corral.testing.memory_manager``);
        a host-backed tier checks its own preconditions (root, a traversable data directory)
        when it is loaded."""
        self.settings = settings
        # First: a tier that cannot run here refuses before anything is written to the home.
        self._registry = BackendRegistry(settings, default=backend)
        settings.home.mkdir(parents=True, exist_ok=True, mode=0o711)
        self.store = Store(settings.home / "corral.db")
        self.secrets = SecretStore(settings.home / "secrets.db")
        self.auditor = Auditor(directory=settings.home / "audit", secrets=self.secrets,
                               placeholders=self.store, counters=self.store,
                               enabled=settings.audit,
                               output_limit_bytes=settings.audit_output_bytes,
                               aggregate_window_s=settings.audit_aggregate_window_s,
                               aggregate_burst=settings.audit_aggregate_burst)
        self.audit_budgets = AuditBudgets(settings=settings, store=self.store,
                                          auditor=self.auditor)
        self.egress = EgressBroker(settings, self.store, self.secrets, self.auditor)
        self.backend: IsolationBackend = self._registry.default  # the default tier
        self.admission = Admission(Ceiling.from_settings(settings))
        locks = WorkspaceLocks(settings.home / "locks")
        self.layers = layers = Layers(self.store, self.backend, settings.home / "layers",
                        backends=self._registry.get, loaded=self._registry.all)
        self.sandboxes = Sandboxes(settings=settings, store=self.store,
                                   backends=self._registry, auditor=self.auditor,
                                   egress=self.egress, admission=self.admission,
                                   layers=layers, locks=locks, ready=self._ensure_recovered,
                                   budgets=self.audit_budgets)
        self.auditor.watch_budgets(self.audit_budgets, self.sandboxes.stop_over_budget)
        self.commands = Commands(store=self.store, sandboxes=self.sandboxes,
                                 auditor=self.auditor, egress=self.egress,
                                 admission=self.admission, locks=locks,
                                 ready=self._ensure_recovered)
        self.processes = ProcessTable(self.commands)
        self.intents = Intents(store=self.store, sandboxes=self.sandboxes,
                               auditor=self.auditor)
        self.snapshots = Snapshots(store=self.store, sandboxes=self.sandboxes,
                                   processes=self.processes, layers=layers, locks=locks,
                                   auditor=self.auditor, admission=self.admission,
                                   intents=self.intents)
        self.volumes = Volumes(settings=settings, store=self.store, backends=self._registry)
        self.recovery = Recovery(store=self.store, sandboxes=self.sandboxes,
                                 processes=self.processes, backends=self._registry,
                                 layers=layers, auditor=self.auditor, settings=settings,
                                 intents=self.intents, volumes=self.volumes)
        self.owners = Owners(self.store)
        self.file_access = Files(store=self.store, sandboxes=self.sandboxes,
                                 auditor=self.auditor)
        self._interpreter: Interpreter | None = None
        self._interpreter_lock = threading.Lock()
        self.ports = Ports(settings=settings, store=self.store, sandboxes=self.sandboxes,
                           auditor=self.auditor)
        # What the services hold per sandbox goes with it, on every destroy path.
        self.sandboxes.on_destroyed(self.processes.drop)
        self.sandboxes.on_destroyed(self._forget_kernels)

    @property
    def interpreter(self) -> Interpreter:
        """The code interpreter's kernels and contexts, built on first use: its module and the
        public models it loads are ~7 ms of every CLI call that runs no code. Under a lock:
        two first calls at once must share one (its contexts live in it)."""
        with self._interpreter_lock:
            if self._interpreter is None:
                from .interpreter import Interpreter

                self._interpreter = Interpreter(sandboxes=self.sandboxes,
                                                processes=self.processes, auditor=self.auditor)
            return self._interpreter

    # -- start-up and backends ------------------------------------------------------------------

    def recover(self) -> list[str]:
        """Finish interrupted destroys, reap expired sandboxes and sweep crash leftovers."""
        return self.recovery.recover()

    def _ensure_recovered(self) -> None:
        self.recovery.ensure()  # late-bound: recovery is built after the services it uses

    def backend_for(self, isolation: str) -> IsolationBackend:
        """The backend of tier ``isolation``, loaded on first use."""
        return self._registry.get(isolation)

    @property
    def _backends(self) -> dict[str, IsolationBackend]:
        return self._registry.loaded

    # -- tenants: ceilings and quotas -------------------------------------------------------------

    @property
    def ceiling(self) -> Ceiling:
        """The operator's default ceiling (CORRAL_CEILING_*), for callers without their own."""
        return self.admission.ceiling

    @property
    def starts(self) -> CommandWindows:
        return self.admission.starts

    def ceiling_for(self, caller: Tenant | None) -> Ceiling:
        """The caller's ceiling, the server default filling the fields it leaves open."""
        return self.admission.ceiling_for(caller)

    def admit(self, caller: Tenant | None) -> None:
        """Count one start of code (command, background process, terminal) against the
        caller's commands-per-minute; the one quota path every surface goes through."""
        self.admission.admit(caller)

    # -- sandboxes --------------------------------------------------------------------------------

    def create(
        self, *, template: str | None = None, resources: str = "small",
        timeout: float | None = None,
        labels: Mapping[str, str] | None = None, network: NetworkSpec = None,
        secrets: Sequence[str] | None = None, tenant: str | None = None,
        max_for_tenant: int | None = None, idle_timeout: float | None = None,
        isolation: str | None = None, snapshot: str | None = None,
        caller: Tenant | None = None, image: str | None = None,
        on_progress: Callable[[str], None] | None = None,
        volumes: Mapping[str, Any] | None = None, data_mounts: Mapping[str, Any] | None = None,
        lifecycle: Lifecycle | None = None,
    ) -> SandboxInfo:
        """Create a sandbox; from ``snapshot`` (id or name), its workspace starts as the
        snapshot's and its template defaults to the snapshot's.

        ``caller`` is who asks (default: the operator): its tiers and sandbox quota apply,
        and its ceiling (over the server default) bounds template, isolation, tier, hosts,
        secrets and lifetime (``CeilingExceeded`` beyond it). ``tenant`` is the owner
        (default: the caller). ``image``: an image reference instead of a template, pulled
        first unless it already was (``on_progress`` hears how that goes). ``volumes``: the
        owner's volumes by name, each at a mount point (``{"data": "/mnt/data"}``, or
        ``{"path": ..., "read_only": True}``); ``data_mounts``: the operator's data mounts by
        name, read-only, the same way. ``lifecycle``: what happens at its timeout (killed, or
        paused and kept for ``paused_keep_s``) and whether a call resumes it when paused."""
        owner = tenant or (caller.name if caller is not None else "local")
        mounts = self.volumes.mounts(volumes, data_mounts, tenant=owner) if (
            volumes or data_mounts) else []
        self.volumes.check_free(mounts)
        return self.sandboxes.create(
            template=template, resources=resources, timeout=timeout, labels=labels,
            network=network, secrets=secrets, tenant=tenant, max_for_tenant=max_for_tenant,
            idle_timeout=idle_timeout, isolation=isolation, snapshot=snapshot,
            caller=caller, image=image, on_progress=on_progress, mounts=mounts,
            lifecycle=lifecycle).public()

    @property
    def tenants(self) -> TenantDirectory:
        """Tenants and their API keys: who the HTTP surfaces' callers are."""
        return TenantDirectory(self.store)

    def record(self, sandbox_id: str) -> SandboxRecord | None:
        """The sandbox's stored record, read with no side effect (``get`` applies its lifetime
        and destroys it when it is over; a guard's owner check must not)."""
        return self.store.get(sandbox_id)

    def owner(self, sandbox_id: str, *, known_only: bool = False) -> str | None:
        """The tenant the sandbox was made for; None if there is no such sandbox (or, with
        ``known_only``, if it is not yet remembered: then nothing is read, and an event loop
        may ask). No side effect: its lifetime is ``get``'s to apply."""
        return self.owners.known(sandbox_id) if known_only else self.owners.of(sandbox_id)

    def records(self) -> builtins.list[SandboxRecord]:
        """Every stored record, those past their lifetime included (``list`` leaves them out)."""
        return self.store.list()

    def get(self, sandbox_id: str, *, tenant: str | None = None) -> SandboxInfo:
        """The sandbox; with ``tenant``, only if it belongs to that tenant (else not found)."""
        return self.sandboxes.get(sandbox_id, tenant=tenant).public()

    def list(self, *, tenant: str | None = None) -> builtins.list[SandboxInfo]:
        return [record.public() for record in self.sandboxes.list(tenant=tenant)]

    def set_timeout(self, sandbox_id: str, timeout: float, *,
                    caller: Tenant | None = None) -> SandboxInfo:
        return self.sandboxes.set_timeout(sandbox_id, timeout, caller=caller).public()

    def set_network(self, sandbox_id: str, network: NetworkSpec, *,
                    caller: Tenant | None = None) -> SandboxInfo:
        """Replace the sandbox's network policy; the next connection sees it. The allow rules
        must fall within the caller's hosts ceiling."""
        return self.sandboxes.set_network(sandbox_id, network, caller=caller).public()

    def pause(self, sandbox_id: str) -> SandboxInfo:
        """Freeze every process of the sandbox (files stay reachable); its TTL keeps running."""
        return self.sandboxes.pause(sandbox_id).public()

    def hibernate(self, sandbox_id: str) -> SandboxInfo:
        """Release every kernel piece of the sandbox (processes, mounts, loop devices,
        cgroup, network namespace), its files and /tmp kept on disk; woken by ``resume`` (or,
        with ``auto_resume``, by the next call). Refused while a process of it runs."""
        return self.sandboxes.hibernate(sandbox_id).public()

    def resume(self, sandbox_id: str) -> SandboxInfo:
        """Wake a paused or hibernated sandbox."""
        return self.sandboxes.resume(sandbox_id).public()

    def usage_now(self, sandbox_id: str) -> dict[str, float] | None:
        """A running sandbox's CPU seconds so far and memory now, where its tier can say
        (``{"cpu_s", "memory_bytes"}``), else None."""
        record = self.sandboxes.get(sandbox_id)
        sample = getattr(self.sandboxes.backend(record), "usage_now", None)
        now = sample(self.sandboxes.spec(record)) if sample is not None else None
        return None if now is None else {"cpu_s": round(now.cpu_s, 3),
                                         "memory_bytes": now.memory_bytes}

    def destroy(self, sandbox_id: str) -> bool:
        """Destroy the sandbox: True once it is gone, False when its destroy is still under
        way after ``DESTROY_WAIT_S`` (accepted: it finishes in the background, and the
        sandbox is gone for every caller already)."""
        return self.sandboxes.destroy(self.sandboxes.get(sandbox_id), reason="requested")

    def on_destroyed(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Have ``callback(sandbox_id)`` called at the end of every destroy, whichever path
        asked for it (a surface's own per-sandbox state goes with it); returns the call that
        unsubscribes it. See ``Sandboxes.on_destroyed``."""
        return self.sandboxes.on_destroyed(callback)

    def _forget_kernels(self, sandbox_id: str) -> None:
        if self._interpreter is not None:  # built: it may hold kernels, which died with it
            self._interpreter.forget_sandbox(sandbox_id)

    def _destroy(self, record: SandboxRecord, *, reason: str) -> None:
        # For the test and drill fixtures that clean up store rows in whatever state: they
        # remove the data directory next, so they wait for the destroy to finish.
        self.sandboxes.destroy(record, reason=reason, wait_s=_CLEANUP_WAIT_S)

    def _spec(self, info: SandboxInfo | SandboxRecord) -> SandboxSpec:
        record = self.store.get(info.id)
        if record is None:
            raise SandboxNotFound(f"sandbox {info.id} does not exist")
        return self.sandboxes.spec(record)

    # -- commands ---------------------------------------------------------------------------------

    def run(
        self, sandbox_id: str, cmd: str | Sequence[str], *, timeout: float | None = None,
        envs: Mapping[str, str] | None = None, cwd: str | None = None,
        stdin: str | bytes | None = None, on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None, context: Mapping[str, Any] | None = None,
        interactive: bool = False, pty: tuple[int, int] | None = None,
        on_start: Callable[[ProcessIO], None] | None = None, lifetime: bool = False,
        command_id: str | None = None, caller: Tenant | None = None,
    ) -> CommandResult:
        """Run a command to completion.

        ``interactive``/``pty``/``on_start`` are for background processes and terminals: stdin
        stays open behind the ProcessIO given to ``on_start``. ``lifetime`` bounds the command
        by the sandbox's remaining lifetime instead of the tier's command timeout. With
        ``caller``, the start counts against its commands per minute (``admit``).
        """
        return self.commands.run(
            sandbox_id, cmd, timeout=timeout, envs=envs, cwd=cwd, stdin=stdin,
            on_stdout=on_stdout, on_stderr=on_stderr, context=context,
            interactive=interactive, pty=pty, on_start=on_start, lifetime=lifetime,
            command_id=command_id, caller=caller)

    def check_run(self, sandbox_id: str, cmd: str | Sequence[str], *,
                  timeout: float | None = None, envs: Mapping[str, str] | None = None,
                  cwd: str | None = None, stdin: str | bytes | None = None,
                  context: Mapping[str, Any] | None = None,
                  caller: Tenant | None = None) -> None:
        """Raise what ``run`` would refuse, without running anything. With ``caller`` the
        start is counted here (admitted), so the ``run`` that follows must not pass it again."""
        self.commands.prepare(sandbox_id, cmd, timeout=timeout, envs=envs, cwd=cwd,
                              stdin=stdin, context=context, lifetime=False, caller=caller)

    def kill_command(self, sandbox_id: str, command_id: str) -> None:
        """Kill a running command (from any process); its run() returns exit code 137."""
        self.commands.kill(sandbox_id, command_id)

    # -- snapshots --------------------------------------------------------------------------------

    def snapshot(self, sandbox_id: str, *, name: str | None = None,
                 tenant: str | None = None, memory: bool = False) -> SnapshotInfo:
        """Seal the workspace's current state as a snapshot (O(1) in its size); with
        ``memory``, also the running sandbox's memory and processes, while commands run
        (tiers with memory snapshots only: microvm)."""
        return self.snapshots.snapshot(sandbox_id, name=name, tenant=tenant, memory=memory)

    def fork(self, sandbox_id: str, count: int = 1, *,
             tenant: str | None = None, max_for_tenant: int | None = None,
             caller: Tenant | None = None, memory: bool = False,
             ) -> builtins.list[SandboxInfo]:
        """``count`` new sandboxes, each starting from this one's current workspace (shared,
        read-only layers; O(1) in the workspace's size) with its template, tier, isolation,
        network policy, secrets and labels, all within the caller's ceiling (and quota).
        With ``memory``, each resumes the running sandbox's memory and processes."""
        children = self.snapshots.fork(sandbox_id, count, tenant=tenant,
                                       max_for_tenant=max_for_tenant, caller=caller,
                                       memory=memory)
        return [child.public() for child in children]

    def restore(self, sandbox_id: str, snapshot: str, *,
                tenant: str | None = None, caller: Tenant | None = None) -> SandboxInfo:
        """Replace the workspace with ``snapshot``'s state, exactly; unsnapshotted changes go.
        The sandbox's policy must still be within the caller's ceiling."""
        return self.snapshots.restore(sandbox_id, snapshot, tenant=tenant,
                                      caller=caller).public()

    def get_snapshot(self, ref: str, *, tenant: str | None = None) -> SnapshotInfo:
        return self.snapshots.get(ref, tenant=tenant)

    def list_snapshots(self, *, tenant: str | None = None) -> builtins.list[SnapshotInfo]:
        return self.snapshots.list(tenant=tenant)

    def delete_snapshot(self, ref: str, *, tenant: str | None = None) -> None:
        """Delete a snapshot no live sandbox is built on (refused while one is)."""
        self.snapshots.delete(ref, tenant=tenant)

    # -- files ------------------------------------------------------------------------------------

    def files(self, sandbox_id: str) -> AuditedFiles:
        return self.file_access.open(sandbox_id)

    def upload(self, sandbox_id: str, path: str, stream: BinaryIO) -> dict[str, int]:
        return self.file_access.upload(sandbox_id, path, stream)

    def download(self, sandbox_id: str, path: str, *, gzip: bool = False) -> Iterator[bytes]:
        return self.file_access.download(sandbox_id, path, gzip=gzip)

    def close(self) -> None:
        self.sandboxes.close()  # destroys under way finish before what they use closes
        self.egress.close()
        self.auditor.close()
        self._registry.close()
        self.store.close()
        self.secrets.close()


_managers: dict[Path, Manager] = {}
_managers_lock = threading.Lock()


def get_manager(settings: Settings | None = None) -> Manager:
    """The process-wide manager of a data directory (built on first use)."""
    settings = settings or Settings()
    with _managers_lock:
        manager = _managers.get(settings.home)
        if manager is None:
            manager = Manager(settings)
            _managers[settings.home] = manager
        return manager
