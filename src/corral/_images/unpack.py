"""Unpacking untrusted image layers on the host, and stacking them into a root filesystem.

An image is someone else's archive, read as root: it may hold ``../`` paths, absolute paths,
symlinks (absolute or not) with files written "through" them, hard links to paths outside,
device nodes, setuid binaries, file capabilities in xattrs, whiteouts of ``/etc``, or simply be
bigger than the disk. Python's ``tarfile`` extraction filters reject some of this and follow the
rest; this module instead never resolves a path through anything it did not just make itself:

* every path is split into components and walked from a directory file descriptor with
  ``O_NOFOLLOW | O_DIRECTORY``, so no symlink in the tree is ever followed on the host, and an
  entry that would pass through one is refused;
* ``..`` anywhere refuses the layer; a leading ``/`` is dropped (the path is the image's own);
* hard links resolve inside the layer being unpacked, never on the host;
* device nodes and FIFOs are left out, setuid/setgid bits cleared, xattrs (file capabilities,
  SELinux labels) never applied, and every file is owned by root on the host whatever uid the
  archive names, so nothing in an image is owned by a host uid that matters;
* sizes and entry counts are capped while unpacking, not after.

Each layer unpacks once into a directory of its own (its whiteouts kept aside as data), keyed
by its ``diff_id``; an image's root is then stacked from its layers with hard links, so images
sharing base layers share their files on disk and a second image costs only its own layers.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import os
import shutil
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..errors import ImageError

__all__ = ["LayerContent", "LayerLimits", "SafeTree", "compose_root", "path_components",
           "unpack_layer"]

_OPAQUE = ".wh..wh..opq"
_WHITEOUT = ".wh."
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20
_MAX_NAME = 255
_MAX_PATH = 4096


@dataclass(frozen=True, slots=True)
class LayerLimits:
    max_bytes: int  # file content written, summed over the image
    max_entries: int = 1_000_000


@dataclass(slots=True)
class LayerContent:
    """What a layer holds besides its tree: what it deletes from the layers below, and what
    was left out of it."""

    diff_id: str
    whiteouts: list[str] = field(default_factory=list)  # paths removed from lower layers
    opaque: list[str] = field(default_factory=list)  # directories whose lower content goes
    entries: int = 0
    bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # "device", "fifo", "setuid", "xattr"

    def to_dict(self) -> dict[str, Any]:
        return {"diff_id": self.diff_id, "whiteouts": self.whiteouts, "opaque": self.opaque,
                "entries": self.entries, "bytes": self.bytes, "skipped": self.skipped}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerContent:
        return cls(diff_id=str(data["diff_id"]), whiteouts=list(data["whiteouts"]),
                   opaque=list(data["opaque"]), entries=int(data["entries"]),
                   bytes=int(data["bytes"]), skipped=dict(data["skipped"]))


class _Hashing(io.RawIOBase):
    """Reads through to ``raw`` and hashes everything read: the layer's ``diff_id``."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._raw.read(len(buffer))
        self.sha256.update(data)
        buffer[: len(data)] = data
        return len(data)

    def drain(self) -> None:
        while chunk := self._raw.read(_CHUNK):
            self.sha256.update(chunk)


def path_components(name: str, what: str) -> list[str]:
    """The path's components inside the root; ``..`` anywhere refuses the layer."""
    if len(name.encode(errors="surrogateescape")) > _MAX_PATH:
        raise ImageError(f"{what}: a path is longer than {_MAX_PATH} bytes")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    for part in parts:
        if part == "..":
            raise ImageError(f"{what}: entry {_show(name)} climbs out of the root with '..'; "
                             "the image is refused")
        if len(part.encode(errors="surrogateescape")) > _MAX_NAME:
            raise ImageError(f"{what}: a name in {_show(name)} is longer than {_MAX_NAME} bytes")
    return parts


def _show(name: str) -> str:
    return repr(name if len(name) <= 120 else name[:120] + "...")


class SafeTree:
    """A directory tree written through directory descriptors only (see the module doc).

    It keeps the descriptors of one path's directories, the last one asked for: layers list
    their entries mostly directory by directory, so most entries reuse them. A descriptor from
    ``directory(p)`` stays open while later calls ask for ``p`` or paths below it.
    """

    def __init__(self, root: Path, what: str) -> None:
        self.what = what
        self._root_fd = os.open(root, _DIR_FLAGS)
        self._chain: list[tuple[str, int]] = []  # (name, fd) from the root down

    def close(self) -> None:
        self._truncate(0)
        os.close(self._root_fd)

    def _truncate(self, keep: int) -> None:
        while len(self._chain) > keep:
            os.close(self._chain.pop()[1])

    def directory(self, parts: list[str] | tuple[str, ...], *, create: bool) -> int | None:
        """The descriptor of directory ``parts`` (made if missing and ``create``); None if it
        is missing. Refuses to pass through a symlink or a file."""
        common = 0
        for (held, _), part in zip(self._chain, parts, strict=False):
            if held != part:
                break
            common += 1
        self._truncate(common)
        fd = self._chain[-1][1] if self._chain else self._root_fd
        for index in range(common, len(parts)):
            name = parts[index]
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    return None
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
                try:
                    fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    raise self._through(parts[: index + 1], exc) from None
            except OSError as exc:
                raise self._through(parts[: index + 1], exc) from None
            self._chain.append((name, fd))
        return fd

    def detached(self, parts: list[str]) -> int | None:
        """Like ``directory(parts, create=False)``, but a descriptor of the caller's own, which
        it must close; the held path is left alone."""
        fd = os.dup(self._root_fd)
        for index, name in enumerate(parts):
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                os.close(fd)
                return None
            except OSError as exc:
                os.close(fd)
                raise self._through(parts[: index + 1], exc) from None
            os.close(fd)
            fd = child
        return fd

    def _through(self, key: list[str] | tuple[str, ...], exc: OSError) -> ImageError:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return ImageError(f"{self.what}: an entry goes through {'/'.join(key)!r}, which "
                              "is a symlink or a file, not a directory; such paths are never "
                              "followed on the host, so the image is refused")
        return ImageError(f"{self.what}: cannot open {'/'.join(key)!r}: {exc.strerror}")

    def remove(self, parts: list[str], name: str) -> bool:
        """Remove ``name`` (a whole directory tree too) from directory ``parts``; False if
        either is absent. Leaves ``parts`` held."""
        parent = self.directory(parts, create=False)
        if parent is None:
            return False
        try:
            st = os.lstat(name, dir_fd=parent)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=parent)
        else:
            os.unlink(name, dir_fd=parent)
        return True

    def replace_with_directory(self, parts: list[str], name: str, mode: int) -> None:
        """``name`` in ``parts`` a directory of ``mode`` (a file or symlink there is replaced,
        as overlayfs lets a directory above hide one)."""
        parent = self.directory(parts, create=True)
        assert parent is not None
        try:
            if not stat.S_ISDIR(os.lstat(name, dir_fd=parent).st_mode):
                self.remove(parts, name)
                os.mkdir(name, 0o700, dir_fd=parent)
        except FileNotFoundError:
            os.mkdir(name, 0o700, dir_fd=parent)
        fd = self.directory([*parts, name], create=False)
        assert fd is not None
        os.fchmod(fd, mode)

    def clear(self, parts: list[str]) -> None:
        """Remove everything inside directory ``parts`` (an opaque directory's lower part)."""
        fd = self.directory(parts, create=False)
        if fd is None:
            return
        for name in os.listdir(fd):
            self.remove(parts, name)


def _stream(blob: IO[bytes], media_type: str, what: str) -> IO[bytes]:
    if media_type.endswith(("+gzip", ".tar.gzip")):
        return gzip.GzipFile(fileobj=blob, mode="rb")  # type: ignore[return-value]
    if media_type.endswith((".tar", ".diff.tar")):
        return blob
    if media_type.endswith("+zstd"):
        raise ImageError(f"{what}: zstd-compressed layers are not supported yet; push the "
                         "image with gzip layers (`skopeo copy --dest-compress-format gzip`)")
    raise ImageError(f"{what}: unknown layer media type {media_type!r}")


def _safe_mode(mode: int, *, directory: bool, image_owner: int) -> int:
    # Permission bits only (no setuid/setgid; sticky kept on directories such as /tmp). A file
    # the image gives to a non-root user is the sandbox user's to read: everything is owned by
    # root on the host, so its owner's read and execute bits are given to others as well.
    mode &= 0o1777 if directory else 0o777
    if image_owner != 0:
        mode |= (mode & 0o500) >> 6
    return mode


class _Counter:
    def __init__(self, limits: LayerLimits, used: int) -> None:
        self.limits = limits
        self.bytes = used
        self.entries = 0


def unpack_layer(blob: IO[bytes], media_type: str, dest: Path, *, diff_id: str,
                 limits: LayerLimits, used_bytes: int = 0, what: str = "layer",
                 on_progress: Callable[[int], None] | None = None) -> LayerContent:
    """Unpack one layer archive into the empty directory ``dest``.

    ``diff_id`` (``sha256:...``) is what the image config says the uncompressed archive hashes
    to; a mismatch refuses the layer. ``used_bytes``: content already unpacked for this image,
    counted against ``limits.max_bytes``.

    Raises:
        ImageError: a hostile or damaged layer, a digest mismatch, or a limit passed; ``dest``
            is then in an unknown state and must be removed by the caller.
    """
    content = LayerContent(diff_id=diff_id)
    counter = _Counter(limits, used_bytes)
    try:
        stream = _stream(blob, media_type, what)
        hashing = _Hashing(stream)
        reader = io.BufferedReader(hashing, buffer_size=_CHUNK)
        tree = SafeTree(dest, what)
        try:
            with tarfile.open(fileobj=reader, mode="r|", errorlevel=2) as archive:
                for member in archive:
                    _entry(archive, member, tree, content, counter)
                    if on_progress is not None and counter.entries % 2048 == 0:
                        on_progress(counter.bytes)
            # The end-of-archive blocks and any padding after them are part of the diff_id
            # (what the reader buffered is hashed already).
            hashing.drain()
        finally:
            tree.close()
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, OSError) as exc:
        if isinstance(exc, ImageError):
            raise
        raise ImageError(f"{what}: not a readable layer archive: {exc}") from None
    got = "sha256:" + hashing.sha256.hexdigest()
    if got != diff_id:
        raise ImageError(f"{what}: its content hashes to {got}, but the image config says "
                         f"{diff_id}; the layer is damaged or was tampered with")
    content.entries = counter.entries
    content.bytes = counter.bytes - used_bytes
    return content


def _entry(archive: tarfile.TarFile, member: tarfile.TarInfo, tree: SafeTree,
           content: LayerContent, counter: _Counter) -> None:
    what = tree.what
    counter.entries += 1
    if counter.entries > counter.limits.max_entries:
        raise ImageError(f"{what}: more than {counter.limits.max_entries} entries")
    parts = path_components(member.name, what)
    if not parts:
        return  # the root itself ("./")
    *parent_parts, name = parts
    if name == _OPAQUE:
        content.opaque.append("/".join(parent_parts))
        return
    if name.startswith(_WHITEOUT):
        hidden = name[len(_WHITEOUT):]
        if hidden in ("", ".", ".."):
            raise ImageError(f"{what}: whiteout {_show(member.name)} names no entry")
        content.whiteouts.append("/".join([*parent_parts, hidden]))
        return
    if member.pax_headers and any(k.startswith("SCHILY.xattr.") for k in member.pax_headers):
        content.skipped["xattr"] = content.skipped.get("xattr", 0) + 1
    if member.ischr() or member.isblk():
        content.skipped["device"] = content.skipped.get("device", 0) + 1
        return
    if member.isfifo():
        content.skipped["fifo"] = content.skipped.get("fifo", 0) + 1
        return
    if member.mode & 0o6000 and not member.isdir():
        content.skipped["setuid"] = content.skipped.get("setuid", 0) + 1
    if member.isdir():
        _directory(tree, parent_parts, name, member)
    elif member.isreg():
        _file(archive, member, tree, parent_parts, name, counter)
    elif member.issym():
        if len(member.linkname.encode(errors="surrogateescape")) > _MAX_PATH:
            raise ImageError(f"{what}: symlink {_show(member.name)} has a target over "
                             f"{_MAX_PATH} bytes")
        parent = _fresh_entry(tree, parent_parts, name)
        # Made, never followed: the target resolves inside a sandbox's own root only.
        os.symlink(member.linkname, name, dir_fd=parent)
    elif member.islnk():
        _hard_link(tree, parent_parts, name, member)
    else:
        raise ImageError(f"{what}: entry {_show(member.name)} has an unknown type "
                         f"{member.type!r}")


def _fresh_entry(tree: SafeTree, parent_parts: list[str], name: str) -> int:
    """The parent's descriptor, made if missing, with nothing left at ``name``."""
    parent = tree.directory(parent_parts, create=True)
    assert parent is not None
    tree.remove(parent_parts, name)
    return parent


def _directory(tree: SafeTree, parent_parts: list[str], name: str,
               member: tarfile.TarInfo) -> None:
    tree.replace_with_directory(parent_parts, name,
                                _safe_mode(member.mode, directory=True, image_owner=member.uid))


def _file(archive: tarfile.TarFile, member: tarfile.TarInfo, tree: SafeTree,
          parent_parts: list[str], name: str, counter: _Counter) -> None:
    if counter.bytes + member.size > counter.limits.max_bytes:
        raise ImageError(f"{tree.what}: the image unpacks to more than "
                         f"{counter.limits.max_bytes} bytes (Settings.image_max_bytes)")
    parent = _fresh_entry(tree, parent_parts, name)
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=parent)
    try:
        source = archive.extractfile(member)
        if source is not None:
            while chunk := source.read(_CHUNK):
                counter.bytes += len(chunk)
                if counter.bytes > counter.limits.max_bytes:
                    raise ImageError(f"{tree.what}: the image unpacks to more than "
                                     f"{counter.limits.max_bytes} bytes "
                                     "(Settings.image_max_bytes)")
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        os.fchmod(fd, _safe_mode(member.mode, directory=False, image_owner=member.uid))
        # Kept: Python trusts a .pyc only while its source's mtime matches.
        mtime_ns = int(member.mtime) * 1_000_000_000
        os.utime(fd, ns=(mtime_ns, mtime_ns))
    finally:
        os.close(fd)


def _hard_link(tree: SafeTree, parent_parts: list[str], name: str,
               member: tarfile.TarInfo) -> None:
    what = tree.what
    target = path_components(member.linkname, what)
    if not target:
        raise ImageError(f"{what}: hard link {_show(member.name)} points at the root")
    missing = ImageError(f"{what}: hard link {_show(member.name)} points at "
                         f"{_show(member.linkname)}, which is not in the layer")
    source_dir = tree.detached(target[:-1])
    if source_dir is None:
        raise missing
    try:
        parent = _fresh_entry(tree, parent_parts, name)
        # Inside the layer's own tree, and the link itself when the target is a symlink.
        os.link(target[-1], name, src_dir_fd=source_dir, dst_dir_fd=parent,
                follow_symlinks=False)
    except FileNotFoundError:
        raise missing from None
    except PermissionError:
        raise ImageError(f"{what}: hard link {_show(member.name)} points at a directory or "
                         "at something that cannot be linked") from None
    finally:
        os.close(source_dir)


# -- stacking layers into a root --------------------------------------------------------------


def _scan(fd: int) -> Iterator[tuple[str, os.stat_result]]:
    with os.scandir(fd) as entries:
        for entry in entries:
            yield entry.name, entry.stat(follow_symlinks=False)


def compose_root(layers: list[tuple[Path, LayerContent]], dest: Path, *,
                 workdir: str | None = None, link: bool = True) -> None:
    """Stack unpacked layers (lowest first) into the empty directory ``dest``.

    Files and symlinks are hard links to the layers' own (nothing is copied; the layers and
    every root made from them are read-only from here on); directories are made afresh. A
    layer's whiteouts and opaque directories remove what the layers below it put there, and a
    directory in a layer replaces a file or symlink of the same path below it (as overlayfs
    stacks them). ``/etc`` is always a real directory afterwards, and ``workdir`` exists.
    ``link=False`` copies every file instead (a root that is going to be written: a build's).
    """
    out = SafeTree(dest, "image")
    try:
        for tree_path, content in layers:
            for rel in content.opaque:
                out.clear(path_components(rel, "image"))
            for rel in content.whiteouts:
                *parent_parts, name = path_components(rel, "image")
                out.remove(parent_parts, name)
            layer_fd = os.open(tree_path, _DIR_FLAGS)
            try:
                _link_tree(layer_fd, [], out, link)
            finally:
                os.close(layer_fd)
        root_fd = out.directory([], create=False)
        assert root_fd is not None
        try:
            st = os.lstat("etc", dir_fd=root_fd)
            if not stat.S_ISDIR(st.st_mode):
                # A symlinked /etc would have the host's /etc copied for sandboxes to read.
                out.remove([], "etc")
                os.mkdir("etc", 0o755, dir_fd=root_fd)
        except FileNotFoundError:
            os.mkdir("etc", 0o755, dir_fd=root_fd)
        if workdir:
            # Docker makes a missing WorkingDir; one through a symlink of the image's own is
            # left for the sandbox to resolve inside its root (never followed here).
            with contextlib.suppress(ImageError):
                out.directory(path_components(workdir, "image config WorkingDir"), create=True)
    finally:
        out.close()


def _link_tree(source_fd: int, parts: list[str], out: SafeTree, link: bool) -> None:
    dest_fd = out.directory(parts, create=False)
    assert dest_fd is not None
    for name, st in sorted(_scan(source_fd)):
        if stat.S_ISDIR(st.st_mode):
            out.replace_with_directory(parts, name, stat.S_IMODE(st.st_mode))
            sub = os.open(name, _DIR_FLAGS, dir_fd=source_fd)
            try:
                _link_tree(sub, [*parts, name], out, link)
            finally:
                os.close(sub)
            dest_fd = out.directory(parts, create=False)  # the cache may have been reset
            assert dest_fd is not None
        else:
            out.remove(parts, name)
            if not link:
                _copy_entry(source_fd, dest_fd, name, st)
                continue
            try:
                os.link(name, name, src_dir_fd=source_fd, dst_dir_fd=dest_fd,
                        follow_symlinks=False)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                _copy_entry(source_fd, dest_fd, name, st)


def _copy_entry(source_fd: int, dest_fd: int, name: str, st: os.stat_result) -> None:
    """A copy of one file or symlink (another file system, or a root to be written)."""
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(name, dir_fd=source_fd), name, dir_fd=dest_fd)
        return
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=source_fd)
    try:
        dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      stat.S_IMODE(st.st_mode), dir_fd=dest_fd)
        try:
            while os.copy_file_range(src, dst, _CHUNK):
                pass
            os.fchmod(dst, stat.S_IMODE(st.st_mode))
            os.utime(dst, ns=(st.st_mtime_ns, st.st_mtime_ns))
        finally:
            os.close(dst)
    finally:
        os.close(src)
