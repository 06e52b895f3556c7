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

from .._control.tenants import Ceiling
from .._core.resources import TIERS
from .._settings import Settings
from .context import BAIT_ALLOWED
from .target import ServiceAccess
from .upstream import UPSTREAM_ADDRESS

__all__ = ["CEILING_SECRET", "UPSTREAM_HOST", "drill_ceiling", "local_service"]

# The name the drill's service pins to the drill's upstream (an operator setting; a sandbox
# still has to allow it).
UPSTREAM_HOST = "upstream.drill.invalid"
# A secret the ceiling tenant's ceiling does not let it bind.
CEILING_SECRET = "CORRAL_DRILL_CEILING_SECRET"


def drill_ceiling() -> Ceiling:
    """The ceiling the caller cases try to get beyond: one bait host, ``base``, the namespace
    tier, ``small``, no secrets, an hour."""
    return Ceiling(hosts=(BAIT_ALLOWED,), templates=("base",), isolation=("namespace",),
                   resources=("small",), secrets=(), max_lifetime_s=3600)


@contextlib.contextmanager
def local_service(settings: Settings) -> Iterator[ServiceAccess]:
    import uvicorn

    from .._control import manager as manager_mod
    from .._server.app import create_app
    from .._server.auth import TenantDirectory

    home = Path(tempfile.mkdtemp(prefix="corral-drill-service-"))
    count = min(64, settings.uid_count)
    # The upstream's address is allowed here only, for this service's own sandboxes: the
    # framing cases need a gateway that will connect to a listener on this host.
    cidrs = ",".join(c for c in (settings.egress_allow_cidrs, f"{UPSTREAM_ADDRESS}/32") if c)
    drill_settings = settings.model_copy(update={
        "home": home, "uid_start": settings.uid_start + settings.uid_count - count,
        "uid_count": count, "egress_allow_cidrs": cidrs,
        "egress_hosts": {**settings.egress_hosts, UPSTREAM_HOST: [UPSTREAM_ADDRESS]}})
    manager = manager_mod.Manager(drill_settings)
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None
    try:
        tenants = TenantDirectory(manager.store)
        keys = []
        for name in ("drill-a", "drill-b"):
            tenants.add_tenant(name, max_sandboxes=4)
            keys.append(tenants.create_key(name)[1])
        tenants.add_tenant("drill-q", max_sandboxes=2, commands_per_minute=2)
        quota_key = tenants.create_key("drill-q")[1]
        # Its quota allows every resource tier, so only the ceiling can refuse `large`.
        tenants.add_tenant("drill-c", max_sandboxes=4, tiers=sorted(TIERS),
                           ceiling=drill_ceiling())
        ceiling_key = tenants.create_key("drill-c")[1]
        manager.secrets.add(CEILING_SECRET, "drill-ceiling-value", [BAIT_ALLOWED])
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
        yield ServiceAccess(f"http://127.0.0.1:{port}", keys[0], keys[1],
                            ceiling_api_key=ceiling_key, quota_api_key=quota_key,
                            upstream_host=UPSTREAM_HOST, home=home)
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
