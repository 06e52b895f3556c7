"""A hibernated sandbox's ``/tmp``, kept on disk: its tmpfs is memory, gone with its mount.

Archived by root, reading only (GNU tar neither follows a symlink nor opens a FIFO or device
when it archives, and ``--one-file-system`` keeps it on the tmpfs); put back by the sandbox's
own uid (``setpriv``), so the names, links and modes a tenant wrote there are extracted with
no more authority than the tenant had: a crafted entry cannot reach outside what that uid
could write anyway.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from ..._core.privileged import privileged_env
from ...errors import BackendError, BackendUnavailable

__all__ = ["archive_tree", "digest_of", "restore_tree"]

_TIMEOUT_S = 600.0


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BackendUnavailable(f"{name} is missing; install it with `apt-get install "
                                 f"{'tar' if name == 'tar' else 'util-linux'}`")
    return path


def digest_of(path: Path) -> str:
    with path.open("rb") as source:
        return "sha256:" + hashlib.file_digest(source, "sha256").hexdigest()


def archive_tree(point: Path, archive: Path) -> int:
    """Write the tree at ``point`` to ``archive`` (root-only, replaced whole: a crash leaves
    the old one or none); its size in bytes."""
    partial = archive.with_name(archive.name + ".part")
    argv = [_tool("tar"), "--create", "--file=-", f"--directory={point}", "--one-file-system",
            "--sparse", "--numeric-owner", "--acls", "--xattrs", "."]
    with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out,
                              stderr=subprocess.PIPE, env=privileged_env(), timeout=_TIMEOUT_S,
                              check=False)
        out.flush()
        os.fsync(out.fileno())
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise BackendError(f"archiving {point} failed: "
                           f"{proc.stderr.decode(errors='replace').strip()[:500]}")
    partial.rename(archive)
    return archive.stat().st_size


def restore_tree(archive: Path, point: Path, uid: int) -> None:
    """Extract ``archive`` into ``point`` (an empty filesystem the uid owns) as ``uid``."""
    argv = [_tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=-all", "--no-new-privs",
            _tool("tar"), "--extract", "--file=-", f"--directory={point}",
            "--preserve-permissions", "--no-same-owner", "--delay-directory-restore"]
    with archive.open("rb") as source:
        proc = subprocess.run(argv, stdin=source, capture_output=True, env=privileged_env(),
                              timeout=_TIMEOUT_S, check=False, cwd="/")
    if proc.returncode != 0:
        raise BackendError(f"putting back {point} from {archive} failed: "
                           f"{proc.stderr.decode(errors='replace').strip()[:500]}")
