"""A throwaway HTTP control plane for an embedded drill's control-plane cases, with the E2B
dialect's listener beside it (as ``corral serve --e2b-port`` runs it).

Both run on loopback over one temporary data directory, with tenants of its own, so the
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._core.resources import TIERS
from .._settings import Settings
from .context import BAIT_ALLOWED, drill_ceiling
from .target import ServiceAccess
from .upstream import UPSTREAM_ADDRESS

if TYPE_CHECKING:
    from .._e2b.app import E2BApp

__all__ = ["CEILING_SECRET", "E2B_DOMAIN", "UPSTREAM_HOST", "local_service"]

# The name the drill's service pins to the drill's upstream (an operator setting; a sandbox
# still has to allow it).
UPSTREAM_HOST = "upstream.drill.invalid"
# The local service's E2B domain-mode listener answers for this domain.
E2B_DOMAIN = "e2b.drill.invalid"
# A secret the ceiling tenant's ceiling does not let it bind.
CEILING_SECRET = "CORRAL_DRILL_CEILING_SECRET"


@dataclass(slots=True)
class _Running:
    server: Any  # uvicorn.Server (imported lazily: the CLI's start-up does not pay for it)
    thread: threading.Thread
    port: int

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _start(app: Any, name: str) -> _Running:
    """``app`` served by uvicorn in a thread on a free loopback port, once it listens."""
    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                            lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    running = _Running(server, thread, port)
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            running.stop()
            raise RuntimeError(f"the drill's local service ({name}) did not start")
        time.sleep(0.02)
    return running


@contextlib.contextmanager
def local_service(settings: Settings) -> Iterator[ServiceAccess]:
    from .._control import plane as manager_mod
    from .._e2b.app import E2BConfig, create_e2b_app
    from .._serve.app import create_app

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
    servers: list[_Running] = []
    e2b_app: E2BApp | None = None
    e2b_domain_app: E2BApp | None = None
    try:
        tenants = manager.tenants
        keys = []
        # The first tenant's E2B cases keep a few sandboxes of their own beside the drill's.
        for name, most in (("drill-a", 8), ("drill-b", 4)):
            tenants.add_tenant(name, max_sandboxes=most)
            keys.append(tenants.create_key(name)[1])
        tenants.add_tenant("drill-q", max_sandboxes=2, commands_per_minute=2)
        quota_key = tenants.create_key("drill-q")[1]
        # Its quota allows every resource tier, so only the ceiling can refuse `large`.
        tenants.add_tenant("drill-c", max_sandboxes=4, tiers=sorted(TIERS),
                           ceiling=drill_ceiling())
        ceiling_key = tenants.create_key("drill-c")[1]
        manager.secrets.add(CEILING_SECRET, "drill-ceiling-value", [BAIT_ALLOWED])
        servers.append(_start(create_app(manager), "corral-drill-service"))
        # The E2B dialect beside it, as `corral serve --e2b-port` runs it: same Manager, its
        # own loopback port, `e2b_` keys of the same tenants.
        e2b_app = create_e2b_app(manager, E2BConfig.build(listen_host="127.0.0.1"))
        servers.append(_start(e2b_app, "corral-drill-e2b"))
        # And in domain mode, routed by `Host: <port>-<id>.<domain>` (plain HTTP here: the
        # drill names the host itself, so neither TLS nor DNS is needed for the routing cases).
        e2b_domain_app = create_e2b_app(manager, E2BConfig.build(
            listen_host="127.0.0.1", domain=E2B_DOMAIN))
        servers.append(_start(e2b_domain_app, "corral-drill-e2b-domain"))
        e2b_keys = [tenants.create_key(name, e2b=True)[1]
                    for name in ("drill-a", "drill-b", "drill-c")]
        yield ServiceAccess(f"http://127.0.0.1:{servers[0].port}", keys[0], keys[1],
                            ceiling_api_key=ceiling_key, quota_api_key=quota_key,
                            upstream_host=UPSTREAM_HOST, home=home,
                            e2b_url=f"http://127.0.0.1:{servers[1].port}",
                            e2b_api_key=e2b_keys[0], e2b_other_api_key=e2b_keys[1],
                            e2b_ceiling_api_key=e2b_keys[2], e2b_domain=E2B_DOMAIN,
                            e2b_domain_url=f"http://127.0.0.1:{servers[2].port}")
    finally:
        for running in servers:
            running.stop()
        for app in (e2b_app, e2b_domain_app):
            if app is not None:
                app.e2b.close()  # lifespan is off: its shutdown would have closed it
        for info in manager.records():
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
