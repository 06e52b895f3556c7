"""A template's root filesystem as the read-only ext4 image a microVM boots from (``/dev/vda``).

The image is the template's built root with its curated ``/etc`` (users, hosts, the egress CA)
in place of the build's own, plus the guest skeleton: ``/corral/init`` (PID 1, static),
``/corral/run`` (the per-command launcher, static, when ``run.c`` exists), ``/corral/agent.pyz``
(the guest agent: the ``corral._guest`` package as a zipapp, ``agent_zipapp``) and the mount
points the guest needs on a read-only root. It is made with ``mkfs.ext4 -d`` (no journal: the
guest mounts it read-only, and QEMU opens it read-only) and cached by a key over what went in,
so every sandbox of a template shares one file and a change to the template, its ``/etc``, the
skeleton sources (the guest package's among them) or this recipe makes a new image next to the
old one.

Layout of the cache directory::

    <key>.ext4   the image, root-owned 0644, appears by one rename
    <key>.json   what it was built from, how long it took, how big it is
    .build-*     builds in progress
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..._core.privileged import privileged_env
from ...errors import BackendError, BackendUnavailable, UsageError
from .._linux.template import BaseTemplate

__all__ = ["AGENT", "BASE_SPEC", "RootImage", "agent_zipapp", "images_dir", "root_image",
           "skeleton_sources", "template_name"]

log = logging.getLogger(__name__)

# The template name ``base`` (the host's own /usr on the other tiers) is this spec here.
BASE_SPEC = "microvm-base"
_RECIPE = "2"  # bump when the steps below change what comes out
_HERE = Path(__file__).parent
_GUEST = _HERE.parent.parent / "_guest"  # the corral._guest package
AGENT = "agent.pyz"  # its name in /corral; init.c starts it
# The zipapp's entry: the package is ``_guest`` in the archive (its imports are relative).
_ZIP_MAIN = b"from _guest.__main__ import main\n\nmain()\n"
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest a zip can say: no build's own time
_MOUNT_POINTS = ("workspace", "home/user", "proc", "sys", "dev", "tmp", "run", "corral")
_MARGIN_BYTES = 64 << 20
_STEP_TIMEOUT_S = 600


@dataclass(frozen=True, slots=True)
class RootImage:
    """A built root image in the cache."""

    path: Path
    key: str
    size_bytes: int  # the image file's size (sparse: the guest sees this much)
    build_s: float  # how long the build took (0.0 when it came from the cache)


def template_name(name: str) -> str:
    """The template a microVM of template ``name`` boots: ``base`` is ``microvm-base`` here."""
    return BASE_SPEC if name == "base" else name


def images_dir(home: Path) -> Path:
    return home / "microvm" / "images"


def skeleton_sources() -> dict[str, Path]:
    """The guest pieces that go into ``/corral``, by their name there: the C programs (``run``
    only if written) and ``agent.pyz``, made from the ``corral._guest`` package directory."""
    sources = {"init": _HERE / "init.c", AGENT: _GUEST}
    if (_HERE / "run.c").is_file():
        sources["run"] = _HERE / "run.c"
    return sources


def agent_zipapp() -> bytes:
    """The guest agent as the one file the guest's python3 runs (``python3 -I -S
    /corral/agent.pyz``): the modules of ``corral._guest`` as the package ``_guest``, and a
    ``__main__`` that runs it.

    The same sources give the same bytes (the image key hashes them): names in a fixed order,
    one fixed time and mode. It is written with ``zipfile`` rather than
    ``zipapp.create_archive``, which stamps each file's own mtime and its ``__main__`` with the
    time of the build; the format is the same.
    """
    members = [("__main__.py", _ZIP_MAIN)]
    members += [(f"_guest/{path.name}", path.read_bytes())
                for path in sorted(_GUEST.glob("*.py"))]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members:
            info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
            info.external_attr = 0o644 << 16
            archive.writestr(info, data)
    return buffer.getvalue()


def _skeleton_bytes(name: str, source: Path) -> bytes:
    return agent_zipapp() if name == AGENT else source.read_bytes()


def _template_parts(template: BaseTemplate | Path) -> tuple[Path, Path]:
    """(root, etc) of the template; the root's own /etc for a bare directory."""
    if isinstance(template, Path):
        return template, template / "etc"
    if template.root is None:
        raise UsageError(
            "the microVM tier cannot boot the host-backed template 'base'; it uses the "
            f"Debian template {BASE_SPEC!r} instead (build it once with "
            f"`corral templates build {BASE_SPEC}`)")
    return template.root, template.etc


def _identity(root: Path) -> bytes:
    # A built template never changes after its rename, and its metadata names its spec hash:
    # that is its identity. A bare directory (tests, images) is identified by what is in it.
    meta = root.parent / "template.json"
    if meta.is_file():
        return f"{root.resolve()}\n".encode() + meta.read_bytes()
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            digest.update(f"{os.path.relpath(path, root)}\0{st.st_mode}\0{st.st_size}\0"
                          f"{st.st_mtime_ns}\0{st.st_uid}\0{st.st_gid}\n".encode())
    return digest.digest()


def _key(root: Path, etc: Path) -> str:
    digest = hashlib.sha256()
    parts = [_RECIPE.encode(), _identity(root), str(etc.resolve()).encode()]
    for name, source in sorted(skeleton_sources().items()):
        parts += [name.encode(), _skeleton_bytes(name, source)]
    for part in parts:
        digest.update(len(part).to_bytes(8, "big") + part)
    return digest.hexdigest()[:16]


def _run(argv: list[str], what: str) -> None:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=_STEP_TIMEOUT_S,
                                check=False, env=privileged_env(), stdin=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise BackendUnavailable(f"{argv[0]} is missing to {what}; install it (apt-get install "
                                 "e2fsprogs gcc libc6-dev)") from exc
    except subprocess.TimeoutExpired as exc:
        raise BackendError(f"{what} took longer than {_STEP_TIMEOUT_S} s ({argv[0]})") from exc
    if result.returncode != 0:
        raise BackendError(f"could not {what} ({' '.join(argv[:3])} ... exit "
                           f"{result.returncode}): {(result.stderr or result.stdout)[-800:]}")


def _has_python(root: Path) -> bool:
    # /usr/bin/python3 is a symlink (python3.11); resolve it inside the root, not on the host.
    path = root / "usr" / "bin" / "python3"
    for _ in range(8):
        if not os.path.islink(path):
            return path.is_file()
        target = os.readlink(path)
        path = (root / target.lstrip("/")) if target.startswith("/") else path.parent / target
    return False


def _stage(root: Path, etc: Path, tree: Path) -> None:
    """``tree`` = the template root (hard links: nothing in it is written) + /etc + skeleton."""
    try:
        _run(["cp", "-al", f"{root}/.", str(tree)], "link the template root for the image")
    except BackendError:
        # Another filesystem than the cache's: copy instead.
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir()
        _run(["cp", "-a", f"{root}/.", str(tree)], "copy the template root for the image")
    # Replaced, never edited: the files are links into the template build.
    shutil.rmtree(tree / "etc", ignore_errors=True)
    if (tree / "etc").is_symlink():
        (tree / "etc").unlink()
    shutil.copytree(etc, tree / "etc", symlinks=True)
    # Nothing of root's: the namespace tier's sandboxes have no /root either, and a build's
    # root home is nobody's business in a sandbox.
    shutil.rmtree(tree / "root", ignore_errors=True)
    for name in _MOUNT_POINTS:
        path = tree / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir() and name != "corral":
            shutil.rmtree(path)  # a mount point hides whatever the build left there
        path.mkdir(parents=True, exist_ok=True, mode=0o755)
    os.chmod(tree / "tmp", 0o1777)
    os.chown(tree / "workspace", 1000, 1000)
    os.chown(tree / "home" / "user", 1000, 1000)
    corral = tree / "corral"
    for name, source in skeleton_sources().items():
        if source.suffix == ".c":
            _run(["gcc", "-static", "-O2", "-Wall", "-o", str(corral / name), str(source)],
                 f"compile the guest's /corral/{name} from {source.name}")
            os.chmod(corral / name, 0o755)
        else:
            (corral / name).write_bytes(_skeleton_bytes(name, source))
            os.chmod(corral / name, 0o644)


def _tree_size(tree: Path) -> tuple[int, int]:
    """(bytes on disk, inodes) of ``tree``, hard links counted once."""
    seen: set[int] = set()
    total, inodes = 0, 0
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if st.st_ino in seen:
                continue
            seen.add(st.st_ino)
            inodes += 1
            total += max(st.st_blocks * 512, 4096)
    return total, inodes


def root_image(template: BaseTemplate | Path, cache: Path) -> RootImage:
    """The root image for ``template`` (a loaded template or a built root directory), built
    unless cached.

    Raises:
        UsageError: the host-backed ``base`` template (the microVM tier boots ``microvm-base``),
            or a template without ``/usr/bin/python3`` (the guest agent runs on it).
        BackendUnavailable: mkfs.ext4 or gcc is missing.
        BackendError: a build step failed.
    """
    root, etc = _template_parts(template)
    if not _has_python(root):
        raise UsageError(
            f"template root {root} has no /usr/bin/python3, which the microVM guest agent runs "
            "on; add python3 to the template's packages and build it again")
    key = _key(root, etc)
    final = cache / f"{key}.ext4"
    cached = _load(cache, key)
    if cached is not None:
        return cached
    cache.mkdir(parents=True, exist_ok=True, mode=0o755)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=cache))
    try:
        tree = work / "tree"
        tree.mkdir()
        _stage(root, etc, tree)
        used, inodes = _tree_size(tree)
        # Read-only: no reserved blocks, no journal; the margin is for ext4's own metadata.
        size = ((used + used // 8 + _MARGIN_BYTES) + (1 << 20) - 1) // (1 << 20) << 20
        image = work / "root.ext4"
        _run(["mkfs.ext4", "-q", "-F", "-d", str(tree), "-O", "^has_journal", "-m", "0",
              "-b", "4096", "-N", str(inodes + inodes // 4 + 1024), "-L", "corral-root",
              "-U", _uuid(key), "-E", f"hash_seed={_uuid(key)}", str(image),
              f"{size >> 10}k"], "make the root image with mkfs.ext4")
        os.chmod(image, 0o644)
        build_s = round(time.monotonic() - started, 2)
        meta = {"key": key, "root": str(root), "etc": str(etc), "recipe": _RECIPE,
                "size_bytes": size, "content_bytes": used, "build_s": build_s,
                "built_at": time.time()}
        (work / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        os.chmod(work / "meta.json", 0o644)
        # Metadata first, image last: an image without its metadata is never loaded.
        os.rename(work / "meta.json", cache / f"{key}.json")
        os.rename(image, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("built microVM root image %s (%d MiB) in %.1f s", key, size >> 20, build_s)
    return RootImage(path=final, key=key, size_bytes=size, build_s=build_s)


def _uuid(key: str) -> str:
    h = hashlib.sha256(key.encode()).hexdigest()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _load(cache: Path, key: str) -> RootImage | None:
    try:
        meta = json.loads((cache / f"{key}.json").read_text())
        path = cache / f"{key}.ext4"
        if not path.is_file():
            return None
        _touch(cache / f"{key}.json")
        return RootImage(path=path, key=key, size_bytes=int(meta["size_bytes"]), build_s=0.0)
    except (OSError, ValueError, KeyError):
        return None


def _touch(path: Path) -> None:
    """Marks a cache entry used now: the cache sweep removes the least recently used first."""
    try:
        os.utime(path)
    except OSError:
        pass  # a read-only cache is still a cache
