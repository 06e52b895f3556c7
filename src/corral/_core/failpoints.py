"""Named failpoints: places in a multi-step change of durable state where the crash tests make
the process die (or fail) on purpose, to show that the next start makes the change whole.

Off, a failpoint costs one test of an empty dict. A test arms them in the process it will kill,
from the environment (``CORRAL_FAILPOINTS="seal.moved,restore.reset=enospc"``, read once at
import) or from code (``arm("seal.moved")``). The actions: ``kill`` (the default: SIGKILL of
this process, as an operator's ``kill -9`` or the OOM killer would), ``enospc`` (an OSError as
a full disk gives) and ``eio``.

``NAMES`` lists every failpoint there is; ``tests/integration/test_crash_matrix.py`` kills the
process at each one of each operation and checks what the next start makes of it.
"""

from __future__ import annotations

import errno
import os
import signal

__all__ = ["NAMES", "arm", "disarm", "failpoint"]

#: Every failpoint, by the operation it is in (docs/durability.md says what each one proves).
NAMES: dict[str, tuple[str, ...]] = {
    "seal": ("seal.intent", "seal.layer-made", "seal.moved", "seal.marked", "seal.new-upper",
             "seal.recorded"),
    "snapshot": ("snapshot.sealed",),
    "fork": ("fork.sealed", "fork.child-made"),
    "restore": ("restore.intent", "restore.upper-dropped", "restore.reset"),
    "hibernate": ("hibernate.intent", "hibernate.archived", "hibernate.released"),
    "volume create": ("volume.create.intent", "volume.recorded", "volume.made"),
    "volume delete": ("volume.delete.intent", "volume.forgotten"),
}
_ALL = frozenset(name for names in NAMES.values() for name in names)
_ACTIONS = ("kill", "enospc", "eio")

_armed: dict[str, str] = {}


def _parse(text: str) -> dict[str, str]:
    armed = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, action = item.partition("=")
        armed[name] = action or "kill"
    return armed


def arm(name: str, action: str = "kill") -> None:
    """Make failpoint ``name`` act (in this process) the next time it is reached."""
    if name not in _ALL:
        raise ValueError(f"no failpoint {name!r}; they are {sorted(_ALL)}")
    if action not in _ACTIONS:
        raise ValueError(f"a failpoint's action is one of {_ACTIONS}, not {action!r}")
    _armed[name] = action


def disarm() -> None:
    _armed.clear()


def failpoint(name: str) -> None:
    """Act as armed at ``name``; nothing when it is not armed (the usual case)."""
    if not _armed:
        return
    action = _armed.pop(name, None)  # once: what runs after it (a recovery) runs as usual
    if action is None:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    code = errno.ENOSPC if action == "enospc" else errno.EIO
    raise OSError(code, f"{os.strerror(code)} (failpoint {name})")


for _name, _action in _parse(os.environ.get("CORRAL_FAILPOINTS", "")).items():
    arm(_name, _action)
