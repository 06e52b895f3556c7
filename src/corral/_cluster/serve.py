"""Running the cluster gateway: uvicorn over ``service``'s app, and the reconciler that keeps
the sandbox map true (lost nodes, nodes back, sandboxes no gateway recorded or that expired)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import uvicorn

from .._control.plane import Reaper, Store
from .._http.keys import is_loopback
from .._settings import Settings
from ..errors import ConfigError

__all__ = ["serve_cluster"]

log = logging.getLogger(__name__)

_RECONCILE_S = 2.0


def serve_cluster(address: str, settings: Settings, *, host: str, port: int,
                  host_names: Sequence[str] = (), allow_keyless: bool = False,
                  e2b_port: int | None = None, e2b_domain: str | None = None,
                  e2b_tls_cert: str | None = None, e2b_tls_key: str | None = None) -> None:
    """Serve the HTTP API over the Ray cluster at ``address`` until interrupted, and with
    ``e2b_port`` the E2B dialect (in domain mode for ``e2b_domain``, over TLS). Keys are
    this data directory's (``corral keys create``). Raises ConfigError where ``corral serve``
    would (no keys beyond loopback, a malformed host name or domain, a domain without TLS)
    and without Ray token auth."""
    from .._e2b.app import E2BConfig
    from .gateway import Cluster
    from .service import create_cluster_app

    if e2b_domain is not None:
        if not (e2b_tls_cert and e2b_tls_key):
            raise ConfigError("--e2b-domain needs --e2b-tls-cert and --e2b-tls-key: E2B's SDKs "
                              "reach a domain over https only")
        try:
            e2b_domain = E2BConfig.build(domain=e2b_domain).domain
        except ValueError as exc:
            raise ConfigError(f"E2B surface: {exc}") from exc
    if bool(e2b_tls_cert) != bool(e2b_tls_key):
        raise ConfigError("give both --e2b-tls-cert and --e2b-tls-key")

    settings.home.mkdir(parents=True, exist_ok=True, mode=0o711)
    store = Store(settings.home / "corral.db")
    if not is_loopback(host) and store.live_key_count() == 0:
        raise ConfigError(
            f"refusing to listen on {host} without API keys: anyone who can reach it could run "
            "code on the cluster. Create a tenant and a key first (`corral tenants add NAME`, "
            "`corral keys create NAME`), or listen on 127.0.0.1")
    cluster = Cluster(address, settings, e2b_domain=e2b_domain)
    try:
        app = create_cluster_app(cluster, store, listen_host=host, host_names=host_names,
                                 allow_keyless=allow_keyless)
    except ValueError as exc:
        raise ConfigError(f"--host-name: {exc}") from exc
    nodes = cluster.nodes()
    log.warning("gateway for %d Corral node(s) at %s, on http://%s:%d", len(nodes), address,
                host, port)
    # The reaper's loop: a pass every 2 s on a thread of its own, a bad pass logged, not fatal.
    reconciler = Reaper(cluster.reconcile, interval_s=_RECONCILE_S)
    reconciler.start()
    try:
        native = uvicorn.Config(app, host=host, port=port, log_level="info",
                                access_log=False, lifespan="on")
        if e2b_port is None:
            uvicorn.Server(native).run()
        else:
            from .._serve.run import Sibling, serve_both
            from .e2b import create_cluster_e2b_app

            e2b = uvicorn.Config(create_cluster_e2b_app(cluster, store, listen_host=host,
                                                        host_names=list(host_names)),
                                 host=host, port=e2b_port, log_level="info",
                                 access_log=False, lifespan="on",
                                 ssl_certfile=e2b_tls_cert, ssl_keyfile=e2b_tls_key)
            asyncio.run(serve_both(uvicorn.Server(native), Sibling(e2b)))
    finally:
        reconciler.stop()
        store.close()
