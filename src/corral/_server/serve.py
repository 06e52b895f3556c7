"""Running the service: uvicorn, the reaper, refusing to listen beyond loopback without keys."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import uvicorn

from .._control.manager import Manager
from .._control.recovery import Reaper
from ..errors import ConfigError
from .app import _is_loopback, create_app

__all__ = ["Reaper", "serve"]

logger = logging.getLogger(__name__)


def serve(manager: Manager, *, host: str, port: int, host_names: Sequence[str] = (),
          allow_keyless: bool = False) -> None:
    """Serve until interrupted. Raises ConfigError when exposure would be unauthenticated or a
    host name is malformed."""
    if not _is_loopback(host) and manager.store.live_key_count() == 0:
        raise ConfigError(
            f"refusing to listen on {host} without API keys: anyone who can reach it could run "
            "code. Create a tenant and a key first (`corral tenants add NAME`, "
            "`corral keys create NAME`), or listen on 127.0.0.1")
    try:
        app = create_app(manager, listen_host=host, host_names=host_names,
                         allow_keyless=allow_keyless)
    except ValueError as exc:
        raise ConfigError(f"--host-name: {exc}") from exc
    if host in ("0.0.0.0", "::") and not any(name.strip() for name in host_names):
        logger.warning("listening on %s, but answering only to localhost, 127.0.0.1 and [::1]: "
                       "name the addresses clients use with --host-name", host)
    if allow_keyless and manager.store.live_key_count() == 0 and manager.store.keys_have_existed():
        logger.warning("serving keyless although API keys existed (--allow-keyless): any local "
                       "process may run code here")
    manager.recover()
    reaper = Reaper(manager.recover)
    reaper.start()
    try:
        uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
    finally:
        reaper.stop()
