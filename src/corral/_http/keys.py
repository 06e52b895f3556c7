"""Who may call a service: loopback, the paths that need a key, and the key check itself (the
native API's and the cluster gateway's; the E2B dialect has keys of its own shape)."""

from __future__ import annotations

import ipaddress
from typing import Any

from starlette.concurrency import run_in_threadpool

from .._control.plane import Store, Tenant, TenantDirectory
from ..errors import AuthError

__all__ = ["is_loopback", "is_protected", "key_authenticator"]


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def is_protected(path: str) -> bool:
    # Everything but the health check, the API's own description and the dashboard's page
    # and assets needs a key (or a dashboard session).
    return path.startswith(("/v1/", "/ui/api/")) or path == "/metrics"


def key_authenticator(store: Store, tenants: TenantDirectory, *, loopback: bool,
                      allow_keyless: bool) -> Any:
    """Auth is required beyond loopback, and on loopback as soon as any key exists, or ever
    existed (unless ``allow_keyless``): revoking the last key must not silently reopen it."""

    def check(header: str | None) -> Tenant:
        if loopback:
            live, ever = store.key_presence()
            required = live
        else:
            required, ever = True, True
        if not required and not allow_keyless and ever:
            if not header:
                raise AuthError(
                    "an API key is required: every key of this service has been revoked, and "
                    "it does not reopen without keys. Create one (`corral keys create "
                    "TENANT`), or restart it with `corral serve --allow-keyless`")
            required = True
        return tenants.authenticate(header, auth_required=required)

    async def authenticate(header: str | None) -> Tenant:
        return await run_in_threadpool(check, header)

    return authenticate
