"""The web dashboard through the cluster gateway (``corral serve --cluster``).

The page, its assets, ``/docs``, sign-in and who is signed in are the single-host ones
(``_ui.routes.install_pages``), with sessions over the gateway's own keys. What reads the
control plane spans nodes here: the sandbox list is every node's, merged and paged; the live
list's event stream is every node's stream, merged; egress groups and templates are asked of
every node; a sandbox's family is asked of its node; the tenants page is the gateway's own
(its keys, the cluster's sandbox map). Everything a sandbox page does beyond that goes
through ``/v1``, which the gateway relays as for any client. The drill is not run from the
gateway: it acts on one control plane (``corral drill --url GATEWAY`` drives it all).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from .._control.plane import LOCAL_TENANT, Tenant, TenantDirectory
from .._http.relay import send_json
from .._ui.routes import PAGE_MAX, sandbox_page
from ..errors import PolicyError, UsageError
from ..models import SandboxInfo
from .fanout import NodeFanout

__all__ = ["GatewayUI"]

_FAMILY = re.compile(r"/ui/api/sandboxes/(sbx_[a-z0-9]{1,50})/family")
_SUBSCRIBE_S = 5.0


class GatewayUI:
    """``/ui/api/*`` over the cluster: the gateway's routing hands it these paths."""

    def __init__(self, nodes: NodeFanout, tenants: TenantDirectory) -> None:
        self._nodes = nodes
        self._tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send, caller: Tenant,
                       relay_to_node: Callable[[str], Any]) -> None:
        path = scope["path"]
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if path == "/ui/api/sandboxes":
            await self._sandboxes(send, caller, query)
        elif (found := _FAMILY.fullmatch(path)) is not None:
            await relay_to_node(found.group(1))
        elif path == "/ui/api/stream":
            await self._stream(receive, send, caller)
        elif path == "/ui/api/egress":
            await self._egress(send, caller)
        elif path == "/ui/api/templates":
            await self._templates(send, caller)
        elif path == "/ui/api/tenants":
            await self._tenants_page(send, caller)
        elif path.startswith("/ui/api/drill"):
            raise UsageError("the drill runs against one control plane: run `corral drill "
                             "--url GATEWAY` for the cluster, or open a node's dashboard")
        else:
            await send_json(send, 404, {"error": "not_found", "message": "Not Found"})

    async def _sandboxes(self, send: Send, caller: Tenant, query: dict[str, list[str]]) -> None:
        def number(name: str, default: int, low: int, high: int) -> int:
            raw = (query.get(name) or [str(default)])[0]
            if not raw.isdigit() or not low <= int(raw) <= high:
                raise UsageError(f"{name} must be a whole number in {low}..{high}")
            return int(raw)

        offset = number("offset", 0, 0, 10**9)
        limit = number("limit", 100, 1, PAGE_MAX)
        q = (query.get("q") or [""])[0][:200]
        answers = await self._nodes.fan_out("GET", "/v1/sandboxes", caller)
        infos: list[SandboxInfo] = []
        for answer in answers:
            if answer.status_code == 200:
                infos.extend(SandboxInfo.model_validate(item) for item in answer.json())
        page = sandbox_page(infos, q=q, offset=offset, limit=limit)
        await send_json(send, 200, page.model_dump(mode="json"))

    async def _egress(self, send: Send, caller: Tenant) -> None:
        groups: dict[tuple[str, str, str], dict[str, Any]] = {}
        for answer in await self._nodes.fan_out("GET", "/ui/api/egress", caller,
                                                query=b"limit=200"):
            if answer.status_code != 200:
                continue
            for group in answer.json()["groups"]:
                key = (group["host"], group["rule"], group["verdict"])
                merged = groups.setdefault(key, {**group, "count": 0, "sandboxes": [],
                                                 "last": 0.0})
                merged["count"] += group["count"]
                merged["sandboxes"] = sorted({*merged["sandboxes"], *group["sandboxes"]})[:10]
                merged["last"] = max(merged["last"], group["last"])
        ranked = sorted(groups.values(), key=lambda g: (g["verdict"] == "allowed",
                                                        -g["count"], g["host"]))
        await send_json(send, 200, {"groups": ranked[:20]})

    async def _templates(self, send: Send, caller: Tenant) -> None:
        nodes = await self._nodes.alive_nodes()
        answers = await asyncio.gather(*(self._nodes.ask(n, "GET", "/ui/api/templates", caller)
                                         for n in nodes))
        builds: list[dict[str, Any]] = []
        for node_id, answer in zip(nodes, answers, strict=True):
            if answer.status_code == 200:
                builds.extend({**b, "node": node_id[:12]} for b in answer.json())
        await send_json(send, 200, builds)

    async def _tenants_page(self, send: Send, caller: Tenant) -> None:
        if not caller.is_local:
            raise PolicyError("only the operator may do this (a key from `corral keys create "
                              "--operator` on the gateway's data directory)")
        records = await run_in_threadpool(self._nodes.cluster.state.records)
        keys = await run_in_threadpool(self._tenants.keys)

        def rows() -> list[dict[str, Any]]:
            live: dict[str, int] = {}
            for record in records.values():
                if record.get("state") != "lost":
                    owner = record.get("tenant") or LOCAL_TENANT
                    live[owner] = live.get(owner, 0) + 1
            by_tenant: dict[str, list[dict[str, Any]]] = {}
            for key in keys:
                by_tenant.setdefault(key["tenant"], []).append(key)
            found = [{"name": t.name, "max_sandboxes": t.max_sandboxes, "tiers": list(t.tiers),
                      "commands_per_minute": t.commands_per_minute,
                      "ceiling": t.ceiling.to_json(), "live_sandboxes": live.get(t.name, 0),
                      "keys": by_tenant.get(t.name, [])} for t in self._tenants.tenants()]
            found.append({"name": LOCAL_TENANT, "operator": True,
                          "live_sandboxes": live.get(LOCAL_TENANT, 0),
                          "keys": by_tenant.get(LOCAL_TENANT, [])})
            return found

        await send_json(send, 200, await run_in_threadpool(rows))

    async def _stream(self, receive: Receive, send: Send, caller: Tenant) -> None:
        """Every node's live-list stream, merged: one comment once all of them listen, then
        each node's change events as they come."""
        nodes = await self._nodes.alive_nodes()
        changes: asyncio.Queue[str] = asyncio.Queue(maxsize=10_000)
        listening = [asyncio.Event() for _ in nodes]

        async def pump(node_id: str, subscribed: asyncio.Event) -> None:
            url = await self._nodes.url(node_id)
            name, value = self._nodes.credential(caller, "http")
            async with self._nodes.http().stream(
                    "GET", f"{url}/ui/api/stream",
                    headers={name.decode(): value.decode()}) as answer:
                async for line in answer.aiter_lines():
                    if line.startswith(":"):
                        subscribed.set()
                    elif line.startswith("data:"):
                        with contextlib.suppress(asyncio.QueueFull):
                            changes.put_nowait(line[5:].strip())

        pumps = [asyncio.create_task(pump(n, ready)) for n, ready in zip(nodes, listening,
                                                                           strict=True)]
        gone = asyncio.create_task(_disconnected(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream"), (b"cache-control", b"no-store")]})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in listening)),
                                       _SUBSCRIBE_S)
            await send({"type": "http.response.body", "body": b": corral live list\n\n",
                        "more_body": True})
            while not gone.done():
                try:
                    data = await asyncio.wait_for(changes.get(), timeout=15)
                except TimeoutError:
                    chunk = b": keep-alive\n\n"
                else:
                    json.loads(data)  # a node's line is passed on only if it is one
                    chunk = f"event: change\ndata: {data}\n\n".encode()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except OSError:
            pass  # the client went away mid-write
        finally:
            for task in [*pumps, gone]:
                task.cancel()
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": b""})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
