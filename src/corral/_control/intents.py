"""Intent records: a multi-step change of durable state writes what it is about to do before
its first step, and closes the record in the same transaction as its last, so that a process
killed in between leaves a record the next start acts on before anything else touches the data
(``Recovery``): it finishes the change (rolls forward) or undoes it (rolls back), idempotently,
and says which in the sandbox's audit trail. Layer garbage collection never removes a layer an
open intent names. The contract, operation by operation: docs/durability.md.

An intent belongs to the process that wrote it (``PID.START``): only a dead owner's intents are
acted on, so one process never undoes what a live neighbour (the service, a CLI call) is doing.

Kinds:

* ``seal`` (a snapshot's or a fork's): the workspace's writable layer becomes read-only layer
  ``layer``. The tier says whether the layer came out whole (``recover_seal``): then the store
  records it and puts the sandbox on it, else the layer goes and the sandbox is as before.
* ``restore``: the sandbox's writable layer is dropped and a fresh one made on ``layer``. A
  restore that began has thrown the old writable layer away, so it is always finished.
* ``hibernate``: the sandbox's tier releases its kernel pieces, its ``/tmp`` archived. The
  tier finishes it (``recover_hibernate``), or undoes it when it had released nothing yet.
* ``volume.create`` and ``volume.delete`` are ``Volumes``' own (``Volumes.recover``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from .._audit.auditor import Auditor
from .._core.owner import owner_alive
from ..backends import SealResult
from ..errors import CorralError
from .sandboxes import Sandboxes
from .store import Store
from .volumes import VOLUME_INTENTS

__all__ = ["Intents"]

logger = logging.getLogger(__name__)


class Intents:
    def __init__(self, *, store: Store, sandboxes: Sandboxes, auditor: Auditor) -> None:
        self._store = store
        self._sandboxes = sandboxes
        self._auditor = auditor

    def resolve_abandoned(self) -> list[str]:
        """Finish or undo every intent whose process is gone; what became of each."""
        done = []
        for intent in self._store.intents():
            if intent["kind"] in VOLUME_INTENTS:  # ``Volumes.recover``'s
                continue
            pid, _, start = str(intent["owner"]).partition(".")
            if owner_alive(pid, start):
                continue
            done.append(self.resolve(intent))
        return done

    def resolve(self, intent: dict[str, Any]) -> str:
        """Finish or undo one intent (its process is gone, or it failed in this one)."""
        kind = intent["kind"]
        if kind == "seal":
            return self._resolve_seal(intent)
        if kind == "restore":
            return self._resolve_restore(intent)
        if kind == "hibernate":
            return self._resolve_hibernate(intent)
        # A kind this build does not know (written by a newer one): leave it for that one.
        logger.warning("intent %s of kind %r left alone: this Corral does not know it",
                       intent["id"], kind)
        return f"intent {intent['id']} ({kind}) left for a Corral that knows it"

    def _resolve_seal(self, intent: dict[str, Any]) -> str:
        data, sandbox_id = intent["data"], intent["sandbox_id"]
        layer = str(data["layer"])
        info = self._store.get(sandbox_id)
        if info is None:
            # The sandbox is gone, and with it whatever the seal made of its workspace: the
            # unrecorded layer is a leftover the sweep removes.
            self._store.delete_intent(intent["id"])
            return f"seal of destroyed sandbox {sandbox_id} dropped"
        # The store still has the layers from before the seal: closing the intent is what
        # records a new one.
        result: SealResult | None = self._sandboxes.backend(info).recover_seal(
            self._sandboxes.spec(info), layer)
        if result is None:
            self._store.delete_intent(intent["id"])
            self._report(sandbox_id, "recovery.rolled_back", intent, {"layer": layer})
            return f"seal of {sandbox_id} undone"
        parent = result.layers[1] if len(result.layers) > 1 else None
        self._store.seal_done(sandbox_id, layer, parent=parent, bytes_used=result.bytes_used,
                              intent=intent["id"])
        self._report(sandbox_id, "recovery.rolled_forward", intent,
                     {"layer": layer, "bytes": result.bytes_used})
        return f"seal of {sandbox_id} finished (layer {layer})"

    def _resolve_restore(self, intent: dict[str, Any]) -> str:
        data, sandbox_id = intent["data"], intent["sandbox_id"]
        info = self._store.get(sandbox_id)
        if info is None:
            self._store.delete_intent(intent["id"])
            return f"restore of destroyed sandbox {sandbox_id} dropped"
        restored = dataclasses.replace(info, layer=data.get("layer"),
                                       memory_image=data.get("memory_image"))
        self._sandboxes.backend(info).reset_workspace(self._sandboxes.spec(restored))
        self._store.restore_done(sandbox_id, restored.layer, memory_image=restored.memory_image,
                                 intent=intent["id"])
        self._report(sandbox_id, "recovery.rolled_forward", intent, {"layer": restored.layer})
        return f"restore of {sandbox_id} finished"

    def _resolve_hibernate(self, intent: dict[str, Any]) -> str:
        sandbox_id = intent["sandbox_id"]
        if self._store.get(sandbox_id) is None:
            self._store.delete_intent(intent["id"])
            return f"hibernate of destroyed sandbox {sandbox_id} dropped"
        image = self._sandboxes.settle_hibernate(intent)
        if image is None:
            self._report(sandbox_id, "recovery.rolled_back", intent, {})
            return f"hibernate of {sandbox_id} undone (paused)"
        self._report(sandbox_id, "recovery.rolled_forward", intent,
                     {"tmp_bytes": image.tmp_bytes})
        return f"hibernate of {sandbox_id} finished"

    def _report(self, sandbox_id: str, type_: str, intent: dict[str, Any],
                extra: dict[str, Any]) -> None:
        """Say in the sandbox's trail what became of an operation a crash cut short."""
        try:
            self._auditor.event(sandbox_id, type_, {
                "operation": intent["data"].get("operation", intent["kind"]),
                "intent": intent["id"], "reason": "the process that began it ended first",
                **extra}, sync=True)
        except (CorralError, OSError) as exc:  # the change itself is made; say so in the log
            logger.warning("recovery of %s (%s) not recorded in its trail: %s", sandbox_id,
                           intent["id"], exc)
