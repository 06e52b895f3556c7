"""The one settings object. Built once at the edge (CLI, ``Sandbox``) and passed down."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .backends import BackendName

__all__ = ["Settings"]

# bwrap writes uid maps with a signed int: larger uids fail ("setting up uid map").
_MAX_UID = 2**31 - 2


def _default_home() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/corral")
    return Path.home() / ".local" / "share" / "corral"


class Settings(BaseSettings):
    """Corral's configuration: arguments first, then ``CORRAL_*`` variables, then defaults.

    Attributes:
        home: data directory (SQLite store, workspaces, templates). ``CORRAL_HOME``.
        uid_start: first host uid handed to sandboxes. ``CORRAL_UID_START``.
        uid_count: how many uids the range holds; also the most sandboxes at once.
            Two Corral homes on one host must use ranges that do not overlap.
        backend: the default isolation tier (``namespace`` or ``gvisor``); each sandbox may
            choose its own. ``CORRAL_BACKEND``.
        run_dir: where network namespaces are pinned (``ip netns`` sees them).
        audit: write the audit trail (``CORRAL_AUDIT=0`` turns it off; only for measuring).
        audit_output_bytes: command output kept in the audit trail, per stream and command.
        audit_aggregate_window_s: the interval repeated events are aggregated over: per
            sandbox and refusal rule (egress) or exposed port (public connections), the first
            ``audit_aggregate_burst`` of an interval are written in full, the rest counted and
            written as one summary event when the interval ends (``docs/audit.md``).
            ``CORRAL_AUDIT_AGGREGATE_WINDOW_S``.
        audit_aggregate_burst: how many repeated events per interval and key are written in
            full before the rest are only counted. ``CORRAL_AUDIT_AGGREGATE_BURST``.
        audit_sandbox_max_bytes: the audit byte budget of one sandbox: at it the sandbox is
            paused with the reason in its trail, and resuming it is refused while it is over
            (0: no budget). A tenant's own (``corral tenants set --audit-sandbox-max-bytes``)
            replaces it. ``CORRAL_AUDIT_SANDBOX_MAX_BYTES``.
        audit_tenant_max_bytes: the audit byte budget of one tenant: what the trails of its
            live sandboxes add up to; past it, each of its sandboxes that writes is paused
            (0: no budget). ``corral tenants set --audit-max-bytes`` replaces it per tenant.
            ``CORRAL_AUDIT_TENANT_MAX_BYTES``.
        audit_retention_s: trails of destroyed sandboxes older than this (since their last
            write) are removed by ``corral audit prune`` and the reaper (0: kept whatever
            their age). ``CORRAL_AUDIT_RETENTION_S``.
        audit_retention_max_bytes: the most the trails of destroyed sandboxes may add up to;
            the oldest are removed first beyond it (0: no bound).
            ``CORRAL_AUDIT_RETENTION_MAX_BYTES``.
        egress_allow_cidrs: operator-only: comma-separated CIDRs the gateway may connect to even
            though they are private/loopback/link-local (internal package mirrors, for example).
            Never settable through a sandbox's own policy. Empty by default.
        egress_hosts: operator-only: names pinned to addresses, consulted before the host's
            resolver (JSON: ``{"mirror.internal": ["10.0.0.5"]}``); answers are still vetted.
        egress_upstream_ca: a CA bundle the gateway trusts for upstream TLS when it intercepts
            (default: the system's).
        url: a Corral service (``corral serve``) to use instead of running sandboxes in this
            process. ``CORRAL_URL``.
        api_key: the key for ``url``. ``CORRAL_API_KEY``.
        ceiling_hosts: operator ceiling, the server default for every caller without its own
            (the local/keyless tenant, the embedded SDK, the CLI, MCP): comma-separated
            allow-rule patterns a sandbox's allowlist must fall within (``*.pypi.org``,
            ``api.example.com:8443``); unset = no bound, empty = no network at all.
            ``CORRAL_CEILING_HOSTS``. Likewise ``ceiling_templates``, ``ceiling_isolation``,
            ``ceiling_resources`` and ``ceiling_secrets`` (comma-separated names) and
            ``ceiling_max_lifetime_s`` (seconds). A tenant's own ceiling
            (``corral tenants set``) replaces a field it sets.
        server_host_names: names ``corral serve`` answers to besides its listen address,
            ``localhost``, ``127.0.0.1`` and ``[::1]`` (comma-separated ``host`` or
            ``host:port``); other ``Host`` headers get 421, other browser Origins 403.
            ``CORRAL_SERVER_HOST_NAMES``.
        e2b_templates: E2B template names and the Corral templates they stand for, over the
            defaults ``base=base,code-interpreter-v1=code-interpreter`` (comma-separated
            ``NAME=TEMPLATE``). ``CORRAL_E2B_TEMPLATES``.
        server_allow_keyless: serve keyless on loopback even though API keys once existed
            (all are revoked). Dangerous: any local process, and any web page that reaches
            loopback, may then run code. ``CORRAL_SERVER_ALLOW_KEYLESS``.
        microvm_allow_tcg: TEST ONLY: let the microVM tier run guests under QEMU's TCG
            emulation on a host without usable hardware KVM (PVM or none). TCG is no isolation
            boundary worth the name. ``CORRAL_MICROVM_ALLOW_TCG``.
        microvm_cache: where the microVM tier keeps what it derives from its inputs and can
            share between data directories: guest kernels, root images, warm snapshots, empty
            formatted disks (each keyed by a hash of what made it). ``CORRAL_MICROVM_CACHE``.
        microvm_warm: restore new microVMs from the template's warm snapshot (on by default;
            off, every VM boots cold). ``CORRAL_MICROVM_WARM``.
        namespace_resident: run a namespace sandbox's commands from a resident helper kept
            while it is in use (on by default: a command costs a fork and an exec in
            namespaces made ahead, not a bwrap); off, every command starts a bwrap of its own.
            Either way each command gets its own PID, mount, IPC, UTS and cgroup namespace,
            ``/tmp``, cgroup and filter. ``CORRAL_NAMESPACE_RESIDENT``.
        namespace_idle_s: how long a namespace sandbox's resident helper with nothing
            running is kept before it is stopped. ``CORRAL_NAMESPACE_IDLE_S``.
        gvisor_resident: run a gVisor sandbox's commands in one gVisor sandbox kept while it
            is in use (on by default: ~7x faster per command); off, every command starts a
            gVisor sandbox of its own (more separation between the commands of one sandbox:
            a memory bomb then ends only its own command). ``CORRAL_GVISOR_RESIDENT``.
        gvisor_idle_s: how long a resident gVisor sandbox with nothing running is kept
            before it is stopped. ``CORRAL_GVISOR_IDLE_S``.
        gvisor_pin_cpus: pin a resident gVisor sandbox, once started, to as many of the
            host's CPUs as its tier has (rounded up; the least used first; never when that is
            all of them). A placement hint, not a limit (the cgroup's quota is the limit):
            gVisor's thread hand-offs are much cheaper on one CPU than across CPUs, about 2x
            per command on a VM. ``CORRAL_GVISOR_PIN_CPUS``.
        registries: the registries images may be pulled from (comma-separated hosts, with
            ``:port`` if not the default; ``docker.io`` covers Docker Hub's names; ``*`` any).
            A registry on loopback is spoken to over plain HTTP, every other one over verified
            TLS. ``CORRAL_REGISTRIES``.
        registries_require_digest: only digest-pinned references (``name@sha256:...``).
            ``CORRAL_REGISTRIES_REQUIRE_DIGEST``.
        registry_auth_file: registry credentials (a ``containers-auth.json``, as ``skopeo
            login`` writes it); read on the host by the pull, never given to a sandbox.
            ``CORRAL_REGISTRY_AUTH_FILE``.
        image_max_bytes: the most an image may unpack to (file content, all layers).
        image_pull_timeout_s: how long one image pull may take.
        index_pypi: the Python package index the ``pypi`` network preset allows and points pip
            at (a PEP 503 simple index URL; a name, not an IP literal: pin a mirror's address
            with ``egress_hosts``, and list a private one in ``egress_allow_cidrs``).
            ``CORRAL_INDEX_PYPI``.
        index_pypi_files: comma-separated URLs or hosts pip downloads files from besides the
            index's own host; unset: ``files.pythonhosted.org`` for the public index, nothing
            for any other (a mirror serves its files itself). ``CORRAL_INDEX_PYPI_FILES``.
        index_npm: the npm registry the ``npm`` preset allows and points npm at.
            ``CORRAL_INDEX_NPM``.
        index_debian: the Debian archive the ``debian`` preset allows and writes apt sources
            for. ``CORRAL_INDEX_DEBIAN``.
        index_debian_security: the security archive beside it; unset: the public one for the
            public archive, none for a mirror. ``CORRAL_INDEX_DEBIAN_SECURITY``.
        index_debian_suite: the release the apt sources name (``bookworm``).
            ``CORRAL_INDEX_DEBIAN_SUITE``.
        data_mounts: the host directories sandboxes may mount read-only, by name
            (``name=/abs/dir``, comma-separated, or a JSON object): the operator's list, so an
            API caller names a data mount and never a host path. ``CORRAL_DATA_MOUNTS``.
        volume_max_bytes: the largest volume one ``Volume.create`` may ask for.
            ``CORRAL_VOLUME_MAX_BYTES``.
        volumes_per_tenant: how many volumes one tenant may have. ``CORRAL_VOLUMES_PER_TENANT``.
        volume_bytes_per_tenant: the most all of one tenant's volumes may add up to (their
            sizes: what they may grow to on the host's disk). ``CORRAL_VOLUME_BYTES_PER_TENANT``.
        ports_url: the URL ``corral serve`` is reached at, for the URLs of exposed ports
            (``<url>/ports/<sandbox>/<port>/``); ``corral serve`` sets it from its listener
            unless given. ``CORRAL_PORTS_URL``.
        ports_domain: a wildcard DNS domain pointing at ``corral serve``, for host URLs of
            exposed ports (``<port>-<sandbox>.<domain>``, E2B's form); unset: path URLs only.
            ``CORRAL_PORTS_DOMAIN``.
    """

    model_config = SettingsConfigDict(env_prefix="CORRAL_", extra="ignore")

    home: Path = Field(default_factory=_default_home)
    uid_start: int = Field(default=1_900_000_000, ge=1000, le=_MAX_UID)
    uid_count: int = Field(default=65536, ge=1, le=1_000_000)
    backend: BackendName = "namespace"
    run_dir: Path = Path("/run/netns")
    audit: bool = True
    audit_output_bytes: int = Field(default=256 * 1024, ge=0, le=64 * 1024 * 1024)
    audit_aggregate_window_s: float = Field(default=30.0, ge=0.1, le=3600)
    audit_aggregate_burst: int = Field(default=5, ge=1, le=1000)
    audit_sandbox_max_bytes: int = Field(default=256 * 2**20, ge=0)
    audit_tenant_max_bytes: int = Field(default=4 * 2**30, ge=0)
    audit_retention_s: float = Field(default=30 * 24 * 3600.0, ge=0)
    audit_retention_max_bytes: int = Field(default=8 * 2**30, ge=0)
    egress_allow_cidrs: str = ""
    egress_hosts: dict[str, list[str]] = Field(default_factory=dict)
    egress_upstream_ca: Path | None = None
    url: str | None = None
    api_key: SecretStr | None = None
    ceiling_hosts: str | None = None
    ceiling_templates: str | None = None
    ceiling_isolation: str | None = None
    ceiling_resources: str | None = None
    ceiling_secrets: str | None = None
    ceiling_max_lifetime_s: int | None = Field(default=None, ge=1)
    server_host_names: str = ""
    server_allow_keyless: bool = False
    e2b_templates: str = ""
    microvm_allow_tcg: bool = False
    microvm_cache: Path = Path("/var/cache/corral/microvm")
    microvm_warm: bool = True
    namespace_resident: bool = True
    namespace_idle_s: float = Field(default=10.0, gt=0, le=3600)
    gvisor_resident: bool = True
    gvisor_idle_s: float = Field(default=10.0, gt=0, le=3600)
    gvisor_pin_cpus: bool = True
    registries: str = "docker.io,ghcr.io,quay.io"
    registries_require_digest: bool = False
    registry_auth_file: Path | None = None
    image_max_bytes: int = Field(default=16 * 2**30, ge=2**20)
    image_pull_timeout_s: float = Field(default=1800.0, gt=0)
    index_pypi: str = "https://pypi.org/simple"
    index_pypi_files: str | None = None
    index_npm: str = "https://registry.npmjs.org"
    index_debian: str = "http://deb.debian.org/debian"
    index_debian_security: str | None = None
    index_debian_suite: str = Field(default="bookworm", pattern=r"^[a-z][a-z0-9.-]{0,39}$")
    # NoDecode: the env value is ours to parse (name=path pairs, or JSON) in the validator.
    data_mounts: Annotated[dict[str, Path], NoDecode] = Field(default_factory=dict)
    volume_max_bytes: int = Field(default=64 * 2**30, ge=2**20)
    volumes_per_tenant: int = Field(default=32, ge=0, le=100_000)
    volume_bytes_per_tenant: int = Field(default=256 * 2**30, ge=0)
    ports_url: str | None = Field(default=None, pattern=r"^https?://[^/?#\s]+/?$")
    ports_domain: str | None = Field(
        default=None, pattern=r"^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$")

    @field_validator("data_mounts", mode="before")
    @classmethod
    def _parse_data_mounts(cls, value: object) -> object:
        if isinstance(value, str) and value.lstrip().startswith("{"):
            return json.loads(value)
        if isinstance(value, str):
            pairs = [item.strip() for item in value.split(",") if item.strip()]
            parsed: dict[str, str] = {}
            for pair in pairs:
                name, sep, path = pair.partition("=")
                if not sep:
                    raise ValueError(f"data mount {pair!r} is not name=/host/directory")
                parsed[name.strip()] = path.strip()
            return parsed
        return value

    @field_validator("data_mounts", mode="after")
    @classmethod
    def _check_data_mounts(cls, value: dict[str, Path]) -> dict[str, Path]:
        for name, path in value.items():
            if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,62}", name):
                raise ValueError(f"data mount name {name!r}: use 1-63 of a-z, 0-9, _ and -")
            if not path.is_absolute():
                raise ValueError(f"data mount {name!r}: {path} is not an absolute path")
        return value

    @model_validator(mode="after")
    def _absolute_home(self) -> Settings:
        self.home = self.home.expanduser().absolute()
        if self.uid_start + self.uid_count - 1 > _MAX_UID:
            raise ValueError(f"the sandbox uid range {self.uid_start}..."
                             f"{self.uid_start + self.uid_count - 1} goes past {_MAX_UID}; "
                             "lower CORRAL_UID_START or CORRAL_UID_COUNT")
        return self

    @property
    def instance(self) -> str:
        """A short tag naming this home in host-wide places (cgroups, netns names): unique per
        home on this host, even for one path in two mount namespaces (``_core.instance``)."""
        from ._core.instance import instance_tag

        return instance_tag(self.home)
