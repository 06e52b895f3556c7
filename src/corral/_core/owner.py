"""A process's identity as leftovers name their owner: its pid and its start time.

Pieces a process makes for itself (command groups, spare workspaces, a microVM's keeper)
carry ``PID.START`` in their names, so a later process can tell a crashed owner's leftovers
from a live neighbour's: a pid alone may have been reused.
"""

from __future__ import annotations

import os

__all__ = ["owner_alive", "proc_start_time", "this_owner"]


def _stat_after_name(pid: int) -> list[str] | None:
    """``/proc/PID/stat``'s fields after the command name (state first, start time at 19);
    None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 19 else None


def proc_start_time(pid: int) -> str | None:
    fields = _stat_after_name(pid)
    return fields[19] if fields is not None else None


def owner_alive(pid: str, start_time: str) -> bool:
    """That process exists and has not exited: a zombie waiting for its parent has (and can
    hold nothing), though its pid and start time read as before until it is reaped."""
    try:
        fields = _stat_after_name(int(pid))
    except ValueError:
        return False
    return fields is not None and fields[19] == start_time and fields[0] not in ("Z", "X")


def this_owner() -> str:
    """``PID.START`` of this process."""
    pid = os.getpid()
    return f"{pid}.{proc_start_time(pid)}"
