"""A throwaway HTTP control plane for an embedded drill's control-plane cases.

It runs on loopback over its own temporary data directory, with two tenants of its own, so the
drill never adds keys to the operator's store (on a keyless loopback service a key's mere
existence would turn authentication on). Its sandboxes take uids from the top 64 of the
operator's range, which the operator's store hands out last.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .._settings import Settings
from .target import ServiceAccess

__all__ = ["local_service"]


@contextlib.contextmanager
def local_service(settings: Settings) -> Iterator[ServiceAccess]:
    import uvicorn

    from .._control import manager as manager_mod
    from .._server.app import create_app
    from .._server.auth import TenantDirectory

    home = Path(tempfile.mkdtemp(prefix="corral-drill-service-"))
    count = min(64, settings.uid_count)
    drill_settings = settings.model_copy(update={
        "home": home, "uid_start": settings.uid_start + settings.uid_count - count,
        "uid_count": count})
    manager = manager_mod.Manager(drill_settings)
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None
    try:
        tenants = TenantDirectory(manager.store)
        keys = []
        for name in ("drill-a", "drill-b"):
            tenants.add_tenant(name, max_sandboxes=4)
            keys.append(tenants.create_key(name)[1])
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        config = uvicorn.Config(create_app(manager), host="127.0.0.1", port=port,
                                log_level="critical", lifespan="off")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name="corral-drill-service", daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the drill's local service did not start")
            time.sleep(0.02)
        yield ServiceAccess(f"http://127.0.0.1:{port}", keys[0], keys[1])
    finally:
        if server is not None and thread is not None:
            server.should_exit = True
            thread.join(timeout=10)
        for info in manager.store.list():
            with contextlib.suppress(Exception):
                manager._destroy(info, reason="drill finished")
        with contextlib.suppress(Exception):
            manager.backend.sweep(set())
        remove_instance = getattr(manager.backend, "remove_instance", None)
        if remove_instance is not None:
            with contextlib.suppress(Exception):
                remove_instance()
        manager.close()
        shutil.rmtree(home, ignore_errors=True)
