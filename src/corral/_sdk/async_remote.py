"""The async remote transport: ``RemoteManager``'s calls over ``httpx.AsyncClient``.

Same endpoints, wire format and error mapping as ``remote.py``; everything that is not I/O
(request bodies, response parsing, error codes, the NDJSON command stream) is shared from there.
One instance owns one ``AsyncClient``, which belongs to the event loop it is used in, so these
are not cached across calls the way sync remote managers are: ``AsyncSandbox`` owns its own and
closes it with ``aclose()``.
"""

from __future__ import annotations

import builtins
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, BinaryIO

import anyio.to_thread
import httpx

from .._audit.log import AuditTrail
from ..errors import TransportError
from ..models import CommandResult, FileEntry, SandboxInfo, SnapshotInfo
from .remote import (
    _NO_RESULT,
    _audit_params,
    _audit_trail,
    _command_result,
    _create_body,
    _encodable,
    _error_for,
    _info,
    _network_body,
    _run_body,
    _snapshot,
    _snapshot_path,
    _stream_event,
    _unreachable,
)

__all__ = ["AsyncOutputCallback", "AsyncRemoteManager", "deliver"]

#: Called with each piece of output; a plain function, or an ``async def`` (then awaited).
AsyncOutputCallback = Callable[[str], Awaitable[None] | None]


async def deliver(callback: AsyncOutputCallback | None, text: str) -> None:
    """Call ``callback`` with ``text``, awaiting it if it is a coroutine function."""
    if callback is not None:
        outcome = callback(text)
        if inspect.isawaitable(outcome):
            await outcome


async def _raise_for(response: httpx.Response) -> None:
    if response.status_code >= 400:
        error = _error_for(response.status_code, await response.aread())
        if error is not None:
            raise error


class AsyncRemoteFiles:
    """Workspace files of one sandbox, over HTTP."""

    def __init__(self, manager: AsyncRemoteManager, sandbox_id: str) -> None:
        self._m = manager
        self._base = f"/v1/sandboxes/{sandbox_id}/files"

    async def read(self, path: str) -> bytes:
        response = await self._m.request("GET", f"{self._base}/content", params={"path": path})
        return response.content

    async def write(self, path: str, data: bytes) -> FileEntry:
        response = await self._m.request("PUT", f"{self._base}/content", params={"path": path},
                                         content=data)
        return FileEntry(**response.json())

    async def list(self, path: str = "/workspace") -> list[FileEntry]:
        response = await self._m.request("GET", self._base, params={"path": path})
        return [FileEntry(**e) for e in response.json()]

    async def stat(self, path: str) -> FileEntry:
        response = await self._m.request("GET", f"{self._base}/stat", params={"path": path})
        return FileEntry(**response.json())

    async def exists(self, path: str) -> bool:
        from ..errors import FileNotFound

        try:
            await self.stat(path)
        except FileNotFound:
            return False
        return True

    async def remove(self, path: str) -> None:
        await self._m.request("DELETE", self._base, params={"path": path})

    async def make_dir(self, path: str) -> bool:
        response = await self._m.request("POST", f"{self._base}/mkdir", params={"path": path})
        return bool(response.json()["created"])

    async def rename(self, src: str, dst: str) -> FileEntry:
        response = await self._m.request("POST", f"{self._base}/rename",
                                         params={"src": src, "dst": dst})
        return FileEntry(**response.json())


class AsyncRemoteManager:
    """Talks to ``corral serve`` at ``url`` from one event loop. Close it with ``aclose()``."""

    def __init__(self, url: str, api_key: str | None = None, *, timeout_s: float = 30.0) -> None:
        self._args = (url, api_key, timeout_s)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        # No read timeout: a command may legitimately print nothing for minutes.
        self._client = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers,
                                         timeout=httpx.Timeout(timeout_s, read=None))

    def sibling(self) -> AsyncRemoteManager:
        """Another manager for the same service and key, with its own connection (for the
        sandboxes of a fork, which each close their own)."""
        url, api_key, timeout_s = self._args
        return AsyncRemoteManager(url, api_key, timeout_s=timeout_s)

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            with _encodable(kwargs):
                response = await self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise _unreachable(self._client.base_url, exc) from exc
        await _raise_for(response)
        return response

    @asynccontextmanager
    async def _stream(self, method: str, path: str, **kwargs: Any
                      ) -> AsyncIterator[httpx.Response]:
        try:
            with _encodable(kwargs):
                async with self._client.stream(method, path, **kwargs) as response:
                    await _raise_for(response)
                    yield response
        except httpx.HTTPError as exc:
            raise TransportError(f"connection to {self._client.base_url} failed: {exc}") from exc

    # -- sandboxes ----------------------------------------------------------------------------

    async def create(self, *, template: str | None = None, resources: str = "small",
                     timeout: float | None = None, labels: Mapping[str, str] | None = None,
                     network: Any = None, secrets: Sequence[str] | None = None,
                     idle_timeout: float | None = None, isolation: str | None = None,
                     snapshot: str | None = None) -> SandboxInfo:
        body = _create_body(template=template, resources=resources, timeout=timeout,
                            labels=labels, network=network, secrets=secrets,
                            idle_timeout=idle_timeout, isolation=isolation, snapshot=snapshot)
        return _info((await self.request("POST", "/v1/sandboxes", json=body)).json())

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return _info((await self.request("GET", f"/v1/sandboxes/{sandbox_id}")).json())

    async def list(self) -> list[SandboxInfo]:
        return [_info(d) for d in (await self.request("GET", "/v1/sandboxes")).json()]

    async def destroy(self, sandbox_id: str) -> None:
        await self.request("DELETE", f"/v1/sandboxes/{sandbox_id}")

    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        response = await self.request("POST", f"/v1/sandboxes/{sandbox_id}/timeout",
                                      json={"timeout": timeout})
        return _info(response.json())

    async def set_network(self, sandbox_id: str, network: Any) -> SandboxInfo:
        response = await self.request("PUT", f"/v1/sandboxes/{sandbox_id}/network",
                                      json=_network_body(network))
        return _info(response.json())

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        return _info((await self.request("POST", f"/v1/sandboxes/{sandbox_id}/pause")).json())

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return _info((await self.request("POST", f"/v1/sandboxes/{sandbox_id}/resume")).json())

    async def kill_command(self, sandbox_id: str, command_id: str) -> None:
        await self.request("POST", f"/v1/sandboxes/{sandbox_id}/commands/{command_id}/kill")

    # -- snapshots (scoped to the API key's tenant by the service) -------------------------

    async def snapshot(self, sandbox_id: str, *, name: str | None = None) -> SnapshotInfo:
        response = await self.request("POST", f"/v1/sandboxes/{sandbox_id}/snapshots",
                                      json={"name": name})
        return _snapshot(response.json())

    async def fork(self, sandbox_id: str, count: int = 1) -> builtins.list[SandboxInfo]:
        response = await self.request("POST", f"/v1/sandboxes/{sandbox_id}/fork",
                                      json={"count": count})
        return [_info(d) for d in response.json()]

    async def restore(self, sandbox_id: str, snapshot: str) -> SandboxInfo:
        response = await self.request("POST", f"/v1/sandboxes/{sandbox_id}/restore",
                                      json={"snapshot": snapshot})
        return _info(response.json())

    async def get_snapshot(self, ref: str) -> SnapshotInfo:
        return _snapshot((await self.request("GET", _snapshot_path(ref))).json())

    async def list_snapshots(self) -> builtins.list[SnapshotInfo]:
        return [_snapshot(d) for d in (await self.request("GET", "/v1/snapshots")).json()]

    async def delete_snapshot(self, ref: str) -> None:
        await self.request("DELETE", _snapshot_path(ref))

    def files(self, sandbox_id: str) -> AsyncRemoteFiles:
        return AsyncRemoteFiles(self, sandbox_id)

    async def upload(self, sandbox_id: str, path: str, stream: BinaryIO) -> dict[str, int]:
        async def chunks() -> AsyncIterator[bytes]:
            # The file object is synchronous (maybe a real file): read it off the loop.
            while chunk := await anyio.to_thread.run_sync(stream.read, 1 << 20):
                yield chunk

        response = await self.request("PUT", f"/v1/sandboxes/{sandbox_id}/archive",
                                      params={"path": path}, content=chunks())
        return dict(response.json())

    async def download(self, sandbox_id: str, path: str, *, gzip: bool = False
                       ) -> AsyncIterator[bytes]:
        async with self._stream("GET", f"/v1/sandboxes/{sandbox_id}/archive",
                                params={"path": path, "gzip": gzip}) as response:
            async for chunk in response.aiter_bytes():
                yield chunk

    async def audit_trail(self, sandbox_id: str, *, types: Sequence[str] | None = None,
                          since: float | None = None, until: float | None = None,
                          command: str | None = None) -> AuditTrail:
        response = await self.request("GET", f"/v1/sandboxes/{sandbox_id}/audit",
                                      params=_audit_params(types, since, until, command))
        return _audit_trail(response)

    # -- commands -----------------------------------------------------------------------------

    async def run(self, sandbox_id: str, cmd: str | Sequence[str], *,
                  timeout: float | None = None, envs: Mapping[str, str] | None = None,
                  cwd: str | None = None, stdin: str | bytes | None = None,
                  on_stdout: AsyncOutputCallback | None = None,
                  on_stderr: AsyncOutputCallback | None = None,
                  context: Mapping[str, Any] | None = None) -> CommandResult:
        body = _run_body(cmd, timeout=timeout, envs=envs, cwd=cwd, stdin=stdin,
                         context=context, stream=on_stdout is not None or on_stderr is not None)
        path = f"/v1/sandboxes/{sandbox_id}/commands"
        if not body["stream"]:
            return _command_result((await self.request("POST", path, json=body)).json())
        async with self._stream("POST", path, json=body) as response:
            async for line in response.aiter_lines():
                event = _stream_event(line)
                if isinstance(event, CommandResult):
                    return event
                if event is not None:
                    await deliver(on_stdout if event[0] == "stdout" else on_stderr, event[1])
        raise TransportError(_NO_RESULT)

    async def aclose(self) -> None:
        await self._client.aclose()
