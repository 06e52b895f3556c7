"""What ``corral mcp`` says about itself on start: where its sandboxes live and what the model
may ask for. An MCP client starts the server with none of its user's environment, so a
``CORRAL_HOME`` set in a shell is silently not there; saying which data directory, from where,
on stderr (the client's log) and in the instructions the client sees, makes that visible."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .._control.plane import Ceiling

__all__ = ["Where", "allowed_text"]


@dataclass(frozen=True, slots=True)
class Where:
    """The data directory the server runs sandboxes in (None: a service's, at ``url``)."""

    home: Path | None
    source: str  # "--home", "CORRAL_HOME" or "the default"
    tier: str  # the default isolation tier (settings.backend)
    url: str | None = None
    uids: tuple[int, int] | None = None  # the first sandbox uid and how many

    def describe(self) -> str:
        if self.home is None:
            return (f"the Corral service at {self.url} (from CORRAL_URL): its data directory and "
                    "tiers are the service's")
        # The uid range too: a second data directory needs one of its own (they must not
        # overlap), and the default is the same for every directory.
        uids = ("" if self.uids is None else
                f", sandbox uids {self.uids[0]}-{self.uids[0] + self.uids[1] - 1}")
        return f"data directory {self.home} (from {self.source}), tier {self.tier}{uids}"


def _names(values: tuple[str, ...] | None, none: str) -> str:
    if values is None:
        return "any"
    return ", ".join(values) if values else none


def allowed_text(ceiling: Ceiling, volumes: Mapping[str, bool]) -> str:
    """The MCP ceiling in a line: what the model may ask for."""
    hosts = _names(ceiling.hosts, "none")
    mounts = ", ".join(f"{name}{':ro' if ro else ''}" for name, ro in sorted(volumes.items()))
    return (f"network {'none' if hosts == 'none' else hosts}; templates "
            f"{_names(ceiling.templates, 'none')}; secrets {_names(ceiling.secrets, 'none')}; "
            f"volumes {mounts or 'none'}")
