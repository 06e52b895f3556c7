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

    Each field's ``description`` is its documentation: ``scripts/reference`` turns them into
    ``docs/reference/settings.md``, where every field is listed with its variable.
    """

    model_config = SettingsConfigDict(env_prefix="CORRAL_", extra="ignore")

    home: Path = Field(
        default_factory=_default_home,
        description="The data directory: the SQLite stores, workspaces, layers, snapshots, "
                    "volumes, templates, audit trails and the egress CA. Back it up with the "
                    "service stopped.",
        examples=["/srv/corral"],
        json_schema_extra={"shown_default": "/var/lib/corral as root, "
                                            "~/.local/share/corral otherwise"})
    uid_start: int = Field(
        default=1_900_000_000, ge=1000, le=_MAX_UID,
        description="The first host uid handed to sandboxes (each sandbox runs as a uid of "
                    "its own from this range).",
        examples=[1_800_000_000])
    uid_count: int = Field(
        default=65536, ge=1, le=1_000_000,
        description="How many uids the range holds; also the most sandboxes at once. Two data "
                    "directories on one host need ranges that do not overlap.",
        examples=[10000])
    backend: BackendName = Field(
        default="namespace",
        description="The default isolation tier (`namespace`, `gvisor` or `microvm`); each "
                    "sandbox may choose its own.",
        examples=["gvisor"])
    run_dir: Path = Field(
        default=Path("/run/netns"),
        description="Where sandboxes' network namespaces are pinned (where `ip netns` sees "
                    "them).",
        examples=["/run/netns"])
    audit: bool = Field(
        default=True,
        description="Write the audit trail and metrics. Turn it off only to measure its cost.",
        examples=[False])
    audit_output_bytes: int = Field(
        default=256 * 1024, ge=0, le=64 * 1024 * 1024,
        description="Command output kept in the audit trail, per stream and command.",
        examples=[1048576])
    audit_aggregate_window_s: float = Field(
        default=30.0, ge=0.1, le=3600,
        description="The interval repeated events are aggregated over: per sandbox and "
                    "refusal rule (egress) or exposed port (anonymous connections), the first "
                    "`audit_aggregate_burst` of an interval are written in full, the rest "
                    "counted into one summary event when the interval ends (docs/audit.md).",
        examples=[60])
    audit_aggregate_burst: int = Field(
        default=5, ge=1, le=1000,
        description="How many repeated events per interval and key are written in full "
                    "before the rest are only counted.",
        examples=[20])
    audit_sandbox_max_bytes: int = Field(
        default=256 * 2**20, ge=0,
        description="The audit byte budget of one sandbox: at it the sandbox is paused with "
                    "the reason in its trail, and resuming it is refused while it is over (0: "
                    "no budget). A tenant's own (`corral tenants set "
                    "--audit-sandbox-max-bytes`) replaces it.",
        examples=[1073741824])
    audit_tenant_max_bytes: int = Field(
        default=4 * 2**30, ge=0,
        description="The audit byte budget of one tenant: what the trails of its live "
                    "sandboxes add up to; past it, each of its sandboxes that writes is paused "
                    "(0: no budget). `corral tenants set --audit-max-bytes` replaces it per "
                    "tenant.",
        examples=[17179869184])
    audit_retention_s: float = Field(
        default=30 * 24 * 3600.0, ge=0,
        description="Trails of destroyed sandboxes older than this (since their last write) "
                    "are removed by `corral audit prune` and the service's reaper (0: kept "
                    "whatever their age).",
        examples=[7776000])
    audit_retention_max_bytes: int = Field(
        default=8 * 2**30, ge=0,
        description="The most the trails of destroyed sandboxes may add up to; the oldest are "
                    "removed first beyond it (0: no bound).",
        examples=[34359738368])
    egress_allow_cidrs: str = Field(
        default="",
        description="Operator only: comma-separated CIDRs the egress gateway may connect to "
                    "although they are private, loopback or link-local (an internal package "
                    "mirror, for example). No sandbox's own policy can set it.",
        examples=["10.1.2.3/32,10.8.0.0/16"])
    egress_hosts: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Operator only: names pinned to addresses, consulted before the host's "
                    "resolver (a JSON object); the addresses are still vetted.",
        examples=['{"mirror.internal": ["10.1.2.3"]}'])
    egress_upstream_ca: Path | None = Field(
        default=None,
        description="A CA bundle (PEM) the egress gateway trusts, instead of the system's, "
                    "for the upstream TLS of the connections it intercepts (those to a host a "
                    "secret is bound to). Give a bundle that holds the public roots too if "
                    "secrets are bound to public hosts.",
        examples=["/etc/corral/upstream-ca.pem"])
    url: str | None = Field(
        default=None,
        description="A Corral service (`corral serve`) the SDK, CLI and MCP server use instead "
                    "of running sandboxes in this process.",
        examples=["http://127.0.0.1:8080"])
    api_key: SecretStr | None = Field(
        default=None,
        description="The API key for `url` (`corral keys create` prints one).",
        examples=["ck_..."])
    ceiling_hosts: str | None = Field(
        default=None,
        description="Operator ceiling, the server default for every caller without its own "
                    "(the keyless local tenant, the embedded SDK, the CLI, MCP): "
                    "comma-separated allow-rule patterns a sandbox's allowlist must fall "
                    "within. Unset: no bound; empty: no network at all. A tenant's own ceiling "
                    "(`corral tenants set --allow-host`) replaces it.",
        examples=["*.pypi.org,files.pythonhosted.org,api.example.com:8443"])
    ceiling_templates: str | None = Field(
        default=None,
        description="Operator ceiling: comma-separated templates a sandbox may use (unset: "
                    "any; empty: none).",
        examples=["base,python"])
    ceiling_isolation: str | None = Field(
        default=None,
        description="Operator ceiling: comma-separated isolation tiers a sandbox may use "
                    "(unset: any; empty: none).",
        examples=["gvisor,microvm"])
    ceiling_resources: str | None = Field(
        default=None,
        description="Operator ceiling: comma-separated resource tiers a sandbox may use "
                    "(unset: any; empty: none).",
        examples=["small"])
    ceiling_secrets: str | None = Field(
        default=None,
        description="Operator ceiling: comma-separated secret names a sandbox may be given "
                    "(unset: any; empty: none).",
        examples=["GITHUB_TOKEN"])
    ceiling_max_lifetime_s: int | None = Field(
        default=None, ge=1,
        description="Operator ceiling: the longest lifetime a sandbox may ask for, in seconds "
                    "(unset: the resource tier's maximum).",
        examples=[3600])
    ceiling_max_asleep_s: int | None = Field(
        default=None, ge=1,
        description="Operator ceiling: the longest a sandbox may stay asleep (paused or "
                    "hibernated), in seconds, before the reaper destroys it (unset: its "
                    "lifetime, or CORRAL_PAUSED_KEEP_S past its timeout, bound it alone).",
        examples=[604800])
    ceiling_max_hibernated: int | None = Field(
        default=None, ge=0,
        description="Operator ceiling: how many of a tenant's sandboxes may be hibernated at "
                    "once (unset: no bound; 0: none). A hibernate past it is refused; the "
                    "reaper's leaves the sandbox paused.",
        examples=[1000])
    server_host_names: str = Field(
        default="",
        description="Names `corral serve` answers to besides its listen address, "
                    "`localhost`, `127.0.0.1` and `[::1]` (comma-separated `host` or "
                    "`host:port`); other `Host` headers get 421, other browser origins 403.",
        examples=["corral.internal,corral.example.com"])
    server_allow_keyless: bool = Field(
        default=False,
        description="Serve keyless on loopback although API keys once existed (all are "
                    "revoked). Dangerous: any local process, and any web page that reaches "
                    "loopback, may then run code.",
        examples=[True])
    e2b_templates: str = Field(
        default="",
        description="E2B template names and the Corral templates they stand for, over the "
                    "defaults `base=base,code-interpreter-v1=code-interpreter` "
                    "(comma-separated `NAME=TEMPLATE`).",
        examples=["data-science=python,code-interpreter-v1=code-interpreter"])
    microvm_allow_tcg: bool = Field(
        default=False,
        description="Test only: let the microVM tier run guests under QEMU's TCG emulation on "
                    "a host without usable hardware KVM. TCG is no isolation boundary.",
        examples=[True])
    microvm_cache: Path = Field(
        default=Path("/var/cache/corral/microvm"),
        description="Where the microVM tier keeps what it derives from its inputs and can "
                    "share between data directories: guest kernels, root images, warm "
                    "snapshots, empty formatted disks (each keyed by a hash of what made it).",
        examples=["/srv/cache/corral-microvm"])
    paused_keep_s: float = Field(
        default=86400.0, gt=0, le=30 * 86400,
        description="How long a sandbox paused at its timeout (lifecycle on_timeout=pause) is "
                    "kept before it is destroyed; a resume before then starts its lifetime "
                    "again.",
        examples=[604800])
    hibernate_after_s: float = Field(
        default=900.0, ge=0, le=30 * 86400,
        description="How long a sandbox stays paused before it is hibernated (every kernel "
                    "piece of it released, its files and /tmp kept on disk) when its lifecycle "
                    "does not say (hibernate_after); 0: never. Only a sandbox with no process "
                    "running hibernates.",
        examples=[3600])
    microvm_cache_max_bytes: int = Field(
        default=10 * 2**30, ge=0,
        description="The most the microVM cache's root images and warm snapshots may add up "
                    "to; beyond it, those least recently used (and not in the last 10 minutes) "
                    "are removed after a root image build, and made again when next needed "
                    "(0: no bound). Images of removed templates go whatever the bound.",
        examples=[34359738368])
    microvm_warm: bool = Field(
        default=True,
        description="Restore new microVMs from the template's warm snapshot; off, every VM "
                    "boots cold.",
        examples=[False])
    namespace_resident: bool = Field(
        default=True,
        description="Run a namespace sandbox's commands from a resident helper kept while it "
                    "is in use (a command then costs a fork and an exec in namespaces made "
                    "ahead, not a bwrap); off, every command starts a bwrap of its own. Either "
                    "way each command gets its own PID, mount, IPC, UTS and cgroup namespace, "
                    "cgroup and seccomp filter.",
        examples=[False])
    namespace_idle_s: float = Field(
        default=10.0, gt=0, le=3600,
        description="How long a namespace sandbox's resident helper with nothing running is "
                    "kept before it is stopped, in seconds.",
        examples=[30])
    gvisor_resident: bool = Field(
        default=True,
        description="Run a gVisor sandbox's commands in one gVisor sandbox kept while it is in "
                    "use (about 7x faster per command); off, every command starts a gVisor "
                    "sandbox of its own (a memory bomb then ends only its own command).",
        examples=[False])
    gvisor_idle_s: float = Field(
        default=10.0, gt=0, le=3600,
        description="How long a resident gVisor sandbox with nothing running is kept before "
                    "it is stopped, in seconds.",
        examples=[30])
    gvisor_pin_cpus: bool = Field(
        default=True,
        description="Pin a resident gVisor sandbox, once started, to as many host CPUs as its "
                    "tier has (the least used first; never when that is all of them). A "
                    "placement hint, not a limit: gVisor's thread hand-offs are about 2x "
                    "cheaper per command on one CPU.",
        examples=[False])
    registries: str = Field(
        default="docker.io,ghcr.io,quay.io",
        description="The registries images may be pulled from (comma-separated hosts, with "
                    "`:port` if not the default; `docker.io` covers Docker Hub's names; `*` "
                    "any). A registry on loopback is spoken to over plain HTTP, every other "
                    "one over verified TLS.",
        examples=["registry.internal:5000,ghcr.io"])
    registries_require_digest: bool = Field(
        default=False,
        description="Accept only digest-pinned image references (`name@sha256:...`).",
        examples=[True])
    registry_auth_file: Path | None = Field(
        default=None,
        description="Registry credentials (a `containers-auth.json`, as `skopeo login` writes "
                    "it); read on the host by the pull, never given to a sandbox.",
        examples=["/etc/corral/registry-auth.json"])
    image_max_bytes: int = Field(
        default=16 * 2**30, ge=2**20,
        description="The most an image may unpack to (file content, all layers).",
        examples=[8589934592])
    image_pull_timeout_s: float = Field(
        default=1800.0, gt=0,
        description="How long one image pull may take, in seconds.",
        examples=[600])
    index_pypi: str = Field(
        default="https://pypi.org/simple",
        description="The Python package index the `pypi` network preset allows and points pip "
                    "at (a PEP 503 simple index URL; a name, not an IP literal: pin a mirror's "
                    "address with `egress_hosts` and list a private one in "
                    "`egress_allow_cidrs`).",
        examples=["https://mirror.internal/pypi/simple"])
    index_pypi_files: str | None = Field(
        default=None,
        description="Comma-separated URLs or hosts pip downloads files from besides the "
                    "index's own host. Unset: `files.pythonhosted.org` for the public index, "
                    "nothing for any other (a mirror serves its files itself).",
        examples=["https://files.mirror.internal"])
    index_npm: str = Field(
        default="https://registry.npmjs.org",
        description="The npm registry the `npm` preset allows and points npm at.",
        examples=["https://mirror.internal/npm"])
    index_debian: str = Field(
        default="http://deb.debian.org/debian",
        description="The Debian archive the `debian` preset allows and writes apt sources "
                    "for.",
        examples=["http://mirror.internal/debian"])
    index_debian_security: str | None = Field(
        default=None,
        description="The security archive beside it. Unset: the public one for the public "
                    "archive, none for a mirror.",
        examples=["http://mirror.internal/debian-security"])
    index_debian_suite: str = Field(
        default="bookworm", pattern=r"^[a-z][a-z0-9.-]{0,39}$",
        description="The release the apt sources name.",
        examples=["bookworm"])
    # NoDecode: the env value is ours to parse (name=path pairs, or JSON) in the validator.
    data_mounts: Annotated[dict[str, Path], NoDecode] = Field(
        default_factory=dict,
        description="The host directories sandboxes may mount read-only, by name "
                    "(`name=/abs/dir`, comma-separated, or a JSON object): the operator's "
                    "list, so an API caller names a data mount, never a host path.",
        examples=["refs=/srv/refs,models=/srv/models"])
    volume_max_bytes: int = Field(
        default=64 * 2**30, ge=2**20,
        description="The largest volume one `Volume.create` may ask for.",
        examples=[10737418240])
    volumes_per_tenant: int = Field(
        default=32, ge=0, le=100_000,
        description="How many volumes one tenant may have.",
        examples=[8])
    volume_bytes_per_tenant: int = Field(
        default=256 * 2**30, ge=0,
        description="The most all of one tenant's volumes may add up to (their sizes: what "
                    "they may grow to on the host's disk).",
        examples=[107374182400])
    ports_url: str | None = Field(
        default=None, pattern=r"^https?://[^/?#\s]+/?$",
        description="The URL `corral serve` is reached at, for the path URLs of exposed ports "
                    "(`<url>/ports/<sandbox>/<port>/`); `corral serve` sets it from its "
                    "listener unless given (`--ports-url`).",
        examples=["https://corral.example.com"])
    ports_domain: str | None = Field(
        default=None, pattern=r"^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$",
        description="A wildcard DNS domain pointing at `corral serve`, for the host URLs of "
                    "exposed ports (`<port>-<sandbox>.<domain>`, E2B's form); unset: path URLs "
                    "only, except on a loopback service (`localhost`).",
        examples=["preview.example.com"])

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
