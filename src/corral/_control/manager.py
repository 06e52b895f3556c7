"""The control plane: sandbox lifecycle, validation, TTL reaping, crash recovery.

Every SDK and CLI call lands here. It validates input, keeps the store and the backend in step,
and enforces lifetimes: an expired sandbox is destroyed the next time anything looks at it (and by
``reap_expired``, which every start runs), so a sandbox never outlives its TTL as something usable.
"""

from __future__ import annotations

import dataclasses
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
from .._backends import load_backend
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
    SandboxBusy,
    SandboxExpired,
    SandboxNotFound,
    UsageError,
)
from ..models import CommandResult, ResourceTier, SandboxInfo
from .egress import EgressBroker, NetworkSpec, policy_from
from .files import AuditedFiles
from .processes import EmbeddedProcessAPI, ProcessTable
from .secrets import SecretStore
from .store import Store

__all__ = ["Manager", "get_manager"]

logger = logging.getLogger(__name__)

_ID_RE = re.compile(r"^sbx_[0-9a-z]{12}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_ENV_BYTES = 256 * 1024
_MAX_ARGV_BYTES = 1024 * 1024
_MAX_STDIN_BYTES = 64 * 1024 * 1024
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}$")


def _new_id() -> str:
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyz"
    return "sbx_" + "".join(secrets.choice(alphabet) for _ in range(12))


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
    if sum(len(a.encode()) + 1 for a in argv) > _MAX_ARGV_BYTES:
        raise CommandError(f"the command is longer than {_MAX_ARGV_BYTES} bytes; pass data "
                           "through stdin or a file instead")
    env: dict[str, str] = {}
    total = 0
    for key, value in (envs or {}).items():
        if not isinstance(key, str) or not _ENV_NAME_RE.match(key):
            raise CommandError(f"invalid environment variable name {key!r}")
        if not isinstance(value, str):
            raise CommandError(f"environment variable {key} must be a string")
        if "\x00" in value:
            raise CommandError(f"environment variable {key} contains a NUL byte")
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
        self.auditor = Auditor(directory=settings.home / "audit", store=self.store,
                               secrets=self.secrets, enabled=settings.audit,
                               output_limit_bytes=settings.audit_output_bytes)
        self.egress = EgressBroker(settings, self.store, self.secrets, self.auditor)
        self.processes = ProcessTable(self)
        self.backend: IsolationBackend = load_backend(settings)
        self._recovered = False
        self._lock = threading.Lock()
        self._destroying: set[str] = set()
        self._destroying_lock = threading.Lock()

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
        swept = self.backend.sweep(lambda sandbox_id: self.store.get(sandbox_id) is not None)
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

    def _idle(self, info: SandboxInfo, now: float) -> bool:
        """Past its idle timeout with nothing running (no command, no background process)."""
        if info.idle_timeout is None or info.state != "running":
            return False
        if now - info.last_active < info.idle_timeout:
            return False
        if any(p.state != "exited" for p in self.processes.list(info.id)):
            return False
        return not self.backend.busy(self._spec(info))

    def _ensure_recovered(self) -> None:
        if not self._recovered:
            with self._lock:
                if not self._recovered:
                    self.recover()

    # -- sandboxes ----------------------------------------------------------------------------

    def create(
        self, *, template: str = "base", resources: str = "small", timeout: float | None = None,
        labels: Mapping[str, str] | None = None, network: NetworkSpec = None,
        secrets: Sequence[str] | None = None, tenant: str = "local",
        max_for_tenant: int | None = None, idle_timeout: float | None = None,
    ) -> SandboxInfo:
        tier = get_tier(resources)
        policy = policy_from(network)
        if isinstance(secrets, str):
            raise UsageError("secrets takes a list of secret names, not a single string")
        placeholders = self.egress.placeholders_for(secrets or [])
        if idle_timeout is not None:
            idle_timeout = self._check_ttl(idle_timeout, tier.max_ttl_s)
        if not isinstance(template, str):
            raise UsageError(f"template must be a string, not {type(template).__name__}")
        ttl = tier.ttl_s if timeout is None else self._check_ttl(timeout, tier.max_ttl_s)
        clean_labels = self._check_labels(labels)
        self._ensure_recovered()
        from .._backends.namespace.template import TEMPLATES

        if template not in TEMPLATES:
            raise UsageError(f"unknown template {template!r}; available: {', '.join(TEMPLATES)}")
        info = self.store.insert(
            sandbox_id=_new_id(), template=template, resources=resources, ttl_s=ttl,
            labels=clean_labels, uid_start=self.settings.uid_start,
            uid_count=self.settings.uid_count, network=policy.to_json(), secrets=placeholders,
            tenant=tenant, max_for_tenant=max_for_tenant, idle_timeout=idle_timeout,
        )
        try:
            self.backend.create(self._spec(info))
        except BaseException:
            self.store.delete(info.id)
            raise
        self.store.set_state(info.id, "running")
        info = dataclasses.replace(info, state="running")
        self.auditor.event(info.id, "sandbox.created", {
            "template": template, "resources": resources, "uid": info.uid,
            "expires_at": info.expires_at, "labels": clean_labels, "limits": tier.to_dict(),
            "backend": self.backend.name, "network": policy.to_json(),
            "secrets": sorted(placeholders), "tenant": tenant,
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

    def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        info = self.get(sandbox_id)
        ttl = self._check_ttl(timeout, get_tier(info.resources).max_ttl_s)
        self.store.set_expiry(sandbox_id, time.time() + ttl)
        info = self.get(sandbox_id)
        self.auditor.event(sandbox_id, "sandbox.timeout_changed", {"expires_at": info.expires_at})
        return info

    def set_network(self, sandbox_id: str, network: NetworkSpec) -> SandboxInfo:
        """Replace the sandbox's network policy; the next connection sees it."""
        policy = policy_from(network)
        self.get(sandbox_id)
        self.store.set_network(sandbox_id, policy.to_json())
        self.auditor.event(sandbox_id, "sandbox.policy_changed", {"network": policy.to_json()})
        return self.get(sandbox_id)

    def pause(self, sandbox_id: str) -> SandboxInfo:
        """Freeze every process of the sandbox (files stay reachable); its TTL keeps running."""
        info = self.get(sandbox_id)
        if info.state == "paused":
            return info
        self.backend.pause(self._spec(info), True)
        self.store.set_state(sandbox_id, "paused")
        self.auditor.event(sandbox_id, "sandbox.paused", {})
        return self.get(sandbox_id)

    def resume(self, sandbox_id: str) -> SandboxInfo:
        info = self.get(sandbox_id)
        if info.state != "paused":
            return info
        self.backend.pause(self._spec(info), False)
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
        if not self.backend.kill_command(self._spec(info), command_id):
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
            self.backend.destroy(self._spec(info))
            self.store.delete(info.id)
            self.auditor.event(info.id, "sandbox.destroyed", {"reason": reason}, sync=True)
            self.auditor.close_log(info.id)
            self.auditor.count("corral_sandboxes_destroyed", reason=reason)
            logger.info("destroyed sandbox %s (%s)", info.id, reason)
        finally:
            with self._destroying_lock:
                self._destroying.discard(info.id)

    def _spec(self, info: SandboxInfo) -> SandboxSpec:
        return SandboxSpec(id=info.id, uid=info.uid, template=info.template,
                           tier=get_tier(info.resources))

    # -- commands -----------------------------------------------------------------------------

    def run(
        self, sandbox_id: str, cmd: str | Sequence[str], *, timeout: float | None = None,
        envs: Mapping[str, str] | None = None, cwd: str | None = None,
        stdin: str | bytes | None = None, on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None, context: Mapping[str, Any] | None = None,
        interactive: bool = False, pty: tuple[int, int] | None = None,
        on_start: Callable[[ProcessIO], None] | None = None, lifetime: bool = False,
        command_id: str | None = None,
    ) -> CommandResult:
        """Run a command to completion.

        ``interactive``/``pty``/``on_start`` are for background processes and terminals: stdin
        stays open behind the ProcessIO given to ``on_start``. ``lifetime`` bounds the command
        by the sandbox's remaining lifetime instead of the tier's command timeout.
        """
        command, info, tier, limit = self._prepare(sandbox_id, cmd, timeout=timeout, envs=envs,
                                                   cwd=cwd, stdin=stdin, context=context,
                                                   lifetime=lifetime)
        if info.idle_timeout is not None:
            self.store.touch(sandbox_id)
        # A command never outlives its sandbox.
        limit = max(0.001, min(limit, info.expires_at - time.time()))
        recorder = self.auditor.command(sandbox_id, command_id)
        command_id = recorder.command_id if recorder else (command_id or new_command_id())
        with tracer.start_as_current_span("corral.command", attributes={
            "corral.sandbox.id": sandbox_id, "corral.command.id": command_id,
            "corral.tier": tier.name, "corral.backend": self.backend.name,
        }) as span:
            if recorder is not None:
                recorder.started(argv=command.argv, cwd=command.cwd, env=command.env,
                                 timeout_s=limit, context=context)
            self.auditor.count("corral_commands_started")
            started = time.monotonic()
            spec = self._spec(info)
            try:
                with self.egress.for_command(self.backend, spec, network=info.network,
                                             placeholders=info.secrets,
                                             command_id=command_id) as egress_env:
                    outcome = self.backend.exec(spec, ExecRequest(
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
                  context: Mapping[str, Any] | None = None) -> None:
        """Raise what ``run`` would refuse, without running anything."""
        self._prepare(sandbox_id, cmd, timeout=timeout, envs=envs, cwd=cwd, stdin=stdin,
                      context=context, lifetime=False)

    def _prepare(
        self, sandbox_id: str, cmd: str | Sequence[str], *, timeout: float | None,
        envs: Mapping[str, str] | None, cwd: str | None, stdin: str | bytes | None,
        context: Mapping[str, Any] | None, lifetime: bool,
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
        return command, info, tier, limit

    def _check_cwd(self, info: SandboxInfo, cwd: str) -> None:
        files = WorkspaceFiles(self.backend.workspace_root(self._spec(info)), info.uid)
        try:
            entry = files.stat(cwd)
        except FileNotFound:
            raise CommandError(f"the working directory {cwd} does not exist") from None
        except FileError as exc:
            raise CommandError(f"cannot use {cwd} as working directory: {exc.message}") from None
        if entry.type != "dir":
            raise CommandError(f"the working directory {cwd} is not a directory")

    # -- files --------------------------------------------------------------------------------

    def files(self, sandbox_id: str) -> AuditedFiles:
        info = self.get(sandbox_id)
        if info.idle_timeout is not None:
            self.store.touch(sandbox_id)
        root: Path = self.backend.workspace_root(self._spec(info))
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
        self.backend.close()
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
