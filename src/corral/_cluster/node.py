"""The Corral node: one per Ray node that offers the ``corral`` resource, a Ray actor pinned to
that node, running the control plane embedded with its own data directory, uid range and
instance (so two nodes on one host, as in the tests, never share a uid, cgroup or netns name),
and shipping its audit lines to the gateway's sink as they are written (``audit``).

It is the same ``Manager`` every other surface uses: tenancy, ceilings, quotas, limits and the
audit trail are enforced here, below the gateway, exactly as on a single host. Plain Python
here; ``gateway`` wraps it with ``ray.remote`` (threaded: commands of many sandboxes run at
once); Ray is imported only to reach the audit sink.

``serve`` starts the node's own service: Corral's HTTP API and the E2B dialect over this
node's control plane, on the node's cluster address, for gateways only (every call carries
a caller token a gateway signed, ``peer``). ``corral serve --cluster`` relays each client
request there unchanged, so streaming output, PTY WebSockets, background processes, exposed
ports and E2B's envd reach the sandbox the way they do on one host.
"""

from __future__ import annotations

import builtins
import io
import shutil
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._control.plane import Manager, Tenant, get_manager
from .._settings import Settings
from .._templates.catalog import list_builds
from ..errors import ConfigError, SandboxNotFound, SnapshotNotFound
from ..models import CommandResult, SandboxInfo, SnapshotInfo
from .audit import Shipper
from .auth import require_token_auth
from .copies import Exported, SnapshotCopies, export_snapshot
from .peer import PeerTenants

__all__ = ["NodeAgent", "node_settings"]


def node_settings(base: Settings, index: int, identity: str) -> dict[str, Any]:
    """What makes node ``index`` distinct from the others on a shared host: its home under the
    gateway's (named after the node's identity, so a node started again finds its own), and
    the ``index``-th uid range of the gateway's size. (On separate machines any would do;
    distinct ones cost nothing.)"""
    return {
        "home": str(Path(base.home) / "nodes" / identity[:63]),
        "uid_start": base.uid_start + index * base.uid_count,
        "uid_count": base.uid_count,
    }


class NodeAgent:
    """The control plane of one node, called by gateways through Ray."""

    def __init__(self, overrides: dict[str, Any], node_id: str, sink: Any = None) -> None:
        require_token_auth(f"the Corral node on Ray node {node_id[:12]}")
        self._node_id = node_id
        home = Path(overrides["home"])
        home.mkdir(parents=True, exist_ok=True, mode=0o711)
        for parent in home.parents:  # sandbox uids walk to their workspaces
            if parent == Path("/"):
                break
            parent.chmod(parent.stat().st_mode | 0o011)
        self._settings = Settings(**overrides)
        self._manager: Manager = get_manager(self._settings)
        self._manager.recover()
        self._copies = SnapshotCopies(self._manager, home)
        self._shipper: Shipper | None = None
        self._services: _Services | None = None
        self._serve_lock = threading.Lock()
        if sink is not None:  # a Ray actor handle (``audit.AuditSink``)
            import ray

            self._shipper = Shipper(
                self._manager.auditor.directory,
                send=lambda sid, offset, data: ray.get(sink.append.remote(sid, offset, data)),
                resume=lambda sid: ray.get(sink.size.remote(sid)))

    def describe(self) -> dict[str, Any]:
        """Who this node is and what it has: its sandboxes, free memory and disk, and the
        templates and images present (the gateway's placement prefers a node that holds the
        template a create names)."""
        home = Path(self._settings.home)
        return {"node_id": self._node_id, "home": str(home),
                "uid_start": self._settings.uid_start, "uid_count": self._settings.uid_count,
                "sandboxes": len(self._manager.list()),
                "free_memory_bytes": _available_memory(),
                "free_disk_bytes": shutil.disk_usage(home).free,
                "templates": sorted({"base", *(build.name for build in
                                               list_builds(home / "templates"))})}

    def serve(self, secret: bytes, host: str | None = None,
              e2b_domain: str | None = None) -> dict[str, str]:
        """Start the node's services (once; idempotent) for gateways holding ``secret``, on
        ``host`` (default: this Ray node's address), and the E2B app in domain mode for
        ``e2b_domain`` if a gateway serves one (one listener per domain). Returns their base
        URLs: ``http``, ``e2b`` and ``e2b:DOMAIN``."""
        with self._serve_lock:
            if self._services is None:
                if host is None:
                    import ray

                    host = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
                self._services = _Services(self._manager, PeerTenants(self._manager.store,
                                                                      secret), host)
            if e2b_domain is not None:
                self._services.add_e2b_domain(e2b_domain)
            return dict(self._services.urls)

    def create(self, kwargs: dict[str, Any]) -> SandboxInfo:
        return self._manager.create(**kwargs)

    def get(self, sandbox_id: str, tenant: str | None) -> SandboxInfo:
        return self._manager.get(sandbox_id, tenant=tenant)

    def holdings(self) -> builtins.list[tuple[str, str, float]]:
        """Every live sandbox here: id, tenant, when it was made."""
        return [(record.id, record.tenant, record.created_at)
                for record in self._manager.sandboxes.list()]

    def list(self, tenant: str | None) -> builtins.list[SandboxInfo]:
        return self._manager.list(tenant=tenant)

    def run(self, sandbox_id: str, cmd: str | Sequence[str], tenant: str | None,
            kwargs: dict[str, Any]) -> CommandResult:
        self._manager.get(sandbox_id, tenant=tenant)  # another tenant's: not found
        return self._manager.run(sandbox_id, cmd, **kwargs)

    def write_file(self, sandbox_id: str, tenant: str | None, path: str, data: bytes) -> None:
        self._manager.get(sandbox_id, tenant=tenant)
        self._manager.files(sandbox_id).write(path, data)

    def read_file(self, sandbox_id: str, tenant: str | None, path: str) -> bytes:
        self._manager.get(sandbox_id, tenant=tenant)
        return bytes(self._manager.files(sandbox_id).read(path))

    def destroy(self, sandbox_id: str, tenant: str | None) -> None:
        self._manager.get(sandbox_id, tenant=tenant)
        self._manager.destroy(sandbox_id)

    def fork(self, sandbox_id: str, count: int, tenant: str | None,
             caller: Tenant | None = None, memory: bool = False) -> builtins.list[SandboxInfo]:
        """``count`` children here, the native way (O(1): shared read-only layers), within
        ``caller``'s ceiling."""
        return self._manager.fork(sandbox_id, count, tenant=tenant, caller=caller,
                                  memory=memory)

    def export_fork(self, sandbox_id: str, tenant: str | None) -> bytes:
        """The workspace as a fork would see it, as a tar, for children on other nodes: a
        native child made (refused while the sandbox is busy, as a fork is), read, dropped.
        The gateway hands the result to the other nodes as an object reference, so Ray moves
        it from this node's object store to each of them once, never through the gateway."""
        child = self._manager.fork(sandbox_id, 1, tenant=tenant)[0]
        try:
            return b"".join(self._manager.download(child.id, "/workspace"))
        finally:
            self._manager.destroy(child.id)

    def import_fork(self, workspace: bytes, kwargs: dict[str, Any],
                    count: int) -> builtins.list[SandboxInfo]:
        """``count`` children of a sandbox of another node: the first made and given the
        workspace (``export_fork``'s tar), the rest native forks of it (the tar arrives and is
        written once per node)."""
        first = self._manager.create(**kwargs)
        try:
            self._manager.upload(first.id, "/workspace", io.BytesIO(workspace))
            rest = self._manager.fork(first.id, count - 1, tenant=kwargs.get("tenant"),
                                      caller=kwargs.get("caller")) if count > 1 else []
        except BaseException:
            self._manager.destroy(first.id)
            raise
        return [self._manager.get(first.id), *rest]

    def snapshot(self, sandbox_id: str, tenant: str | None, name: str | None) -> SnapshotInfo:
        return self._manager.snapshot(sandbox_id, name=name, tenant=tenant)

    def delete_snapshot(self, ref: str, tenant: str | None) -> None:
        self._manager.delete_snapshot(ref, tenant=tenant)

    def find_snapshot(self, ref: str, tenant: str | None) -> dict[str, Any] | None:
        """The snapshot ``ref`` if it was taken here: its id and whether it holds memory."""
        try:
            snap = self._manager.get_snapshot(ref, tenant=tenant)
        except SnapshotNotFound:
            return None
        return {"id": snap.id, "memory": snap.memory}

    def export_snapshot(self, snapshot_id: str, tenant: str | None) -> Exported:
        """The snapshot's workspace for a copy on another node (``copies``). The gateway hands
        the result on as an object reference: Ray moves it node to node."""
        return export_snapshot(self._manager, snapshot_id, tenant)

    def snapshot_copy(self, origin: str) -> str | None:
        """This node's copy of another node's snapshot ``origin``, if it has one."""
        return self._copies.find(origin)

    def copy_snapshot(self, exported: Exported) -> str:
        """A copy here of another node's snapshot (made once; later calls find it)."""
        return self._copies.make(exported)

    def drop_snapshot_copy(self, origin: str) -> bool:
        return self._copies.drop(origin)

    def snapshot_copies(self) -> dict[str, str]:
        return self._copies.all()

    def forget(self, sandbox_ids: builtins.list[str]) -> builtins.list[str]:
        """Destroy what the cluster has declared lost (this node was gone, and is back)."""
        gone = []
        for sandbox_id in sandbox_ids:
            try:
                self._manager.destroy(sandbox_id)
            except SandboxNotFound:
                continue
            gone.append(sandbox_id)
        return gone

    def close(self) -> None:
        """Take the node down: destroy its sandboxes, sweep its host pieces, remove its
        instance's cgroup roots, close its control plane."""
        for info in self._manager.list():
            try:
                self._manager.destroy(info.id)
            except SandboxNotFound:
                pass
        if self._services is not None:
            self._services.close()
        if self._shipper is not None:
            self._shipper.close()  # the last events, the destroys' too, go out first
        self._manager.backend.sweep(set())
        remove_instance = getattr(self._manager.backend, "remove_instance", None)
        if remove_instance is not None:
            remove_instance()
        self._manager.close()


def _available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


class _Services:
    """The node's HTTP API and E2B listeners, each uvicorn on a thread of its own with a port
    the kernel picked, and the reaper that destroys what expires (as ``corral serve`` runs)."""

    def __init__(self, manager: Manager, tenants: PeerTenants, host: str) -> None:
        from .._control.plane import Reaper
        from .._e2b.app import E2BConfig, create_e2b_app
        from .._serve.app import create_app

        self._manager, self._tenants, self._host = manager, tenants, host
        self.urls: dict[str, str] = {}
        self._servers: list[tuple[Any, threading.Thread]] = []
        self._start("http", create_app(manager, listen_host=host, tenants=tenants))
        self._start("e2b", create_e2b_app(manager, E2BConfig(listen_host=host),
                                          tenants=tenants))
        self._reaper = Reaper(manager.recover)
        self._reaper.start()

    def add_e2b_domain(self, domain: str) -> None:
        """E2B's domain mode for a gateway that serves ``domain``: the gateway passes the
        client's Host (``api.DOMAIN``, ``<port>-<id>.DOMAIN``) on, and this app routes by it
        exactly as ``corral serve --e2b-domain`` does (TLS ends at the gateway)."""
        from .._e2b.app import E2BConfig, create_e2b_app

        if f"e2b:{domain}" in self.urls:
            return
        try:
            config = E2BConfig.build(listen_host=self._host, domain=domain)
        except ValueError as exc:
            raise ConfigError(f"E2B domain: {exc}") from exc
        self._start(f"e2b:{config.domain}", create_e2b_app(self._manager, config,
                                                           tenants=self._tenants))

    def _start(self, name: str, app: Any) -> None:
        import uvicorn

        host = self._host
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                               lifespan="off", timeout_keep_alive=30))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                  name=f"corral-node-{name}", daemon=True)
        thread.start()
        self._servers.append((server, thread))
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node's {name} service did not start within 10 s")
            time.sleep(0.01)
        shown = f"[{host}]" if ":" in host else host
        self.urls[name] = f"http://{shown}:{port}"

    def close(self) -> None:
        self._reaper.stop()
        for server, _ in self._servers:
            server.should_exit = True
        for _, thread in self._servers:
            thread.join(timeout=10)
