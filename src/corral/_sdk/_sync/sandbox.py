# Generated from src/corral/_sdk/_async/sandbox.py by scripts/unasync: do not edit.
# Change the async source and run scripts/unasync.
"""The SDK façade: a sandbox with ``commands``, ``processes``, ``files``, ``network`` and
``audit``, over a transport.

The async façade is written by hand; the sync one is generated from it by
``scripts/unasync`` and checked in CI (``scripts/unasync --check``).
Why generated rather than two façades over a shared core: the façade *is* the public API
(signatures and docstrings are what users read), and a shared core still leaves one method per
operation on each side to keep in step by eye; httpcore's answer (write async, generate sync)
makes drift impossible rather than unlikely. What is not I/O (bodies, parsing, error mapping,
the command stream) lives once in ``_wire``; what differs by more than ``await`` lives in
``_io`` and the embedded transports (the sync one is the call; the async one runs it in a
worker thread).

One pattern, as in E2B: ``create()`` returns the sandbox, which is a context manager::

    with Sandbox.create() as sb:
        result = sb.commands.run("echo hi")

Transports (``transport=``): embedded (this process runs the sandboxes; on the async side each
blocking control-plane call runs in a worker thread, so the event loop never blocks), HTTP
(``url=`` or ``CORRAL_URL``), or any ``Transport``, e.g. the app in-process over ASGI
(``corral.testing``). Nothing here calls ``asyncio.run()``.
"""

from __future__ import annotations

import builtins
import enum
import io
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Literal, overload

from ..._audit.events import AuditEvent
from ..._audit.log import AuditTrail
from ...errors import SandboxNotFound, UsageError
from ...models import (
    CodeContext,
    CommandResult,
    Execution,
    FileEntry,
    Lifecycle,
    PortInfo,
    SandboxInfo,
    SnapshotInfo,
)
from .. import _wire
from .._embedded import open_transport, using_transport
from .._io import now, shielded, sleep
from .._wire import OutputCallback, ProcessInfo, deliver
from .transport import Transport

__all__ = ["Audit", "Commands", "Files", "Network", "Ports",
           "Process", "Processes", "Sandbox", "read_audit"]


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
        output: _wire.Output = "text",
    ) -> CommandResult:
        """Run ``cmd`` and wait for it.

        Args:
            cmd: a shell string (run by ``bash -c``) or an argv list (run directly).
            timeout: seconds before the whole process tree is killed; defaults to the tier's
                limit and may not exceed it.
            envs: extra environment variables.
            cwd: working directory inside ``/workspace`` (default ``/workspace``).
            stdin: data fed to the command's standard input.
            on_stdout: called with each piece of standard output as it arrives (on the async
                side it may be an ``async def``, awaited; it runs on the event loop, in
                order). When the stream reaches its cap it is called once with a notice (an
                ``OutputCut``, a ``str``) and then no more.
            on_stderr: the same for standard error.
            context: why this command runs, kept (redacted) in the audit trail; for example
                ``{"tool_call_id": ..., "model_input": ...}``.
            output: ``"bytes"`` also fills ``result.stdout_bytes``/``stderr_bytes`` with the
                kept output exactly as written (binary output intact; base64 over HTTP).

        Returns:
            The result; a non-zero exit is not an exception (check ``result.ok``). Cancelling
            the awaiting task stops the waiting, not the command: it ends at its timeout, by
            ``kill()`` with its command id, or with the sandbox.

        Raises:
            CommandError: empty or malformed command, bad env, cwd outside ``/workspace``.
            SandboxNotFound: the sandbox is gone (or expired).

        Example:
            >>> (sb.commands.run("python3 -c 'print(6 * 7)'")).stdout
            '42\\n'
        """
        _wire.check_output(output)
        sb = self._sandbox
        return sb._transport().run(
            sb._live_id(), cmd, timeout=timeout, envs=envs, cwd=cwd, stdin=stdin,
            on_stdout=on_stdout, on_stderr=on_stderr, context=context, output=output)

    def kill(self, command_id: str) -> None:
        """Kill a running command by its id (``result.command_id``, or from the audit trail);
        its ``run()`` returns with exit code 137."""
        self._sandbox._transport().kill_command(self._sandbox._live_id(), command_id)


class Process:
    """A declared background process. Reached through ``sandbox.processes``."""

    def __init__(self, sandbox: Sandbox, data: ProcessInfo) -> None:
        self._sandbox = sandbox
        self._data = data

    @property
    def id(self) -> str:
        return str(self._data["id"])

    def info(self) -> ProcessInfo:
        """``{id, state ("running"|"exited"), exit_code, command_id, output_bytes, ...}``."""
        self._data = self._sandbox._transport().get_process(self._sandbox.id, self.id)
        return dict(self._data)

    def output(self, offset: int = 0, *, follow: bool = False,
               wait_s: float | None = None) -> Iterator[tuple[int, str, str]]:
        """``(offset, stream, text)`` from ``offset``; ``follow`` waits for more until the
        process exits (or ``wait_s`` passes). Reconnect later with the last offset + len."""
        return self._sandbox._transport().process_output(
            self._sandbox.id, self.id, offset, follow=follow, wait_s=wait_s)

    def send(self, data: str | bytes) -> None:
        """Write to the process's stdin."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        self._sandbox._transport().send_process(self._sandbox.id, self.id, raw)

    def kill(self) -> None:
        self._sandbox._transport().kill_process(self._sandbox.id, self.id)

    def wait(self, timeout: float | None = None) -> ProcessInfo:
        """Wait until it exits (or ``timeout``); returns ``info()``."""
        deadline = None if timeout is None else now() + timeout
        while True:
            data = self.info()
            if data["state"] == "exited" or (deadline is not None and now() >= deadline):
                return data
            sleep(0.05)


class Processes:
    """Background processes of a sandbox: servers, kernels, watchers."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def start(self, cmd: str | Sequence[str], *, envs: Mapping[str, str] | None = None,
                    cwd: str | None = None, context: Mapping[str, Any] | None = None
                    ) -> Process:
        """Start ``cmd`` in the background. It runs until it exits, is killed, or the
        sandbox ends; it counts against the sandbox's limits; its output is kept for
        reconnecting (the last 4 MiB)."""
        sb = self._sandbox
        data = sb._transport().start_process(sb._live_id(), cmd, envs=envs, cwd=cwd,
                                                   context=context)
        return Process(sb, data)

    def list(self) -> builtins.list[Process]:
        sb = self._sandbox
        return [Process(sb, d)
                for d in sb._transport().list_processes(sb._live_id())]

    def get(self, process_id: str) -> Process:
        sb = self._sandbox
        return Process(sb, sb._transport().get_process(sb._live_id(), process_id))


class Files:
    """Files in the sandbox's ``/workspace``. Paths are ``/workspace/...`` or relative to it.

    Paths that leave ``/workspace`` (``..``, other absolute paths, symlinks pointing out) raise
    ``PathRefused``.
    """

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def _at(self) -> tuple[Transport, str]:
        return self._sandbox._transport(), self._sandbox._live_id()

    @overload
    def read(self, path: str, *, format: Literal["text"] = "text") -> str: ...
    @overload
    def read(self, path: str, *, format: Literal["bytes"]) -> bytes: ...

    def read(self, path: str, *,
                   format: Literal["text", "bytes"] = "text") -> str | bytes:
        """Read a whole file, as text (UTF-8, invalid bytes replaced) or bytes."""
        _wire.check_format(format)
        transport, sandbox_id = self._at()
        data = transport.read_file(sandbox_id, path)
        return data if format == "bytes" else data.decode("utf-8", errors="replace")

    def write(self, path: str, data: str | bytes) -> FileEntry:
        """Write a whole file atomically, creating parent directories."""
        raw = _wire.file_data(data)
        transport, sandbox_id = self._at()
        return transport.write_file(sandbox_id, path, raw)

    def list(self, path: str = "/workspace") -> builtins.list[FileEntry]:
        """The entries of a directory, sorted by name."""
        transport, sandbox_id = self._at()
        return transport.list_files(sandbox_id, path)

    def stat(self, path: str) -> FileEntry:
        transport, sandbox_id = self._at()
        return transport.stat_file(sandbox_id, path)

    def exists(self, path: str) -> bool:
        transport, sandbox_id = self._at()
        return transport.file_exists(sandbox_id, path)

    def remove(self, path: str) -> None:
        """Remove a file or a whole directory tree."""
        transport, sandbox_id = self._at()
        transport.remove_file(sandbox_id, path)

    def make_dir(self, path: str) -> bool:
        """Create a directory and its parents; False if it already existed."""
        transport, sandbox_id = self._at()
        return transport.make_dir(sandbox_id, path)

    def rename(self, src: str, dst: str) -> FileEntry:
        """Move a file, directory or symlink inside the workspace."""
        transport, sandbox_id = self._at()
        return transport.rename_file(sandbox_id, src, dst)

    def upload(self, archive: bytes | BinaryIO, path: str = "/workspace"
                     ) -> dict[str, int]:
        """Extract a tar or tar.gz (bytes or a binary file object, streamed) under ``path``.

        Refuses absolute names, ``..``, links leading out, hard links, devices, and archives
        larger than the workspace; entries before a refused one stay. Returns the counts.
        """
        stream = io.BytesIO(archive) if isinstance(archive, bytes | bytearray) else archive
        transport, sandbox_id = self._at()
        return dict(transport.upload(sandbox_id, path, stream))

    def download(self, path: str = "/workspace", *, gzip: bool = False
                 ) -> Iterator[bytes]:
        """The tree under ``path`` as a tar stream, chunk by chunk (symlinks kept as links)."""
        transport, sandbox_id = self._at()
        return transport.download(sandbox_id, path, gzip=gzip)


class Network:
    """The sandbox's network policy. Reached as ``sandbox.network``."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def get(self) -> dict[str, Any]:
        """``{"mode": "none"|"allowlist", "allow": [...], "deny": [...]}``."""
        return dict((self._sandbox.get_info()).network)

    def update(self, *, allow: Sequence[str] | None = None,
                     deny: Sequence[str] | None = None) -> dict[str, Any]:
        """Replace the policy: allow these hosts (``pypi.org``, ``*.github.com``,
        ``api.example.com:8443``), deny these (deny wins). No allow rules means no network.
        Takes effect for the next connection, also of commands already running."""
        sb = self._sandbox
        sb._info = sb._transport().set_network(
            sb._live_id(), {"allow": builtins.list(allow or []),
                            "deny": builtins.list(deny or [])})
        return dict(sb._info.network)

    def block(self) -> None:
        """Back to no network at all."""
        sb = self._sandbox
        sb._info = sb._transport().set_network(sb._live_id(), "none")


class Ports:
    """The sandbox's ports as URLs served by ``corral serve``. Reached as ``sandbox.ports``."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def expose(self, port: int, *, public: bool = False,
                     link_ttl: float | None = None) -> PortInfo:
        """Serve ``port`` (a server in the sandbox on ``0.0.0.0`` or ``127.0.0.1``) through
        the proxy, HTTP and WebSockets alike; idempotent (exposing again changes ``public``).

        Args:
            port: the TCP port inside the sandbox.
            public: reachable by anyone with the URL; by default only with the port's
                ``token`` (header ``X-Corral-Port-Token``), its owner's API key, or a browser
                that opened ``signed_url``.
            link_ttl: seconds the returned ``signed_url`` works (default an hour, at most a
                week).

        Returns:
            The URLs (``url``, and ``host_url`` when the service has a ports domain; both
            ``None`` embedded without ``CORRAL_PORTS_URL``), the token and a signed link.
        """
        sb = self._sandbox
        return sb._transport().expose_port(sb._live_id(), port, public=public,
                                                 link_ttl=link_ttl)

    def list(self) -> builtins.list[PortInfo]:
        """The exposed ports, each with a fresh signed link."""
        sb = self._sandbox
        return sb._transport().list_ports(sb._live_id())

    def unexpose(self, port: int) -> None:
        """Stop serving ``port``: its token and signed links stop working at once."""
        sb = self._sandbox
        sb._transport().unexpose_port(sb._live_id(), port)


class Audit:
    """The sandbox's audit trail. Reached as ``sandbox.audit``; readable after ``kill()``."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def events(self, *, types: Sequence[str] | None = None, since: float | None = None,
                     until: float | None = None, command: str | None = None
                     ) -> builtins.list[AuditEvent]:
        """Events in log order, filtered by type (``command.finished`` or ``command.*``), Unix
        time and command id (``result.command_id``)."""
        trail = self.trail(types=types, since=since, until=until, command=command)
        return trail.events

    def trail(self, *, types: Sequence[str] | None = None, since: float | None = None,
                    until: float | None = None, command: str | None = None) -> AuditTrail:
        """Like ``events`` but also says whether a torn last line was skipped."""
        return self._sandbox._transport().audit_trail(
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
    transport: Transport | None = None,
) -> AuditTrail:
    """The audit trail of any sandbox, also one that has been destroyed.

    Raises:
        SandboxNotFound: no trail exists for that id.
    """
    with using_transport(transport, home, url, api_key) as opened:
        return opened.audit_trail(sandbox_id, types=types, since=since, until=until,
                                        command=command)


class _State(enum.Enum):
    """The connection's state; whether the sandbox was killed is ``_killed`` (a killed
    sandbox's connection stays open so its audit trail stays readable)."""

    OPEN = "open"
    CLOSED = "closed"


class Sandbox:
    """A sandbox: an isolated Linux environment with one writable directory, ``/workspace``.

    Use it as a context manager, which kills the sandbox and then closes the connection on
    exit. Without one, ``kill()`` destroys it and ``close()`` releases the connection
    (``close()`` alone detaches and leaves the sandbox running, for ``connect()`` later).

    Example:
        >>> from corral import Sandbox
        >>> with Sandbox.create() as sb:
        ...     sb.files.write("hello.py", "print('hi')")
        ...     print((sb.commands.run("python3 hello.py")).stdout)
        hi
    """

    def __init__(self, info: SandboxInfo, transport: Transport) -> None:
        self._info = info
        self._mgr = transport
        self._state = _State.OPEN
        self._killed = False
        self.commands = Commands(self)
        self.files = Files(self)
        self.audit = Audit(self)
        self.network = Network(self)
        self.processes = Processes(self)
        self.ports = Ports(self)

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
        image: str | None = None,
        volumes: Mapping[str, str | Mapping[str, Any]] | None = None,
        data_mounts: Mapping[str, str] | None = None,
        lifecycle: Lifecycle | Mapping[str, Any] | None = None,
        home: str | Path | None = None,
        url: str | None = None,
        api_key: str | None = None,
        transport: Transport | None = None,
    ) -> Sandbox:
        """Create a sandbox.

        Args:
            template: root filesystem; ``base`` (the default) is the host's system, read-only;
                others are built with ``corral templates build``. From a snapshot, the
                snapshot's template.
            resources: tier name, ``small`` or ``large`` (limits are in the README).
            timeout: lifetime in seconds (default: the tier's); it is destroyed after that.
            labels: free-form string labels, shown by ``list()``.
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
            image: start from an image instead of a template: ``[host/]path[:tag][@sha256:...]``
                from a registry the operator allows (``CORRAL_REGISTRIES``); embedded, also
                ``oci:/path[:tag]`` or ``docker-archive:/path.tar``. Pulled first unless it
                already was; its environment and working directory apply to commands.
            volumes: your volumes (``Volume.create``) by name, each at a mount point
                under ``/mnt/`` or ``/workspace/``: ``{"cache": "/mnt/cache"}``, or
                ``{"cache": {"path": "/mnt/cache", "read_only": True}}``. A volume has one
                writer or any number of readers (``VolumeInUse`` otherwise).
            data_mounts: the operator's data mounts (``CORRAL_DATA_MOUNTS``) by name, each
                at a mount point, read-only: ``{"refs": "/mnt/refs"}``.
            lifecycle: what happens at its timeout, a ``Lifecycle`` or a dict such as
                ``{"on_timeout": "pause", "auto_resume": True}``. ``on_timeout``: ``"kill"``
                (default) destroys it; ``"pause"`` pauses it instead and keeps it paused for
                the operator's ``paused_keep_s`` (``resume()`` starts its lifetime again).
                ``auto_resume``: a command, file, code or port call resumes it when paused,
                instead of being refused (``SandboxBusy``). ``get_info().lifecycle`` says
                which it has.
            home: data directory (default ``CORRAL_HOME`` or ``/var/lib/corral``).
            url: a Corral service to use (default ``CORRAL_URL``; embedded when unset).
            api_key: its API key (default ``CORRAL_API_KEY``).
            transport: use this transport instead (``home``/``url``/``api_key`` are then
                ignored); closing the sandbox closes it.

        Raises:
            UsageError: unknown template or tier, bad timeout or labels.
            SnapshotNotFound: no such snapshot (or not yours, on a service).
            BackendUnavailable: the host lacks something the sandbox needs (see ``corral doctor``).
            TransportError: the service at ``url`` cannot be reached.
        """
        opened = transport or open_transport(home, url, api_key)
        try:
            info = opened.create(template=template, resources=resources,
                                       timeout=timeout, labels=labels, network=network,
                                       secrets=secrets, idle_timeout=idle_timeout,
                                       isolation=isolation,
                                       snapshot=_wire.snapshot_ref(snapshot), image=image,
                                       volumes=volumes, data_mounts=data_mounts,
                                       lifecycle=_wire.lifecycle_body(lifecycle))
        except BaseException:
            if transport is None:  # one passed in stays its owner's to close
                opened.close()
            raise
        return cls(info, opened)

    @classmethod
    def connect(cls, sandbox_id: str, *, home: str | Path | None = None,
                      url: str | None = None, api_key: str | None = None,
                      transport: Transport | None = None) -> Sandbox:
        """Attach to an existing sandbox (also one created by another process)."""
        opened = transport or open_transport(home, url, api_key)
        try:
            info = opened.get(sandbox_id)
        except BaseException:
            if transport is None:  # one passed in stays its owner's to close
                opened.close()
            raise
        return cls(info, opened)

    @classmethod
    def list(cls, *, home: str | Path | None = None, url: str | None = None,
                   api_key: str | None = None, transport: Transport | None = None
                   ) -> builtins.list[SandboxInfo]:
        """Every live sandbox (of the data directory, or of your tenant on a service)."""
        with using_transport(transport, home, url, api_key) as opened:
            return opened.list()

    @classmethod
    def list_snapshots(cls, *, home: str | Path | None = None, url: str | None = None,
                             api_key: str | None = None, transport: Transport | None = None
                             ) -> builtins.list[SnapshotInfo]:
        """Every snapshot (of the data directory, or of your tenant on a service)."""
        with using_transport(transport, home, url, api_key) as opened:
            return opened.list_snapshots()

    @classmethod
    def get_snapshot(cls, snapshot: str, *, home: str | Path | None = None,
                           url: str | None = None, api_key: str | None = None,
                           transport: Transport | None = None) -> SnapshotInfo:
        """A snapshot by id or name. Raises ``SnapshotNotFound``."""
        with using_transport(transport, home, url, api_key) as opened:
            return opened.get_snapshot(snapshot)

    @classmethod
    def delete_snapshot(cls, snapshot: str | SnapshotInfo, *,
                              home: str | Path | None = None, url: str | None = None,
                              api_key: str | None = None,
                              transport: Transport | None = None) -> None:
        """Delete a snapshot. Raises ``SnapshotInUse`` while a sandbox is built on it."""
        with using_transport(transport, home, url, api_key) as opened:
            opened.delete_snapshot(_wire.snapshot_ref(snapshot))

    # -- code interpreter -------------------------------------------------------------------

    def run_code(
        self,
        code: str,
        language: str | None = None,
        context: CodeContext | str | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = None,
        *,
        on_stdout: _wire.MessageCallback | None = None,
        on_stderr: _wire.MessageCallback | None = None,
        on_result: _wire.ResultCallback | None = None,
        on_error: _wire.ErrorCallback | None = None,
    ) -> Execution:
        """Run a cell in a stateful kernel: variables, imports and cwd stay for the next cell.

        Args:
            code: the cell's source.
            language: ``"python"`` (default; IPython when the template has it), ``"bash"``
                (one persistent shell), ``"javascript"``/``"js"`` or ``"typescript"``/``"ts"``
                (node, one persistent context), or ``"r"`` (Rscript; the ``code-interpreter``
                template has them all); used with no ``context``: the sandbox's default context
                of that language, started on demand.
            context: a context from ``create_code_context()`` (or its id).
            envs: environment variables for this cell only.
            timeout: seconds before the cell is interrupted (default and maximum: the tier's
                command timeout); a cell that ignores the interrupt loses its kernel.
            on_stdout: called with each ``OutputMessage`` of standard output as it is printed.
            on_stderr: the same for standard error.
            on_result: called with each ``Result`` (a displayed figure, the cell's value).
            on_error: called with the cell's ``ExecutionError``.

        Returns:
            The ``Execution``: ``results`` (MIME bundles: ``.text``, ``.html``, ``.png``...),
            ``logs``, ``error`` (an exception in the cell is not raised), ``execution_count``.
            A kernel that died (crash, out of memory, ``os._exit``) is an ``error`` too
            (``KernelDied``, ``KernelOutOfMemory``); the next cell starts a fresh kernel.

        Raises:
            ContextNotFound: no such context in this sandbox.
            InterpreterUnavailable: the template cannot run that language.

        Example:
            >>> (sb.run_code("x = 6 * 7\nx")).text
            '42'
        """
        callbacks = {"stdout": on_stdout, "stderr": on_stderr, "result": on_result,
                     "error": on_error}

        def dispatch(item: _wire.CodeItem) -> None:
            deliver(callbacks[item[0]], item[1])  # type: ignore[arg-type]

        wanted = any(callbacks.values())
        return self._transport().run_code(
            self._live_id(), code, context_id=context.id if isinstance(context, CodeContext)
            else context, language=language, envs=envs, timeout=timeout,
            on_event=dispatch if wanted else None)

    def create_code_context(self, cwd: str | None = None,
                                  language: str | None = None) -> CodeContext:
        """A new kernel context (``python``, ``javascript``, ``typescript``, ``r`` or ``bash``;
        ``cwd`` any directory in the sandbox, relative ones under ``/workspace``); its kernel
        starts with its first cell and counts as a background process."""
        return self._transport().create_code_context(self._live_id(),
                                                           language=language, cwd=cwd)

    def list_code_contexts(self) -> builtins.list[CodeContext]:
        return self._transport().list_code_contexts(self._live_id())

    def restart_code_context(self, context: CodeContext | str) -> CodeContext:
        """Kill the context's kernel: its state is gone; the next cell starts afresh."""
        return self._transport().restart_code_context(
            self._live_id(), context.id if isinstance(context, CodeContext) else context)

    def remove_code_context(self, context: CodeContext | str) -> None:
        self._transport().remove_code_context(
            self._live_id(), context.id if isinstance(context, CodeContext) else context)

    def snapshot(self, name: str | None = None, *, memory: bool = False) -> SnapshotInfo:
        """Seal the workspace's current state as a snapshot, in O(1) of its size; the sandbox
        goes on from there. Nothing may be running in it (``SandboxBusy`` otherwise).

        With ``memory=True`` (the microvm tier only; ``UsageError`` on another), the running
        sandbox's memory and processes are saved too, at one instant, and commands and
        background processes may be running (that is the point): a sandbox created from the
        snapshot, or ``restore``d to it, resumes them. Refused while paused."""
        return self._transport().snapshot(self._live_id(), name=name, memory=memory)

    def fork(self, n: int = 1, *, memory: bool = False) -> builtins.list[Sandbox]:
        """``n`` new sandboxes starting from this one's workspace as it is now (sharing its
        read-only layers), with its template, tier, isolation, network policy and secrets.
        With ``memory=True`` (microvm tier), each resumes this sandbox's running memory and
        processes as they are now, while this one runs on.

        Each has a connection of its own: use each as a context manager, or ``kill()`` and
        close each, as for a sandbox from ``create()``."""
        transport = self._transport()
        infos = transport.fork(self._live_id(), n, memory=memory)
        return [Sandbox(info, transport.sibling()) for info in infos]

    def restore(self, snapshot: str | SnapshotInfo) -> None:
        """Put the workspace back exactly as it was in ``snapshot``; changes made since (and
        not in a snapshot) are gone. Nothing may be running in it."""
        self._info = self._transport().restore(self._live_id(),
                                                     _wire.snapshot_ref(snapshot))

    @property
    def id(self) -> str:
        return self._info.id

    def get_info(self) -> SandboxInfo:
        """Fresh metadata from the store."""
        self._info = self._transport().get(self._live_id())
        return self._info

    def pause(self) -> None:
        """Freeze every process in the sandbox (files stay reachable); ``resume()`` goes on.
        Commands cannot start while paused (unless its lifecycle says ``auto_resume``: then
        the command resumes it); lifetimes and timeouts keep counting."""
        self._info = self._transport().pause(self._live_id())

    def hibernate(self) -> None:
        """Release everything of the sandbox the host's kernel holds (processes, mounts, loop
        devices, cgroup, network namespace), keeping its files and ``/tmp`` on disk: it then
        costs disk only. ``resume()`` (or, with ``lifecycle={"auto_resume": True}``, the next
        call) wakes it. On the microVM tier its processes' memory is kept too, and they go
        on after the wake; on the namespace and gVisor tiers it is refused (``SandboxBusy``)
        while a process of it runs: ``pause()`` freezes those in place instead."""
        self._info = self._transport().hibernate(self._live_id())

    def resume(self) -> None:
        """Let a paused sandbox's processes run again, or wake a hibernated one; one paused
        at its timeout (``lifecycle={"on_timeout": "pause"}``) starts its lifetime again."""
        self._info = self._transport().resume(self._live_id())

    def set_timeout(self, timeout: float) -> None:
        """Set the remaining lifetime to ``timeout`` seconds from now."""
        self._info = self._transport().set_timeout(self._live_id(), timeout)

    def kill(self) -> None:
        """Destroy the sandbox: kill its processes, delete its workspace. Idempotent."""
        if not self._killed:
            transport = self._transport()  # closed: refuse rather than silently not destroy
            self._killed = True
            try:
                transport.destroy(self._info.id)
            except SandboxNotFound:
                pass

    def close(self) -> None:
        """Release the connection (the sandbox itself stays unless killed). Idempotent."""
        if self._state is not _State.CLOSED:
            self._state = _State.CLOSED
            self._mgr.close()


    def _transport(self) -> Transport:
        if self._state is _State.CLOSED:
            raise UsageError(f"this {type(self).__name__} for {self._info.id} was closed; "
                             "connect() attaches again")
        return self._mgr

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
        with shielded():
            try:
                if self._state is _State.OPEN:
                    self.kill()
            finally:
                self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._info.id} {self._info.resources}>"
