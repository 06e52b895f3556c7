"""A secret of the data directory's own (32 random bytes in a root-only file), made once and
the same for every process and restart: what derived tokens (E2B access tokens, port tokens and
signed links) are HMACs under, so they need no per-object storage."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

__all__ = ["load_or_create_secret"]


def load_or_create_secret(path: Path) -> bytes:
    with contextlib.suppress(FileNotFoundError):
        secret = path.read_bytes()
        if len(secret) == 32:
            return secret
        raise OSError(f"{path} is damaged (expected 32 bytes); remove it to issue new tokens")
    # Written under a temporary name and linked into place, so two processes starting at once
    # agree on one secret (the loser of the link reads the winner's).
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_bytes(32))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_bytes()
