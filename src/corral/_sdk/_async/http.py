"""``AsyncHTTPTransport``: the SDK's calls over the HTTP API with ``httpx.AsyncClient``.

Pass ``client=`` to use a client of your own: ``httpx.AsyncClient(transport=
httpx.ASGITransport(app))`` drives the app in-process, without a server (``corral.testing``).
Request building, response parsing and error mapping are ``_wire``'s; this module only does I/O.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, BinaryIO

import httpx

from ..._audit.log import AuditTrail
from ...errors import FileNotFound, TransportError
from ...models import (
    CodeContext,
    CommandResult,
    Execution,
    FileEntry,
    PortInfo,
    SandboxInfo,
    SnapshotInfo,
    VolumeInfo,
)
from .. import _wire
from .._io import Pool, ahttp_pool, aread_chunk, arelease
from .._wire import AsyncCodeCallback, AsyncOutputCallback, ProcessInfo, adeliver

__all__ = ["AsyncHTTPTransport"]


async def _raise_for(response: httpx.Response) -> None:
    if response.status_code >= 400:
        error = _wire.error_for(response.status_code, await response.aread())
        if error is not None:
            raise error


def _sandbox(sandbox_id: str) -> str:
    return f"/v1/sandboxes/{sandbox_id}"


class AsyncHTTPTransport:
    """Talks to ``corral serve`` at ``url`` (or through ``client``). Close it with
    ``aclose()``; a client passed in is closed too (it is the transport's from then on)."""

    def __init__(self, url: str | None = None, api_key: str | None = None, *,
                 timeout_s: float = 30.0, client: httpx.AsyncClient | None = None) -> None:
        self._pool: Pool | None = None
        if client is None:
            if url is None:
                raise ValueError("pass url= (the service) or client= (an httpx client)")
            self._pool = ahttp_pool(url, api_key, timeout_s)
            client = self._pool.client
        self._args = (url, api_key, timeout_s)
        self._client = client

    def sibling(self) -> AsyncHTTPTransport:
        url, api_key, timeout_s = self._args
        if url is None:  # a client of the caller's: share it (its owner closes it)
            return _Borrowed(self._client)
        return AsyncHTTPTransport(url, api_key, timeout_s=timeout_s)

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            with _wire.encodable(kwargs):
                response = await self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise _wire.unreachable(self._client.base_url, exc) from exc
        await _raise_for(response)
        return response

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return (await self.request(method, path, **kwargs)).json()

    @asynccontextmanager
    async def _stream(self, method: str, path: str, **kwargs: Any
                      ) -> AsyncIterator[httpx.Response]:
        try:
            with _wire.encodable(kwargs):
                async with self._client.stream(method, path, **kwargs) as response:
                    await _raise_for(response)
                    yield response
        except httpx.HTTPError as exc:
            raise TransportError(f"connection to {self._client.base_url} failed: {exc}") from exc

    # -- sandboxes --------------------------------------------------------------------------

    async def create(self, *, template: str | None, resources: str, timeout: float | None,
                     labels: Mapping[str, str] | None, network: Any,
                     secrets: Sequence[str] | None, idle_timeout: float | None,
                     isolation: str | None, snapshot: str | None,
                     image: str | None = None, volumes: Mapping[str, Any] | None = None,
                     data_mounts: Mapping[str, Any] | None = None,
                     lifecycle: Mapping[str, Any] | None = None) -> SandboxInfo:
        body = _wire.create_body(template=template, resources=resources, timeout=timeout,
                                 labels=labels, network=network, secrets=secrets,
                                 idle_timeout=idle_timeout, isolation=isolation,
                                 snapshot=snapshot, image=image, volumes=volumes,
                                 data_mounts=data_mounts, lifecycle=lifecycle)
        return _wire.sandbox_info(await self._json("POST", "/v1/sandboxes", json=body))

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return _wire.sandbox_info(await self._json("GET", _sandbox(sandbox_id)))

    async def list(self) -> builtins.list[SandboxInfo]:
        return [_wire.sandbox_info(d) for d in await self._json("GET", "/v1/sandboxes")]

    async def destroy(self, sandbox_id: str) -> None:
        await self.request("DELETE", _sandbox(sandbox_id))

    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        return _wire.sandbox_info(await self._json(
            "POST", f"{_sandbox(sandbox_id)}/timeout", json={"timeout": timeout}))

    async def set_network(self, sandbox_id: str, network: Any) -> SandboxInfo:
        return _wire.sandbox_info(await self._json(
            "PUT", f"{_sandbox(sandbox_id)}/network", json=_wire.network_body(network)))

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        return _wire.sandbox_info(await self._json("POST", f"{_sandbox(sandbox_id)}/pause"))

    async def expose_port(self, sandbox_id: str, port: int, *, public: bool,
                          link_ttl: float | None) -> PortInfo:
        body: dict[str, Any] = {"public": public}
        if link_ttl is not None:
            body["link_ttl"] = link_ttl
        return PortInfo.model_validate(await self._json(
            "POST", f"{_sandbox(sandbox_id)}/ports/{_wire.port_number(port)}", json=body))

    async def list_ports(self, sandbox_id: str) -> builtins.list[PortInfo]:
        return [PortInfo.model_validate(d)
                for d in await self._json("GET", f"{_sandbox(sandbox_id)}/ports")]

    async def unexpose_port(self, sandbox_id: str, port: int) -> None:
        await self.request("DELETE", f"{_sandbox(sandbox_id)}/ports/{_wire.port_number(port)}")

    async def create_volume(self, name: str, size: int | str) -> VolumeInfo:
        return VolumeInfo.model_validate(await self._json(
            "POST", "/v1/volumes", json={"name": name, "size": size}))

    async def get_volume(self, ref: str) -> VolumeInfo:
        return VolumeInfo.model_validate(await self._json("GET", _wire.volume_path(ref)))

    async def list_volumes(self) -> builtins.list[VolumeInfo]:
        return [VolumeInfo.model_validate(d) for d in await self._json("GET", "/v1/volumes")]

    async def delete_volume(self, ref: str) -> None:
        await self.request("DELETE", _wire.volume_path(ref))

    async def hibernate(self, sandbox_id: str) -> SandboxInfo:
        return _wire.sandbox_info(await self._json("POST", f"{_sandbox(sandbox_id)}/hibernate"))

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return _wire.sandbox_info(await self._json("POST", f"{_sandbox(sandbox_id)}/resume"))

    # -- commands and processes -------------------------------------------------------------

    async def run(self, sandbox_id: str, cmd: str | Sequence[str], *, timeout: float | None,
                  envs: Mapping[str, str] | None, cwd: str | None, stdin: str | bytes | None,
                  on_stdout: AsyncOutputCallback | None, on_stderr: AsyncOutputCallback | None,
                  context: Mapping[str, Any] | None, output: str) -> CommandResult:
        stream = on_stdout is not None or on_stderr is not None
        body = _wire.run_body(cmd, timeout=timeout, envs=envs, cwd=cwd, stdin=stdin,
                              context=context, stream=stream, output=output)
        path = f"{_sandbox(sandbox_id)}/commands"
        if not stream:
            return _wire.command_result(await self._json("POST", path, json=body))
        events = _wire.CommandStream()
        async with self._stream("POST", path, json=body) as response:
            async for line in response.aiter_lines():
                piece = events.feed(line)
                if piece is not None:
                    await adeliver(on_stdout if piece[0] == "stdout" else on_stderr, piece[1])
        return events.finished()

    async def kill_command(self, sandbox_id: str, command_id: str) -> None:
        await self.request("POST", f"{_sandbox(sandbox_id)}/commands/{command_id}/kill")

    async def start_process(self, sandbox_id: str, cmd: str | Sequence[str], *,
                            envs: Mapping[str, str] | None, cwd: str | None,
                            context: Mapping[str, Any] | None) -> ProcessInfo:
        body = _wire.process_body(cmd, envs=envs, cwd=cwd, context=context)
        return dict(await self._json("POST", f"{_sandbox(sandbox_id)}/processes", json=body))

    async def get_process(self, sandbox_id: str, process_id: str) -> ProcessInfo:
        return dict(await self._json("GET",
                                     f"{_sandbox(sandbox_id)}/processes/{process_id}"))

    async def list_processes(self, sandbox_id: str) -> builtins.list[ProcessInfo]:
        return builtins.list(await self._json("GET", f"{_sandbox(sandbox_id)}/processes"))

    async def process_output(self, sandbox_id: str, process_id: str, offset: int, *,
                             follow: bool, wait_s: float | None
                             ) -> AsyncIterator[tuple[int, str, str]]:
        params: dict[str, Any] = {"offset": offset, "follow": follow}
        if wait_s is not None:
            params["wait_s"] = wait_s
        path = f"{_sandbox(sandbox_id)}/processes/{process_id}/output"
        async with self._stream("GET", path, params=params) as response:
            async for line in response.aiter_lines():
                event = _wire.process_event(line)
                if event is not None:
                    yield event

    async def send_process(self, sandbox_id: str, process_id: str, data: bytes) -> None:
        await self.request("POST", f"{_sandbox(sandbox_id)}/processes/{process_id}/input",
                           content=data)

    async def kill_process(self, sandbox_id: str, process_id: str) -> None:
        await self.request("POST", f"{_sandbox(sandbox_id)}/processes/{process_id}/kill")

    # -- code interpreter -------------------------------------------------------------------

    async def run_code(self, sandbox_id: str, code: str, *, context_id: str | None,
                       language: str | None, envs: Mapping[str, str] | None,
                       timeout: float | None, on_event: AsyncCodeCallback | None
                       ) -> Execution:
        body = _wire.code_body(code, context_id=context_id, language=language, envs=envs,
                               timeout=timeout)
        stream = _wire.CodeStream()
        async with self._stream("POST", f"{_sandbox(sandbox_id)}/code", json=body) as response:
            async for line in response.aiter_lines():
                item = stream.feed(line)
                if item is not None:
                    await adeliver(on_event, item)
        return stream.finished()

    async def create_code_context(self, sandbox_id: str, *, language: str | None,
                                  cwd: str | None) -> CodeContext:
        return _wire.code_context(await self._json(
            "POST", f"{_sandbox(sandbox_id)}/code/contexts",
            json={"language": language, "cwd": cwd}))

    async def list_code_contexts(self, sandbox_id: str) -> builtins.list[CodeContext]:
        data = await self._json("GET", f"{_sandbox(sandbox_id)}/code/contexts")
        return [_wire.code_context(item) for item in data]

    async def restart_code_context(self, sandbox_id: str, context_id: str) -> CodeContext:
        return _wire.code_context(await self._json(
            "POST", f"{_sandbox(sandbox_id)}/code/contexts/{context_id}/restart"))

    async def remove_code_context(self, sandbox_id: str, context_id: str) -> None:
        await self.request("DELETE", f"{_sandbox(sandbox_id)}/code/contexts/{context_id}")

    # -- files ------------------------------------------------------------------------------

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        response = await self.request("GET", f"{_sandbox(sandbox_id)}/files/content",
                                      params={"path": path})
        return response.content

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> FileEntry:
        return _wire.file_entry(await self._json(
            "PUT", f"{_sandbox(sandbox_id)}/files/content", params={"path": path},
            content=data))

    async def list_files(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        entries = await self._json("GET", f"{_sandbox(sandbox_id)}/files",
                                   params={"path": path})
        return [_wire.file_entry(e) for e in entries]

    async def stat_file(self, sandbox_id: str, path: str) -> FileEntry:
        return _wire.file_entry(await self._json(
            "GET", f"{_sandbox(sandbox_id)}/files/stat", params={"path": path}))

    async def file_exists(self, sandbox_id: str, path: str) -> bool:
        try:
            await self.stat_file(sandbox_id, path)
        except FileNotFound:
            return False
        return True

    async def remove_file(self, sandbox_id: str, path: str) -> None:
        await self.request("DELETE", f"{_sandbox(sandbox_id)}/files", params={"path": path})

    async def make_dir(self, sandbox_id: str, path: str) -> bool:
        data = await self._json("POST", f"{_sandbox(sandbox_id)}/files/mkdir",
                                params={"path": path})
        return bool(data["created"])

    async def rename_file(self, sandbox_id: str, src: str, dst: str) -> FileEntry:
        return _wire.file_entry(await self._json(
            "POST", f"{_sandbox(sandbox_id)}/files/rename", params={"src": src, "dst": dst}))

    async def upload(self, sandbox_id: str, path: str, stream: BinaryIO) -> dict[str, int]:
        async def chunks() -> AsyncIterator[bytes]:
            while chunk := await aread_chunk(stream):
                yield chunk

        return dict(await self._json("PUT", f"{_sandbox(sandbox_id)}/archive",
                                     params={"path": path}, content=chunks()))

    async def download(self, sandbox_id: str, path: str, *, gzip: bool
                       ) -> AsyncIterator[bytes]:
        async with self._stream("GET", f"{_sandbox(sandbox_id)}/archive",
                                params={"path": path, "gzip": gzip}) as response:
            async for chunk in response.aiter_bytes():
                yield chunk

    # -- audit and snapshots (scoped to the API key's tenant by the service) ----------------

    async def audit_trail(self, sandbox_id: str, *, types: Sequence[str] | None,
                          since: float | None, until: float | None,
                          command: str | None) -> AuditTrail:
        response = await self.request(
            "GET", f"{_sandbox(sandbox_id)}/audit",
            params=_wire.audit_params(types, since, until, command))
        return _wire.audit_trail(response.text, response.headers.get("x-corral-torn-tail"))

    async def snapshot(self, sandbox_id: str, *, name: str | None,
                       memory: bool = False) -> SnapshotInfo:
        # ``memory`` only when asked: a server from before memory snapshots refuses the field.
        return _wire.snapshot_info(await self._json(
            "POST", f"{_sandbox(sandbox_id)}/snapshots",
            json={"name": name, **({"memory": True} if memory else {})}))

    async def fork(self, sandbox_id: str, count: int, *,
                   memory: bool = False) -> builtins.list[SandboxInfo]:
        data = await self._json("POST", f"{_sandbox(sandbox_id)}/fork",
                                json={"count": count, **({"memory": True} if memory else {})})
        return [_wire.sandbox_info(d) for d in data]

    async def restore(self, sandbox_id: str, snapshot: str) -> SandboxInfo:
        return _wire.sandbox_info(await self._json(
            "POST", f"{_sandbox(sandbox_id)}/restore", json={"snapshot": snapshot}))

    async def get_snapshot(self, ref: str) -> SnapshotInfo:
        return _wire.snapshot_info(await self._json("GET", _wire.snapshot_path(ref)))

    async def list_snapshots(self) -> builtins.list[SnapshotInfo]:
        return [_wire.snapshot_info(d) for d in await self._json("GET", "/v1/snapshots")]

    async def delete_snapshot(self, ref: str) -> None:
        await self.request("DELETE", _wire.snapshot_path(ref))

    async def aclose(self) -> None:
        if self._pool is not None:
            await arelease(self._pool)
        else:
            await self._client.aclose()


class _Borrowed(AsyncHTTPTransport):
    """A fork's transport over the parent's own client: closing it leaves the client open."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        super().__init__(client=client)

    async def aclose(self) -> None:
        pass
