"""Running the service: uvicorn for the native API and the E2B dialect's listener beside it, the
reaper, refusing to listen beyond loopback without keys."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from .._control.plane import Manager, Reaper
from .._core.homelock import hold_home
from .._http.keys import is_loopback
from ..errors import ConfigError
from .app import create_app

__all__ = ["E2BListener", "Prepared", "Reaper", "Sibling", "prepare", "preview_problems", "serve",
           "serve_both"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class E2BListener:
    """The E2B dialect's listener, beside the native API (``corral._e2b.app``)."""

    port: int
    domain: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    templates: str = ""


class Sibling(uvicorn.Server):
    """A second listener in the process (the E2B dialect's): the native server owns the
    process's signals, and this one stops when it does."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _e2b_config(manager: Manager, listener: E2BListener, host: str,
                host_names: Sequence[str]) -> uvicorn.Config:
    from .._e2b.app import E2BConfig, create_e2b_app  # only with the listener: start-up time

    if listener.domain and not (listener.tls_cert and listener.tls_key):
        raise ConfigError("--e2b-domain needs --e2b-tls-cert and --e2b-tls-key: E2B's SDKs "
                          "reach a domain over https only")
    if bool(listener.tls_cert) != bool(listener.tls_key):
        raise ConfigError("give both --e2b-tls-cert and --e2b-tls-key")
    try:
        config = E2BConfig.build(listen_host=host, host_names=host_names,
                                 domain=listener.domain, templates=listener.templates)
    except ValueError as exc:
        raise ConfigError(f"E2B surface: {exc}") from exc
    return uvicorn.Config(create_e2b_app(manager, config), host=host, port=listener.port,
                          log_level="info", access_log=False, lifespan="on",
                          ssl_certfile=listener.tls_cert, ssl_keyfile=listener.tls_key)


def preview_problems(domain: str | None, host: str, host_names: Sequence[str]) -> list[str]:
    """What the operator should know about where browsers open exposed ports."""
    names = [n.strip().lower().rpartition(":")[0] or n.strip().lower()
             for n in host_names if n.strip()]
    if domain is None:
        if is_loopback(host) and not names:
            return []
        return ["no --ports-domain: browsers open exposed ports in the path form, on this "
                "service's own origin, where their pages are sandboxed (no cookies or storage "
                "of their own, and a private port's page loads without its assets); give the "
                "service a wildcard DNS domain of its own with --ports-domain "
                "(docs/ports-and-volumes.md, Origins)"]
    problems = []
    for name in names:
        if _same_site(name, domain.lower()):
            problems.append(
                f"--ports-domain {domain} and the service's name {name} are one site: a page "
                "a sandbox serves there can set cookies the dashboard's browser sends here. "
                "Over https the dashboard's session is a __Host- cookie none of them can set; "
                "over http, give previews a domain of their own (a different registrable "
                "domain, as githubusercontent.com is to github.com)")
    return problems


def _same_site(name: str, domain: str) -> bool:
    """Whether two DNS names share a registrable domain, approximately (the last two labels;
    the public suffix list would say exactly)."""
    tail = ".".join(name.split(".")[-2:])
    return "." in tail and (domain == tail or domain.endswith("." + tail))


async def serve_both(native: uvicorn.Server, e2b: uvicorn.Server) -> None:
    """Serve ``native`` and, beside it, ``e2b`` (a :class:`Sibling`); both stop with the first."""
    sibling = asyncio.create_task(e2b.serve())
    try:
        await native.serve()
    finally:
        e2b.should_exit = True
        with contextlib.suppress(SystemExit, asyncio.CancelledError):
            await sibling


@dataclass(frozen=True, slots=True)
class Prepared:
    """What ``serve`` runs, built and checked before anything listens."""

    app: FastAPI
    e2b: uvicorn.Config | None
    warnings: list[str]


def prepare(manager: Manager, *, host: str, host_names: Sequence[str] = (),
            allow_keyless: bool = False, e2b: E2BListener | None = None) -> Prepared:
    """The service's apps, or ConfigError when exposure would be unauthenticated or a name or
    E2B option is malformed. ``serve`` and ``corral serve --check-config`` both run it, so the
    check refuses exactly what starting would."""
    if not is_loopback(host) and manager.store.live_key_count() == 0:
        raise ConfigError(
            f"refusing to listen on {host} without API keys: anyone who can reach it could run "
            "code. Create a tenant and a key first (`corral tenants add NAME`, "
            "`corral keys create NAME`), or listen on 127.0.0.1")
    try:
        app = create_app(manager, listen_host=host, host_names=host_names,
                         allow_keyless=allow_keyless)
    except ValueError as exc:
        raise ConfigError(f"--host-name: {exc}") from exc
    warnings = []
    if host in ("0.0.0.0", "::") and not any(name.strip() for name in host_names):
        warnings.append(f"listening on {host}, but answering only to localhost, 127.0.0.1 and "
                        "[::1]: name the addresses clients use with --host-name")
    if allow_keyless and manager.store.live_key_count() == 0 and manager.store.keys_have_existed():
        warnings.append("serving keyless although API keys existed (--allow-keyless): any "
                        "local process may run code here")
    warnings += preview_problems(manager.ports.urls.domain, host, host_names)
    e2b_config = None if e2b is None else _e2b_config(manager, e2b, host, host_names)
    return Prepared(app, e2b_config, warnings)


def serve(manager: Manager, *, host: str, port: int, host_names: Sequence[str] = (),
          allow_keyless: bool = False, e2b: E2BListener | None = None,
          share_home: bool | None = None) -> None:
    """Serve until interrupted. Raises ConfigError as ``prepare`` does, and when another
    Corral instance (``corral serve``, ``corral mcp``) uses the data directory, unless
    ``share_home`` (None: the caller has no option for it to name; False: ``--share-home``)."""
    prepared = prepare(manager, host=host, host_names=host_names, allow_keyless=allow_keyless,
                       e2b=e2b)
    app, e2b_config = prepared.app, prepared.e2b
    for warning in prepared.warnings:
        logger.warning("%s", warning)
    # Held for the service's life; released by the kernel however the process ends.
    instance = hold_home(manager.settings.home, f"corral serve on {host}:{port}",
                         share=bool(share_home),
                         override=None if share_home is None else "--share-home")
    for other in instance.others:
        logger.warning("sharing the data directory with %s (--share-home)", other.describe())
    try:
        _run(manager, app, e2b_config, host=host, port=port)
    finally:
        instance.release()


def _run(manager: Manager, app: FastAPI, e2b_config: uvicorn.Config | None, *, host: str,
         port: int) -> None:
    manager.recover()
    reaper = Reaper(manager.recover)
    reaper.start()
    try:
        with _exit_cleanly_on_sigterm():
            if e2b_config is None:
                uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
            else:
                native = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                       log_level="info", access_log=False))
                asyncio.run(serve_both(native, Sibling(e2b_config)))
    finally:
        reaper.stop()
        # The spare workspaces (mounts, loop devices), the resident helpers and the data
        # directory's cgroups once empty: a stopped service leaves none of them behind.
        manager.close()
        logger.info("stopped: spare workspaces and helpers released")


@contextlib.contextmanager
def _exit_cleanly_on_sigterm() -> Iterator[None]:
    """uvicorn shuts down on SIGTERM, then raises the signal again with the handler it found
    installed: the default one ends the process on the spot, with no ``finally`` and no
    ``atexit`` (the spare workspaces stayed mounted until the next sweep). Found installed,
    this one unwinds instead, with the same exit status (128 + 15)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
