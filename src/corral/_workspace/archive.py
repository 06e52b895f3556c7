"""Whole trees into and out of a sandbox's ``/workspace`` as streaming tar archives.

Threat model. Both the archive (uploaded by an API caller, often an agent relaying something it
fetched) and the workspace (written by the sandboxed code, which may be hostile and may change
it while we work) are untrusted; the host process runs as root. So:

* Nothing is ever written through a host path string. Every entry goes through the
  sandbox's ``WorkspaceFS``; the host tiers' one, ``WorkspaceFiles``, looks up with
  ``openat2(RESOLVE_BENEATH)`` from the workspace root: the kernel refuses any step out of
  ``/workspace`` (``..``, absolute or escaping symlinks the sandbox planted, even while it
  swaps them) and we report that as ``PathRefused``. That is the
  security boundary; everything below about ``dest`` is about keeping an archive inside the
  directory it was aimed at.
* Entry names are checked before anything is written: absolute names and any ``..`` component
  are refused; so are symlinks whose target is absolute or leads out of ``dest`` (checked
  component by component, so a link cannot escape through another link from the same archive),
  every hard link (a link to a path the archive did not write, such as ``/etc/passwd``, is the
  classic attack, and links inside a tree are rare; re-create the archive with
  ``tar --hard-dereference``), device nodes, fifos, GNU sparse entries and unknown types.
  An entry whose parent is a symlink extracted earlier from the same archive is refused too
  (GNU tar defers symlinks for the same reason), whatever the link points at.
* Size: ``max_bytes`` bounds the total uncompressed file content and ``max_entries`` the number
  of headers; both are checked from the header, before the entry's first byte is written.
  Memory stays bounded whatever the input: data moves in 1 MiB chunks, gzip is inflated with
  bounded output per read, metadata headers (PAX, GNU long names) over ``MAX_HEADER_BYTES`` are
  refused before they are read, and tarfile's list of seen members is cleared as we go. Only
  plain and gzip-compressed tar is accepted (bzip2 and xz can inflate by ratios that tarfile's
  stream reader would buffer whole).
* Files are written atomically (temp file + rename) with permission bits masked by ``0o755``
  (no setuid, setgid, sticky or group/other write), owned by the sandbox's uid; directories
  are created ``mkdir -p`` style with mode ``0o755``. Owners, groups and directory modes in the
  archive are ignored; file mtimes are kept.

Refusal semantics: validate as we go. Extraction stops at the first refused or failing entry
and raises; entries before it stay in place (the message says how many), the refused entry
leaves nothing behind (a partly written file is a temp file that is removed). Pass ``report=``
to see the counts of what was extracted when an error is raised.

Download walks the tree with ``WorkspaceFiles.walk`` (never follows symlinks; they go into the
archive as symlink entries; fifos, sockets and devices are skipped) and writes tar headers with
``TarInfo.tobuf`` and file data ourselves, yielding chunks as they are produced, so a large file
is never held in memory.
"""

from __future__ import annotations

import contextlib
import gzip as _gzip
import logging
import tarfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, BinaryIO, cast

from ..backends import WorkspaceFS
from ..errors import CorralError, FileError, PathRefused, QuotaExceeded, TooLarge
from .files import to_relative

__all__ = ["MAX_HEADER_BYTES", "ExtractReport", "create_tar", "extract_tar"]

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 1 << 20
_CHUNK = 1 << 20
_FLUSH = 1 << 16
_MAX_MTIME = 1 << 34  # year 2514; tar allows far larger values that utime() rejects
_ARCHIVE_ERRORS = (tarfile.TarError, OSError, EOFError, zlib.error)


@dataclass(slots=True)
class ExtractReport:
    """What an archive operation moved (filled in as it goes, so partial on error).

    Attributes:
        files: regular files written (or archived).
        dirs: directory entries.
        symlinks: symlink entries.
        bytes: file content bytes, uncompressed.
    """

    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    bytes: int = 0

    @property
    def entries(self) -> int:
        """Files, directories and symlinks together."""
        return self.files + self.dirs + self.symlinks


# -- reading ---------------------------------------------------------------------------------


class _BoundedTarInfo(tarfile.TarInfo):
    """A TarInfo that refuses, before reading them, headers that tarfile would buffer whole.

    The hooks are tarfile's private per-type processing methods (stable since Python 3.2).
    """

    def _proc_member(self, tarfile_: tarfile.TarFile) -> Any:
        if self.type in _META_TYPES and self.size > MAX_HEADER_BYTES:
            raise TooLarge(
                f"an extended header of {self.size} bytes is over the {MAX_HEADER_BYTES}-byte "
                "limit for metadata"
            )
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise _sparse()
        return tarfile.TarInfo._proc_member(self, tarfile_)  # type: ignore[attr-defined]

    def _proc_gnusparse_10(self, *args: object) -> Any:
        raise _sparse()


_META_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
               tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)


def _sparse() -> PathRefused:
    return PathRefused("GNU sparse entries are not supported; create the archive without -S")


class _Prefixed:
    """``stream`` with ``head`` (already read from it) put back in front."""

    def __init__(self, head: bytes, stream: BinaryIO) -> None:
        self._head = head
        self._stream = stream

    def read(self, size: int = -1) -> bytes:
        if self._head:
            if size < 0:
                size = len(self._head)
            out, self._head = self._head[:size], self._head[size:]
            return out
        return self._stream.read(size)


@contextlib.contextmanager
def _archive_errors() -> Iterator[None]:
    """Turn what a corrupt, truncated or non-tar input raises into ``FileError``."""
    try:
        yield
    except _ARCHIVE_ERRORS as exc:
        raise FileError(
            f"the upload is not a valid tar archive (plain or gzip-compressed), or it is "
            f"truncated: {exc}"
        ) from None


def _open_tar(stream: BinaryIO) -> tarfile.TarFile:
    head = b""
    while len(head) < 2:
        more = stream.read(2 - len(head))
        if not more:
            break
        head += more
    source: Any = _Prefixed(head, stream)
    if head == b"\x1f\x8b":
        # GzipFile.read(n) inflates at most n bytes per call, unlike tarfile's own "r|gz".
        source = _gzip.GzipFile(fileobj=source, mode="rb")
    return tarfile.open(fileobj=cast(IO[bytes], source), mode="r|", bufsize=1 << 16,
                        tarinfo=_BoundedTarInfo)


def _entry_name(raw: str) -> str:
    """The entry's path relative to ``dest`` (``""`` for ``dest`` itself), or PathRefused."""
    _check_text(raw, "name")
    if raw.startswith("/"):
        raise PathRefused("its name is absolute; archive names must be relative")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise PathRefused("its name has a '..' component")
    return "/".join(parts)


def _check_text(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PathRefused(f"its {what} is not valid UTF-8") from None
    if "\x00" in text:
        raise PathRefused(f"its {what} contains a NUL byte")


def _check_link(name: str, target: str, links: set[str]) -> None:
    """Refuse a symlink target that is absolute, leaves ``dest``, or goes through a link.

    Walking the target one component at a time from the link's directory, and refusing to pass
    through a link this archive made, makes the lexical result the real one for the archive's
    own entries.
    """
    if not target:
        raise PathRefused("it is a symlink with an empty target")
    _check_text(target, "symlink target")
    if target.startswith("/"):
        raise PathRefused(f"it is a symlink to the absolute path {target!r}")
    where = name.split("/")[:-1]
    comps = [c for c in target.split("/") if c not in ("", ".")]
    for i, comp in enumerate(comps):
        if comp == "..":
            if not where:
                raise PathRefused(
                    f"it is a symlink to {target!r}, which leads out of the destination"
                )
            where.pop()
            continue
        where.append(comp)
        if i < len(comps) - 1 and "/".join(where) in links:
            raise PathRefused(
                f"it is a symlink to {target!r}, which goes through the symlink "
                f"{'/'.join(where)!r} from this archive"
            )


def _member_chunks(tar: tarfile.TarFile, member: tarfile.TarInfo) -> Iterator[bytes]:
    with _archive_errors():
        fobj = tar.extractfile(member)
    if fobj is None:  # pragma: no cover - only for non-regular members
        raise FileError("tarfile has no data for a regular file entry")
    remaining = member.size
    while remaining:
        with _archive_errors():
            chunk = fobj.read(min(_CHUNK, remaining))
        if not chunk:
            raise FileError("the archive ends in the middle of this file")
        remaining -= len(chunk)
        yield chunk


def extract_tar(
    files: WorkspaceFS, dest: str, stream: BinaryIO, *, max_bytes: int,
    max_entries: int = 100_000, report: ExtractReport | None = None,
) -> ExtractReport:
    """Extract a tar (plain or gzip) read from ``stream`` under the sandbox directory ``dest``.

    The stream is read once, front to back, in bounded chunks; it is not closed. See the
    module docstring for what is refused and why.

    Args:
        files: the sandbox's workspace.
        dest: a sandbox path (``/workspace/x`` or ``x``); created if missing.
        stream: anything with ``read(n)``.
        max_bytes: limit on the total uncompressed size of the files in the archive.
        max_entries: limit on the number of entries (headers) in the archive.
        report: filled in as entries are extracted; pass one to learn what was written when
            an error is raised.

    Returns:
        What was extracted (``report`` when given).

    Raises:
        PathRefused: an entry (named in the message) is refused, or ``dest`` leaves
            ``/workspace``.
        TooLarge: the files add up to more than ``max_bytes`` (or a metadata header is huge).
        QuotaExceeded: more than ``max_entries`` entries, or the workspace is full.
        FileError: the input is not a tar archive or is truncated; an entry clashes with
            what is there (a file where a directory is needed, ...).

    Example:
        >>> with open("tree.tar.gz", "rb") as f:
        ...     extract_tar(files, "/workspace/src", f, max_bytes=100 << 20)
        ExtractReport(files=12, dirs=3, symlinks=1, bytes=48213)
    """
    if max_bytes < 0 or max_entries < 0:
        raise ValueError("max_bytes and max_entries must not be negative")
    report = report if report is not None else ExtractReport()
    base = to_relative(dest)
    files.make_dir(dest)
    shown = "/workspace" if base == "." else f"/workspace/{base}"
    links: set[str] = set()
    count = 0
    name = ""
    try:
        with _archive_errors():
            tar = _open_tar(stream)
        try:
            while True:
                if count:
                    name = f"#{count + 1} (the header after {name})"
                with _archive_errors():
                    member = tar.next()
                if member is None:
                    return report
                cast(Any, tar).members.clear()  # tarfile keeps every member otherwise
                count += 1
                name = f"#{count} {member.name!r}"
                if count > max_entries:
                    raise QuotaExceeded(
                        f"the archive has more than {max_entries} entries; split it or raise "
                        "max_entries"
                    )
                _extract_member(files, tar, member, base, links, report,
                                max_bytes=max_bytes)
        finally:
            tar.close()
    except CorralError as exc:
        where = f"archive entry {name} for {shown}" if name else f"archive for {shown}"
        done = report.entries
        kept = (f"; the {done} entries before it were extracted and stay in place" if done > 1
                else "; the entry before it was extracted and stays in place" if done
                else "; nothing was extracted")
        raise type(exc)(f"{where}: {exc.message}{kept}") from None


def _extract_member(
    files: WorkspaceFS, tar: tarfile.TarFile, member: tarfile.TarInfo, base: str,
    links: set[str], report: ExtractReport, *, max_bytes: int,
) -> None:
    name = _entry_name(member.name)
    if not name:
        if member.isdir():
            return  # "./": the destination itself
        raise PathRefused("its name is the destination directory itself")
    parts = name.split("/")
    for i in range(1, len(parts)):
        parent = "/".join(parts[:i])
        if parent in links:
            raise PathRefused(
                f"it is beneath {parent!r}, a symlink extracted earlier from this archive; "
                "entries may not be written through symlinks from the same archive"
            )
    target = name if base == "." else f"{base}/{name}"
    if member.isreg():
        if member.size > max_bytes - report.bytes:
            raise TooLarge(
                f"its {member.size} bytes would take the archive past its limit of {max_bytes} "
                "bytes; nothing of it was written"
            )
        mtime = float(min(max(member.mtime, 0), _MAX_MTIME))
        files.write_stream(target, _member_chunks(tar, member), mode=member.mode & 0o755,
                           mtime=mtime, follow_symlinks=False)
        links.discard(name)
        report.files += 1
        report.bytes += member.size
    elif member.isdir():
        files.make_dir(target)
        report.dirs += 1
    elif member.issym():
        _check_link(name, member.linkname, links)
        files.symlink(target, member.linkname)
        links.add(name)
        report.symlinks += 1
    elif member.islnk():
        raise PathRefused(
            f"it is a hard link to {member.linkname!r}; hard links are refused (re-create the "
            "archive with `tar --hard-dereference`)"
        )
    elif member.ischr() or member.isblk():
        raise PathRefused("it is a device node; device files are refused")
    elif member.isfifo():
        raise PathRefused("it is a fifo; fifos are refused")
    else:
        raise PathRefused(f"its type {member.type!r} is not supported")


# -- writing ---------------------------------------------------------------------------------


class _Output:
    """Collects tar bytes (gzip-compressed if asked) and hands them out in chunks."""

    def __init__(self, *, compress: bool) -> None:
        self._z = zlib.compressobj(6, zlib.DEFLATED, 31) if compress else None
        self._buf = bytearray()
        self.offset = 0  # uncompressed bytes written

    def write(self, data: bytes) -> bytes | None:
        self.offset += len(data)
        self._buf += self._z.compress(data) if self._z is not None else data
        if len(self._buf) < _FLUSH:
            return None
        out = bytes(self._buf)
        self._buf.clear()
        return out

    def close(self) -> bytes:
        if self._z is not None:
            self._buf += self._z.flush()
        out = bytes(self._buf)
        self._buf.clear()
        return out


def create_tar(
    files: WorkspaceFS, src: str, *, max_bytes: int, max_entries: int = 100_000,
    gzip: bool = False, report: ExtractReport | None = None,
) -> Iterator[bytes]:
    """A tar archive (PAX format) of the tree under the sandbox directory ``src``, in chunks.

    ``src`` is checked now (so errors come before the first byte of a response); the tree is
    read lazily as the iterator is consumed. Entry names are relative to ``src``; owners are
    the sandbox user's view (uid/gid 1000); symlinks are stored as links, never followed;
    fifos, sockets and devices are skipped. A file that shrinks while it is read is padded
    with zeros and one that grows is cut at the size it had when opened, as GNU tar does.

    Args:
        files: the sandbox's workspace.
        src: a sandbox directory.
        max_bytes: limit on the total size of the files; checked before each file is added.
        max_entries: limit on the number of entries.
        gzip: compress the stream with gzip.
        report: filled in as entries are added.

    Returns:
        An iterator of byte chunks (about 64 KiB, or 1 MiB inside large files).

    Raises:
        PathRefused, FileNotFound, FileError: at call time, when ``src`` is not a directory
            inside ``/workspace``.
        TooLarge, QuotaExceeded: while iterating, when a limit is reached; the stream is then
            incomplete and must be discarded.
    """
    if max_bytes < 0 or max_entries < 0:
        raise ValueError("max_bytes and max_entries must not be negative")
    entry = files.stat(src)
    if entry.type not in ("dir", "symlink"):
        raise FileError(f"{entry.path} is not a directory; read() fetches a single file")
    return _tar_chunks(files, src, max_bytes, max_entries, gzip,
                       report if report is not None else ExtractReport())


def _tar_chunks(files: WorkspaceFS, src: str, max_bytes: int, max_entries: int,
                compress: bool, report: ExtractReport) -> Iterator[bytes]:
    out = _Output(compress=compress)
    count = 0
    for item in files.walk(src):
        count += 1
        if count > max_entries:
            raise QuotaExceeded(f"{src} holds more than {max_entries} entries")
        info = tarfile.TarInfo(item.path)
        info.mtime = int(item.mtime)
        info.mode = item.mode & 0o777
        info.uid = info.gid = 1000
        info.uname = info.gname = "user"
        if item.kind == "dir":
            info.type = tarfile.DIRTYPE
            report.dirs += 1
        elif item.kind == "symlink":
            info.type = tarfile.SYMTYPE
            info.linkname = item.link_target or ""
            report.symlinks += 1
        else:
            if item.size > max_bytes - report.bytes:
                raise TooLarge(
                    f"{src}/{item.path} ({item.size} bytes) would take the archive past its "
                    f"limit of {max_bytes} bytes"
                )
            info.type = tarfile.REGTYPE
            info.size = item.size
        if (chunk := out.write(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))):
            yield chunk
        if item.kind == "file" and item.read is not None:
            yield from _file_data(out, item.read, item.size)
            report.files += 1
            report.bytes += item.size
    # Two zero blocks end the archive; then pad to a whole record, as tar(1) writes it.
    total = out.offset + 2 * tarfile.BLOCKSIZE
    tail = b"\0" * (2 * tarfile.BLOCKSIZE + (-total) % tarfile.RECORDSIZE)
    if (chunk := out.write(tail)):
        yield chunk
    if (chunk := out.close()):
        yield chunk


def _file_data(out: _Output, read: Callable[[int], bytes], size: int) -> Iterator[bytes]:
    remaining = size
    while remaining:
        try:
            data = read(min(_CHUNK, remaining))
        except OSError as exc:
            raise FileError(f"reading a file for the archive failed: {exc.strerror}") from None
        if not data:  # shrank since it was opened
            logger.debug("file shrank while archived; padding %d bytes", remaining)
            data = b"\0" * min(_CHUNK, remaining)
        remaining -= len(data)
        if (chunk := out.write(data)):
            yield chunk
    if (chunk := out.write(b"\0" * ((-size) % tarfile.BLOCKSIZE))):
        yield chunk
