"""The control plane: sandbox lifecycle, validation, TTL reaping, crash recovery.

Every SDK and CLI call lands here. It validates input, keeps the store and the backend in step,
and enforces lifetimes: an expired sandbox is destroyed the next time anything looks at it (and by
``reap_expired``, which every start runs), so a sandbox never outlives its TTL as something usable.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import fcntl
import logging
import os
import re
import secrets
import shlex
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .._audit.auditor import Auditor, new_command_id
from .._audit.tracing import tracer
from .._backends import BACKENDS, load_backend
from .._backends.namespace.template import require_template
from .._core.resources import get_tier
from .._settings import Settings
from .._workspace.files import WorkspaceFiles, to_relative
from ..backends import ExecRequest, IsolationBackend, OutputCallback, ProcessIO, SandboxSpec
from ..errors import (
    BackendUnavailable,
    CommandError,
    CommandNotFound,
    ConfigError,
    FileError,
    FileNotFound,
    QuotaExceeded,
    SandboxBusy,
    SandboxExpired,
    SandboxNotFound,
    SnapshotInUse,
    SnapshotNotFound,
    UsageError,
)
from ..models import CommandResult, ResourceTier, SandboxInfo, SnapshotInfo
from .egress import EgressBroker, NetworkSpec, policy_from
from .files import AuditedFiles
from .processes import EmbeddedProcessAPI, ProcessTable
from .secrets import SecretStore
from .store import Store
from .tenants import Ceiling, CommandWindows, Tenant
from .tenants import check as check_ceiling

__all__ = ["Manager", "get_manager"]

logger = logging.getLogger(__name__)

_ID_RE = re.compile(r"^sbx_[0-9a-z]{12}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_ENV_BYTES = 256 * 1024
_MAX_ARGV_BYTES = 1024 * 1024
_MAX_STDIN_BYTES = 64 * 1024 * 1024
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}$")
_SNAPSHOT_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}")
_MAX_FORKS = 64


def _new_id(prefix: str = "sbx") -> str:
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyz"
    return f"{prefix}_" + "".join(secrets.choice(alphabet) for _ in range(12))


@dataclass(frozen=True, slots=True)
class _Command:
    argv: list[str]
    cwd: str
    env: dict[str, str]
    stdin: bytes | None


def _validate_command(
    cmd: str | Sequence[str], cwd: str | None, envs: Mapping[str, str] | None,
    stdin: str | bytes | None,
) -> _Command:
    if isinstance(cmd, str):
        if not cmd.strip():
            raise CommandError("the command is empty; pass a shell string or an argv list")
        argv = ["/bin/bash", "-c", cmd]
    elif isinstance(cmd, Sequence) and not isinstance(cmd, bytes | bytearray):
        argv = list(cmd)
        if not argv:
            raise CommandError("the command is empty; pass a shell string or an argv list")
        for i, arg in enumerate(argv):
            if not isinstance(arg, str):
                raise CommandError(f"argv[{i}] is {type(arg).__name__}, not str")
        if not argv[0]:
            raise CommandError("argv[0] (the program) is empty")
    else:
        raise CommandError(
            f"command must be a string or a list of strings, not {type(cmd).__name__}"
        )
    if any("\x00" in a for a in argv):
        raise CommandError("the command contains a NUL byte")
    try:
        for a in argv:
            a.encode()
    except UnicodeEncodeError:
        raise CommandError("the command is not valid Unicode text (a lone surrogate); pass "
                           "UTF-8 text") from None
    if sum(len(a.encode()) + 1 for a in argv) > _MAX_ARGV_BYTES:
        raise CommandError(f"the command is longer than {_MAX_ARGV_BYTES} bytes; pass data "
                           "through stdin or a file instead")
    env: dict[str, str] = {}
    total = 0
    for key, value in (envs or {}).items():
        if not isinstance(key, str) or not _ENV_NAME_RE.match(key):
            # Empty, '=' or NUL cannot be one environment entry (NAME=value).
            shown = key[:64] + "..." if isinstance(key, str) and len(key) > 64 else key
            raise CommandError(f"invalid environment variable name {shown!r}; names are "
                               "letters, digits and '_', not starting with a digit")
        if not isinstance(value, str):
            raise CommandError(f"environment variable {key} must be a string")
        if "\x00" in value:
            raise CommandError(f"environment variable {key} contains a NUL byte, which no "
                               "environment entry can hold; remove it")
        try:
            value.encode()
        except UnicodeEncodeError:
            raise CommandError(f"environment variable {key} is not valid Unicode text (a lone "
                               "surrogate); pass UTF-8 text") from None
        total += len(key) + len(value.encode()) + 2
        env[key] = value
    if total > _MAX_ENV_BYTES:
        raise CommandError(
            f"the environment is {total} bytes, over the {_MAX_ENV_BYTES}-byte limit; pass "
            "large data through files or stdin"
        )
    rel = to_relative(cwd or "/workspace")
    cwd_inside = "/workspace" if rel == "." else f"/workspace/{rel}"
    data: bytes | None
    if stdin is None:
        data = None
    elif isinstance(stdin, str):
        data = stdin.encode()
    elif isinstance(stdin, bytes | bytearray | memoryview):
        data = bytes(stdin)
    else:
        raise CommandError(f"stdin must be str or bytes, not {type(stdin).__name__}")
    if data is not None and len(data) > _MAX_STDIN_BYTES:
        raise CommandError(f"stdin is over {_MAX_STDIN_BYTES} bytes; write a file instead")
    return _Command(argv=argv, cwd=cwd_inside, env=env, stdin=data)


def _outcome(result: CommandResult) -> str:
    if result.timed_out:
        return "timeout"
    if result.usage.oom_killed:
        return "oom"
    return "ok" if result.exit_code == 0 else "error"


class Manager:
    """Owns the store and the backend of one data directory."""

    def __init__(self, settings: Settings) -> None:
        if os.geteuid() != 0:
            raise BackendUnavailable(
                "Corral must run as root: each sandbox gets its own unprivileged host uid, and "
                "setting that up needs root. Run `corral doctor` for the full host check."
            )
        self.settings = settings
        settings.home.mkdir(parents=True, exist_ok=True, mode=0o711)
        os.chmod(settings.home, 0o711)
        for parent in settings.home.parents:
            # bwrap runs as the sandbox's uid and must reach the template and the workspace.
            if not os.stat(parent).st_mode & 0o001:
                raise ConfigError(
                    f"{parent} is not traversable by other users (mode "
                    f"{os.stat(parent).st_mode & 0o777:o}), so sandboxes cannot reach "
                    f"{settings.home}; `chmod o+x {parent}` or choose another CORRAL_HOME")
        self.store = Store(settings.home / "corral.db")
        self.secrets = SecretStore(settings.home / "secrets.db")
        self.auditor = Auditor(directory=settings.home / "audit", secrets=self.secrets,
                               placeholders=self.store, counters=self.store,
                               enabled=settings.audit,
                               output_limit_bytes=settings.audit_output_bytes)
        self.egress = EgressBroker(settings, self.store, self.secrets, self.auditor)
        self.processes = ProcessTable(self)
        self.backend: IsolationBackend = load_backend(settings)  # the default tier
        self._backends: dict[str, IsolationBackend] = {self.backend.name: self.backend}
        self._layers_lock = threading.RLock()
        self._recovered = False
        # Two locks, one job each: recovery reaches backend_for() (a store may hold sandboxes
        # of any tier), so loading a backend must never wait on the lock recovery holds.
        self._recover_lock = threading.Lock()
        self._backends_lock = threading.Lock()
        self._destroying: set[str] = set()
        self._destroying_lock = threading.Lock()
        # The operator's default ceiling (CORRAL_CEILING_*), for callers without their own.
        self.ceiling = Ceiling.from_settings(settings)
        self.starts = CommandWindows()

    # -- start-up -----------------------------------------------------------------------------

    def recover(self) -> list[str]:
        """Finish interrupted destroys, reap expired sandboxes and sweep crash leftovers."""
        removed: list[str] = []
        now = time.time()
        for info in self.store.list():
            # A create takes milliseconds; one still "creating" after a minute was interrupted.
            stale_create = info.state == "creating" and info.created_at < now - 60
            if info.expires_at <= now and info.state in ("running", "paused"):
                self._expire(info)
            elif self._idle(info, now):
                self.auditor.event(info.id, "sandbox.expired", {
                    "idle_timeout": info.idle_timeout, "last_active": info.last_active})
                self._destroy(info, reason="idle")
            elif info.state == "destroying" or stale_create:
                self._destroy(info, reason="interrupted")
            else:
                continue
            self.auditor.count("corral_reaper_actions", action="destroy_sandbox")
            removed.append(f"sandbox {info.id}")
        # Every tier that has sandboxes sweeps its own leftovers; pieces shared by the tiers
        # (workspaces, cgroups, netns) are only removed for ids the store does not know.
        for name in {info.isolation for info in self.store.list()} - set(self._backends):
            with contextlib.suppress(BackendUnavailable):
                self.backend_for(name)
        swept: list[str] = []
        for backend in list(self._backends.values()):
            swept += backend.sweep(lambda sandbox_id: self.store.get(sandbox_id) is not None)
        removed += self._sweep_layers()
        for item in swept:
            self.auditor.count("corral_reaper_actions", action=f"sweep_{item.split()[0]}")
            kind, _, group = item.partition(" ")
            sandbox_id, _, name = group.partition("/")
            command_id = name.rsplit(".", 1)[-1]
            if kind == "command" and command_id.startswith("cmd_"):
                # Its process died (crash, SIGKILL): close the command's story in the trail.
                self.auditor.event(sandbox_id, "command.finished", {
                    "exit_code": None, "interrupted": True,
                    "error": "interrupted: the process running it stopped",
                }, command=command_id, sync=True)
        self._recovered = True
        return removed + swept

    def _sweep_layers(self) -> list[str]:
        """Delete layers nothing uses, and layer directories a crash left without a record."""
        removed = [f"layer {layer}" for layer in self._gc_layers()]
        known = self.store.layer_ids()
        for layer in self.backend.layer_ids():
            path = self.settings.home / "layers" / layer
            # A seal in another process records its layer a moment after making it.
            if layer not in known and _age(path) > 60:
                self.backend.remove_layer(layer)
                removed.append(f"layer {layer}")
        return removed

    def _gc_layers(self) -> list[str]:
        with self._layers_lock:
            unused = self.store.unused_layers()
            for layer in unused:
                self.backend.remove_layer(layer)
        return unused

    def backend_for(self, isolation: str) -> IsolationBackend:
        """The backend of tier ``isolation``, loaded on first use."""
        backend = self._backends.get(isolation)
        if backend is None:
            if isolation not in BACKENDS:
                raise UsageError(f"unknown isolation tier {isolation!r}; choose one of: "
                                 f"{', '.join(BACKENDS)}")
            with self._backends_lock:
                backend = self._backends.get(isolation)
                if backend is None:
                    backend = self._backends[isolation] = load_backend(self.settings, isolation)
        return backend

    def _backend(self, info: SandboxInfo) -> IsolationBackend:
        return self.backend_for(info.isolation)

    @contextlib.contextmanager
    def _workspace_lock(self, sandbox_id: str, *, exclusive: bool) -> Iterator[None]:
        """Commands hold it shared; snapshot and restore exclusively (across processes too),
        so no command starts on a workspace that is being sealed or replaced."""
        locks = self.settings.home / "locks"
        locks.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(locks / sandbox_id, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if not exclusive:
                fcntl.flock(fd, fcntl.LOCK_SH)
            else:
                deadline = time.monotonic() + 1.0
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise SandboxBusy(
                                f"commands are running in sandbox {sandbox_id}; wait for them "
                                "(or kill them) and retry") from None
                        time.sleep(0.02)
            yield
        finally:
            os.close(fd)

    def _idle(self, info: SandboxInfo, now: float) -> bool:
        """Past its idle timeout with nothing running (no command, no background process)."""
        if info.idle_timeout is None or info.state != "running":
            return False
        if now - info.last_active < info.idle_timeout:
            return False
        return not self._running(info)

    def _running(self, info: SandboxInfo) -> bool:
        """True while a background process or any command (from any process) runs."""
        return (any(p.state != "exited" for p in self.processes.list(info.id))
                or self._backend(info).busy(self._spec(info)))

    def _ensure_recovered(self) -> None:
        if not self._recovered:
            with self._recover_lock:
                if not self._recovered:
                    self.recover()

    # -- tenants: ceilings and quotas ---------------------------------------------------------

    def ceiling_for(self, caller: Tenant | None) -> Ceiling:
        """The caller's ceiling, the server default filling the fields it leaves open."""
        return self.ceiling if caller is None else caller.ceiling.over(self.ceiling)

    def admit(self, caller: Tenant | None) -> None:
        """Count one start of code (command, background process, terminal) against the
        caller's commands-per-minute; the one quota path every surface goes through."""
        if caller is not None:
            self.starts.count(caller)

    def _check_policy(self, info: SandboxInfo, caller: Tenant | None) -> None:
        """Refuse to carry an existing sandbox's policy on (fork, restore) beyond the ceiling
        the caller has now: it may have been created under a wider one."""
        check_ceiling(self.ceiling_for(caller), tenant=caller.name if caller else info.tenant,
                      template=info.template, isolation=info.isolation,
                      resources=info.resources, network=policy_from(_network_spec(info.network)),
                      secrets=sorted(info.secrets))

    # -- sandboxes ----------------------------------------------------------------------------

    def create(
        self, *, template: str | None = None, resources: str = "small",
        timeout: float | None = None,
        labels: Mapping[str, str] | None = None, network: NetworkSpec = None,
        secrets: Sequence[str] | None = None, tenant: str | None = None,
        max_for_tenant: int | None = None, idle_timeout: float | None = None,
        isolation: str | None = None, snapshot: str | None = None,
        caller: Tenant | None = None,
        _layer: str | None = None, _event: Mapping[str, Any] | None = None,
    ) -> SandboxInfo:
        """Create a sandbox; from ``snapshot`` (id or name), its workspace starts as the
        snapshot's and its template defaults to the snapshot's.

        ``caller`` is who asks (default: the operator): its tiers and sandbox quota apply,
        and its ceiling (over the server default) bounds template, isolation, tier, hosts,
        secrets and lifetime (``CeilingExceeded`` beyond it). ``tenant`` is the owner
        (default: the caller)."""
        tier = get_tier(resources)
        if tenant is None:
            tenant = caller.name if caller is not None else "local"
        if caller is not None and not caller.is_local:
            if max_for_tenant is None:
                max_for_tenant = caller.max_sandboxes
            if resources not in caller.tiers:
                raise QuotaExceeded(f"tenant {caller.name!r} may not use the {resources!r} tier "
                                    f"(allowed: {', '.join(caller.tiers)})")
        isolation = self.settings.backend if isolation is None else isolation
        if not isinstance(isolation, str):
            raise UsageError(f"isolation must be a string, not {type(isolation).__name__}")
        if isolation not in BACKENDS:
            raise UsageError(f"unknown isolation tier {isolation!r}; choose one of: "
                             f"{', '.join(BACKENDS)}")
        layer = _layer
        if snapshot is not None:
            snap = self.get_snapshot(snapshot, tenant=tenant)
            layer = self.store.snapshot_layer(snap.id)
            template = snap.template if template is None else template
        template = "base" if template is None else template
        policy = policy_from(network)
        if isinstance(secrets, str):
            raise UsageError("secrets takes a list of secret names, not a single string")
        placeholders = self.egress.placeholders_for(secrets or [])
        if idle_timeout is not None:
            idle_timeout = self._check_ttl(idle_timeout, tier.max_ttl_s)
        if not isinstance(template, str):
            raise UsageError(f"template must be a string, not {type(template).__name__}")
        ceiling = self.ceiling_for(caller)
        ttl = tier.ttl_s if timeout is None else self._check_ttl(timeout, tier.max_ttl_s)
        if timeout is None and ceiling.max_lifetime_s is not None:
            ttl = min(ttl, float(ceiling.max_lifetime_s))  # the default fits the ceiling
        check_ceiling(ceiling, tenant=caller.name if caller else tenant, template=template,
                      isolation=isolation, resources=resources, network=policy,
                      secrets=secrets or (), lifetime_s=ttl)
        backend = self.backend_for(isolation)
        clean_labels = self._check_labels(labels)
        self._ensure_recovered()
        require_template(template, self.settings.home / "templates")
        info = self.store.insert(
            sandbox_id=_new_id(), template=template, resources=resources, ttl_s=ttl,
            labels=clean_labels, uid_start=self.settings.uid_start,
            uid_count=self.settings.uid_count, network=policy.to_json(), secrets=placeholders,
            tenant=tenant, max_for_tenant=max_for_tenant, idle_timeout=idle_timeout,
            isolation=isolation, layer=layer,
        )
        try:
            backend.create(self._spec(info))
        except BaseException:
            self.store.delete(info.id)
            raise
        self.store.set_state(info.id, "running")
        info = dataclasses.replace(info, state="running")
        self.auditor.event(info.id, "sandbox.created", {
            "template": template, "resources": resources, "uid": info.uid,
            "expires_at": info.expires_at, "labels": clean_labels, "limits": tier.to_dict(),
            "backend": backend.name, "isolation": isolation, "network": policy.to_json(),
            "secrets": sorted(placeholders), "tenant": tenant,
            **({"snapshot": snapshot, "layer": layer} if snapshot is not None else {}),
            **(_event or {}),
        })
        self.auditor.count("corral_sandboxes_created")
        logger.info("created sandbox %s (uid %d, %s)", info.id, info.uid, resources)
        return info

    @staticmethod
    def _check_ttl(timeout: float, max_ttl: float) -> float:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise UsageError(f"timeout must be a number of seconds, not {timeout!r}")
        if not 0 < timeout <= max_ttl:
            raise UsageError(f"timeout must be between 0 and {max_ttl:g} seconds, got {timeout:g}")
        return float(timeout)

    @staticmethod
    def _check_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
        clean: dict[str, str] = {}
        for key, value in (labels or {}).items():
            if not isinstance(key, str) or not _LABEL_RE.match(key):
                raise UsageError(f"invalid label name {key!r}: letters, digits, _ . - / only")
            if not isinstance(value, str) or len(value) > 256:
                raise UsageError(f"label {key} must be a string of at most 256 characters")
            clean[key] = value
        if len(clean) > 64:
            raise UsageError("at most 64 labels per sandbox")
        return clean

    def get(self, sandbox_id: str, *, tenant: str | None = None) -> SandboxInfo:
        """The sandbox; with ``tenant``, only if it belongs to that tenant (else not found)."""
        if not isinstance(sandbox_id, str) or not _ID_RE.match(sandbox_id):
            raise SandboxNotFound(
                f"{sandbox_id!r} is not a sandbox id (they look like sbx_0123456789ab); "
                "`corral ls` lists them"
            )
        info = self.store.get(sandbox_id)
        if info is None or (tenant is not None and info.tenant != tenant):
            raise SandboxNotFound(f"sandbox {sandbox_id} does not exist; `corral ls` lists them")
        if info.state == "destroying":
            raise SandboxNotFound(f"sandbox {sandbox_id} is being destroyed")
        if info.state == "creating":
            raise SandboxBusy(f"sandbox {sandbox_id} is still being created; try again shortly")
        if info.expires_at <= time.time():
            self._expire(info)
            raise SandboxExpired(
                f"sandbox {sandbox_id} reached the end of its lifetime and was destroyed; pass a "
                "longer timeout= when creating it, or extend it with set_timeout()"
            )
        return info

    def list(self, *, tenant: str | None = None) -> list[SandboxInfo]:
        self._ensure_recovered()
        now = time.time()
        live = []
        for info in self.store.list():
            if info.expires_at <= now and info.state in ("running", "paused"):
                self._expire(info)
            elif info.state in ("running", "paused") and (tenant is None
                                                          or info.tenant == tenant):
                live.append(info)
        return live

    def set_timeout(self, sandbox_id: str, timeout: float, *,
                    caller: Tenant | None = None) -> SandboxInfo:
        info = self.get(sandbox_id)
        ttl = self._check_ttl(timeout, get_tier(info.resources).max_ttl_s)
        # The ceiling bounds the whole life, so extending again and again cannot pass it.
        check_ceiling(self.ceiling_for(caller), tenant=caller.name if caller else info.tenant,
                      lifetime_s=time.time() + ttl - info.created_at)
        self.store.set_expiry(sandbox_id, time.time() + ttl)
        info = self.get(sandbox_id)
        self.auditor.event(sandbox_id, "sandbox.timeout_changed", {"expires_at": info.expires_at})
        return info

    def set_network(self, sandbox_id: str, network: NetworkSpec, *,
                    caller: Tenant | None = None) -> SandboxInfo:
        """Replace the sandbox's network policy; the next connection sees it. The allow rules
        must fall within the caller's hosts ceiling."""
        policy = policy_from(network)
        info = self.get(sandbox_id)
        check_ceiling(self.ceiling_for(caller), tenant=caller.name if caller else info.tenant,
                      network=policy)
        self.store.set_network(sandbox_id, policy.to_json())
        self.auditor.event(sandbox_id, "sandbox.policy_changed", {"network": policy.to_json()})
        return self.get(sandbox_id)

    def pause(self, sandbox_id: str) -> SandboxInfo:
        """Freeze every process of the sandbox (files stay reachable); its TTL keeps running."""
        info = self.get(sandbox_id)
        if info.state == "paused":
            return info
        self._backend(info).pause(self._spec(info), True)
        self.store.set_state(sandbox_id, "paused")
        self.auditor.event(sandbox_id, "sandbox.paused", {})
        return self.get(sandbox_id)

    def resume(self, sandbox_id: str) -> SandboxInfo:
        info = self.get(sandbox_id)
        if info.state != "paused":
            return info
        self._backend(info).pause(self._spec(info), False)
        self.store.set_state(sandbox_id, "running")
        self.auditor.event(sandbox_id, "sandbox.resumed", {})
        return self.get(sandbox_id)

    def kill_command(self, sandbox_id: str, command_id: str) -> None:
        """Kill a running command (from any process); its run() returns exit code 137."""
        info = self.get(sandbox_id)
        if info.state == "paused":
            raise SandboxBusy(f"sandbox {sandbox_id} is paused; resume it before killing "
                              "commands")
        if not isinstance(command_id, str) or not re.match(r"^cmd_[0-9a-f]{12}$", command_id):
            raise CommandNotFound(f"{command_id!r} is not a command id")
        if not self._backend(info).kill_command(self._spec(info), command_id):
            raise CommandNotFound(f"command {command_id} is not running in {sandbox_id}")

    def destroy(self, sandbox_id: str) -> None:
        info = self.get(sandbox_id)
        self._destroy(info, reason="requested")

    def _expire(self, info: SandboxInfo) -> None:
        self.auditor.event(info.id, "sandbox.expired", {"expires_at": info.expires_at})
        self._destroy(info, reason="expired")

    def _destroy(self, info: SandboxInfo, *, reason: str) -> None:
        # One destroy per sandbox at a time in this process: the reaper finishing a
        # "destroying" row must not race the request that is destroying it right now.
        with self._destroying_lock:
            if info.id in self._destroying:
                return
            self._destroying.add(info.id)
        try:
            # Mark first: a crash in the middle leaves a row that the next start finishes off.
            self.store.set_state(info.id, "destroying")
            self._backend(info).destroy(self._spec(info))
            self.store.delete(info.id)
            (self.settings.home / "locks" / info.id).unlink(missing_ok=True)
            if info.layer is not None:
                self._gc_layers()
            self.auditor.event(info.id, "sandbox.destroyed", {"reason": reason}, sync=True)
            self.auditor.close_log(info.id)
            self.auditor.count("corral_sandboxes_destroyed", reason=reason)
            logger.info("destroyed sandbox %s (%s)", info.id, reason)
        finally:
            with self._destroying_lock:
                self._destroying.discard(info.id)

    def _spec(self, info: SandboxInfo) -> SandboxSpec:
        return SandboxSpec(id=info.id, uid=info.uid, template=info.template,
                           tier=get_tier(info.resources), layers=self.store.layer_chain(info.layer))

    # -- commands -----------------------------------------------------------------------------

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
        command, info, tier, limit = self._prepare(sandbox_id, cmd, timeout=timeout, envs=envs,
                                                   cwd=cwd, stdin=stdin, context=context,
                                                   lifetime=lifetime, caller=caller)
        if info.idle_timeout is not None:
            self.store.touch(sandbox_id)
        # A command never outlives its sandbox.
        limit = max(0.001, min(limit, info.expires_at - time.time()))
        recorder = self.auditor.command(sandbox_id, command_id)
        command_id = recorder.command_id if recorder else (command_id or new_command_id())
        with tracer.start_as_current_span("corral.command", attributes={
            "corral.sandbox.id": sandbox_id, "corral.command.id": command_id,
            "corral.tier": tier.name, "corral.backend": info.isolation,
        }) as span:
            if recorder is not None:
                recorder.started(argv=command.argv, cwd=command.cwd, env=command.env,
                                 timeout_s=limit, context=context)
            self.auditor.count("corral_commands_started")
            started = time.monotonic()
            spec = self._spec(info)
            backend = self._backend(info)
            try:
                with self._workspace_lock(sandbox_id, exclusive=False), \
                        self.egress.for_command(backend, spec, network=info.network,
                                                placeholders=info.secrets,
                                                command_id=command_id) as egress_env:
                    outcome = backend.exec(spec, ExecRequest(
                        command_id=command_id,
                        argv=command.argv, cwd=command.cwd, env={**command.env, **egress_env},
                        timeout_s=limit, stdin=command.stdin,
                        output_limit_bytes=tier.output_limit_bytes,
                        on_stdout=self.auditor.recorded_callback(recorder, "stdout", on_stdout),
                        on_stderr=self.auditor.recorded_callback(recorder, "stderr", on_stderr),
                        interactive=interactive, pty=pty, on_start=on_start,
                    ))
            except BaseException as exc:
                span.set_attribute("corral.outcome", "failed")
                if recorder is not None:
                    recorder.finished(None, error=f"{type(exc).__name__}: {exc}")
                self.auditor.count("corral_commands_finished", outcome="failed")
                raise
            result = CommandResult(
                exit_code=outcome.exit_code, stdout=outcome.stdout, stderr=outcome.stderr,
                timed_out=outcome.timed_out, duration_s=time.monotonic() - started,
                usage=outcome.usage, stdout_truncated=outcome.stdout_truncated,
                stderr_truncated=outcome.stderr_truncated, command_id=command_id,
            )
            verdict = _outcome(result)
            span.set_attributes({"corral.outcome": verdict, "corral.exit_code": result.exit_code})
            with tracer.start_as_current_span("corral.audit.commit"):
                if recorder is not None:
                    recorder.finished(result)
                if self.auditor.enabled:
                    self.auditor.metrics.command_finished(
                        outcome=verdict, duration_s=result.duration_s,
                        cpu_s=result.usage.cpu_s,
                        peak_memory_bytes=result.usage.peak_memory_bytes)
        logger.debug("ran %s in %s: exit %d", shlex.join(command.argv)[:200], sandbox_id,
                     outcome.exit_code)
        return result

    def check_run(self, sandbox_id: str, cmd: str | Sequence[str], *,
                  timeout: float | None = None, envs: Mapping[str, str] | None = None,
                  cwd: str | None = None, stdin: str | bytes | None = None,
                  context: Mapping[str, Any] | None = None,
                  caller: Tenant | None = None) -> None:
        """Raise what ``run`` would refuse, without running anything. With ``caller`` the
        start is counted here (admitted), so the ``run`` that follows must not pass it again."""
        self._prepare(sandbox_id, cmd, timeout=timeout, envs=envs, cwd=cwd, stdin=stdin,
                      context=context, lifetime=False, caller=caller)

    def _prepare(
        self, sandbox_id: str, cmd: str | Sequence[str], *, timeout: float | None,
        envs: Mapping[str, str] | None, cwd: str | None, stdin: str | bytes | None,
        context: Mapping[str, Any] | None, lifetime: bool, caller: Tenant | None = None,
    ) -> tuple[_Command, SandboxInfo, ResourceTier, float]:
        command = _validate_command(cmd, cwd, envs, stdin)
        if context is not None and not isinstance(context, Mapping):
            raise UsageError(f"context must be a mapping, not {type(context).__name__}")
        info = self.get(sandbox_id)
        if info.state == "paused":
            raise SandboxBusy(f"sandbox {sandbox_id} is paused; resume() it to run commands")
        self._ensure_recovered()
        tier = get_tier(info.resources)
        if lifetime:
            limit = info.expires_at - time.time()
        elif timeout is None:
            limit = tier.command_timeout_s
        else:
            if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
                raise UsageError(f"timeout must be a positive number of seconds, got {timeout!r}")
            if timeout > tier.command_timeout_s:
                raise UsageError(
                    f"timeout {timeout:g} s is over the {tier.name} tier's limit of "
                    f"{tier.command_timeout_s:g} s; use resources='large' for longer commands"
                )
            limit = float(timeout)
        if command.cwd != "/workspace":
            self._check_cwd(info, command.cwd)
        self.admit(caller)  # last: a refused command does not use up the quota
        return command, info, tier, limit

    def _check_cwd(self, info: SandboxInfo, cwd: str) -> None:
        files = WorkspaceFiles(self._backend(info).workspace_root(self._spec(info)), info.uid)
        try:
            entry = files.stat(cwd)
        except FileNotFound:
            raise CommandError(f"the working directory {cwd} does not exist") from None
        except FileError as exc:
            raise CommandError(f"cannot use {cwd} as working directory: {exc.message}") from None
        if entry.type != "dir":
            raise CommandError(f"the working directory {cwd} is not a directory")

    # -- snapshots ----------------------------------------------------------------------------

    def _seal(self, info: SandboxInfo) -> str:
        """Seal the sandbox's writable layer into a new read-only layer; return its id."""
        if info.state == "paused":
            raise SandboxBusy(f"sandbox {info.id} is paused; resume() it first")
        backend = self._backend(info)
        with self._workspace_lock(info.id, exclusive=True):
            if self._running(info):
                raise SandboxBusy(
                    f"sandbox {info.id} has running commands or background processes; wait "
                    "for them (or kill them) before taking a snapshot")
            layer = _new_id("lyr")
            result = backend.seal_workspace(self._spec(info), layer)
            parent = result.layers[1] if len(result.layers) > 1 else None
            self.store.add_layer(layer, parent=parent, bytes_used=result.bytes_used)
            self.store.set_layer(info.id, layer)
        if result.squashed:
            self._gc_layers()
        return layer

    @staticmethod
    def _check_snapshot_name(name: str | None) -> str | None:
        if name is None:
            return None
        if not isinstance(name, str) or not _SNAPSHOT_NAME_RE.fullmatch(name) \
                or re.match(r"^snap_[0-9a-z]{12}$", name):
            raise UsageError(
                f"invalid snapshot name {name!r}: 1-63 letters, digits, _ . - (starting with a "
                "letter or digit), and not shaped like a snapshot id")
        return name

    def snapshot(self, sandbox_id: str, *, name: str | None = None,
                 tenant: str | None = None) -> SnapshotInfo:
        """Seal the workspace's current state as a snapshot (O(1) in its size)."""
        name = self._check_snapshot_name(name)
        info = self.get(sandbox_id, tenant=tenant)
        if name is not None and self.store.snapshot(name, tenant=info.tenant) is not None:
            raise UsageError(f"a snapshot named {name!r} already exists; choose another name or "
                             f"remove it with `corral snapshots rm {name}`")
        started = time.monotonic()
        layer = self._seal(info)
        snap = self.store.add_snapshot(_new_id("snap"), name=name, tenant=info.tenant,
                                       layer=layer, template=info.template, sandbox=info.id)
        self.auditor.event(info.id, "snapshot.created", {
            "snapshot": snap.id, "name": name, "layer": layer, "depth": snap.depth,
            "size_bytes": snap.size_bytes,
            "duration_ms": round((time.monotonic() - started) * 1000, 3)})
        self.auditor.count("corral_snapshots_created")
        return snap

    def fork(self, sandbox_id: str, count: int = 1, *,
             tenant: str | None = None, max_for_tenant: int | None = None,
             caller: Tenant | None = None,
             ) -> builtins.list[SandboxInfo]:
        """``count`` new sandboxes, each starting from this one's current workspace (shared,
        read-only layers; O(1) in the workspace's size) with its template, tier, isolation,
        network policy, secrets and labels, all within the caller's ceiling (and quota)."""
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= _MAX_FORKS:
            raise UsageError(f"count must be an integer from 1 to {_MAX_FORKS}, not {count!r}")
        if caller is not None and not caller.is_local:
            tenant = caller.name if tenant is None else tenant
            max_for_tenant = caller.max_sandboxes if max_for_tenant is None else max_for_tenant
        info = self.get(sandbox_id, tenant=tenant)
        self._check_policy(info, caller)  # before sealing: a refused fork changes nothing
        layer = self._seal(info)
        children: list[SandboxInfo] = []
        try:
            for _ in range(count):
                children.append(self.create(
                    template=info.template, resources=info.resources, labels=info.labels,
                    network=_network_spec(info.network), secrets=sorted(info.secrets),
                    tenant=info.tenant, max_for_tenant=max_for_tenant,
                    idle_timeout=info.idle_timeout, isolation=info.isolation, _layer=layer,
                    caller=caller,
                    _event={"forked_from": info.id, "layer": layer}))
        except BaseException:
            for child in children:
                with contextlib.suppress(Exception):
                    self._destroy(child, reason="fork failed")
            raise
        self.auditor.event(info.id, "sandbox.forked", {
            "children": [c.id for c in children], "layer": layer})
        return children

    def restore(self, sandbox_id: str, snapshot: str, *,
                tenant: str | None = None, caller: Tenant | None = None) -> SandboxInfo:
        """Replace the workspace with ``snapshot``'s state, exactly; unsnapshotted changes go.
        The sandbox's policy must still be within the caller's ceiling."""
        if caller is not None and not caller.is_local and tenant is None:
            tenant = caller.name
        info = self.get(sandbox_id, tenant=tenant)
        self._check_policy(info, caller)
        if info.state == "paused":
            raise SandboxBusy(f"sandbox {sandbox_id} is paused; resume() it first")
        snap = self.get_snapshot(snapshot, tenant=info.tenant)
        layer = self.store.snapshot_layer(snap.id)
        backend = self._backend(info)
        with self._workspace_lock(info.id, exclusive=True):
            if self._running(info):
                raise SandboxBusy(
                    f"sandbox {info.id} has running commands or background processes; wait "
                    "for them (or kill them) before restoring")
            info = dataclasses.replace(info, layer=layer)
            backend.reset_workspace(self._spec(info))
            self.store.set_layer(info.id, layer)
        self._gc_layers()
        self.auditor.event(info.id, "snapshot.restored", {
            "snapshot": snap.id, "name": snap.name, "layer": layer})
        return self.get(sandbox_id)

    def get_snapshot(self, ref: str, *, tenant: str | None = None) -> SnapshotInfo:
        if not isinstance(ref, str) or not ref:
            raise UsageError(f"a snapshot is named by its id or name, not {ref!r}")
        snap = self.store.snapshot(ref, tenant=tenant)
        if snap is None:
            raise SnapshotNotFound(f"snapshot {ref!r} does not exist; `corral snapshots ls` "
                                   "lists them")
        return snap

    def list_snapshots(self, *, tenant: str | None = None) -> builtins.list[SnapshotInfo]:
        return self.store.snapshots(tenant=tenant)

    def delete_snapshot(self, ref: str, *, tenant: str | None = None) -> None:
        """Delete a snapshot no live sandbox is built on (refused while one is)."""
        snap = self.get_snapshot(ref, tenant=tenant)
        layer = self.store.snapshot_layer(snap.id)
        with self._layers_lock:
            users = [s.id for s in self.store.list() if layer in self.store.layer_chain(s.layer)]
            if users:
                shown = ", ".join(users[:5]) + (f" and {len(users) - 5} more"
                                                 if len(users) > 5 else "")
                raise SnapshotInUse(
                    f"snapshot {snap.name or snap.id} is in use: sandboxes {shown} are built on "
                    "it; destroy them or restore them to another snapshot first")
            self.store.delete_snapshot(snap.id)
        self._gc_layers()
        self.auditor.event(snap.sandbox, "snapshot.deleted", {
            "snapshot": snap.id, "name": snap.name, "layer": layer})

    # -- files --------------------------------------------------------------------------------

    def files(self, sandbox_id: str) -> AuditedFiles:
        info = self.get(sandbox_id)
        if info.idle_timeout is not None:
            self.store.touch(sandbox_id)
        root: Path = self._backend(info).workspace_root(self._spec(info))
        return AuditedFiles(WorkspaceFiles(root, info.uid), self.auditor, sandbox_id)

    def process_api(self) -> EmbeddedProcessAPI:
        return EmbeddedProcessAPI(self.processes)

    def upload(self, sandbox_id: str, path: str, stream: BinaryIO) -> dict[str, int]:
        info = self.get(sandbox_id)
        report = self.files(sandbox_id).upload(
            path, stream, max_bytes=get_tier(info.resources).disk_bytes)
        return dataclasses.asdict(report)

    def download(self, sandbox_id: str, path: str, *, gzip: bool = False) -> Iterator[bytes]:
        info = self.get(sandbox_id)
        return self.files(sandbox_id).download(
            path, max_bytes=get_tier(info.resources).disk_bytes, gzip=gzip)

    def close(self) -> None:
        self.egress.close()
        self.auditor.close()
        for backend in self._backends.values():
            backend.close()
        self.store.close()
        self.secrets.close()


def _network_spec(network: Mapping[str, Any]) -> NetworkSpec:
    """A stored policy back in the form ``create`` takes."""
    if not network or network.get("mode") == "none" and not network.get("deny"):
        return "none"
    return {"allow": list(network.get("allow") or []), "deny": list(network.get("deny") or [])}


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


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
