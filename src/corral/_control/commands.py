"""Running commands: validate, admit, audit, trace, count, then hand them to the backend.

Background processes and terminals are commands too (``interactive``); the process table reaches
this service through the narrow ``CommandRunner`` protocol (``processes.py``) it implements, so
nothing here knows about them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .._audit.auditor import Auditor, new_command_id
from .._audit.tracing import tracer
from .._core.diskfull import disk_full_as_error
from .._core.resources import get_tier
from .._images.config import ImageConfig
from .._templates import catalog
from ..backends import ExecRequest, OutputCallback, ProcessIO
from ..errors import CommandNotFound, SandboxBusy
from ..models import CommandResult, ResourceTier
from . import validate
from .admission import Admission
from .egress import EgressBroker
from .locks import WorkspaceLocks
from .records import ASLEEP, SandboxRecord
from .sandboxes import Sandboxes
from .store import Store
from .tenants import Tenant

__all__ = ["Commands"]

logger = logging.getLogger(__name__)


def _outcome(result: CommandResult) -> str:
    if result.timed_out:
        return "timeout"
    if result.usage.oom_killed:
        return "oom"
    return "ok" if result.exit_code == 0 else "error"


class Commands:
    """The commands service (a ``processes.CommandRunner``)."""

    def __init__(self, *, store: Store, sandboxes: Sandboxes, auditor: Auditor,
                 egress: EgressBroker, admission: Admission, locks: WorkspaceLocks,
                 ready: Callable[[], None]) -> None:
        self._store = store
        self._sandboxes = sandboxes
        self._auditor = auditor
        self._egress = egress
        self._admission = admission
        self._locks = locks
        self._ready = ready  # recovery, before the first command (see Sandboxes)

    def admit_background(self, sandbox_id: str, caller: Tenant | None) -> str:
        info = self._sandboxes.awake(sandbox_id, tenant=None if caller is None
                                     else caller.scope, doing="start processes")
        self._admission.admit(caller)
        return info.id

    def run(
        self, sandbox_id: str, cmd: str | Sequence[str], *, timeout: float | None = None,
        envs: Mapping[str, str] | None = None, cwd: str | None = None,
        stdin: str | bytes | None = None, on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None, context: Mapping[str, Any] | None = None,
        interactive: bool = False, pty: tuple[int, int] | None = None,
        on_start: Callable[[ProcessIO], None] | None = None, lifetime: bool = False,
        command_id: str | None = None, caller: Tenant | None = None,
        stream_past_limit: bool = False, build_root: str | None = None,
        lossless_output: bool = False,
    ) -> CommandResult:
        """Run a command to completion (see ``Manager.run``; ``stream_past_limit``,
        ``lossless_output`` and ``build_root``, given as the working directory inside that
        root: see ``ExecRequest``)."""
        command, info, tier, limit = self.prepare(sandbox_id, cmd, timeout=timeout, envs=envs,
                                                  cwd=None if build_root else cwd, stdin=stdin,
                                                  context=context, lifetime=lifetime,
                                                  caller=caller, build=build_root is not None)
        if build_root is not None:
            command = dataclasses.replace(command, cwd=cwd or "/")
        if info.idle_timeout is not None:
            self._store.touch(sandbox_id)
        # A command never outlives its sandbox.
        limit = max(0.001, min(limit, _life_left(info)))
        recorder = self._auditor.command(sandbox_id, command_id)
        command_id = recorder.command_id if recorder else (command_id or new_command_id())
        with tracer.start_as_current_span("corral.command", attributes={
            "corral.sandbox.id": sandbox_id, "corral.command.id": command_id,
            "corral.tier": tier.name, "corral.backend": info.isolation,
        }) as span:
            if recorder is not None:
                recorder.started(argv=command.argv, cwd=command.cwd, env=command.env,
                                 timeout_s=limit, context=context)
            self._auditor.count("corral_commands_started")
            started = time.monotonic()
            spec = self._sandboxes.spec(info)
            backend = self._sandboxes.backend(info)
            try:
                # A tier that writes to the data directory to start (gVisor's bundle, a VM's
                # disk) refuses a full disk as DiskFullError, not an OSError.
                with disk_full_as_error(self._store.path.parent), \
                        self._locks.hold(sandbox_id, exclusive=False), \
                        self._egress.for_command(backend, spec, network=info.network,
                                                 placeholders=info.secrets,
                                                 command_id=command_id) as egress_env:
                    outcome = backend.exec(spec, ExecRequest(
                        command_id=command_id,
                        argv=command.argv, cwd=command.cwd, env={**command.env, **egress_env},
                        timeout_s=limit, stdin=command.stdin,
                        output_limit_bytes=tier.output_limit_bytes,
                        stream_past_limit=stream_past_limit, lossless_output=lossless_output,
                        on_stdout=self._auditor.recorded_callback(
                            recorder, "stdout", on_stdout, lossless=lossless_output),
                        on_stderr=self._auditor.recorded_callback(
                            recorder, "stderr", on_stderr, lossless=lossless_output),
                        interactive=interactive, pty=pty, on_start=on_start,
                        build_root=build_root,
                    ))
            except BaseException as exc:
                span.set_attribute("corral.outcome", "failed")
                if recorder is not None:
                    recorder.finished(None, error=f"{type(exc).__name__}: {exc}")
                self._auditor.count("corral_commands_finished", outcome="failed")
                raise
            result = CommandResult(
                exit_code=outcome.exit_code, stdout=outcome.stdout, stderr=outcome.stderr,
                timed_out=outcome.timed_out, duration_s=time.monotonic() - started,
                usage=outcome.usage, stdout_truncated=outcome.stdout_truncated,
                stderr_truncated=outcome.stderr_truncated, command_id=command_id,
                stdout_bytes=outcome.stdout_bytes, stderr_bytes=outcome.stderr_bytes,
            )
            verdict = _outcome(result)
            span.set_attributes({"corral.outcome": verdict, "corral.exit_code": result.exit_code})
            with tracer.start_as_current_span("corral.audit.commit"):
                if recorder is not None:
                    recorder.finished(result)
                if self._auditor.enabled:
                    self._auditor.metrics.command_finished(
                        outcome=verdict, duration_s=result.duration_s,
                        cpu_s=result.usage.cpu_s,
                        peak_memory_bytes=result.usage.peak_memory_bytes)
        logger.debug("ran %s in %s: exit %d", shlex.join(command.argv)[:200], sandbox_id,
                     outcome.exit_code)
        return result

    def prepare(
        self, sandbox_id: str, cmd: str | Sequence[str], *, timeout: float | None,
        envs: Mapping[str, str] | None, cwd: str | None, stdin: str | bytes | None,
        context: Mapping[str, Any] | None, lifetime: bool, caller: Tenant | None = None,
        build: bool = False,
    ) -> tuple[validate.Command, SandboxRecord, ResourceTier, float]:
        """Everything ``run`` refuses, refused before anything runs; with ``caller``, the
        start is counted (last, so a refused command does not use up the quota)."""
        command = validate.command(cmd, cwd, envs, stdin)
        validate.context(context)
        # A caller reaches only its tenant's sandboxes, as if the others did not exist: the
        # surfaces need no check of their own before a run.
        # A paused one is resumed first when its lifecycle says so, else refused.
        info = self._sandboxes.awake(sandbox_id,
                                     tenant=None if caller is None else caller.scope)
        image = None if build else image_config(self._sandboxes.templates_dir, info.template)
        if image is not None:
            command = _with_image(command, image, cwd_given=cwd is not None)
        self._ready()
        tier = get_tier(info.resources)
        if lifetime:
            limit = _life_left(info)
        else:
            limit = validate.command_timeout(timeout, tier)
        self._admission.admit(caller)
        return command, info, tier, limit

    def kill(self, sandbox_id: str, command_id: str) -> None:
        """Kill a running command (from any process); its run() returns exit code 137."""
        info = self._sandboxes.get(sandbox_id)
        if info.state in ASLEEP:
            raise SandboxBusy(f"sandbox {sandbox_id} is {info.state}; resume it before "
                              "killing commands")
        validate.command_id(command_id)
        if not self._sandboxes.backend(info).kill_command(self._sandboxes.spec(info),
                                                          command_id):
            raise CommandNotFound(f"command {command_id} is not running in {sandbox_id}")


#: What bounds a command of a sandbox paused at its timeout: its destroy, and this (24 days:
#: the most a poll's millisecond timeout holds, 2**31 ms).
_NO_END_S = 24 * 86400.0


def _life_left(info: SandboxRecord) -> float:
    """How long a command may run at most: until its sandbox's timeout, which ends it. A
    sandbox that its lifecycle pauses at its timeout has its processes sleep with it and go on
    after a resume; its destroy (the keep over, or a kill) is what ends them."""
    if info.lifecycle.on_timeout == "pause":
        return _NO_END_S
    return info.expires_at - time.time()


# Corral's own for the sandbox user (home is the workspace); an image's values would point a
# command at directories it cannot write.
_SANDBOX_IDENTITY = frozenset({"HOME", "USER", "LOGNAME"})


def _with_image(command: validate.Command, image: ImageConfig, *,
                cwd_given: bool) -> validate.Command:
    """The image's environment under the caller's, and its working directory unless the caller
    chose one (Docker's rules; the user is always the sandbox user)."""
    env = {k: v for k, v in image.env.items() if k not in _SANDBOX_IDENTITY}
    cwd = command.cwd if cwd_given or image.working_dir is None else image.working_dir
    argv = command.argv
    if argv[:2] == ["/bin/bash", "-c"] and len(argv) == 3 and image.shell != "/bin/bash":
        argv = [image.shell, "-c", argv[2]]
    return dataclasses.replace(command, argv=argv, env={**env, **command.env}, cwd=cwd)


def image_config(templates_dir: Path, template: str) -> ImageConfig | None:
    """The image config of template ``template``'s current build (None if it is no image)."""
    try:
        pointer = os.readlink(catalog.pointer(templates_dir, template))
    except OSError:
        return None
    return _image_config(templates_dir, pointer)


@functools.lru_cache(maxsize=256)
def _image_config(templates_dir: Path, build: str) -> ImageConfig | None:
    # Keyed by the build's directory, which never changes once made.
    try:
        meta = json.loads((templates_dir / build / "template.json").read_text())
    except (OSError, ValueError):
        return None
    image = meta.get("image") if isinstance(meta, dict) else None
    if not isinstance(image, dict):
        return None
    return ImageConfig.from_dict(image.get("config") or {})
