"""The native API with the dashboard mounted in it: what ``corral serve``, a cluster node and
the drill serve on the native port."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI

from .._control.plane import Manager, TenantDirectory
from .._server.app import create_app as create_api
from .._ui.routes import install as install_ui
from .._ui.session import UISessions

__all__ = ["create_app"]


def create_app(manager: Manager, *, listen_host: str = "127.0.0.1",
               host_names: Sequence[str] = (), allow_keyless: bool = False,
               ports_domain: str | None = None,
               tenants: TenantDirectory | None = None) -> FastAPI:
    """``corral._server.app.create_app``'s API (the same arguments, errors and auth) with the
    dashboard and ``/docs``. Dashboard sessions sign in with this service's own keys, so a
    cluster node (``tenants`` given: the gateways' signed callers) serves the pages without
    sessions: its gateway holds them."""
    sessions = None if tenants is not None else UISessions(
        lambda: manager.settings.home, manager.tenants)
    app = create_api(manager, listen_host=listen_host, host_names=host_names,
                     allow_keyless=allow_keyless, ports_domain=ports_domain, tenants=tenants,
                     sessions=None if sessions is None else sessions.tenant)
    install_ui(app, sessions)
    return app
