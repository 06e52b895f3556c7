"""The embedded transport: the control plane in this process, called directly.

``_aembedded.AsyncEmbeddedTransport`` runs each of these same calls in a worker thread: this
one *is* the call, the async one wraps it (one generic wrapper, plus the few calls with
callbacks or iterators). ``caller`` is who asks (a tenant and its ceiling; the operator when
``None``), as the service passes for an API key. Importing this loads neither anyio nor
httpx (the CLI's embedded start-up); the HTTP transport is imported when a URL is used.
"""

from __future__ import annotations

import builtins
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from .._audit.log import AuditTrail
from .._settings import Settings
from ..backends import OutputCallback
from ..models import (
    CodeContext,
    CommandResult,
    Execution,
    FileEntry,
    PortInfo,
    SandboxInfo,
    SnapshotInfo,
    VolumeInfo,
)
from ._wire import CodeItem, ProcessInfo, code_item, shaped

if TYPE_CHECKING:
    from .._control.plane import Manager, Tenant
    from ._sync.transport import Transport

__all__ = ["EmbeddedTransport", "embedded_target", "open_transport", "using_transport"]

class EmbeddedTransport:
    """The in-process control plane. Closing it releases nothing: the manager is the
    process's (``get_manager``)."""

    def __init__(self, manager: Manager, *, caller: Tenant | None = None) -> None:
        self.manager = manager
        self.caller = caller

    def sibling(self) -> EmbeddedTransport:
        return self

    def create(self, *, template: str | None, resources: str, timeout: float | None,
               labels: Mapping[str, str] | None, network: Any, secrets: Sequence[str] | None,
               idle_timeout: float | None, isolation: str | None,
               snapshot: str | None, image: str | None = None,
               volumes: Mapping[str, Any] | None = None,
               data_mounts: Mapping[str, Any] | None = None,
               lifecycle: Mapping[str, Any] | None = None) -> SandboxInfo:
        from .._control.requests import CreateSandbox

        # Checked by the service's own create request, so a bad one is refused in the same
        # words on either transport.
        asked = None if lifecycle is None else CreateSandbox.parse({"lifecycle": lifecycle})
        return self.manager.create(template=template, resources=resources, timeout=timeout,
                                   labels=labels, network=network, secrets=secrets,
                                   idle_timeout=idle_timeout, isolation=isolation,
                                   snapshot=snapshot, caller=self.caller, image=image,
                                   volumes=volumes, data_mounts=data_mounts,
                                   lifecycle=asked.lifecycle.lifecycle() if asked is not None
                                   and asked.lifecycle is not None else None)

    def get(self, sandbox_id: str) -> SandboxInfo:
        return self.manager.get(sandbox_id)

    def list(self) -> builtins.list[SandboxInfo]:
        return self.manager.list()

    def destroy(self, sandbox_id: str) -> None:
        self.manager.destroy(sandbox_id)

    def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        return self.manager.set_timeout(sandbox_id, timeout)

    def set_network(self, sandbox_id: str, network: Any) -> SandboxInfo:
        return self.manager.set_network(sandbox_id, network)

    def pause(self, sandbox_id: str) -> SandboxInfo:
        return self.manager.pause(sandbox_id)

    # The operator's own process sees every tenant's; a caller only its own.
    def _tenant(self) -> str | None:
        return None if self.caller is None or self.caller.is_local else self.caller.name

    def expose_port(self, sandbox_id: str, port: int, *, public: bool,
                    link_ttl: float | None) -> PortInfo:
        return self.manager.ports.expose(sandbox_id, port, public=public, link_ttl_s=link_ttl,
                                         tenant=self._tenant())

    def list_ports(self, sandbox_id: str) -> builtins.list[PortInfo]:
        return self.manager.ports.list(sandbox_id, tenant=self._tenant())

    def unexpose_port(self, sandbox_id: str, port: int) -> None:
        self.manager.ports.unexpose(sandbox_id, port, tenant=self._tenant())

    def create_volume(self, name: str, size: int | str) -> VolumeInfo:
        return self.manager.volumes.create(name, size, tenant=self._tenant() or "local")

    def get_volume(self, ref: str) -> VolumeInfo:
        return self.manager.volumes.get(ref, tenant=self._tenant())

    def list_volumes(self) -> builtins.list[VolumeInfo]:
        return self.manager.volumes.list(tenant=self._tenant())

    def delete_volume(self, ref: str) -> None:
        self.manager.volumes.delete(ref, tenant=self._tenant())

    def hibernate(self, sandbox_id: str) -> SandboxInfo:
        return self.manager.hibernate(sandbox_id)

    def resume(self, sandbox_id: str) -> SandboxInfo:
        return self.manager.resume(sandbox_id)

    def run(self, sandbox_id: str, cmd: str | Sequence[str], *, timeout: float | None,
            envs: Mapping[str, str] | None, cwd: str | None, stdin: str | bytes | None,
            on_stdout: OutputCallback | None, on_stderr: OutputCallback | None,
            context: Mapping[str, Any] | None, output: str) -> CommandResult:
        return shaped(self.manager.run(sandbox_id, cmd, timeout=timeout, envs=envs, cwd=cwd,
                                       stdin=stdin, on_stdout=on_stdout, on_stderr=on_stderr,
                                       context=context, caller=self.caller), output)

    def kill_command(self, sandbox_id: str, command_id: str) -> None:
        self.manager.kill_command(sandbox_id, command_id)

    def start_process(self, sandbox_id: str, cmd: str | Sequence[str], *,
                      envs: Mapping[str, str] | None, cwd: str | None,
                      context: Mapping[str, Any] | None) -> ProcessInfo:
        return self.manager.processes.start(sandbox_id, cmd, envs=envs, cwd=cwd,
                                            context=context, caller=self.caller).to_dict()

    def get_process(self, sandbox_id: str, process_id: str) -> ProcessInfo:
        return self.manager.processes.get(sandbox_id, process_id).to_dict()

    def list_processes(self, sandbox_id: str) -> builtins.list[ProcessInfo]:
        return [p.to_dict() for p in self.manager.processes.list(sandbox_id)]

    def process_output(self, sandbox_id: str, process_id: str, offset: int, *, follow: bool,
                       wait_s: float | None) -> Iterator[tuple[int, str, str]]:
        process = self.manager.processes.get(sandbox_id, process_id)
        return iter(process.output(offset, follow=follow, wait_s=wait_s))

    def send_process(self, sandbox_id: str, process_id: str, data: bytes) -> None:
        self.manager.processes.get(sandbox_id, process_id).send(data)

    def kill_process(self, sandbox_id: str, process_id: str) -> None:
        self.manager.processes.kill(sandbox_id, process_id)

    def run_code(self, sandbox_id: str, code: str, *, context_id: str | None,
                 language: str | None, envs: Mapping[str, str] | None, timeout: float | None,
                 on_event: Callable[[CodeItem], object] | None) -> Execution:
        from .._control.plane import CodeEvent, event_line

        def forward(event: CodeEvent) -> None:
            # The wire's own dicts: embedded and remote callbacks get the very same items.
            item = code_item(event_line(event))
            if item is not None and on_event is not None:
                on_event(item)

        return self.manager.interpreter.execute(
            sandbox_id, code, context_id=context_id, language=language, envs=envs,
            timeout=timeout, caller=self.caller, on_event=forward)

    def create_code_context(self, sandbox_id: str, *, language: str | None,
                            cwd: str | None) -> CodeContext:
        return self.manager.interpreter.create_context(sandbox_id, language=language, cwd=cwd,
                                                       caller=self.caller)

    def list_code_contexts(self, sandbox_id: str) -> builtins.list[CodeContext]:
        return self.manager.interpreter.list_contexts(sandbox_id)

    def restart_code_context(self, sandbox_id: str, context_id: str) -> CodeContext:
        return self.manager.interpreter.restart_context(sandbox_id, context_id)

    def remove_code_context(self, sandbox_id: str, context_id: str) -> None:
        self.manager.interpreter.remove_context(sandbox_id, context_id)

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        return self.manager.files(sandbox_id).read(path)

    def write_file(self, sandbox_id: str, path: str, data: bytes) -> FileEntry:
        return self.manager.files(sandbox_id).write(path, data)

    def list_files(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        return self.manager.files(sandbox_id).list(path)

    def stat_file(self, sandbox_id: str, path: str) -> FileEntry:
        return self.manager.files(sandbox_id).stat(path)

    def file_exists(self, sandbox_id: str, path: str) -> bool:
        return self.manager.files(sandbox_id).exists(path)

    def remove_file(self, sandbox_id: str, path: str) -> None:
        self.manager.files(sandbox_id).remove(path)

    def make_dir(self, sandbox_id: str, path: str) -> bool:
        return self.manager.files(sandbox_id).make_dir(path)

    def rename_file(self, sandbox_id: str, src: str, dst: str) -> FileEntry:
        return self.manager.files(sandbox_id).rename(src, dst)

    def upload(self, sandbox_id: str, path: str, stream: BinaryIO) -> dict[str, int]:
        return dict(self.manager.upload(sandbox_id, path, stream))

    def download(self, sandbox_id: str, path: str, *, gzip: bool) -> Iterator[bytes]:
        return self.manager.download(sandbox_id, path, gzip=gzip)

    def audit_trail(self, sandbox_id: str, *, types: Sequence[str] | None,
                    since: float | None, until: float | None,
                    command: str | None) -> AuditTrail:
        return self.manager.auditor.trail(sandbox_id, types=types, since=since, until=until,
                                          command=command)

    def snapshot(self, sandbox_id: str, *, name: str | None,
                 memory: bool = False) -> SnapshotInfo:
        return self.manager.snapshot(sandbox_id, name=name, memory=memory)

    def fork(self, sandbox_id: str, count: int, *,
             memory: bool = False) -> builtins.list[SandboxInfo]:
        return self.manager.fork(sandbox_id, count, caller=self.caller, memory=memory)

    def restore(self, sandbox_id: str, snapshot: str) -> SandboxInfo:
        return self.manager.restore(sandbox_id, snapshot, caller=self.caller)

    def get_snapshot(self, ref: str) -> SnapshotInfo:
        return self.manager.get_snapshot(ref)

    def list_snapshots(self) -> builtins.list[SnapshotInfo]:
        return self.manager.list_snapshots()

    def delete_snapshot(self, ref: str) -> None:
        self.manager.delete_snapshot(ref)

    def close(self) -> None:
        """Nothing to release: the manager is shared by the process."""


def _corral_environment() -> tuple[tuple[str, str], ...]:
    """The variables ``Settings`` reads (its prefix, in any case): the settings' cache key."""
    return tuple(sorted((name, value) for name, value in os.environ.items()
                        if name.upper().startswith("CORRAL_")))


@functools.lru_cache(maxsize=32)
def _settings(home: str | None, environment: tuple[tuple[str, str], ...]) -> Settings:
    """``Settings`` for ``home`` under ``environment``, built once: reading them is ~5 ms of
    pydantic-settings' parsing, which every SDK call of an embedded caller paid (a third of a
    sandbox's create). A changed variable is a new key."""
    del environment  # the key only: Settings reads os.environ itself
    return Settings(home=Path(home)) if home is not None else Settings()


def embedded_target(home: str | Path | None, url: str | None,
            api_key: str | None) -> tuple[str, str | None] | Manager:
    """Embedded (this process runs the sandboxes) unless a service URL is given or set in
    ``CORRAL_URL``: the URL and key, or the manager."""
    settings = _settings(str(home) if home is not None else None, _corral_environment())
    target = url or settings.url
    if target and home is None:
        key = api_key or (settings.api_key.get_secret_value() if settings.api_key else None)
        return target, key
    try:
        from .._control.plane import get_manager

        return get_manager(settings)
    except ModuleNotFoundError as exc:
        from .._core.install import host_install_needed

        raise host_install_needed(exc, "Embedded mode (no CORRAL_URL)") or exc from None


def open_transport(home: str | Path | None, url: str | None, api_key: str | None
                   ) -> Transport:
    target = embedded_target(home, url, api_key)
    if isinstance(target, tuple):
        from ._sync.http import HTTPTransport  # httpx only for a service: embedded stays lean

        return HTTPTransport(*target)
    return EmbeddedTransport(target)


@contextmanager
def using_transport(transport: Transport | None, home: str | Path | None, url: str | None,
                    api_key: str | None) -> Iterator[Transport]:
    """``transport``, or one opened for this block and closed after it."""
    if transport is not None:
        yield transport
        return
    opened = open_transport(home, url, api_key)
    try:
        yield opened
    finally:
        opened.close()


