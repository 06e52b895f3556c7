"""The embedded Python SDK: ``Sandbox`` with ``commands`` and ``files``.

Shaped like the hosted sandboxes agent developers know (``Sandbox.create()``,
``sb.commands.run()``, ``sb.files.write()``), running in-process against the local control plane.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Literal, Protocol, overload

from .._audit.events import AuditEvent
from .._audit.log import AuditTrail
from .._control.files import AuditedFiles
from .._control.manager import Manager, get_manager
from .._settings import Settings
from ..backends import OutputCallback
from ..errors import UsageError
from ..models import CommandResult, FileEntry, SandboxInfo, SnapshotInfo

__all__ = ["Audit", "Commands", "Files", "Network", "Process", "Processes", "Sandbox",
           "read_audit"]


@overload
def _snapshot_ref(snapshot: str | SnapshotInfo) -> str: ...
@overload
def _snapshot_ref(snapshot: str | SnapshotInfo | None) -> str | None: ...
def _snapshot_ref(snapshot: str | SnapshotInfo | None) -> str | None:
    return snapshot.id if isinstance(snapshot, SnapshotInfo) else snapshot


def _manager(home: str | Path | None = None, url: str | None = None,
             api_key: str | None = None) -> Manager:
    """Embedded (this process runs the sandboxes) unless a service URL is given or set in
    ``CORRAL_URL``; the remote manager has the same methods."""
    settings = Settings(home=Path(home)) if home is not None else Settings()
    url = url or settings.url
    if url and home is None:
        from .remote import remote_manager  # the HTTP client is not imported when embedded

        key = api_key or (settings.api_key.get_secret_value() if settings.api_key else None)
        return remote_manager(url, key)  # type: ignore[return-value]
    return get_manager(settings)


class Commands:
    """Run commands in one sandbox. Reached as ``sandbox.commands``."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def run(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        envs: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: str | bytes | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        context: Mapping[str, Any] | None = None,
    ) -> CommandResult:
        """Run ``cmd`` and wait for it.

        Args:
            cmd: a shell string (run by ``bash -c``) or an argv list (run directly).
            timeout: seconds before the whole process tree is killed; defaults to the tier's
                limit and may not exceed it.
            envs: extra environment variables.
            cwd: working directory inside ``/workspace`` (default ``/workspace``).
            stdin: data fed to the command's standard input.
            on_stdout: called with each piece of standard output as it arrives.
            on_stderr: the same for standard error.
            context: why this command runs, kept (redacted) in the audit trail; for example
                ``{"tool_call_id": ..., "model_input": ...}``.

        Returns:
            The result; a non-zero exit is not an exception (check ``result.ok``).

        Raises:
            CommandError: empty or malformed command, bad env, cwd outside ``/workspace``.
            SandboxNotFound: the sandbox is gone (or expired).

        Example:
            >>> sb.commands.run("python3 -c 'print(6 * 7)'").stdout
            '42\\n'
        """
        return self._sandbox._mgr.run(
            self._sandbox._live_id(), cmd, timeout=timeout, envs=envs, cwd=cwd, stdin=stdin,
            on_stdout=on_stdout, on_stderr=on_stderr, context=context,
        )


    def kill(self, command_id: str) -> None:
        """Kill a running command by its id (``result.command_id``, or from the audit trail);
        its ``run()`` returns with exit code 137."""
        self._sandbox._mgr.kill_command(self._sandbox._live_id(), command_id)


class ProcessAPI(Protocol):
    """What a transport offers for background processes (embedded table or HTTP)."""

    def start(self, sandbox_id: str, cmd: str | Sequence[str], *,
              envs: Mapping[str, str] | None = ..., cwd: str | None = ...,
              context: Mapping[str, Any] | None = ...) -> dict[str, Any]: ...
    def get(self, sandbox_id: str, process_id: str) -> dict[str, Any]: ...
    def list(self, sandbox_id: str) -> list[dict[str, Any]]: ...
    def output(self, sandbox_id: str, process_id: str, offset: int = 0, *,
               follow: bool = False, wait_s: float | None = None
               ) -> Iterator[tuple[int, str, str]]: ...
    def send(self, sandbox_id: str, process_id: str, data: bytes) -> None: ...
    def kill(self, sandbox_id: str, process_id: str) -> None: ...


class Process:
    """A declared background process. Reached through ``sandbox.processes``."""

    def __init__(self, sandbox: Sandbox, data: dict[str, Any]) -> None:
        self._sandbox = sandbox
        self._data = data

    @property
    def id(self) -> str:
        return str(self._data["id"])

    def info(self) -> dict[str, Any]:
        """``{id, state ("running"|"exited"), exit_code, command_id, output_bytes, ...}``."""
        self._data = self._sandbox._mgr_processes().get(self._sandbox.id, self.id)
        return dict(self._data)

    def output(self, offset: int = 0, *, follow: bool = False,
               wait_s: float | None = None) -> Iterator[tuple[int, str, str]]:
        """``(offset, stream, text)`` from ``offset``; ``follow`` waits for more until the
        process exits (or ``wait_s`` passes). Reconnect later with the last offset + len."""
        return self._sandbox._mgr_processes().output(self._sandbox.id, self.id, offset,
                                                     follow=follow, wait_s=wait_s)

    def send(self, data: str | bytes) -> None:
        """Write to the process's stdin."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        self._sandbox._mgr_processes().send(self._sandbox.id, self.id, raw)

    def kill(self) -> None:
        self._sandbox._mgr_processes().kill(self._sandbox.id, self.id)

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait until it exits (or ``timeout``); returns ``info()``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            data = self.info()
            if data["state"] == "exited":
                return data
            if deadline is not None and time.monotonic() >= deadline:
                return data
            time.sleep(0.05)


class Processes:
    """Background processes of a sandbox: servers, kernels, watchers."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def start(self, cmd: str | Sequence[str], *, envs: Mapping[str, str] | None = None,
              cwd: str | None = None, context: Mapping[str, Any] | None = None) -> Process:
        """Start ``cmd`` in the background. It runs until it exits, is killed, or the
        sandbox ends; it counts against the sandbox's limits; its output is kept for
        reconnecting (the last 4 MiB)."""
        data = self._sandbox._mgr_processes().start(self._sandbox._live_id(), cmd, envs=envs,
                                                    cwd=cwd, context=context)
        return Process(self._sandbox, data)

    def list(self) -> list[Process]:
        return [Process(self._sandbox, d)
                for d in self._sandbox._mgr_processes().list(self._sandbox._live_id())]

    def get(self, process_id: str) -> Process:
        return Process(self._sandbox, self._sandbox._mgr_processes().get(
            self._sandbox._live_id(), process_id))


class Files:
    """Files in the sandbox's ``/workspace``. Paths are ``/workspace/...`` or relative to it.

    Paths that leave ``/workspace`` (``..``, other absolute paths, symlinks pointing out) raise
    ``PathRefused``.
    """

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def _fs(self) -> AuditedFiles:
        return self._sandbox._mgr.files(self._sandbox._live_id())

    @overload
    def read(self, path: str, *, format: Literal["text"] = "text") -> str: ...
    @overload
    def read(self, path: str, *, format: Literal["bytes"]) -> bytes: ...

    def read(self, path: str, *, format: Literal["text", "bytes"] = "text") -> str | bytes:
        """Read a whole file, as text (UTF-8, invalid bytes replaced) or bytes."""
        if format not in ("text", "bytes"):
            raise UsageError(f"format must be 'text' or 'bytes', not {format!r}")
        data = self._fs().read(path)
        return data if format == "bytes" else data.decode("utf-8", errors="replace")

    def write(self, path: str, data: str | bytes) -> FileEntry:
        """Write a whole file atomically, creating parent directories."""
        if isinstance(data, str):
            data = data.encode()
        elif not isinstance(data, bytes | bytearray | memoryview):
            raise UsageError(f"data must be str or bytes, not {type(data).__name__}")
        return self._fs().write(path, bytes(data))

    def list(self, path: str = "/workspace") -> list[FileEntry]:
        """The entries of a directory, sorted by name."""
        return self._fs().list(path)

    def stat(self, path: str) -> FileEntry:
        return self._fs().stat(path)

    def exists(self, path: str) -> bool:
        return self._fs().exists(path)

    def remove(self, path: str) -> None:
        """Remove a file or a whole directory tree."""
        self._fs().remove(path)

    def make_dir(self, path: str) -> bool:
        """Create a directory and its parents; False if it already existed."""
        return self._fs().make_dir(path)

    def rename(self, src: str, dst: str) -> FileEntry:
        """Move a file, directory or symlink inside the workspace."""
        return self._fs().rename(src, dst)

    def upload(self, archive: bytes | BinaryIO, path: str = "/workspace") -> dict[str, int]:
        """Extract a tar or tar.gz (bytes or a binary file object, streamed) under ``path``.

        Refuses absolute names, ``..``, links leading out, hard links, devices, and archives
        larger than the workspace; entries before a refused one stay. Returns the counts.
        """
        stream = io.BytesIO(archive) if isinstance(archive, bytes | bytearray) else archive
        report = self._sandbox._mgr.upload(self._sandbox._live_id(), path, stream)
        return dict(report)

    def download(self, path: str = "/workspace", *, gzip: bool = False) -> Iterator[bytes]:
        """The tree under ``path`` as a tar stream, chunk by chunk (symlinks kept as links)."""
        return self._sandbox._mgr.download(self._sandbox._live_id(), path, gzip=gzip)


class Network:
    """The sandbox's network policy. Reached as ``sandbox.network``."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def get(self) -> dict[str, Any]:
        """``{"mode": "none"|"allowlist", "allow": [...], "deny": [...]}``."""
        return dict(self._sandbox.get_info().network)

    def update(self, *, allow: Sequence[str] | None = None,
               deny: Sequence[str] | None = None) -> dict[str, Any]:
        """Replace the policy: allow these hosts (``pypi.org``, ``*.github.com``,
        ``api.example.com:8443``), deny these (deny wins). No allow rules means no network.
        Takes effect for the next connection, also of commands already running."""
        info = self._sandbox._mgr.set_network(
            self._sandbox._live_id(), {"allow": list(allow or []), "deny": list(deny or [])})
        self._sandbox._info = info
        return dict(info.network)

    def block(self) -> None:
        """Back to no network at all."""
        self._sandbox._info = self._sandbox._mgr.set_network(self._sandbox._live_id(), "none")


class Audit:
    """The sandbox's audit trail. Reached as ``sandbox.audit``."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def events(
        self,
        *,
        types: Sequence[str] | None = None,
        since: float | None = None,
        until: float | None = None,
        command: str | None = None,
    ) -> list[AuditEvent]:
        """Events in log order, filtered by type (``command.finished`` or ``command.*``), Unix
        time and command id (``result.command_id``)."""
        return self.trail(types=types, since=since, until=until, command=command).events

    def trail(
        self,
        *,
        types: Sequence[str] | None = None,
        since: float | None = None,
        until: float | None = None,
        command: str | None = None,
    ) -> AuditTrail:
        """Like ``events`` but also says whether a torn last line was skipped."""
        return self._sandbox._mgr.auditor.trail(
            self._sandbox.id, types=types, since=since, until=until, command=command)


def read_audit(
    sandbox_id: str,
    *,
    home: str | Path | None = None,
    url: str | None = None,
    api_key: str | None = None,
    types: Sequence[str] | None = None,
    since: float | None = None,
    until: float | None = None,
    command: str | None = None,
) -> AuditTrail:
    """The audit trail of any sandbox, also one that has been destroyed.

    Raises:
        SandboxNotFound: no trail exists for that id.
    """
    return _manager(home, url, api_key).auditor.trail(
        sandbox_id, types=types, since=since, until=until, command=command)


class Sandbox:
    """A sandbox: an isolated Linux environment with one writable directory, ``/workspace``.

    Example:
        >>> from corral import Sandbox
        >>> with Sandbox.create() as sb:
        ...     sb.files.write("hello.py", "print('hi')")
        ...     print(sb.commands.run("python3 hello.py").stdout)
        hi
    """

    def __init__(self, info: SandboxInfo, manager: Manager) -> None:
        self._info = info
        self._mgr = manager
        self._killed = False
        self.commands = Commands(self)
        self.files = Files(self)
        self.audit = Audit(self)
        self.network = Network(self)
        self.processes = Processes(self)

    @classmethod
    def create(
        cls,
        template: str | None = None,
        *,
        resources: str = "small",
        timeout: float | None = None,
        labels: Mapping[str, str] | None = None,
        network: str | Mapping[str, Sequence[str]] | None = None,
        secrets: Sequence[str] | None = None,
        idle_timeout: float | None = None,
        isolation: str | None = None,
        snapshot: str | SnapshotInfo | None = None,
        home: str | Path | None = None,
        url: str | None = None,
        api_key: str | None = None,
    ) -> Sandbox:
        """Create a sandbox.

        Args:
            template: root filesystem; ``base`` (the default) is the host's system, read-only;
                others are built with ``corral templates build``. From a snapshot, the
                snapshot's template.
            resources: tier name, ``small`` or ``large`` (limits are in the README).
            timeout: lifetime in seconds (default: the tier's); it is destroyed after that.
            labels: free-form string labels, shown by ``Sandbox.list()``.
            network: ``"none"`` (default: no network at all) or
                ``{"allow": ["pypi.org", "*.github.com"], "deny": [...]}``; allowed traffic goes
                through the audited egress gateway (HTTP_PROXY and friends are set).
            secrets: names of host secrets (``corral secrets add``) to expose: the sandbox sees
                a placeholder in env ``NAME``; the gateway swaps in the value for the hosts the
                secret is bound to.
            idle_timeout: destroy it after this many seconds without a command or file
                operation (and nothing running); enforced by the service's reaper and by
                ``corral reap``.
            isolation: the isolation tier, ``"namespace"`` (default) or ``"gvisor"`` (a
                user-space kernel between the code and the host; ``corral doctor`` says which
                tiers this host supports).
            snapshot: start from this snapshot's workspace (a ``SnapshotInfo``, id or name).
            home: data directory (default ``CORRAL_HOME`` or ``/var/lib/corral``).
            url: a Corral service to use (default ``CORRAL_URL``; embedded when unset).
            api_key: its API key (default ``CORRAL_API_KEY``).

        Raises:
            UsageError: unknown template or tier, bad timeout or labels.
            BackendUnavailable: the host lacks something the sandbox needs (see ``corral doctor``).
        """
        manager = _manager(home, url, api_key)
        info = manager.create(template=template, resources=resources, timeout=timeout,
                              labels=labels, network=network, secrets=secrets,
                              idle_timeout=idle_timeout, isolation=isolation,
                              snapshot=_snapshot_ref(snapshot))
        return cls(info, manager)

    @classmethod
    def list_snapshots(cls, *, home: str | Path | None = None, url: str | None = None,
                       api_key: str | None = None) -> list[SnapshotInfo]:
        """Every snapshot (of the data directory, or of your tenant on a service)."""
        return _manager(home, url, api_key).list_snapshots()

    @classmethod
    def get_snapshot(cls, snapshot: str, *, home: str | Path | None = None,
                     url: str | None = None, api_key: str | None = None) -> SnapshotInfo:
        """A snapshot by id or name. Raises ``SnapshotNotFound``."""
        return _manager(home, url, api_key).get_snapshot(snapshot)

    @classmethod
    def delete_snapshot(cls, snapshot: str | SnapshotInfo, *, home: str | Path | None = None,
                        url: str | None = None, api_key: str | None = None) -> None:
        """Delete a snapshot. Raises ``SnapshotInUse`` while a sandbox is built on it."""
        _manager(home, url, api_key).delete_snapshot(_snapshot_ref(snapshot))

    def snapshot(self, name: str | None = None) -> SnapshotInfo:
        """Seal the workspace's current state as a snapshot, in O(1) of its size; the sandbox
        goes on from there. Nothing may be running in it (``SandboxBusy`` otherwise)."""
        return self._mgr.snapshot(self._live_id(), name=name)

    def fork(self, n: int = 1) -> list[Sandbox]:
        """``n`` new sandboxes starting from this one's workspace as it is now (sharing its
        read-only layers), with its template, tier, isolation, network policy and secrets."""
        return [Sandbox(info, self._mgr) for info in self._mgr.fork(self._live_id(), n)]

    def restore(self, snapshot: str | SnapshotInfo) -> None:
        """Put the workspace back exactly as it was in ``snapshot``; changes made since (and
        not in a snapshot) are gone. Nothing may be running in it."""
        self._info = self._mgr.restore(self._live_id(), _snapshot_ref(snapshot))

    @classmethod
    def connect(cls, sandbox_id: str, *, home: str | Path | None = None, url: str | None = None,
                api_key: str | None = None) -> Sandbox:
        """Attach to an existing sandbox (also one created by another process)."""
        manager = _manager(home, url, api_key)
        return cls(manager.get(sandbox_id), manager)

    @classmethod
    def list(cls, *, home: str | Path | None = None, url: str | None = None,
             api_key: str | None = None) -> list[SandboxInfo]:
        """Every live sandbox (of the data directory, or of your tenant on a service)."""
        return _manager(home, url, api_key).list()

    @property
    def id(self) -> str:
        return self._info.id

    def get_info(self) -> SandboxInfo:
        """Fresh metadata from the store."""
        self._info = self._mgr.get(self._live_id())
        return self._info

    def pause(self) -> None:
        """Freeze every process in the sandbox (files stay reachable); ``resume()`` goes on.
        Commands cannot start while paused; lifetimes and timeouts keep counting."""
        self._info = self._mgr.pause(self._live_id())

    def resume(self) -> None:
        self._info = self._mgr.resume(self._live_id())

    def set_timeout(self, timeout: float) -> None:
        """Set the remaining lifetime to ``timeout`` seconds from now."""
        self._info = self._mgr.set_timeout(self._live_id(), timeout)

    def kill(self) -> None:
        """Destroy the sandbox: kill its processes, delete its workspace. Idempotent."""
        if not self._killed:
            self._killed = True
            from ..errors import SandboxNotFound

            try:
                self._mgr.destroy(self._info.id)
            except SandboxNotFound:
                pass

    def _mgr_processes(self) -> ProcessAPI:
        """The process API of the transport: embedded manager's table or the remote client."""
        api: ProcessAPI = self._mgr.process_api()
        return api

    def _live_id(self) -> str:
        if self._killed:
            raise UsageError(f"sandbox {self._info.id} was killed; create a new one")
        return self._info.id

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()

    def __repr__(self) -> str:
        return f"<Sandbox {self._info.id} {self._info.resources}>"
