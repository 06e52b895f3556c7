"""The identity of one Corral home on this host, for names in host-wide places (cgroups,
network namespace pins).

A hash of the home's *path* is not unique: two containers (two mount namespaces) may both use
``/var/lib/corral``, and would then name their cgroups the same and sweep each other's. So the
identity is a random token created once and kept in the home, mixed with the home directory's
device and inode (a copied home, token included, still gets a name of its own). Both are read
from the home itself, so every process using it agrees. The device number may change across
a reboot; what the tag names (cgroups, ``/run/netns`` pins) does not survive one either.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from pathlib import Path

__all__ = ["instance_tag"]

_TOKEN_FILE = "instance-id"


def _token(home: Path) -> str:
    path = home / _TOKEN_FILE
    with contextlib.suppress(FileNotFoundError):
        token = path.read_text().strip()
        if token:
            return token
    # Written aside and linked into place: two processes racing on a fresh home both end up
    # with the one token that won, never with a half-written file.
    tmp = home / f".{_TOKEN_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    tmp.write_text(secrets.token_hex(16) + "\n")
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text().strip()


def instance_tag(home: Path) -> str:
    """Eight hex characters naming ``home`` among every Corral home on this host (creates the
    home and its token on first use)."""
    home.mkdir(parents=True, exist_ok=True, mode=0o711)
    st = os.stat(home)
    identity = f"{_token(home)}:{st.st_dev}:{st.st_ino}"
    return hashlib.sha256(identity.encode()).hexdigest()[:8]
