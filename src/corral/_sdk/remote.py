"""The remote transport: the same calls the SDK makes on the embedded manager, over HTTP.

``Sandbox`` is written against a small duck-typed surface (create, get, list, destroy,
set_timeout, set_network, run, files, auditor.trail, snapshot, fork, restore and the snapshot
calls); ``RemoteManager`` implements it with httpx.
Server errors come back as the same exception classes (from their wire ``code``).
"""

from __future__ import annotations

import builtins
import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, BinaryIO
from urllib.parse import quote

import httpx

from .._audit.events import AuditEvent
from .._audit.log import AuditTrail
from .._workspace.files import to_relative
from ..backends import OutputCallback
from ..errors import CorralError, SnapshotNotFound, TransportError, UsageError, error_class
from ..models import CommandResult, FileEntry, SandboxInfo, SnapshotInfo, Usage

__all__ = ["RemoteManager", "remote_manager"]


def _info(data: Mapping[str, Any]) -> SandboxInfo:
    return SandboxInfo.model_validate(data)  # the wire schema itself; unknown fields ignored


def _snapshot(data: Mapping[str, Any]) -> SnapshotInfo:
    return SnapshotInfo.model_validate(data)


def _command_result(data: Mapping[str, Any]) -> CommandResult:
    return CommandResult(
        exit_code=data["exit_code"], stdout=data["stdout"], stderr=data["stderr"],
        timed_out=data["timed_out"], duration_s=data["duration_s"],
        usage=Usage(**data["usage"]), stdout_truncated=data.get("stdout_truncated", 0),
        stderr_truncated=data.get("stderr_truncated", 0), command_id=data.get("command_id", ""))


def _error_for(status_code: int, content: bytes) -> CorralError | None:
    """The exception a response stands for (``None`` below 400), from the body's wire code."""
    if status_code < 400:
        return None
    try:
        body = json.loads(content)
        code, message = body["error"], body["message"]
    except (ValueError, KeyError, TypeError):
        text = content.decode("utf-8", errors="replace")
        code, message = "transport_error", f"HTTP {status_code}: {text[:300]}"
    return error_class(code)(message)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@contextmanager
def _encodable(kwargs: Mapping[str, Any]) -> Iterator[None]:
    """Refuse, as a Corral error, a string no request can carry: a lone surrogate, which is
    how Python hands over a name with bytes that are not UTF-8 (``os.listdir``, ``sys.argv``).
    A path gets the very PathRefused the service would give; anything else a UsageError."""
    for part in (kwargs.get("params"), kwargs.get("json")):
        for key, value in (part.items() if isinstance(part, Mapping) else ()):
            if key in ("path", "src", "dst") and isinstance(value, str) and not _is_utf8(value):
                to_relative(value)
    try:
        yield
    except UnicodeEncodeError as exc:
        shown = exc.object[:80]
        if isinstance(shown, str):
            shown = shown.encode("utf-8", "backslashreplace").decode("utf-8")
        raise UsageError(f"a value in the request is not valid UTF-8 ({exc.reason} at "
                         f"position {exc.start} of {shown!r}); pass UTF-8 text") from None


def _raise_for(response: httpx.Response) -> None:
    if response.status_code >= 400 and (error := _error_for(response.status_code,
                                                            response.read())) is not None:
        raise error


def _unreachable(base_url: httpx.URL, exc: httpx.HTTPError) -> TransportError:
    return TransportError(f"cannot reach the Corral service at {base_url}: {exc}; check "
                          "CORRAL_URL and that `corral serve` runs")


def _create_body(*, template: str | None, resources: str, timeout: float | None,
                 labels: Mapping[str, str] | None, network: Any,
                 secrets: Sequence[str] | None, idle_timeout: float | None = None,
                 isolation: str | None = None, snapshot: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"resources": resources, "timeout": timeout,
                            "labels": dict(labels or {}), "network": network or "none",
                            "secrets": list(secrets or []), "idle_timeout": idle_timeout}
    # Sent only when chosen, so a plain create still works against a server that predates them
    # (it refuses unknown fields); the server picks the defaults (base, or the snapshot's).
    for key, value in (("template", template), ("isolation", isolation),
                       ("snapshot", snapshot)):
        if value is not None:
            body[key] = value
    return body


def _snapshot_path(ref: str) -> str:
    """``/v1/snapshots/{ref}``, answering here what the control plane would for refs that
    cannot be one path segment (the URL would name another route)."""
    if not isinstance(ref, str) or not ref:
        raise UsageError(f"a snapshot is named by its id or name, not {ref!r}")
    if "/" in ref or ref in (".", ".."):  # no id or name has these
        raise SnapshotNotFound(f"snapshot {ref!r} does not exist; `corral snapshots ls` "
                               "lists them")
    return f"/v1/snapshots/{quote(ref, safe='')}"


def _network_body(network: Any) -> dict[str, Any]:
    return {"allow": [], "deny": []} if network in (None, "none") else dict(network)


def _audit_params(types: Sequence[str] | None, since: float | None, until: float | None,
                  command: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {"type": list(types or [])}
    for key, value in (("since", since), ("until", until), ("command", command)):
        if value is not None:
            params[key] = value
    return params


def _audit_trail(response: httpx.Response) -> AuditTrail:
    events = [AuditEvent.model_validate_json(line)
              for line in response.text.splitlines() if line.strip()]
    return AuditTrail(events=events,
                      torn_tail=response.headers.get("x-corral-torn-tail") == "true")


def _run_body(cmd: str | Sequence[str], *, timeout: float | None,
              envs: Mapping[str, str] | None, cwd: str | None, stdin: str | bytes | None,
              context: Mapping[str, Any] | None, stream: bool) -> dict[str, Any]:
    if isinstance(stdin, bytes | bytearray):
        try:
            stdin = bytes(stdin).decode()
        except UnicodeDecodeError:
            raise UsageError("stdin over the remote API must be UTF-8 text; write binary "
                             "data with files.write() instead") from None
    return {"cmd": cmd if isinstance(cmd, str) else list(cmd), "timeout": timeout,
            "envs": dict(envs or {}), "cwd": cwd, "stdin": stdin,
            "context": dict(context) if context else None, "stream": stream}


def _stream_event(line: str) -> tuple[str, str] | CommandResult | None:
    """One NDJSON line of a command stream: ``("stdout"|"stderr", text)`` to deliver, the
    final result, or ``None`` (blank line, keepalive); an error event is raised."""
    if not line.strip():
        return None
    event = json.loads(line)
    kind = event.get("type")
    if kind in ("stdout", "stderr"):
        return kind, event["data"]
    if kind == "result":
        return _command_result(event)
    if kind == "error":
        raise error_class(event["error"])(event["message"])
    return None


_NO_RESULT = "the command's stream ended without a result"


class RemoteFiles:
    def __init__(self, manager: RemoteManager, sandbox_id: str) -> None:
        self._m = manager
        self._base = f"/v1/sandboxes/{sandbox_id}/files"

    def read(self, path: str) -> bytes:
        return self._m.request("GET", f"{self._base}/content", params={"path": path}).content

    def write(self, path: str, data: bytes) -> FileEntry:
        body = self._m.request("PUT", f"{self._base}/content", params={"path": path},
                               content=data).json()
        return FileEntry(**body)

    def list(self, path: str = "/workspace") -> list[FileEntry]:
        return [FileEntry(**e) for e in
                self._m.request("GET", self._base, params={"path": path}).json()]

    def stat(self, path: str) -> FileEntry:
        return FileEntry(**self._m.request("GET", f"{self._base}/stat",
                                           params={"path": path}).json())

    def exists(self, path: str) -> bool:
        from ..errors import FileNotFound

        try:
            self.stat(path)
        except FileNotFound:
            return False
        return True

    def remove(self, path: str) -> None:
        self._m.request("DELETE", self._base, params={"path": path})

    def make_dir(self, path: str) -> bool:
        return bool(self._m.request("POST", f"{self._base}/mkdir",
                                    params={"path": path}).json()["created"])

    def rename(self, src: str, dst: str) -> FileEntry:
        return FileEntry(**self._m.request("POST", f"{self._base}/rename",
                                           params={"src": src, "dst": dst}).json())


class _RemoteAudit:
    def __init__(self, manager: RemoteManager) -> None:
        self._m = manager

    def trail(self, sandbox_id: str, *, types: Sequence[str] | None = None,
              since: float | None = None, until: float | None = None,
              command: str | None = None) -> AuditTrail:
        return _audit_trail(self._m.request("GET", f"/v1/sandboxes/{sandbox_id}/audit",
                                            params=_audit_params(types, since, until, command)))


class _RemoteProcesses:
    def __init__(self, manager: RemoteManager) -> None:
        self._m = manager

    def _base(self, sandbox_id: str) -> str:
        return f"/v1/sandboxes/{sandbox_id}/processes"

    def start(self, sandbox_id: str, cmd: str | Sequence[str], *,
              envs: Mapping[str, str] | None = None, cwd: str | None = None,
              context: Mapping[str, Any] | None = None) -> dict[str, Any]:
        body = {"cmd": cmd if isinstance(cmd, str) else list(cmd), "envs": dict(envs or {}),
                "cwd": cwd, "context": dict(context) if context else None}
        return dict(self._m.request("POST", self._base(sandbox_id), json=body).json())

    def get(self, sandbox_id: str, process_id: str) -> dict[str, Any]:
        return dict(self._m.request("GET", f"{self._base(sandbox_id)}/{process_id}").json())

    def list(self, sandbox_id: str) -> list[dict[str, Any]]:
        return list(self._m.request("GET", self._base(sandbox_id)).json())

    def output(self, sandbox_id: str, process_id: str, offset: int = 0, *,
               follow: bool = False, wait_s: float | None = None
               ) -> Iterator[tuple[int, str, str]]:
        params: dict[str, Any] = {"offset": offset, "follow": follow}
        if wait_s is not None:
            params["wait_s"] = wait_s
        with self._m._stream("GET", f"{self._base(sandbox_id)}/{process_id}/output",
                             params=params) as response:
            for line in response.iter_lines():
                if line.strip():
                    event = json.loads(line)
                    yield event["offset"], event["stream"], event["data"]

    def send(self, sandbox_id: str, process_id: str, data: bytes) -> None:
        self._m.request("POST", f"{self._base(sandbox_id)}/{process_id}/input", content=data)

    def kill(self, sandbox_id: str, process_id: str) -> None:
        self._m.request("POST", f"{self._base(sandbox_id)}/{process_id}/kill")


class RemoteManager:
    """Talks to ``corral serve`` at ``url``. Thread-safe (one httpx client)."""

    def __init__(self, url: str, api_key: str | None = None, *, timeout_s: float = 30.0) -> None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        # No read timeout: a command may legitimately print nothing for minutes.
        self._client = httpx.Client(base_url=url.rstrip("/"), headers=headers,
                                    timeout=httpx.Timeout(timeout_s, read=None))
        self.auditor = _RemoteAudit(self)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            with _encodable(kwargs):
                response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise _unreachable(self._client.base_url, exc) from exc
        _raise_for(response)
        return response

    @contextmanager
    def _stream(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx.Response]:
        try:
            with _encodable(kwargs), self._client.stream(method, path, **kwargs) as response:
                _raise_for(response)
                yield response
        except httpx.HTTPError as exc:
            raise TransportError(f"connection to {self._client.base_url} failed: {exc}") from exc

    # -- sandboxes ----------------------------------------------------------------------------

    def create(self, *, template: str | None = None, resources: str = "small",
               timeout: float | None = None, labels: Mapping[str, str] | None = None,
               network: Any = None, secrets: Sequence[str] | None = None,
               idle_timeout: float | None = None, isolation: str | None = None,
               snapshot: str | None = None) -> SandboxInfo:
        body = _create_body(template=template, resources=resources, timeout=timeout,
                            labels=labels, network=network, secrets=secrets,
                            idle_timeout=idle_timeout, isolation=isolation, snapshot=snapshot)
        return _info(self.request("POST", "/v1/sandboxes", json=body).json())

    def get(self, sandbox_id: str) -> SandboxInfo:
        return _info(self.request("GET", f"/v1/sandboxes/{sandbox_id}").json())

    def list(self) -> list[SandboxInfo]:
        return [_info(d) for d in self.request("GET", "/v1/sandboxes").json()]

    def destroy(self, sandbox_id: str) -> None:
        self.request("DELETE", f"/v1/sandboxes/{sandbox_id}")

    def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        return _info(self.request("POST", f"/v1/sandboxes/{sandbox_id}/timeout",
                                  json={"timeout": timeout}).json())

    def set_network(self, sandbox_id: str, network: Any) -> SandboxInfo:
        return _info(self.request("PUT", f"/v1/sandboxes/{sandbox_id}/network",
                                  json=_network_body(network)).json())

    def pause(self, sandbox_id: str) -> SandboxInfo:
        return _info(self.request("POST", f"/v1/sandboxes/{sandbox_id}/pause").json())

    def resume(self, sandbox_id: str) -> SandboxInfo:
        return _info(self.request("POST", f"/v1/sandboxes/{sandbox_id}/resume").json())

    def kill_command(self, sandbox_id: str, command_id: str) -> None:
        self.request("POST", f"/v1/sandboxes/{sandbox_id}/commands/{command_id}/kill")

    # -- snapshots ----------------------------------------------------------------------------
    # The service scopes these to the API key's tenant, so unlike the Manager's they take no
    # ``tenant``: another tenant's sandboxes and snapshots answer SandboxNotFound and
    # SnapshotNotFound.

    def snapshot(self, sandbox_id: str, *, name: str | None = None) -> SnapshotInfo:
        return _snapshot(self.request("POST", f"/v1/sandboxes/{sandbox_id}/snapshots",
                                      json={"name": name}).json())

    def fork(self, sandbox_id: str, count: int = 1) -> builtins.list[SandboxInfo]:
        response = self.request("POST", f"/v1/sandboxes/{sandbox_id}/fork",
                                json={"count": count})
        return [_info(d) for d in response.json()]

    def restore(self, sandbox_id: str, snapshot: str) -> SandboxInfo:
        return _info(self.request("POST", f"/v1/sandboxes/{sandbox_id}/restore",
                                  json={"snapshot": snapshot}).json())

    def get_snapshot(self, ref: str) -> SnapshotInfo:
        return _snapshot(self.request("GET", _snapshot_path(ref)).json())

    def list_snapshots(self) -> builtins.list[SnapshotInfo]:
        return [_snapshot(d) for d in self.request("GET", "/v1/snapshots").json()]

    def delete_snapshot(self, ref: str) -> None:
        self.request("DELETE", _snapshot_path(ref))

    def files(self, sandbox_id: str) -> RemoteFiles:
        return RemoteFiles(self, sandbox_id)

    def process_api(self) -> _RemoteProcesses:
        return _RemoteProcesses(self)

    def upload(self, sandbox_id: str, path: str, stream: BinaryIO) -> dict[str, int]:
        def chunks() -> Iterator[bytes]:
            while chunk := stream.read(1 << 20):
                yield chunk

        response = self.request("PUT", f"/v1/sandboxes/{sandbox_id}/archive",
                                params={"path": path}, content=chunks())
        return dict(response.json())

    def download(self, sandbox_id: str, path: str, *, gzip: bool = False) -> Iterator[bytes]:
        with self._stream("GET", f"/v1/sandboxes/{sandbox_id}/archive",
                          params={"path": path, "gzip": gzip}) as response:
            yield from response.iter_bytes()

    # -- commands -----------------------------------------------------------------------------

    def run(self, sandbox_id: str, cmd: str | Sequence[str], *, timeout: float | None = None,
            envs: Mapping[str, str] | None = None, cwd: str | None = None,
            stdin: str | bytes | None = None, on_stdout: OutputCallback | None = None,
            on_stderr: OutputCallback | None = None,
            context: Mapping[str, Any] | None = None) -> CommandResult:
        body = _run_body(cmd, timeout=timeout, envs=envs, cwd=cwd, stdin=stdin,
                         context=context, stream=on_stdout is not None or on_stderr is not None)
        path = f"/v1/sandboxes/{sandbox_id}/commands"
        if not body["stream"]:
            return _command_result(self.request("POST", path, json=body).json())
        with self._stream("POST", path, json=body) as response:
            for line in response.iter_lines():
                event = _stream_event(line)
                if isinstance(event, CommandResult):
                    return event
                if event is not None:
                    callback = on_stdout if event[0] == "stdout" else on_stderr
                    if callback is not None:
                        callback(event[1])
        raise TransportError(_NO_RESULT)

    def close(self) -> None:
        self._client.close()


_remotes: dict[tuple[str, str | None], RemoteManager] = {}
_lock = threading.Lock()


def remote_manager(url: str, api_key: str | None) -> RemoteManager:
    with _lock:
        manager = _remotes.get((url, api_key))
        if manager is None:
            manager = _remotes[(url, api_key)] = RemoteManager(url, api_key)
        return manager

