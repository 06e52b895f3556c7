"""A hibernate that keeps a microVM's memory, as the commands this process follows in it see
it: their keeper goes away with the VM, so each waits here (``take``) instead of failing, and
the wake hands it its command again, attached to the restored guest's agent under a new id
(``attach``, by the command's tag) before the guest thaws, so no output falls between. A
hibernate that could not keep them, or a destroy, ends the wait with the reason (``lose``).

The commands are the ones this process followed when the hibernate began: a command in
another Corral process is that process's to follow, and one of a process that has since ended
runs on in the guest with no reader, as after a memory snapshot's restore.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ...errors import BackendError

__all__ = ["Attached", "Sleep"]

Events = queue.Queue[dict[str, Any]]
_LOOK_S = 5.0  # how often a waiting command looks whether its sandbox is still there


@dataclass(frozen=True, slots=True)
class Attached:
    """A command given back by a wake: where its events now come from."""

    client: Any  # the KeeperClient of the restored VM
    exec_id: int
    events: Events
    slept_s: float  # from the hibernate's start to the attach, for the command's deadline


class Sleep:
    """One hibernate of one sandbox, and the commands (by tag) it promised to give back."""

    def __init__(self, sandbox_id: str, tags: Iterable[str]) -> None:
        self.sandbox_id = sandbox_id
        self._began = time.monotonic()
        self._cond = threading.Condition()
        self._pending = set(tags)
        self._given: dict[str, Attached | BackendError] = {}
        self._lost: str | None = None

    def holds(self, tag: str | None) -> bool:
        """Whether the command tagged ``tag`` is this sleep's to give back (or to end)."""
        with self._cond:
            return tag is not None and (tag in self._pending or tag in self._given)

    def take(self, tag: str, *, still: Callable[[], bool]) -> Attached:
        """Wait for the wake and return the command attached again; raises ``BackendError``
        when it cannot come back (the hibernate failed, the sandbox was destroyed, or its
        guest no longer runs it). ``still``: whether the sandbox is still there, asked now
        and then (another Corral process may destroy it, and tells this one nothing)."""
        with self._cond:
            while not self._cond.wait_for(
                    lambda: tag in self._given or self._lost is not None, timeout=_LOOK_S):
                if not still():
                    self._lost = "the sandbox is gone"
            given = self._given.pop(tag, None)
            self._pending.discard(tag)
            if given is None:
                raise BackendError(f"the command ended with sandbox {self.sandbox_id}'s "
                                   f"hibernate: {self._lost}")
        if isinstance(given, BackendError):
            raise given
        return given

    def woke(self, attach: Callable[[str], tuple[Any, int, Events]]) -> None:
        """The guest runs again (frozen): attach every command this sleep holds."""
        with self._cond:
            tags = sorted(self._pending)
        slept = time.monotonic() - self._began
        for tag in tags:
            try:
                client, exec_id, events = attach(tag)
                given: Attached | BackendError = Attached(client, exec_id, events, slept)
            except BackendError as exc:
                given = exc
            with self._cond:
                self._given[tag] = given
                self._pending.discard(tag)
                self._cond.notify_all()

    def lose(self, why: str) -> None:
        """End every wait: the commands did not survive (``why`` says how)."""
        with self._cond:
            if self._lost is None:
                self._lost = why
            self._cond.notify_all()
