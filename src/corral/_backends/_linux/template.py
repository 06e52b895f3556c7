"""Templates as sandbox roots: system directories bound read-only plus a curated ``/etc``.

``base`` is the host's own system. Its ``/etc`` is an allowlist copied once into the data
directory rather than the host's own ``/etc`` with holes punched in it: a host secret we did not
think of (a key under ``/etc/ssl/private``, a token in ``/etc/environment``, ssh host keys) then
stays out by default.

Every other template is a root filesystem built from Debian packages (``corral._templates``).
Its system directories come from the built root, and its ``/etc`` is the built root's own (which
we made, so it holds nothing of the host's) minus password hashes and keys.

Both get Corral's ``passwd``, ``group``, ``hosts``, ``hostname`` and ``resolv.conf``, and the
egress gateway's CA appended to the system bundle. A curated ``/etc`` lives in a directory named
after what went into it, so a new CA makes a new directory instead of rewriting one that running
sandboxes have bound. For ``base`` that includes the host's own ``/etc`` as it is now
(``_host_etc_state``: a few dozen ``lstat`` calls, no copy): a package upgrade or an edit there
makes a new copy at the next load, and otherwise every process reuses the one made.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..._images.config import ImageConfig
from ..._templates.roots import current_template, executable_in_root, not_built

__all__ = ["SANDBOX_GID", "SANDBOX_UID", "BaseTemplate", "build_root_template", "load_template",
           "template_python"]

SANDBOX_UID = 1000
SANDBOX_GID = 1000
_VERSION = "4"

# Entries of the host /etc a userland needs; nothing that identifies or authenticates the host.
_ETC_ALLOW = (
    "alternatives", "bash.bashrc", "ca-certificates", "ca-certificates.conf", "debian_version",
    "gai.conf", "host.conf", "inputrc", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
    "locale.alias", "localtime", "magic", "magic.mime", "mailcap", "mime.types", "nsswitch.conf",
    "os-release", "perl", "profile", "protocols", "python3", "python3.11", "rpc", "services",
    "ssl", "terminfo", "timezone", "vim", "xattr.conf",
)
_ETC_DENY_INSIDE = {"ssl/private"}
# Left out of a built root's /etc: password hashes, keys, and what Corral writes itself.
_BUILT_ETC_DENY = (
    "shadow", "shadow-", "gshadow", "gshadow-", "passwd-", "group-", "subuid", "subuid-",
    "subgid", "subgid-", ".pwd.lock", "security/opasswd", "ssl/private", "ssh/ssh_host_*",
)

_PASSWD = (
    "root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
    f"user:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox user:/workspace:/bin/bash\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
_GROUP = f"root:x:0:\nuser:x:{SANDBOX_GID}:\nnogroup:x:65534:\n"
_HOSTS = "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"
# No nameserver: the C library then asks 127.0.0.1:53, where nothing listens, and a lookup
# fails at once on every tier (a bound wait if something ever does). What it says is for the
# model that looks here to learn why (corral._egress.refusals says it to proxy clients).
_RESOLV_CONF = """\
# corral: no resolver. Name lookups fail at once: nothing answers on 127.0.0.1:53.
# Programs that honour HTTP_PROXY/HTTPS_PROXY reach Corral's egress gateway instead; it looks
# up the hosts the sandbox's network policy allows, and refuses the others saying so.
# Allow a host with network={"allow": ["pypi.org"]} (SDK), corral create --allow pypi.org
# (CLI), corral network $CORRAL_SANDBOX_ID --allow pypi.org (a running sandbox), or use the
# operator's package index with network={"presets": ["pypi"]} (--index pypi).
options timeout:1 attempts:1
"""

# Kernel memory, key and timer details a sandbox has no use for (Docker masks the same ones).
_MASKED_PROC = ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/kallsyms",
                "/proc/sched_debug")

# Top-level paths bound read-only. On merged-/usr systems most are symlinks into /usr and are
# recreated as symlinks.
_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# A built root is ours, so its /opt and /var (dpkg's database: `dpkg -l` works) come along.
_BUILT_EXTRA_DIRS = ("opt", "var")
# An image's root brings every top-level directory of its own (/app, /srv, /root...) except
# these: the sandbox makes them itself (/etc is curated; /home/user and /workspace are the
# workspace; /mnt is for mounts), or they are the kernel's.
_IMAGE_SKIPPED_DIRS = frozenset({"etc", "proc", "sys", "dev", "tmp", "run", "home", "workspace",
                                 "mnt", "lost+found", ".corral"})


@dataclass(frozen=True, slots=True)
class BaseTemplate:
    """Where the template's pieces are on the host."""

    etc: Path
    system: tuple[tuple[str, str, str], ...]  # (kind, source, dest); kind is "bind" or "symlink"
    masked_proc: tuple[str, ...] = ()  # /proc files hidden behind /dev/null
    # The whole built root filesystem (None for ``base``, whose root is the host's). Its /etc is
    # the unedited build: sandboxes must get ``etc`` instead.
    root: Path | None = None
    image: ImageConfig | None = None  # a pulled image's environment, working directory, ...
    version: str | None = None  # BuiltTemplate.version
    # An image build's root (ExecRequest.build_root): bound writable, /etc included, and the
    # command runs as root inside its user namespace, without the workspace.
    writable: bool = False


def _copy_host_etc(tmp: Path) -> None:
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


def _copy_built_etc(source: Path) -> Callable[[Path], None]:
    def copy(tmp: Path) -> None:
        def ignore(directory: str, names: list[str]) -> list[str]:
            rel = os.path.relpath(directory, source)
            return [n for n in names
                    if any(fnmatch.fnmatchcase(os.path.normpath(os.path.join(rel, n)), pattern)
                           for pattern in _BUILT_ETC_DENY)]

        shutil.copytree(source, tmp, symlinks=True, ignore=ignore, dirs_exist_ok=True)

    return copy


def _add_corral_files(tmp: Path, extra_ca: bytes | None) -> None:
    for name in ("passwd", "group", "hosts", "hostname", "resolv.conf"):
        (tmp / name).unlink(missing_ok=True)  # may be a symlink into the built root
    (tmp / "passwd").write_text(_PASSWD)
    (tmp / "group").write_text(_GROUP)
    (tmp / "hosts").write_text(_HOSTS)
    (tmp / "hostname").write_text("sandbox\n")
    (tmp / "resolv.conf").write_text(_RESOLV_CONF)
    if extra_ca:
        # The egress gateway's CA, trusted inside for the hosts it intercepts.
        (tmp / "corral").mkdir(exist_ok=True)
        (tmp / "corral" / "egress-ca.pem").write_bytes(extra_ca)
        bundle = tmp / "ssl" / "certs" / "ca-certificates.crt"
        if bundle.is_file() and not bundle.is_symlink():
            bundle.write_bytes(bundle.read_bytes().rstrip(b"\n") + b"\n" + extra_ca)
        else:
            bundle.parent.mkdir(parents=True, exist_ok=True)
            bundle.unlink(missing_ok=True)
            bundle.write_bytes(extra_ca)
    for path in [tmp, *tmp.rglob("*")]:
        if not path.is_symlink():
            # Readable by every sandbox uid; nothing secret is left in here.
            executable = path.is_dir() or path.stat().st_mode & 0o111
            os.chmod(path, 0o755 if executable else 0o644)


def _lstat_key(path: str) -> list[int]:
    st = os.lstat(path)
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode]


def _host_etc_state(etc: str = "/etc") -> str:
    """What changes when the allowlisted part of the host's ``/etc`` does, cheaply: every
    top-level entry (a file edited in place changes its own mtime) and every directory below
    them (a file added, removed or replaced by rename, as dpkg and ldconfig do, changes its
    directory's). A file deep in a directory edited in place is missed until something else
    changes; base's copies are small and a stale one only lags, it never leaks more."""
    state: list[object] = []
    for name in _ETC_ALLOW:
        top = os.path.join(etc, name)
        try:
            state.append([name, *_lstat_key(top)])
        except OSError:
            continue
        pending = [top] if os.path.isdir(top) and not os.path.islink(top) else []
        while pending:
            directory = pending.pop()
            with contextlib.suppress(OSError), os.scandir(directory) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        state.append([entry.path, *_lstat_key(entry.path)])
                        pending.append(entry.path)
    return hashlib.sha256(repr(state).encode()).hexdigest()


def _curated_etc(parent: Path, fill: Callable[[Path], None], extra_ca: bytes | None, *,
                 source_state: str = "") -> Path:
    """``parent/etc.<digest>``, made once by ``fill`` plus Corral's files; ``source_state``
    names the state of what ``fill`` copies when that can change (the host's ``/etc``).

    Made in a private directory and renamed into place, so concurrent first uses (a CLI and a
    server) cannot see or break each other's half-made copy; the loser discards its own.
    """
    stamp = _VERSION + (f":{hashlib.sha256(extra_ca).hexdigest()}" if extra_ca else "")
    stamp += f":{hashlib.sha256(_RESOLV_CONF.encode()).hexdigest()}"
    stamp += f":{source_state}" if source_state else ""
    dest = parent / f"etc.{hashlib.sha256(stamp.encode()).hexdigest()[:16]}"
    if dest.is_dir():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=".etc-", dir=parent))
    try:
        fill(tmp)
        _add_corral_files(tmp, extra_ca)
        try:
            tmp.rename(dest)
        except OSError:
            if not dest.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _system_of(root: Path, names: tuple[str, ...]) -> tuple[tuple[str, str, str], ...]:
    system = []
    for entry in names:
        src = root / entry
        if src.is_symlink():
            system.append(("symlink", os.readlink(src), f"/{entry}"))
        elif src.is_dir():
            system.append(("bind", str(src), f"/{entry}"))
    return tuple(system)


def load_template(name: str, templates_dir: Path, *, extra_ca: bytes | None = None) -> BaseTemplate:
    """Return the template ``name``, making its curated ``/etc`` on first use.

    Raises:
        UsageError: unknown template, or one not built on this host.
    """
    masked = tuple(p for p in _MASKED_PROC if os.path.exists(p))
    if name == "base":
        (templates_dir / "base").mkdir(parents=True, exist_ok=True, mode=0o755)
        etc = _curated_etc(templates_dir / "base", _copy_host_etc, extra_ca,
                           source_state=_host_etc_state())
        return BaseTemplate(etc=etc, system=_system_of(Path("/"), _SYSTEM_DIRS),
                            masked_proc=masked)
    build = current_template(name, templates_dir)
    try:
        etc = _curated_etc(build.path, _copy_built_etc(build.root / "etc"), extra_ca)
    except FileNotFoundError:
        # Removed (`corral templates rm`) while we looked; never recreate its directory.
        raise not_built(name, templates_dir) from None
    if build.image is None:
        return BaseTemplate(etc=etc,
                            system=_system_of(build.root, _SYSTEM_DIRS + _BUILT_EXTRA_DIRS),
                            masked_proc=masked, root=build.root, version=build.version)
    top = sorted(n for n in os.listdir(build.root) if n not in _IMAGE_SKIPPED_DIRS)
    return BaseTemplate(etc=etc, system=_system_of(build.root, tuple(top)), masked_proc=masked,
                        root=build.root, version=build.version,
                        image=ImageConfig.from_dict(build.image.get("config") or {}))


_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")


def template_python(template: BaseTemplate) -> str | None:
    """Where python3 is inside the template's root (None if it has none): helpers that run
    inside a sandbox (the gVisor resident) need it, and an image may not have it."""
    return _PYTHONS[0] if template.root is None else _python_in(template.root)


@functools.lru_cache(maxsize=256)
def _python_in(root: Path) -> str | None:
    # A build's root never changes once made, so its answer holds.
    for path in _PYTHONS:
        if executable_in_root(root, path):
            return path
    return None


def build_root_template(root: Path) -> BaseTemplate:
    """The template for an image build's step: every top-level directory of ``root`` bound
    writable (``ExecRequest.build_root``)."""
    masked = tuple(p for p in _MASKED_PROC if os.path.exists(p))
    system = []
    for name in sorted(os.listdir(root)):
        if name in _BUILD_SKIPPED_DIRS:
            continue
        path = root / name
        if path.is_symlink():
            system.append(("symlink", os.readlink(path), f"/{name}"))
        elif path.is_dir():
            system.append(("bind-rw", str(path), f"/{name}"))
    return BaseTemplate(etc=root / "etc", system=tuple(system), masked_proc=masked, root=root,
                        writable=True)


# The kernel's and the sandbox's own; everything else of a build's root is the command's.
# /workspace is not: a step has no workspace, and a Dockerfile's ``WORKDIR /workspace`` (a
# common one) is the image's directory, which its steps write in as Docker's do.
_BUILD_SKIPPED_DIRS = frozenset({"proc", "sys", "dev", "tmp", "run"})
