"""Where the agent finds its channel, workspace, cgroups and launcher: the guest's fixed places,
or (for the host-side unit tests only) the ``CORRAL_AGENT_*`` overrides."""

from __future__ import annotations

from dataclasses import dataclass

from .fsrules import WORKSPACE
from .protocol import PORT_NAME

__all__ = ["HOME", "PORT_PATH", "USER_ID", "Config"]

PORT_PATH = f"/dev/virtio-ports/{PORT_NAME}"
HOME = "/home/user"
USER_ID = 1000
_OVERRIDES = ("CORRAL_AGENT_CHANNEL", "CORRAL_AGENT_WORKSPACE", "CORRAL_AGENT_CGROUP",
              "CORRAL_AGENT_RUN")


@dataclass(frozen=True)
class Config:
    """The agent's places. ``strict`` is false in test mode (any override set): cgroup
    controllers that are missing are skipped instead of refusing the command, ``resume``
    leaves the clock and the hostname alone, and there is no workspace disk or home."""

    channel: str
    workspace: str
    cgroup_root: str
    run: str
    disk: str | None
    home: str | None
    strict: bool

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Config:
        test = any(k in env for k in _OVERRIDES)
        return cls(channel=env.get("CORRAL_AGENT_CHANNEL", PORT_PATH),
                   workspace=env.get("CORRAL_AGENT_WORKSPACE", WORKSPACE),
                   cgroup_root=env.get("CORRAL_AGENT_CGROUP", "/sys/fs/cgroup"),
                   run=env.get("CORRAL_AGENT_RUN", "/corral/run"),
                   disk=None if test else "/dev/vdb", home=None if test else HOME,
                   strict=not test)
