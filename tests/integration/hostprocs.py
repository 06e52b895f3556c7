"""Looking at the host's processes from a test: what runs as a sandbox's host uid."""

from __future__ import annotations

import os
import re

__all__ = ["host_procs_of_uid", "host_uid", "not_resident", "status_field"]

_NAMESPACE_RESIDENT = re.compile(r"/[rw]\.\d+\.\d+(\.\d+)?$", re.MULTILINE)


def host_uid(sandbox_id: str) -> int:
    """The host uid a sandbox of this process runs as: the store's record has it (it is the
    operator's business, so the public SandboxInfo does not)."""
    from corral._control.manager import _managers

    for manager in list(_managers.values()):
        record = manager.store.get(sandbox_id)
        if record is not None:
            return record.uid
    raise LookupError(f"no manager of this process knows {sandbox_id}")


def status_field(status: str, name: str) -> str:
    for line in status.splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    raise KeyError(name)


def host_procs_of_uid(uid: int, *, zombies: bool = False) -> list[tuple[int, str]]:
    """(pid, status text) of every host process whose real, effective, saved or fs uid is ``uid``.

    Zombies (dead, waiting to be reaped: they run no code) are left out unless ``zombies``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:") and str(uid) in line.split()[1:]:
                if zombies or not status_field(status, "State").startswith("Z"):
                    found.append((int(entry), status))
                break
    return found


def not_resident(procs: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Those of ``procs`` that are not a sandbox's resident helper's, kept between commands
    until it is idle: a gVisor sandbox's (runsc, gofer, Sentry: its own cgroup group
    ``c.<owner>.resident-N``) or a namespace sandbox's (bwrap and its zygote, group
    ``r.<owner>``, and the next command's init made ahead, ``w.<owner>.N``)."""
    kept = []
    for pid, status in procs:
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                groups = f.read()
        except OSError:
            continue  # gone meanwhile
        if ".resident-" not in groups and not _NAMESPACE_RESIDENT.search(groups):
            kept.append((pid, status))
    return kept
