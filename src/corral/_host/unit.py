"""The systemd unit ``corral setup --service`` writes for ``corral serve``.

Not socket-activated, on purpose: the service is more than its listener. From its start it runs
the reaper (a sandbox must die at its lifetime whether or not anyone calls), recovers what a
crash left, and keeps spare workspaces ready; started on the first connection, expired sandboxes
would outlive their lifetime until someone knocked.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ServiceUnit", "UNIT_PATH"]

UNIT_PATH = Path("/etc/systemd/system/corral.service")


@dataclass(frozen=True)
class ServiceUnit:
    corral: Path  # the `corral` executable of this install
    home: Path
    host: str
    port: int
    environment_file: Path  # optional CORRAL_* settings, read when it exists

    def serve_arguments(self) -> list[str]:
        return [str(self.corral), "--home", str(self.home), "serve", "--host", self.host,
                "--port", str(self.port)]

    def render(self) -> str:
        serve = shlex.join(self.serve_arguments())
        return f"""\
# Written by `corral setup --service`; run it again to rewrite (say what you change in
# {self.environment_file}, which this unit reads, rather than here).
[Unit]
Description=Corral: execution sandboxes for AI agents
After=network-online.target local-fs.target
Wants=network-online.target

[Service]
Type=exec
# Root, by design: every sandbox runs as its own unprivileged host uid in its own namespaces
# and cgroup, which only root can set up. Nothing a tenant runs keeps root.
User=root
EnvironmentFile=-{self.environment_file}
ExecStartPre={shlex.join([*self.serve_arguments(), "--check-config"])}
ExecStart={serve}
Restart=on-failure
RestartSec=2
# The service stops sandboxes' processes itself (a clean stop releases spare workspaces and
# helpers); systemd then ends whatever is left in the unit's cgroup.
KillMode=mixed
TimeoutStopSec=60
# Sandboxes are processes of this unit: their own limits are Corral's cgroups, so the unit's
# must not cap them all together.
Delegate=yes
TasksMax=infinity
LimitNOFILE=1048576
LimitNPROC=infinity

[Install]
WantedBy=multi-user.target
"""
