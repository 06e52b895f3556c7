"""What a drill attacks: sandboxes made through the SDK (embedded or a service), behind a small
protocol so the tests can also point the drill at a runner with no sandbox at all."""

from __future__ import annotations

import contextlib
import io
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .._audit.events import AuditEvent
from ..models import CommandResult

__all__ = ["DrillSandbox", "DrillTarget", "SdkTarget", "ServiceAccess", "tar_bytes"]


@dataclass(frozen=True, slots=True)
class ServiceAccess:
    """An HTTP control plane to probe: its URL, a key of the tenant the drill runs as, and
    (optionally) a key of a second tenant, to prove tenants cannot reach each other."""

    url: str
    api_key: str | None
    other_api_key: str | None = None
    # For the caller cases: a tenant held to ``caller.DRILL_CEILING``, a tenant with a small
    # commands-per-minute quota, a name the operator pinned to the drill's upstream address
    # (``caller.UPSTREAM_ADDRESS``, allowed as an operator CIDR), and the service's data
    # directory when the drill can see it (to know a workspace's host path).
    ceiling_api_key: str | None = None
    quota_api_key: str | None = None
    upstream_host: str | None = None
    home: Path | None = None
    # The E2B surface beside it (``corral serve --e2b-port``), when it has one: its URL and
    # ``e2b_`` keys of the same three tenants (first, second, held to the drill's ceiling).
    e2b_url: str | None = None
    e2b_api_key: str | None = None
    e2b_other_api_key: str | None = None
    e2b_ceiling_api_key: str | None = None
    # Domain mode (``--e2b-domain``): the domain, and the listener that routes by it when it is
    # not ``e2b_url`` itself (the local service keeps its URL-mode listener plain).
    e2b_domain: str | None = None
    e2b_domain_url: str | None = None


class DrillSandbox(Protocol):
    """The few things a case does to a sandbox."""

    @property
    def id(self) -> str: ...

    def run(self, cmd: str | Sequence[str], *, timeout: float = 30,
            envs: Mapping[str, str] | None = None) -> CommandResult: ...

    def write(self, path: str, data: str | bytes) -> None: ...

    def read(self, path: str) -> bytes: ...

    def upload_tar(self, data: bytes, path: str = "/workspace") -> None: ...

    def events(self, *, command: str | None = None,
               types: Sequence[str] | None = None) -> list[AuditEvent]: ...

    def kill(self) -> None: ...


class DrillTarget(Protocol):
    """Makes sandboxes the way the operator's configuration does."""

    @property
    def capabilities(self) -> frozenset[str]:
        """What the drill may do around the sandboxes: ``admin`` (host side: register a
        secret, read the data directory's paths), ``service`` (an HTTP control plane)."""
        ...

    @property
    def home(self) -> Path | None: ...

    @property
    def service(self) -> ServiceAccess | None: ...

    def describe(self) -> dict[str, Any]: ...

    def create(self, *, network: str | Mapping[str, Sequence[str]],
               secrets: Sequence[str] = (), labels: Mapping[str, str] | None = None,
               ) -> DrillSandbox: ...

    def add_secret(self, name: str, value: str, hosts: Sequence[str]) -> None:
        """Register a host secret (``admin`` only)."""
        ...

    def remove_secret(self, name: str) -> None: ...

    def close(self) -> None: ...


def tar_bytes(members: Sequence[tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]]) -> bytes:
    """A tar archive of hand-made members (for the tar-slip cases)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for member in members:
            if isinstance(member, tuple):
                info, data = member
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(member)
    return buf.getvalue()


class _SdkSandbox:
    def __init__(self, sandbox: Any) -> None:
        from .._sdk.sandbox import Sandbox

        self._sb: Sandbox = sandbox

    @property
    def id(self) -> str:
        return self._sb.id

    def run(self, cmd: str | Sequence[str], *, timeout: float = 30,
            envs: Mapping[str, str] | None = None) -> CommandResult:
        return self._sb.commands.run(cmd, timeout=timeout, envs=dict(envs or {}))

    def write(self, path: str, data: str | bytes) -> None:
        self._sb.files.write(path, data)

    def read(self, path: str) -> bytes:
        return self._sb.files.read(path, format="bytes")

    def upload_tar(self, data: bytes, path: str = "/workspace") -> None:
        self._sb.files.upload(data, path)

    def events(self, *, command: str | None = None,
               types: Sequence[str] | None = None) -> list[AuditEvent]:
        return self._sb.audit.events(command=command, types=types)

    def kill(self) -> None:
        self._sb.kill()


class SdkTarget:
    """Sandboxes through ``corral.Sandbox``: embedded in this process (``home``) or on a
    service (``url``), with the operator's tier, template, isolation and allow rules."""

    def __init__(self, *, home: Path | None = None, url: str | None = None,
                 api_key: str | None = None, other_api_key: str | None = None,
                 ceiling_api_key: str | None = None, quota_api_key: str | None = None,
                 upstream_host: str | None = None, e2b_url: str | None = None,
                 e2b_api_key: str | None = None, e2b_other_api_key: str | None = None,
                 e2b_ceiling_api_key: str | None = None, e2b_domain: str | None = None,
                 isolation: str | None = None,
                 template: str | None = None, resources: str = "small") -> None:
        self._home = home
        self._url = url
        self._api_key = api_key
        self._isolation = isolation
        self._template = template
        self._resources = resources
        self._service = ServiceAccess(
            url, api_key, other_api_key, ceiling_api_key=ceiling_api_key,
            quota_api_key=quota_api_key, upstream_host=upstream_host, e2b_url=e2b_url,
            e2b_api_key=e2b_api_key, e2b_other_api_key=e2b_other_api_key,
            e2b_ceiling_api_key=e2b_ceiling_api_key, e2b_domain=e2b_domain) if url else None
        self._made: list[_SdkSandbox] = []

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset({"service"} if self._url else {"admin"})

    @property
    def home(self) -> Path | None:
        return self._home

    @property
    def service(self) -> ServiceAccess | None:
        return self._service

    def describe(self) -> dict[str, Any]:
        return {"transport": "http" if self._url else "embedded",
                "url": self._url, "home": str(self._home) if self._home else None,
                "isolation": self._isolation or "default", "template": self._template or "base",
                "resources": self._resources}

    def create(self, *, network: str | Mapping[str, Sequence[str]],
               secrets: Sequence[str] = (), labels: Mapping[str, str] | None = None,
               ) -> DrillSandbox:
        from .._sdk.sandbox import Sandbox

        sb = Sandbox.create(self._template, resources=self._resources, network=network,
                            secrets=list(secrets) or None, labels=labels, timeout=1800,
                            isolation=self._isolation,
                            home=None if self._url else self._home, url=self._url,
                            api_key=self._api_key)
        made = _SdkSandbox(sb)
        self._made.append(made)
        return made

    def _manager(self) -> Any:
        from .._control.plane import get_manager
        from .._settings import Settings

        return get_manager(Settings(home=self._home) if self._home else Settings())

    def add_secret(self, name: str, value: str, hosts: Sequence[str]) -> None:
        self._manager().secrets.add(name, value, list(hosts))

    def remove_secret(self, name: str) -> None:
        self._manager().secrets.remove(name)

    def close(self) -> None:
        for sb in self._made:
            with contextlib.suppress(Exception):
                sb.kill()
        self._made.clear()
