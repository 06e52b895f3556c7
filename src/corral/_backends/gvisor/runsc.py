"""The runsc binary: where it is, which build, the flags every sandbox shares, its state files.

Flags, each chosen by measurement on the development machines (2 cores, no nested KVM; see
``bench/bench_gvisor.py``) or for safety:

* ``--platform=systrap``: the default and the fastest platform without KVM (``ptrace`` was no
  faster to start and is slower per system call; ``kvm`` needs ``/dev/kvm``).
* ``--network=host``: gVisor passes socket calls to the host kernel, inside the sandbox's own
  network namespace (holding only ``lo``); see ``backend`` for why.
* ``--overlay2=none``: the root is read-only, so no overlay and no filestore file are needed.
* ``--ignore-cgroups``: Corral's cgroup driver places, limits, freezes and kills the sandbox.
* ``--oci-seccomp``: enforce the command's seccomp profile inside gVisor.
* ``--net-raw=false``, ``--host-uds=none``, ``--host-fifo=none``: no raw sockets, no host
  sockets or FIFOs reachable through the mounts (the defaults, pinned).
* ``--file-access-mounts=shared``: the host writes into ``/workspace`` (the files API) while
  commands run, so gVisor must revalidate what it cached; the read-only root stays ``exclusive``.
* ``--directfs`` (default on): the Sentry opens files itself through descriptors the gofer hands
  over, instead of asking the gofer for each operation; a little faster, and no wider: the
  Sentry still sees only the mounts of the bundle, from an empty chroot, as the runtime uid.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from ..._core.privileged import privileged_env

__all__ = ["MIN_VERSION", "Runsc", "find_runsc", "runsc_version"]

# Debian bookworm's own runsc (2022) breaks statx, so `ls` fails; bookworm-backports has 2024.
MIN_VERSION = 20230101
_INSTALL = ("apt-get install -t bookworm-backports runsc (add `deb http://deb.debian.org/debian "
            "bookworm-backports main` to the apt sources first; `corral setup` does both)")


def find_runsc() -> str | None:
    return shutil.which("runsc") or (
        "/usr/bin/runsc" if os.access("/usr/bin/runsc", os.X_OK) else None)


def runsc_version(path: str) -> tuple[str, int | None]:
    """(version text, build date as YYYYMMDD or None) from ``runsc --version``."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10,
                             stdin=subprocess.DEVNULL, env=privileged_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"does not run: {exc}", None
    first = out.stdout.strip().splitlines()[0] if out.stdout.strip() else out.stderr.strip()
    # "runsc version 0.0~20240729.0" (Debian) or "runsc version release-20240729.0" (upstream).
    match = re.search(r"(20\d{6})", first)
    return first, int(match.group(1)) if match else None


class Runsc:
    """One runsc binary and one state directory (``--root``), shared by a backend's sandboxes."""

    install_hint = _INSTALL

    def __init__(self, path: str, state_dir: Path) -> None:
        self.path = path
        self.state_dir = state_dir

    def prepare(self) -> None:
        # Traversable, like runsc's own default: the sandbox's runtime uid must reach nothing
        # here, but runsc creates its control sockets in this directory.
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o711)

    def run_argv(self, *, bundle: Path, container_id: str, network: str = "host") -> list[str]:
        """``runsc run`` for ``bundle``: attached, so the sandbox dies with this process."""
        return [
            self.path,
            f"--root={self.state_dir}",
            "--platform=systrap",
            f"--network={network}",
            "--net-raw=false",
            "--host-uds=none",
            "--host-fifo=none",
            "--overlay2=none",
            "--file-access=exclusive",
            "--file-access-mounts=shared",
            "--ignore-cgroups",
            "--oci-seccomp",
            # runsc's own complaints go here, apart from the command's stderr (which is runsc's
            # stderr too); empty when all goes well.
            f"--log={bundle / 'runsc.log'}",
            "--log-format=json",
            "run",
            f"--bundle={bundle}",
            container_id,
        ]

    @staticmethod
    def error_of(bundle: Path) -> str | None:
        """The last error runsc logged for the bundle's run, if any."""
        try:
            text = (bundle / "runsc.log").read_text(errors="replace")
        except OSError:
            return None
        message = None
        for line in text.splitlines():
            with contextlib.suppress(ValueError, AttributeError):
                entry = json.loads(line)
                if entry.get("level") in ("error", "fatal", "warning"):
                    message = str(entry.get("msg", "")).strip() or message
        return message

    def state_entries(self) -> dict[str, list[Path]]:
        """State files by container id (``<id>_sandbox:<id>.state``, ``.lock``,
        ``runsc-<id>.sock``); runsc removes them itself unless it is killed."""
        found: dict[str, list[Path]] = {}
        if not self.state_dir.is_dir():
            return found
        for entry in self.state_dir.iterdir():
            name = entry.name
            if name.startswith("runsc-") and name.endswith(".sock"):
                container_id = name[len("runsc-"):-len(".sock")]
            elif "_sandbox:" in name:
                container_id = name.split("_sandbox:", 1)[0]
            else:
                continue
            found.setdefault(container_id, []).append(entry)
        return found

    def remove_state(self, container_id: str) -> None:
        """Delete what a killed ``runsc run`` left for ``container_id``. Idempotent."""
        for path in (self.state_dir / f"runsc-{container_id}.sock",
                     *self.state_dir.glob(f"{_glob_escape(container_id)}_sandbox:*")):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)
