"""The namespace tier: bwrap + user/PID/mount/IPC/UTS/cgroup namespaces + seccomp + cgroups,
a private network namespace per sandbox and a per-sandbox host uid.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ..._settings import Settings
from ...backends import BackendName, ExecOutcome, ExecRequest, HostCheck, SandboxSpec
from ...errors import BackendUnavailable
from .._linux.cgroups import detect_cgroups
from .._linux.host import HostBackedBackend
from .._linux.hostcheck import check_host
from .._linux.template import build_root_template
from .runner import CommandLauncher, Launch

__all__ = ["NamespaceBackend"]


class NamespaceBackend(HostBackedBackend):
    """See the module docstring. One instance per process and data directory."""

    name: BackendName = "namespace"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._launcher: CommandLauncher | None = None

    def check_host(self) -> list[HostCheck]:
        return check_host(self._settings)

    def _ready(self) -> CommandLauncher:
        if self._launcher is None:
            failed = [c for c in self.check_host() if not c.ok]
            if failed:
                lines = "; ".join(f"{c.name}: {c.detail} (fix: {c.fix})" for c in failed)
                raise BackendUnavailable(
                    f"this host cannot run namespace sandboxes safely: {lines}. "
                    "Run `corral doctor` for details."
                )
            bwrap = shutil.which("bwrap")
            assert bwrap is not None  # checked above
            cgroups = detect_cgroups(self._instance)
            self._attach_cgroups(cgroups)
            self._launcher = CommandLauncher(bwrap=bwrap, cgroups=cgroups)
        return self._launcher

    def create(self, spec: SandboxSpec) -> None:
        self._create_host_pieces(spec)

    def exec(self, spec: SandboxSpec, request: ExecRequest) -> ExecOutcome:
        launcher = self._ready()
        workspace = self._ensure_runtime(spec)
        template = (self._template(spec.template) if request.build_root is None
                    else build_root_template(Path(request.build_root)))
        # An image build's step has a root of its own and never a volume.
        mounts = () if request.build_root is not None else tuple(
            (str(m.source), m.target, m.read_only) for m in self._planned_mounts(spec))
        return launcher.run(Launch(
            uid=spec.uid, netns_path=self._netns_path(spec.id),
            template=template, workspace=workspace,
            tmp_bytes=spec.tier.tmp_bytes, group=f"{spec.id}/{self._group_name(request)}",
            request=request, env=self._command_env(spec, request), mounts=mounts,
        ))


if TYPE_CHECKING:  # the protocol, checked by mypy
    from ...backends import IsolationBackend

    _conforms: type[IsolationBackend] = NamespaceBackend
