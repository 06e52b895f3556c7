"""Admission: whether a caller may have what it asks for, the same for every surface.

Every rule that refuses a caller for *who it is* rather than for a malformed request lives
here, each one function the services call before they act (nothing is pulled, built or
written for a caller that is refused):

- its **ceiling** (what policy it may give a sandbox: ``tenants.check``, applied by
  ``check_create``, ``check_image``, ``check_lifetime``, ``check_network`` and
  ``check_policy``);
- its **tiers** (``check_tier``: the resource tiers its quota lets it use);
- its **sandboxes** (``sandbox_limit``, ``check_sandbox_count``): the count is read once
  before a create acts, and decided for good inside the store's insert transaction (the
  store counts, ``sandbox_slot`` judges), so two creates racing for the last slot, in this
  process or another, cannot both pass it;
- its **commands per minute** (``admit``: commands, background processes and terminals).

The local tenant (the operator on this host) has no quotas; its ceiling is the server's
default (``CORRAL_CEILING_*``) unless it was given one (``corral mcp``'s, ``mcp_ceiling``: the
MCP server's caller is the local tenant with that ceiling, so the control plane applies it like
any tenant's; against a remote service, which cannot know it, the MCP server applies it with
``Admission.check_create`` before asking).

- its **volumes** (``volume_slot``): how many and how many bytes in all, judged inside the
  store's transaction that records a new one, as sandboxes are.

Elsewhere, and why: a cluster gateway's limits are its placement's (``_cluster``), and each
node's control plane applies these rules again.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from .._egress.policy import NetworkPolicy
from ..errors import CeilingExceeded, QuotaExceeded
from .tenants import LOCAL_TENANT, Ceiling, Tenant, check

__all__ = ["Admission", "CommandWindows", "check_sandbox_count", "volume_slot"]

# An image's template is named after its digest (``corral._images.pull``).
_IMAGE_TEMPLATE_PREFIX = "img-"


def _who(caller: Tenant | None, tenant: str) -> str:
    return caller.name if caller is not None else tenant


def volume_slot(tenant: str, size_bytes: int, *, max_count: int | None,
                max_bytes: int | None) -> Callable[[int, int], None] | None:
    """The judge of ``tenant``'s volumes (their count and bytes in all, before the new one of
    ``size_bytes``) for the store's transaction; None for the operator (no quotas)."""
    if tenant == LOCAL_TENANT:
        return None

    def judge(count: int, total: int) -> None:
        if max_count is not None and count >= max_count:
            raise QuotaExceeded(
                f"tenant {tenant!r} already has {count} volumes, its limit "
                "(CORRAL_VOLUMES_PER_TENANT); delete one first")
        if max_bytes is not None and total + size_bytes > max_bytes:
            raise QuotaExceeded(
                f"tenant {tenant!r}'s volumes would add up to {total + size_bytes} "
                f"bytes, over its {max_bytes} (CORRAL_VOLUME_BYTES_PER_TENANT); "
                "delete or shrink one first")

    return judge


def check_sandbox_count(tenant: str, count: int, limit: int, *, adding: int = 1) -> None:
    """Refuse ``adding`` more sandboxes to ``tenant``, which has ``count`` of its ``limit``."""
    if count + adding <= limit:
        return
    if adding == 1:
        raise QuotaExceeded(
            f"tenant {tenant!r} already has {count} sandboxes, its limit; destroy "
            "one or ask the operator for a higher limit")
    raise QuotaExceeded(
        f"tenant {tenant!r} has {count} sandboxes and may have {limit}; {adding} more would "
        "pass it: destroy some, ask for fewer or ask the operator for a higher limit")


class CommandWindows:
    """Sliding one-minute windows of code starts per tenant (commands, processes, terminals)."""

    def __init__(self) -> None:
        self._windows: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def count(self, tenant: Tenant) -> None:
        """Count one start; refuse it past the tenant's rate. The local tenant is not counted."""
        if tenant.is_local:
            return
        now = time.monotonic()
        with self._lock:
            window = self._windows.setdefault(tenant.name, deque())
            while window and window[0] < now - 60:
                window.popleft()
            if len(window) >= tenant.commands_per_minute:
                wait = 60 - (now - window[0])
                raise QuotaExceeded(
                    f"tenant {tenant.name!r} reached {tenant.commands_per_minute} commands per "
                    f"minute (commands, background processes and terminals count alike); "
                    f"retry in {wait:.0f} s")
            window.append(now)


class Admission:
    """The tenancy rules the control plane applies to every call (see the module)."""

    def __init__(self, default: Ceiling) -> None:
        self.ceiling = default  # the operator's (CORRAL_CEILING_*), for callers without one
        self.starts = CommandWindows()

    # -- ceilings ---------------------------------------------------------------------------

    def ceiling_for(self, caller: Tenant | None) -> Ceiling:
        """The caller's ceiling, the server default filling the fields it leaves open."""
        return self.ceiling if caller is None else caller.ceiling.over(self.ceiling)

    def check_create(self, *, caller: Tenant | None, tenant: str, template: str | None,
                     isolation: str | None, resources: str | None,
                     network: NetworkPolicy | None, secrets: Iterable[str] = (),
                     lifetime_s: float | None) -> None:
        """A new sandbox's policy, within the caller's ceiling (``template`` None: an
        image's, judged by ``check_image`` first and by name once it is known; any None:
        the service's default, judged where it is chosen)."""
        check(self.ceiling_for(caller), tenant=_who(caller, tenant), template=template,
              isolation=isolation, resources=resources, network=network,
              secrets=secrets, lifetime_s=lifetime_s)

    def check_image(self, *, caller: Tenant | None, tenant: str, image: str) -> None:
        """Refuse an image before it is pulled when the caller's templates ceiling allows
        no image's template at all (one named ``img-<digest>`` is judged after the pull,
        its name being the digest the pull resolves)."""
        allowed = self.ceiling_for(caller).templates
        if allowed is not None and not any(t.startswith(_IMAGE_TEMPLATE_PREFIX)
                                           for t in allowed):
            shown = ", ".join(allowed) if allowed else "none"
            raise CeilingExceeded(
                f"the template ceiling of tenant {_who(caller, tenant)!r} does not allow "
                f"image {image!r} (allowed: {shown}); the operator can raise it with "
                "`corral tenants set` or CORRAL_CEILING_*")

    def check_lifetime(self, *, caller: Tenant | None, tenant: str,
                       lifetime_s: float) -> None:
        """A sandbox's whole life (extending again and again cannot pass the ceiling)."""
        check(self.ceiling_for(caller), tenant=_who(caller, tenant), lifetime_s=lifetime_s)

    def check_network(self, *, caller: Tenant | None, tenant: str,
                      network: NetworkPolicy) -> None:
        check(self.ceiling_for(caller), tenant=_who(caller, tenant), network=network)

    def check_policy(self, *, caller: Tenant | None, tenant: str, template: str,
                     isolation: str, resources: str, network: NetworkPolicy,
                     secrets: Sequence[str]) -> None:
        """Refuse to carry an existing sandbox's policy on (fork, restore) beyond the ceiling
        the caller has now: it may have been created under a wider one."""
        check(self.ceiling_for(caller), tenant=_who(caller, tenant),
              template=template, isolation=isolation, resources=resources,
              network=network, secrets=sorted(secrets))

    # -- quotas -----------------------------------------------------------------------------

    @staticmethod
    def check_tier(caller: Tenant | None, resources: str) -> None:
        """The resource tiers the caller's quota lets it use."""
        if caller is not None and not caller.is_local and resources not in caller.tiers:
            raise QuotaExceeded(f"tenant {caller.name!r} may not use the {resources!r} tier "
                                f"(allowed: {', '.join(caller.tiers)})")

    @staticmethod
    def sandbox_limit(caller: Tenant | None, asked: int | None) -> int | None:
        """How many sandboxes the owner may have: ``asked`` (a gateway's or a test's), else
        the caller's quota; None (no limit) for the operator."""
        if asked is None and caller is not None and not caller.is_local:
            return caller.max_sandboxes
        return asked

    @staticmethod
    def sandbox_slot(tenant: str, limit: int | None) -> Callable[[int], None] | None:
        """The judge of ``tenant``'s sandbox count for the store's insert transaction (it
        calls it with the count there); None when there is no limit."""
        if limit is None:
            return None
        return lambda count: check_sandbox_count(tenant, count, limit)

    def admit(self, caller: Tenant | None) -> None:
        """Count one start of code (command, background process, terminal) against the
        caller's commands-per-minute; the one quota path every surface goes through."""
        if caller is not None:
            self.starts.count(caller)
