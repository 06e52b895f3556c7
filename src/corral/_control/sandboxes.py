"""Sandbox lifecycle: create, look up (expiring what is past its lifetime), list, change
lifetime and network policy, pause, resume and destroy.

An expired sandbox is destroyed the next time anything looks at it (and by the reaper), so a
sandbox never outlives its TTL as something usable. Destroys run on threads of their own
(``destroyer``): a caller waits for one at most ``DESTROY_WAIT_S`` and a stuck one never holds
up anything but its own sandbox.

A destroy is one sequence whichever path asks for it (a request on any surface, expiry seen on
a look-up, the reaper at a lifetime's or an idle timeout's end, an audit budget, one finished
after a crash): mark it ``destroying`` (hidden at once, finished by the next start if this one
dies), the tier's destroy, the trail's last commands settled, the row and lock gone, layers
collected, ``sandbox.destroyed``; then the ``on_destroyed`` listeners, which drop what else
holds something per sandbox (the interpreter's contexts, the process table, the E2B surface's
state, MCP's sessions). Create is planned first (``plan_create``: everything that can refuse
the caller), then carried out (pull, insert, the tier's create).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .._audit.auditor import Auditor
from .._audit.budget import Overrun
from .._core.owner import owner_alive, this_owner
from .._core.resources import get_tier
from .._egress.policy import NetworkPolicy
from .._settings import Settings
from .._templates.roots import template_version
from ..backends import Hibernated, Hibernation, IsolationBackend, Mount, SandboxSpec
from ..errors import (
    BackendUnavailable,
    CorralError,
    QuotaExceeded,
    SandboxBusy,
    SandboxExpired,
    SandboxNotFound,
    SnapshotNotFound,
    UsageError,
)
from ..models import Lifecycle, SnapshotInfo
from . import validate
from .admission import Admission, check_sandbox_count
from .auditbudget import AuditBudgets
from .destroyer import Destroyer, DestroyJob
from .egress import EgressBroker, NetworkSpec
from .layers import Layers
from .locks import WorkspaceLocks
from .memimages import capable, check_resumable
from .records import ASLEEP, LIVE, SandboxRecord, new_id
from .registry import BackendRegistry
from .store import Store
from .tenants import LOCAL_TENANT, Ceiling, Tenant, TenantDirectory

__all__ = ["DESTROY_WAIT_S", "CreatePlan", "Sandboxes", "find_snapshot"]

logger = logging.getLogger(__name__)


#: How long a caller waits for a sandbox's destroy (a destroy kills, unmounts and syncs the
#: trail: well under a second, seconds on a loaded host); past it, the destroy goes on in the
#: background and the caller is told it is under way.
DESTROY_WAIT_S = 10.0
# The most a destroy waits for the commands it killed to record their ends.
_SETTLE_S = 5.0


def find_snapshot(store: Store, ref: str, *, tenant: str | None) -> SnapshotInfo:
    """The snapshot ``ref`` (id or name) among ``tenant``'s (everyone's with None)."""
    validate.snapshot_ref(ref)
    snap = store.snapshot(ref, tenant=tenant)
    if snap is None:
        raise SnapshotNotFound(f"snapshot {ref!r} does not exist; `corral snapshots ls` "
                               "lists them")
    return snap


@dataclasses.dataclass(frozen=True, slots=True)
class CreatePlan:
    """A create the caller is allowed (``Sandboxes.plan_create``): what remains is to do it.
    ``template`` is None for an image's, named once it is pulled."""

    caller: Tenant | None
    tenant: str
    template: str | None
    image: str | None
    resources: str
    ttl_s: float
    labels: dict[str, str]
    policy: NetworkPolicy
    secrets: tuple[str, ...]
    placeholders: dict[str, str]
    idle_timeout: float | None
    isolation: str
    backend: IsolationBackend
    layer: str | None
    memory_image: str | None
    limit: int | None
    mounts: tuple[Mapping[str, Any], ...]
    origin: dict[str, Any]
    lifecycle: Lifecycle


class Sandboxes:
    """The lifecycle service; everything else reaches a sandbox through ``get``."""

    def __init__(self, *, settings: Settings, store: Store, backends: BackendRegistry,
                 auditor: Auditor, egress: EgressBroker, admission: Admission, layers: Layers,
                 locks: WorkspaceLocks, ready: Callable[[], None],
                 budgets: AuditBudgets | None = None) -> None:
        self._settings = settings
        self._budgets = budgets
        self.templates_dir = settings.home / "templates"
        self._store = store
        self._backends = backends
        self._auditor = auditor
        self._egress = egress
        self._admission = admission
        self._layers = layers
        self._locks = locks
        self._sleep_locks = [threading.RLock() for _ in range(64)]
        # Recovery, before the first create or list: injected, because recovery is built on
        # this service (the call goes up; the dependency does not).
        self._ready = ready
        self._destroyer = Destroyer(self._destroy_now)
        # What else holds something per sandbox (kernels, background processes, a surface's
        # own state): told at the end of every destroy, whichever path asked for it.
        self._on_destroyed: builtins.list[Callable[[str], None]] = []
        self._listeners_lock = threading.Lock()
        # Recorded with each row it creates: a create cut short by this process's death is
        # then told from one under way (``Recovery``).
        self._owner = this_owner()

    # -- what the other services share ---------------------------------------------------------

    def backend(self, info: SandboxRecord) -> IsolationBackend:
        return self._backends.get(info.isolation)

    def spec(self, info: SandboxRecord) -> SandboxSpec:
        return SandboxSpec(id=info.id, uid=info.uid, template=info.template,
                           tier=get_tier(info.resources),
                           layers=self._store.layer_chain(info.layer),
                           memory_image=info.memory_image,
                           mounts=tuple(Mount(**mount) for mount in info.mounts))

    def busy(self, info: SandboxRecord) -> bool:
        """True while any command runs in it (from any process); background processes are
        the process table's to report."""
        return self.backend(info).busy(self.spec(info))

    # -- lifecycle -------------------------------------------------------------------------------

    def create(
        self, *, template: str | None, resources: str, timeout: float | None,
        labels: Mapping[str, str] | None, network: NetworkSpec,
        secrets: Sequence[str] | None, tenant: str | None, max_for_tenant: int | None,
        idle_timeout: float | None, isolation: str | None, snapshot: str | None,
        caller: Tenant | None, parent_layer: str | None = None,
        origin: Mapping[str, Any] | None = None, memory_image: str | None = None,
        image: str | None = None,
        on_progress: Callable[[str], None] | None = None,
        mounts: Sequence[Mapping[str, Any]] = (), lifecycle: Lifecycle | None = None,
    ) -> SandboxRecord:
        """A running sandbox (see ``Manager.create``). A fork passes ``parent_layer``, the
        sealed workspace it starts from (and ``memory_image``, the memory it resumes, for a
        memory fork), and ``origin``, added to its ``sandbox.created`` event. ``image``: an
        image reference, pulled first unless already (``corral._images``). ``mounts``: the
        volumes and data mounts, as ``Volumes.mounts`` checked them.

        Planned, then carried out: everything that can refuse the caller (validation, its
        tiers, ceiling and sandbox count) is decided before anything is pulled or written."""
        plan = self.plan_create(
            template=template, resources=resources, timeout=timeout, labels=labels,
            network=network, secrets=secrets, tenant=tenant, max_for_tenant=max_for_tenant,
            idle_timeout=idle_timeout, isolation=isolation, snapshot=snapshot, caller=caller,
            parent_layer=parent_layer, origin=origin, memory_image=memory_image, image=image,
            mounts=mounts, lifecycle=lifecycle)
        return self._carry_out(plan, on_progress=on_progress)

    def plan_create(
        self, *, template: str | None, resources: str, timeout: float | None,
        labels: Mapping[str, str] | None, network: NetworkSpec,
        secrets: Sequence[str] | None, tenant: str | None, max_for_tenant: int | None,
        idle_timeout: float | None, isolation: str | None, snapshot: str | None,
        caller: Tenant | None, parent_layer: str | None = None,
        origin: Mapping[str, Any] | None = None, memory_image: str | None = None,
        image: str | None = None, mounts: Sequence[Mapping[str, Any]] = (),
        lifecycle: Lifecycle | None = None,
    ) -> CreatePlan:
        """What ``create`` will do, or what refuses it: reads the store and the tier's
        registry, writes nothing and pulls nothing."""
        tier = get_tier(resources)
        if image is not None and (template is not None or snapshot is not None):
            raise UsageError("give an image, a template or a snapshot to start from, not "
                             "two of them")
        if tenant is None:
            tenant = caller.name if caller is not None else "local"
        self._admission.check_tier(caller, resources)
        limit = self._admission.sandbox_limit(caller, max_for_tenant)
        asked_isolation = isolation
        isolation = validate.isolation(self._settings.backend if isolation is None
                                       else isolation)
        layer = parent_layer
        if snapshot is not None:
            snap = find_snapshot(self._store, snapshot, tenant=tenant)
            layer = self._store.snapshot_layer(snap.id)
            memory_image = self._store.snapshot_memory_image(snap.id)
            template = snap.template if template is None else template
            origin = {"snapshot": snapshot, "layer": layer, **(origin or {})}
        memory = None if memory_image is None else self._store.memory_image(memory_image)
        if memory_image is not None:
            if memory is None:
                raise SnapshotNotFound(f"memory image {memory_image} is gone; take the "
                                       "snapshot again")
            # A memory image is a running machine: it resumes only on the tier that made it.
            isolation = memory["isolation"] if asked_isolation is None else isolation
            origin = {**(origin or {}), "memory_image": memory_image}
        if image is None:
            template = validate.template("base" if template is None else template)
        policy = self._egress.policy(network)
        names = validate.secret_names(secrets)
        placeholders = self._egress.placeholders_for(names)
        if idle_timeout is not None:
            idle_timeout = validate.ttl(idle_timeout, tier.max_ttl_s)
        ceiling = self._admission.ceiling_for(caller)
        ttl = tier.ttl_s if timeout is None else validate.ttl(timeout, tier.max_ttl_s)
        if timeout is None and ceiling.max_lifetime_s is not None:
            ttl = min(ttl, float(ceiling.max_lifetime_s))  # the default fits the ceiling
        if image is not None:
            self._admission.check_image(caller=caller, tenant=tenant, image=image)
        self._admission.check_create(caller=caller, tenant=tenant, template=template,
                                     isolation=isolation, resources=resources, network=policy,
                                     secrets=names, lifetime_s=ttl)
        if memory is not None:  # before loading a tier it could never resume on
            check_resumable(memory, snapshot=snapshot or str(memory_image),
                            template=template or "", resources=resources, isolation=isolation)
        backend = self._backends.get(isolation)
        if memory is not None:
            capable(backend, "starting from a memory snapshot")
        clean_labels = validate.labels(labels)
        self._ready()  # recovery first: what expired meanwhile no longer counts
        if limit is not None:  # told now, before a pull; decided again in the insert
            check_sandbox_count(tenant, self._store.count_sandboxes(tenant), limit)
        return CreatePlan(
            caller=caller, tenant=tenant, template=template, image=image,
            resources=resources, ttl_s=ttl, labels=clean_labels, policy=policy,
            secrets=tuple(names), placeholders=placeholders, idle_timeout=idle_timeout,
            isolation=isolation, backend=backend, layer=layer, memory_image=memory_image,
            limit=limit, mounts=tuple(mounts), origin=dict(origin or {}),
            lifecycle=lifecycle or Lifecycle())

    def _carry_out(self, plan: CreatePlan, *,
                   on_progress: Callable[[str], None] | None) -> SandboxRecord:
        """``plan`` done: the image pulled (unless already), the row inserted (the sandbox
        count decided for good in its transaction), the tier's sandbox made."""
        template, pulled = plan.template, None
        if plan.image is not None:
            # Only the host's operator (in-process, no caller) may name images on the host.
            from .._images.pull import pull_image  # an image's create only

            pulled = pull_image(plan.image, self._settings, allow_local=plan.caller is None,
                                on_progress=on_progress)
            template = pulled.template.name
            # Its name is its digest, known now: the one part of the ceiling judged this late.
            self._admission.check_create(
                caller=plan.caller, tenant=plan.tenant, template=template,
                isolation=plan.isolation, resources=plan.resources, network=plan.policy,
                secrets=plan.secrets, lifetime_s=plan.ttl_s)
        assert template is not None
        backend = plan.backend
        version = template_version(template, self.templates_dir)
        info = self._store.insert(
            sandbox_id=new_id(), template=template, resources=plan.resources,
            ttl_s=plan.ttl_s, labels=plan.labels, allocate_uid=backend.allocate_uid,
            network=plan.policy.to_json(), secrets=plan.placeholders,
            tenant=plan.tenant, admit=self._admission.sandbox_slot(plan.tenant, plan.limit),
            idle_timeout=plan.idle_timeout, isolation=plan.isolation, layer=plan.layer,
            memory_image=plan.memory_image, template_version=version, mounts=plan.mounts,
            creator=self._owner, lifecycle=plan.lifecycle,
        )
        try:
            backend.create(self.spec(info))
        except BaseException:
            self._store.delete(info.id)
            raise
        self._store.set_state(info.id, "running")
        info = dataclasses.replace(info, state="running")
        tier = get_tier(plan.resources)
        self._auditor.event(info.id, "sandbox.created", {
            "template": template, "template_version": version,
            **({"image": pulled.reference} if pulled is not None else {}),
            "resources": plan.resources, "uid": info.uid,
            "expires_at": info.expires_at, "labels": plan.labels, "limits": tier.to_dict(),
            "backend": backend.name, "isolation": plan.isolation,
            "network": plan.policy.to_json(), "secrets": sorted(plan.placeholders),
            "tenant": plan.tenant,
            **({"mounts": [dict(m) for m in plan.mounts]} if plan.mounts else {}),
            **plan.origin,
        })
        self._auditor.count("corral_sandboxes_created")
        logger.info("created sandbox %s (uid %d, %s)", info.id, info.uid, plan.resources)
        return info

    def get(self, sandbox_id: str, *, tenant: str | None = None) -> SandboxRecord:
        """The sandbox; with ``tenant``, only if it belongs to that tenant (else not found)."""
        validate.sandbox_id(sandbox_id)
        info = self._store.get(sandbox_id)
        if info is None or (tenant is not None and info.tenant != tenant):
            raise SandboxNotFound(f"sandbox {sandbox_id} does not exist; `corral ls` lists them")
        if info.state == "destroying":
            raise SandboxNotFound(f"sandbox {sandbox_id} is being destroyed")
        if info.state == "creating":
            raise SandboxBusy(f"sandbox {sandbox_id} is still being created; try again shortly")
        if info.expires_at <= time.time():
            if self.sleeps_at_timeout(info):
                return self.sleep(info)
            self.expire(info)
            raise SandboxExpired(
                f"sandbox {sandbox_id} reached the end of its lifetime and was destroyed; pass a "
                "longer timeout= when creating it, or extend it with set_timeout()"
            )
        return info

    def list(self, *, tenant: str | None = None) -> builtins.list[SandboxRecord]:
        self._ready()
        now = time.time()
        live, expired = [], []
        for info in self._store.list():
            if info.expires_at <= now and self.sleeps_at_timeout(info):
                with contextlib.suppress(SandboxExpired):  # a tier that could not pause it
                    info = self.sleep(info)
            if info.expires_at <= now and info.state in LIVE:
                expired.append(self.begin_expire(info))
            elif info.state in LIVE and (tenant is None or info.tenant == tenant):
                live.append(info)
        wait_all(expired, DESTROY_WAIT_S)  # together: one wait however many expired
        return live

    def set_timeout(self, sandbox_id: str, timeout: float, *,
                    caller: Tenant | None) -> SandboxRecord:
        info = self.get(sandbox_id)
        ttl = validate.ttl(timeout, get_tier(info.resources).max_ttl_s)
        # The ceiling bounds the whole life, so extending again and again cannot pass it.
        self._admission.check_lifetime(caller=caller, tenant=info.tenant,
                                       lifetime_s=time.time() + ttl - info.created_at)
        self._store.set_expiry(sandbox_id, time.time() + ttl, timeout_s=ttl)
        info = self.get(sandbox_id)
        self._auditor.event(sandbox_id, "sandbox.timeout_changed",
                            {"expires_at": info.expires_at})
        return info

    def set_network(self, sandbox_id: str, network: NetworkSpec, *,
                    caller: Tenant | None) -> SandboxRecord:
        policy = self._egress.policy(network)
        info = self.get(sandbox_id)
        self._admission.check_network(caller=caller, tenant=info.tenant, network=policy)
        self._store.set_network(sandbox_id, policy.to_json())
        self._auditor.event(sandbox_id, "sandbox.policy_changed", {"network": policy.to_json()})
        return self.get(sandbox_id)

    def pause(self, sandbox_id: str, *, reason: str | None = None) -> SandboxRecord:
        """Freeze the sandbox's processes; ``reason`` (the control plane's own pauses) is
        recorded in its ``sandbox.paused`` event."""
        info = self.get(sandbox_id)
        if info.state in ASLEEP:
            return info
        started = time.monotonic()
        self.backend(info).pause(self.spec(info), True)
        self._store.set_state(sandbox_id, "paused")
        self._auditor.event(sandbox_id, "sandbox.paused", {
            **({"reason": reason} if reason is not None else {}),
            "duration_ms": _ms_since(started)})
        self._auditor.count("corral_sandbox_sleeps", state="paused")
        return self.get(sandbox_id)

    def hibernate(self, sandbox_id: str, *, reason: str | None = None) -> SandboxRecord:
        """Release every piece of the sandbox the kernel holds (processes, mounts, loop
        devices, cgroup, network namespace), its files and ``/tmp`` kept on disk; woken like
        a paused sandbox (``resume``, or the next call with ``auto_resume``). A tier that
        ``keeps_processes`` (the microVM's) saves their memory too, and they go on after the
        wake; on the others it is refused (``SandboxBusy``) while a process of it runs;
        refused (``QuotaExceeded``) when its tenant keeps its ceiling's
        ``max_hibernated`` already. A running sandbox is paused first, so nothing new starts
        in it meanwhile; a refusal leaves it as it was."""
        info = self.get(sandbox_id)
        if info.state == "hibernated":
            return info
        backend = self.backend(info)
        if not isinstance(backend, Hibernation):
            raise BackendUnavailable(
                f"the {info.isolation} tier cannot hibernate a sandbox yet; pause() it instead "
                "(frozen in place, woken the same way)")
        with self._sleeping(sandbox_id):
            info = self.get(sandbox_id)
            if info.state == "hibernated":
                return info
            started = time.monotonic()
            spec = self.spec(info)
            if not backend.keeps_processes and backend.busy(spec):
                raise SandboxBusy(
                    f"sandbox {sandbox_id} has processes running; hibernating would end them "
                    f"(the {info.isolation} tier does not keep a process's memory on disk): "
                    "stop them, or pause() it")
            was = info.state
            if was == "running":  # frozen first: nothing new starts while its pieces go
                backend.pause(spec, True)
                self._store.set_state(sandbox_id, "paused")
            # Its refusing egress listener lives in its network namespace: closed first, or
            # it would keep the namespace alive.
            self._egress.forget(sandbox_id)
            # Past the tier's first release, a sandbox cut short is neither paused (its /tmp
            # may be unmounted) nor hibernated (no image recorded): the intent lets the next
            # start, or the next call here, finish it or undo it.
            intent: str | None = None
            try:
                intent = self._store.begin_hibernate(
                    sandbox_id, tenant=info.tenant,
                    limit=self.ceiling_of(info.tenant).max_hibernated)
                image = backend.hibernate(spec)
            except (SandboxBusy, QuotaExceeded):  # refused before anything changed
                if intent is not None:
                    self._store.delete_intent(intent)
                if was == "running":  # a command started beside this call: left running
                    backend.pause(spec, False)
                    self._store.set_state(sandbox_id, "running")
                raise
            except Exception as exc:
                settled = None if intent is None else self._settle_here(intent)
                if settled is None:
                    if was == "running":
                        backend.pause(spec, False)
                        self._store.set_state(sandbox_id, "running")
                    raise
                logger.warning("hibernating %s failed once (%s) and was finished", sandbox_id,
                               exc)
                image = settled
            else:
                self._store.set_hibernated(sandbox_id, _image_record(image), intent=intent)
            self._auditor.event(sandbox_id, "sandbox.hibernated", {
                **({"reason": reason} if reason is not None else {}),
                "duration_ms": _ms_since(started), "tmp_bytes": image.tmp_bytes,
                **({"memory_bytes": image.memory_bytes} if image.memory_bytes else {})})
            self._auditor.count("corral_sandbox_sleeps", state="hibernated")
        return self.get(sandbox_id)

    def settle_hibernate(self, intent: dict[str, Any]) -> Hibernated | None:
        """Make whole a hibernate cut short (its ``intent`` still open): finished (its image;
        the sandbox hibernated) or, when its tier had released nothing yet, undone (None; the
        sandbox paused as before). The intent is closed either way; an error leaves it."""
        info = self._store.get(intent["sandbox_id"])
        backend = None if info is None else self.backend(info)
        if info is None or info.state == "hibernated" or not isinstance(backend, Hibernation):
            self._store.delete_intent(intent["id"])  # gone, or made whole already
            return None
        image = backend.recover_hibernate(self.spec(info))
        if image is None:
            self._store.delete_intent(intent["id"])
        else:
            self._store.set_hibernated(info.id, _image_record(image), intent=intent["id"])
        return image

    def _settle_here(self, intent: str) -> Hibernated | None:
        """``settle_hibernate`` for a hibernate that failed in this process; an error there
        is logged and the intent left to the next start's recovery."""
        record = next((i for i in self._store.intents() if i["id"] == intent), None)
        if record is None:
            return None
        try:
            return self.settle_hibernate(record)
        except Exception:
            logger.exception("an interrupted hibernate (%s) is left to recovery", intent)
            return None

    def resume(self, sandbox_id: str, *, reason: str | None = None) -> SandboxRecord:
        """Thaw a paused sandbox, or wake a hibernated one (its pieces rebuilt, its ``/tmp``
        put back; refused, and left hibernated, when its image on disk was changed);
        refused (``QuotaExceeded``) while its trail is over its audit budget: its processes
        would only write on. ``reason``: the control plane's own resumes (a call that woke
        it), recorded in its ``sandbox.resumed`` event."""
        info = self.get(sandbox_id)
        if info.state not in ASLEEP:
            return info
        if self._budgets is not None:
            self._budgets.check_resume(info)
        with self._sleeping(sandbox_id):  # never beside a hibernate of this process
            info = self.get(sandbox_id)
            if info.state not in ASLEEP:
                return info
            started = time.monotonic()
            if info.state == "paused":
                info = self._settle_left(info)
            if info.state == "hibernated":
                self._wake(info)
            else:
                self.backend(info).pause(self.spec(info), False)
            if info.lifecycle.on_timeout == "pause":
                # Paused at (or before) its timeout, it starts its lifetime again, as E2B's
                # resume does; a connect or set_timeout may then change it.
                self._store.set_sleep(sandbox_id, "running", time.time() + info.timeout_s)
            else:
                self._store.set_state(sandbox_id, "running")
        self._auditor.budgets.forget(sandbox_id)  # a raised budget is looked up afresh
        self._auditor.event(sandbox_id, "sandbox.resumed", {
            **({"reason": reason} if reason is not None else {}),
            "from": info.state, "duration_ms": _ms_since(started),
            **({"slept_s": round(time.time() - info.slept_at, 3)}
               if info.slept_at is not None else {})})
        self._auditor.count("corral_sandbox_wakes", state=info.state)
        return self.get(sandbox_id)

    def _settle_left(self, info: SandboxRecord) -> SandboxRecord:
        """A paused sandbox, after any hibernate of it that failed in this process (and
        could not be made whole then) or whose process is gone: such a one is neither
        paused nor hibernated until settled. Another live process's is its own business."""
        for intent in self._store.intents(info.id):
            pid, _, start = str(intent["owner"]).partition(".")
            if intent["kind"] == "hibernate" and (
                    intent["owner"] == this_owner() or not owner_alive(pid, start)):
                self.settle_hibernate(intent)
                info = self.get(info.id)
        return info

    def _wake(self, info: SandboxRecord) -> None:
        backend = self.backend(info)
        image = self._store.hibernated_image(info.id)
        if not isinstance(backend, Hibernation) or image is None:
            raise BackendUnavailable(f"sandbox {info.id} is hibernated but its tier keeps no "
                                     "image of it; `corral rm` it")
        backend.wake(self.spec(info), Hibernated(**image))

    def hibernate_due(self, info: SandboxRecord, now: float) -> float | None:
        """How long ``info`` has been paused, once that is its lifecycle's
        ``hibernate_after`` (else the operator's ``hibernate_after_s``; 0 there: never);
        None before then, or when it is not paused."""
        if info.state != "paused" or info.slept_at is None:
            return None
        after = info.lifecycle.hibernate_after
        if after is None:
            after = self._settings.hibernate_after_s
            if after == 0:
                return None
        paused_for = now - info.slept_at
        return paused_for if paused_for >= after else None

    def ceiling_of(self, tenant: str) -> Ceiling:
        """The ceiling ``tenant``'s sandboxes live under: its own over the operator's."""
        ceiling = self._admission.ceiling
        if tenant != LOCAL_TENANT:
            with contextlib.suppress(UsageError):  # a tenant removed since: the default
                ceiling = TenantDirectory(self._store).get(tenant).ceiling.over(ceiling)
        return ceiling

    def max_asleep_s(self, tenant: str) -> int | None:
        """How long a sandbox of ``tenant`` may stay asleep before it is destroyed (None: no
        bound of its own)."""
        return self.ceiling_of(tenant).max_asleep_s

    def sleeps_at_timeout(self, info: SandboxRecord) -> bool:
        """A running sandbox past its lifetime that its lifecycle pauses instead of killing."""
        return info.state == "running" and info.lifecycle.on_timeout == "pause"

    def sleep(self, info: SandboxRecord) -> SandboxRecord:
        """Pause ``info`` at its timeout (``on_timeout="pause"``) and keep it so for the
        operator's ``paused_keep_s``; then it is destroyed like any sandbox past its life. A
        tier that cannot pause it has it destroyed at once, as its timeout would."""
        with self._sleeping(info.id):
            current = self._store.get(info.id)
            if current is None or not self.sleeps_at_timeout(current) \
                    or current.expires_at > time.time():
                return self.get(info.id)  # another caller put it to sleep (or woke it)
            kept_until = time.time() + self._settings.paused_keep_s
            try:
                self.backend(current).pause(self.spec(current), True)
            except CorralError as exc:
                logger.warning("sandbox %s could not be paused at its timeout (%s); it is "
                               "destroyed instead", info.id, exc)
                self.expire(current)
                raise SandboxExpired(f"sandbox {info.id} reached the end of its lifetime and "
                                     f"could not be paused ({exc.message}); it was destroyed") \
                    from exc
            self._store.set_sleep(info.id, "paused", kept_until)
            self._auditor.event(info.id, "sandbox.paused",
                                {"reason": "timeout", "kept_until": kept_until})
            return dataclasses.replace(current, state="paused", expires_at=kept_until)

    def awake(self, sandbox_id: str, *, tenant: str | None = None,
              doing: str | None = "run commands") -> SandboxRecord:
        """The sandbox, running: a paused or hibernated one whose lifecycle says
        ``auto_resume`` is woken first (concurrent callers wait for the one wake); otherwise
        one asleep is refused (``SandboxBusy``, saying it cannot ``doing``), or with
        ``doing=None`` (what works on a frozen sandbox too, its files) a paused one is
        returned paused (a hibernated one has no files mounted: refused)."""
        info = self.get(sandbox_id, tenant=tenant)
        if info.state not in ASLEEP:
            return info
        if not info.lifecycle.auto_resume:
            if doing is None and info.state == "paused":
                return info
            raise SandboxBusy(f"sandbox {sandbox_id} is {info.state}; resume() it to "
                              f"{doing or 'use its files'}")
        with self._sleeping(sandbox_id):
            info = self.get(sandbox_id, tenant=tenant)
            if info.state in ASLEEP:
                info = self.resume(sandbox_id, reason="a call needed it")
        return info

    @contextlib.contextmanager
    def _sleeping(self, sandbox_id: str) -> Iterator[None]:
        """One sleep or wake of a sandbox at a time in this process (striped locks: bounded
        however many sandboxes come and go)."""
        with self._sleep_locks[hash(sandbox_id) % len(self._sleep_locks)]:
            yield

    def stop_over_budget(self, overrun: Overrun) -> None:
        """The audit budget's stop (on a thread of the audit layer's): record why, then pause
        the sandbox; a tier that cannot pause it has it destroyed instead. Only a running
        sandbox is stopped: one already paused writes nothing of its own any more."""
        info = self._store.get(overrun.sandbox_id)
        if info is None or info.state != "running":
            return
        self._auditor.event(info.id, "audit.budget_exceeded",
                            {**overrun.to_dict(), "action": "pause"}, sync=True)
        reason = f"audit budget exceeded ({overrun.scope})"
        try:
            self.pause(info.id, reason=reason)
            action = "pause"
        except SandboxNotFound:
            return  # destroyed or expired meanwhile: nothing left to stop
        except SandboxBusy:
            # Briefly busy (a destroy under way elsewhere): looked at again at its next write.
            self._auditor.budgets.forget(info.id)
            return
        except CorralError as exc:
            logger.warning("sandbox %s is over its audit budget and could not be paused "
                           "(%s); destroying it", info.id, exc)
            self.destroy(info, reason="audit-budget")
            action = "destroy"
        self._auditor.count("corral_audit_budget_stops", scope=overrun.scope, action=action)
        logger.warning("sandbox %s stopped (%s) at its %s audit budget: %d of %d bytes",
                       info.id, action, overrun.scope, overrun.used_bytes,
                       overrun.budget_bytes)

    def expire(self, info: SandboxRecord, *, wait_s: float | None = None) -> bool:
        """Destroy ``info`` for having reached its lifetime (paused or not); whether it is
        gone after at most ``wait_s`` (``DESTROY_WAIT_S`` unless given; else its destroy
        goes on in the background)."""
        return self._finish(self.begin_expire(info), wait_s)

    def begin_expire(self, info: SandboxRecord) -> DestroyJob:
        if self._destroyer.underway(info.id) is None:  # one expired event per sandbox
            self._auditor.event(info.id, "sandbox.expired", {"expires_at": info.expires_at})
        return self.begin_destroy(info, reason="expired")

    def destroy(self, info: SandboxRecord, *, reason: str,
                wait_s: float | None = None) -> bool:
        """Destroy ``info``: True once it is gone, False when its destroy is still under way
        after ``wait_s`` (``DESTROY_WAIT_S`` unless given; accepted: it goes on in the
        background, the sandbox already hidden from every caller). Raises what made every
        try fail."""
        return self._finish(self.begin_destroy(info, reason=reason), wait_s)

    def begin_destroy(self, info: SandboxRecord, *, reason: str) -> DestroyJob:
        """Start destroying ``info`` (or join the destroy under way) without waiting."""
        underway = self._destroyer.underway(info.id)
        if underway is not None:
            return underway
        # Marked before anything else: hidden at once from every caller, and a crash in the
        # middle leaves a row the next start finishes off.
        self._store.set_state(info.id, "destroying")
        return self._destroyer.start(info, reason)

    def on_destroyed(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call ``callback(sandbox_id)`` at the end of every destroy (requested, expired,
        idle, reaped, over its audit budget, finished after a crash), on the destroy's own
        thread; it must be quick and must not raise (what it raises is logged). Returns the
        call that unsubscribes it."""
        with self._listeners_lock:
            self._on_destroyed.append(callback)

        def unsubscribe() -> None:
            with self._listeners_lock, contextlib.suppress(ValueError):
                self._on_destroyed.remove(callback)

        return unsubscribe

    def destroy_due(self, sandbox_id: str) -> bool:
        """Whether the reaper should destroy ``sandbox_id`` now (no destroy under way, and
        a failed one far enough behind)."""
        return self._destroyer.due(sandbox_id)

    def destroy_underway(self, sandbox_id: str) -> DestroyJob | None:
        return self._destroyer.underway(sandbox_id)

    def forget_gone(self) -> None:
        """Drop what this process holds for sandboxes another process destroyed (their
        refusing listeners, which would keep their network namespaces alive)."""
        self._egress.forget_gone(lambda sandbox_id: self._store.get(sandbox_id) is not None)

    def close(self) -> None:
        """Let the destroys under way finish first (bounded)."""
        self._destroyer.drain()

    @staticmethod
    def _finish(job: DestroyJob, wait_s: float | None) -> bool:
        if job.thread == threading.get_ident():
            return False  # asked again from inside its own destroy: never wait on itself
        done = job.wait(DESTROY_WAIT_S if wait_s is None else wait_s)
        if not done:
            logger.warning("sandbox %s is still being destroyed after %.0f s (%s); it goes "
                           "on in the background", job.sandbox_id, job.running_s, job.reason)
        return done

    def _destroy_now(self, info: SandboxRecord, reason: str) -> None:
        """One try of the whole destroy (on the destroy's own thread)."""
        self._egress.forget(info.id)  # its refusing listener, before its namespace goes
        self.backend(info).destroy(self.spec(info))
        # The commands it killed record their ends on their own threads: first, so that
        # sandbox.destroyed is the trail's last event (bounded: a runner slow to notice its
        # process gone delays the record, never the destroy for long).
        if not self._auditor.inflight.settle(info.id, _SETTLE_S):
            logger.info("sandbox %s: a command's end was not recorded within %.0f s of its "
                        "destroy", info.id, _SETTLE_S)
        self._store.delete(info.id)
        self._locks.remove(info.id)
        if info.layer is not None:
            self._layers.collect()
        self._auditor.event(info.id, "sandbox.destroyed", {"reason": reason}, sync=True)
        self._auditor.close_log(info.id)
        self._auditor.count("corral_sandboxes_destroyed", reason=reason)
        logger.info("destroyed sandbox %s (%s)", info.id, reason)
        self._tell_destroyed(info.id)

    def _tell_destroyed(self, sandbox_id: str) -> None:
        """The listeners, last: the sandbox is gone by now, whatever they do."""
        with self._listeners_lock:
            listeners = builtins.list(self._on_destroyed)
        for listener in listeners:
            try:
                listener(sandbox_id)
            except Exception:  # one listener's failure neither stops the others nor the destroy
                logger.exception("a destroy listener failed for sandbox %s", sandbox_id)


def _ms_since(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 3)


def wait_all(jobs: builtins.list[DestroyJob], wait_s: float) -> builtins.list[DestroyJob]:
    """Wait for ``jobs`` together, at most ``wait_s`` in all; the ones still under way. A
    failed one is logged (its destroy is tried again later), not raised: one sandbox's
    failure must not stop the caller's look at the others."""
    deadline = time.monotonic() + wait_s
    pending = []
    for job in jobs:
        try:
            if not job.wait(max(0.0, deadline - time.monotonic())):
                pending.append(job)
        except Exception as exc:
            logger.warning("destroying sandbox %s failed: %s", job.sandbox_id, exc)
    return pending


def _image_record(image: Hibernated) -> dict[str, Any]:
    """What the store keeps of a hibernated image (``wake`` gets it back as ``Hibernated``)."""
    return dataclasses.asdict(image)
