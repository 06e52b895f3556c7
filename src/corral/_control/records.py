"""What the control plane keeps about a sandbox: the public ``SandboxInfo`` plus what is the
operator's business only (its host uid, the placeholders standing in for its secrets, when it
was last active). Converted to the public form once, at the Manager's edge."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from ..models import Lifecycle, SandboxInfo, SandboxState

__all__ = ["ASLEEP", "LIVE", "SandboxRecord", "new_id"]

#: The states of a sandbox asleep: frozen in place, or hibernated (nothing left in the kernel).
ASLEEP: tuple[SandboxState, ...] = ("paused", "hibernated")
#: The states of a sandbox that exists for its callers (listed, reachable, expiring).
LIVE: tuple[SandboxState, ...] = ("running", *ASLEEP)


def new_id(prefix: str = "sbx") -> str:
    """A fresh id for a record of kind ``prefix`` (``sbx``, ``lyr``, ``int``, ...)."""
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyz"
    return f"{prefix}_" + "".join(secrets.choice(alphabet) for _ in range(12))


@dataclass(frozen=True, slots=True)
class SandboxRecord:
    """A sandbox as the store holds it."""

    id: str
    template: str
    resources: str
    state: SandboxState
    created_at: float
    expires_at: float
    uid: int
    labels: dict[str, str] = field(default_factory=dict)
    network: dict[str, Any] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)  # name -> placeholder
    tenant: str = "local"
    idle_timeout: float | None = None  # destroyed after this long without commands or file use
    last_active: float = 0.0
    isolation: str = "namespace"  # the isolation tier: "namespace" or "gvisor"
    layer: str | None = None  # top read-only workspace layer (from a snapshot or fork), if any
    # The memory image it resumed from (a memory snapshot or fork) while its workspace is
    # still that image's; cleared when the workspace is sealed or restored to a disk snapshot.
    memory_image: str | None = None
    # The exact build it runs on: a Debian build's spec hash, or an image's manifest digest.
    template_version: str | None = None
    # Volumes and data mounts: ``backends.Mount`` fields, as JSON objects.
    mounts: list[dict[str, Any]] = field(default_factory=list)
    # ``PID.START`` of the process that created it: while it is ``creating``, recovery
    # cleans it up at once if that process is gone (a crash cut the create short).
    creator: str | None = None
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    # The lifetime asked at create (or set since): what a resume of a sandbox paused at its
    # timeout starts again.
    timeout_s: float = 0.0
    # When it went to sleep (paused or hibernated; a deeper sleep keeps the time); None awake.
    slept_at: float | None = None

    def public(self) -> SandboxInfo:
        return SandboxInfo(
            id=self.id, template=self.template, resources=self.resources, state=self.state,
            created_at=self.created_at, expires_at=self.expires_at, labels=self.labels,
            network=self.network, secrets=sorted(self.secrets),
            idle_timeout=self.idle_timeout, isolation=self.isolation, layer=self.layer,
            memory_image=self.memory_image, template_version=self.template_version,
            mounts=self.mounts, lifecycle=self.lifecycle,
            sleeping_since=self.slept_at)
