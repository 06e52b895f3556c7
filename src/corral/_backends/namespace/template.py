"""The ``base`` template: the host's system directories, read-only, with a curated ``/etc``.

``/etc`` is an allowlist copied once into the data directory rather than the host's own ``/etc``
with holes punched in it: a host secret we did not think of (a key under ``/etc/ssl/private``, a
token in ``/etc/environment``, ssh host keys) then stays out by default.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ...errors import UsageError

__all__ = ["SANDBOX_GID", "SANDBOX_UID", "TEMPLATES", "BaseTemplate", "load_template",
           "require_template"]

TEMPLATES = ("base",)
SANDBOX_UID = 1000
SANDBOX_GID = 1000
_VERSION = "3"

# Entries of the host /etc a userland needs; nothing that identifies or authenticates the host.
_ETC_ALLOW = (
    "alternatives", "bash.bashrc", "ca-certificates", "ca-certificates.conf", "debian_version",
    "gai.conf", "host.conf", "inputrc", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
    "locale.alias", "localtime", "magic", "magic.mime", "mailcap", "mime.types", "nsswitch.conf",
    "os-release", "perl", "profile", "protocols", "python3", "python3.11", "rpc", "services",
    "ssl", "terminfo", "timezone", "vim", "xattr.conf",
)
_ETC_DENY_INSIDE = {"ssl/private"}

_PASSWD = (
    "root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
    f"user:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox user:/workspace:/bin/bash\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
_GROUP = f"root:x:0:\nuser:x:{SANDBOX_GID}:\nnogroup:x:65534:\n"
_HOSTS = "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"

# Top-level host paths bound read-only. On merged-/usr systems most are symlinks into /usr and
# are recreated as symlinks.
# Kernel memory, key and timer details a sandbox has no use for (Docker masks the same ones).
_MASKED_PROC = ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/kallsyms",
                "/proc/sched_debug")

_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")


@dataclass(frozen=True, slots=True)
class BaseTemplate:
    """Where the template's pieces are on the host."""

    etc: Path
    system: tuple[tuple[str, str, str], ...]  # (kind, source, dest); kind is "bind" or "symlink"
    masked_proc: tuple[str, ...] = ()  # /proc files hidden behind /dev/null


def _copy_etc(dest: Path, stamp: str, extra_ca: bytes | None) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in _ETC_ALLOW:
        src = Path("/etc") / name
        if not os.path.lexists(src):
            continue
        target = tmp / name
        if src.is_symlink():
            os.symlink(os.readlink(src), target)
        elif src.is_dir():
            shutil.copytree(
                src, target, symlinks=True,
                ignore=lambda d, names: [
                    n for n in names
                    if os.path.relpath(os.path.join(d, n), "/etc") in _ETC_DENY_INSIDE
                ],
            )
        elif src.is_file():
            shutil.copy2(src, target)
    (tmp / "passwd").write_text(_PASSWD)
    (tmp / "group").write_text(_GROUP)
    (tmp / "hosts").write_text(_HOSTS)
    (tmp / "hostname").write_text("sandbox\n")
    (tmp / "resolv.conf").write_text("# no resolver: the sandbox has no network\n")
    if extra_ca:
        # The egress gateway's CA, trusted inside for the hosts it intercepts.
        (tmp / "corral").mkdir()
        (tmp / "corral" / "egress-ca.pem").write_bytes(extra_ca)
        bundle = tmp / "ssl" / "certs" / "ca-certificates.crt"
        if bundle.is_file() and not bundle.is_symlink():
            bundle.write_bytes(bundle.read_bytes().rstrip(b"\n") + b"\n" + extra_ca)
        else:
            bundle.parent.mkdir(parents=True, exist_ok=True)
            bundle.unlink(missing_ok=True)
            bundle.write_bytes(extra_ca)
    (tmp / ".corral-template").write_text(stamp)
    for path in [tmp, *tmp.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def require_template(name: str, templates_dir: Path) -> None:
    """Raise ``UsageError`` unless a sandbox can be created from template ``name`` now."""
    if name not in TEMPLATES:
        raise UsageError(f"unknown template {name!r}; available: {', '.join(TEMPLATES)}")


def load_template(name: str, templates_dir: Path, *, extra_ca: bytes | None = None) -> BaseTemplate:
    """Return the template ``name``, building its ``/etc`` on first use.

    Raises:
        UsageError: unknown template.
    """
    if name not in TEMPLATES:
        raise UsageError(f"unknown template {name!r}; available: {', '.join(TEMPLATES)}")
    etc = templates_dir / name / "etc"
    stamp_file = etc / ".corral-template"
    stamp = _VERSION + (f":{hashlib.sha256(extra_ca).hexdigest()[:16]}" if extra_ca else "")
    if not stamp_file.exists() or stamp_file.read_text() != stamp:
        _copy_etc(etc, stamp, extra_ca)
    system = []
    for entry in _SYSTEM_DIRS:
        src = Path("/") / entry
        if src.is_symlink():
            system.append(("symlink", os.readlink(src), f"/{entry}"))
        elif src.is_dir():
            system.append(("bind", str(src), f"/{entry}"))
    masked = tuple(p for p in _MASKED_PROC if os.path.exists(p))
    return BaseTemplate(etc=etc, system=tuple(system), masked_proc=masked)
