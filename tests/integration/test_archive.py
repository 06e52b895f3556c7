"""Streaming tar upload and download of whole trees, against real sandboxes (no mocks).

Proven here: a tree (nested directories, binary files, a symlink) goes in as a plain or gzip tar,
is visible to commands with the sandbox user as owner, and comes back out equal; every classic
archive attack (tar-slip by ``..`` or absolute names, symlinks and hard links to host files,
devices, fifos, writing through a symlink, size and entry-count bombs) is refused with
``PathRefused`` / ``QuotaExceeded`` and leaves the host untouched while the sandbox keeps
working; and a 200 MB archive streams in and out without the host process growing.
"""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import shutil
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import PathRefused, QuotaExceeded, Sandbox
from corral._control.manager import Manager
from corral._workspace.archive import ExtractReport, create_tar, extract_tar
from corral._workspace.files import WorkspaceFiles

pytestmark = pytest.mark.needs_root


# -- helpers -----------------------------------------------------------------------------------


def run_ok(sb: Sandbox, cmd: str, timeout: float = 60) -> str:
    r = sb.commands.run(cmd, timeout=timeout)
    assert r.exit_code == 0, f"{cmd!r} exited {r.exit_code}: {r.stdout!r} {r.stderr!r}"
    return r.stdout


def workspace(manager: Manager, sb: Sandbox) -> WorkspaceFiles:
    return manager.files(sb.id)._files


def host_root(manager: Manager, sb: Sandbox) -> Path:
    return manager.backend.workspace_root(manager._spec(manager.get(sb.id)))


def make_tar(*entries: tuple[str, bytes | None, dict[str, object]], gz: bool = False) -> bytes:
    """A tar built entry by entry: (name, data or None, TarInfo attributes)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", format=tarfile.PAX_FORMAT) as t:
        for name, data, attrs in entries:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            for key, value in attrs.items():
                setattr(info, key, value)
            if data is not None:
                info.size = len(data)
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def f(name: str, data: bytes, **attrs: object) -> tuple[str, bytes | None, dict[str, object]]:
    return (name, data, attrs)


def d(name: str, **attrs: object) -> tuple[str, bytes | None, dict[str, object]]:
    return (name, None, {"type": tarfile.DIRTYPE, "mode": 0o755, **attrs})


def sym(name: str, target: str) -> tuple[str, bytes | None, dict[str, object]]:
    return (name, None, {"type": tarfile.SYMTYPE, "linkname": target})


BLOB = bytes(range(256)) * 16 + b"\x00\r\n\xff" + os.urandom(100_000)

TREE = make_tar(
    d("./"),
    d("a/"),
    f("a/b.txt", b"hello from the tar\n"),
    d("a/deep/er/"),
    f("a/deep/er/blob.bin", BLOB, mode=0o640),
    f("run.sh", b"#!/bin/sh\necho ran\n", mode=0o6777),  # setuid/setgid must be dropped
    sym("a/link", "b.txt"),
    f("top.txt", b"top\n"),
)


class HostGuard:
    """A host canary directory plus /etc: both must look the same after every refusal."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="corral-canary-"))
        (self.dir / "secret.txt").write_bytes(f"SECRET-{secrets.token_hex(8)}\n".encode())
        self.before = self.snapshot()

    def snapshot(self) -> dict[str, object]:
        etc = Path("/etc")
        out: dict[str, object] = {
            "canary": sorted((p.name, p.read_bytes(), p.lstat().st_mtime_ns)
                             for p in self.dir.iterdir()),
            "etc": sorted(p.name for p in etc.iterdir()),
            "passwd": (etc / "passwd").read_bytes(),
            "passwd_st": ((etc / "passwd").stat().st_mtime_ns, (etc / "passwd").stat().st_nlink),
        }
        return out

    def check(self) -> None:
        assert self.snapshot() == self.before
        assert not Path("/etc/evil").exists()


@pytest.fixture
def guard() -> Iterator[HostGuard]:
    g = HostGuard()
    try:
        yield g
    finally:
        shutil.rmtree(g.dir, ignore_errors=True)


def rss_kib(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux 4.0+)
    except OSError:
        return False
    return True


class GeneratedStream:
    """A read-only file object over a generator of byte chunks: nothing is materialized."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = b""
        self.consumed = 0

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self._buf) < size:
            nxt = next(self._chunks, None)
            if nxt is None:
                break
            self._buf += nxt
        if size < 0:
            size = len(self._buf)
        out, self._buf = self._buf[:size], self._buf[size:]
        self.consumed += len(out)
        return out


def zero_archive(name: str, size: int) -> Iterator[bytes]:
    """A tar with one ``size``-byte file of zeros, produced 1 MiB at a time."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    yield info.tobuf(tarfile.PAX_FORMAT)
    zeros = bytes(1 << 20)
    left = size
    while left:
        n = min(left, len(zeros))
        yield zeros[:n]
        left -= n
    yield b"\0" * ((-size) % 512) + b"\0" * 1024


# -- round trips -------------------------------------------------------------------------------


def test_upload_is_visible_inside_and_owned_by_the_sandbox_user(
    sandbox: Sandbox, manager: Manager
) -> None:
    files = workspace(manager, sandbox)
    report = extract_tar(files, "/workspace/up", io.BytesIO(TREE), max_bytes=1 << 20)
    assert report == ExtractReport(files=4, dirs=2, symlinks=1, bytes=len(BLOB) + 19 + 19 + 4)

    out = run_ok(sandbox, "cd up && find . -type f | sort; cat a/b.txt; cat a/link; "
                          "sha256sum a/deep/er/blob.bin | cut -c1-64; ./run.sh")
    assert out == ("./a/b.txt\n./a/deep/er/blob.bin\n./run.sh\n./top.txt\n"
                   "hello from the tar\nhello from the tar\n"
                   f"{hashlib.sha256(BLOB).hexdigest()}\nran\n")
    owners = run_ok(sandbox, "cd up && stat -c '%n %u:%g %a' . a a/deep a/deep/er a/b.txt "
                             "a/deep/er/blob.bin run.sh top.txt; stat -c '%u:%g' -L a/link; "
                             "readlink a/link")
    assert owners.splitlines() == [
        ". 1000:1000 755", "a 1000:1000 755", "a/deep 1000:1000 755", "a/deep/er 1000:1000 755",
        "a/b.txt 1000:1000 644", "a/deep/er/blob.bin 1000:1000 640", "run.sh 1000:1000 755",
        "top.txt 1000:1000 644", "1000:1000", "b.txt",
    ]
    # The sandbox user can change and remove what was uploaded.
    run_ok(sandbox, "cd up && echo more >> a/b.txt && rm -r a/deep && rm a/link")
    assert sandbox.files.read("up/a/b.txt") == "hello from the tar\nmore\n"


def test_download_round_trip_equals(sandbox: Sandbox, manager: Manager) -> None:
    files = workspace(manager, sandbox)
    extract_tar(files, "tree", io.BytesIO(TREE), max_bytes=1 << 20)
    run_ok(sandbox, "cd tree && mkfifo pipe && printf made-inside > a/inside.txt")

    report = ExtractReport()
    chunks = list(create_tar(files, "/workspace/tree", max_bytes=1 << 20, report=report))
    assert all(len(c) <= 2 << 20 for c in chunks)
    data = b"".join(chunks)
    assert len(data) % tarfile.RECORDSIZE == 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as t:
        members = {m.name: m for m in t.getmembers()}
        assert sorted(members) == ["a", "a/b.txt", "a/deep", "a/deep/er", "a/deep/er/blob.bin",
                                   "a/inside.txt", "a/link", "run.sh", "top.txt"]  # no fifo
        assert members["a/link"].issym() and members["a/link"].linkname == "b.txt"
        assert members["a"].isdir()
        assert members["run.sh"].mode == 0o755
        assert members["a/b.txt"].uid == 1000
        content = {n: t.extractfile(m).read() for n, m in members.items()  # type: ignore[union-attr]
                   if m.isreg()}
    assert content["a/deep/er/blob.bin"] == BLOB
    assert content["a/b.txt"] == b"hello from the tar\n"
    assert content["a/inside.txt"] == b"made-inside"
    assert report.files == 5 and report.symlinks == 1 and report.dirs == 3

    # Upload what was downloaded (gzip this time) elsewhere: the same tree.
    gz = b"".join(create_tar(files, "tree", max_bytes=1 << 20, gzip=True))
    assert gz[:2] == b"\x1f\x8b"
    extract_tar(files, "copy", io.BytesIO(gz), max_bytes=1 << 20)
    assert run_ok(sandbox, "diff -r --no-dereference tree copy 2>&1 | grep -v pipe; "
                           "cd copy && find . | sort | tr '\\n' ' '") == (
        ". ./a ./a/b.txt ./a/deep ./a/deep/er ./a/deep/er/blob.bin ./a/inside.txt ./a/link "
        "./run.sh ./top.txt "
    )


def test_gzip_upload(sandbox: Sandbox, manager: Manager) -> None:
    gz = make_tar(f("z/one.txt", b"1\n"), f("z/two.txt", b"2\n"), gz=True)
    assert gz[:2] == b"\x1f\x8b"
    report = extract_tar(workspace(manager, sandbox), ".", io.BytesIO(gz), max_bytes=100)
    assert report.files == 2 and report.bytes == 4
    assert run_ok(sandbox, "cat z/one.txt z/two.txt") == "1\n2\n"


def test_download_refuses_a_missing_or_escaping_source(sandbox: Sandbox, manager: Manager) -> None:
    files = workspace(manager, sandbox)
    run_ok(sandbox, "ln -s /etc etc-link && echo x > plain")
    with pytest.raises(PathRefused):
        create_tar(files, "/etc", max_bytes=1 << 20)
    with pytest.raises(PathRefused):
        list(create_tar(files, "etc-link", max_bytes=1 << 20))
    with pytest.raises(PathRefused):
        list(create_tar(files, "../..", max_bytes=1 << 20))
    from corral import FileError, FileNotFound
    with pytest.raises(FileNotFound):
        create_tar(files, "nope", max_bytes=1 << 20)
    with pytest.raises(FileError, match="not a directory"):
        create_tar(files, "plain", max_bytes=1 << 20)
    # A symlink inside the tree pointing out is archived as a link, never followed.
    run_ok(sandbox, "mkdir t && ln -s /etc/passwd t/pw && ln -s ../../../../etc t/up")
    data = b"".join(create_tar(files, "t", max_bytes=1 << 20))
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        assert {(m.name, m.type, m.linkname, m.size) for m in t} == {
            ("pw", tarfile.SYMTYPE, "/etc/passwd", 0), ("up", tarfile.SYMTYPE, "../../../../etc", 0)
        }
    with pytest.raises(QuotaExceeded):
        list(create_tar(files, ".", max_bytes=0, gzip=True))


# -- refusals ----------------------------------------------------------------------------------

OK_FIRST = f("first.txt", b"first\n")

REFUSED = {
    "dotdot": (make_tar(OK_FIRST, f("../evil", b"x")), "'..' component"),
    "absolute": (make_tar(OK_FIRST, f("/etc/evil", b"x")), "absolute"),
    "inner-dotdot": (make_tar(OK_FIRST, f("a/../../evil", b"x")), "'..' component"),
    "symlink-etc-then-write": (
        make_tar(OK_FIRST, sym("link", "/etc"), f("link/evil", b"x")), "absolute path '/etc'"),
    "symlink-passwd": (make_tar(OK_FIRST, sym("pw", "/etc/passwd")), "absolute path"),
    "symlink-climbs": (make_tar(OK_FIRST, sym("up", "../" * 20 + "etc")), "leads out"),
    "symlink-chain": (
        make_tar(OK_FIRST, d("p/"), sym("p/q", ".."), sym("p/r", "q/..")), "goes through"),
    "through-own-symlink": (
        make_tar(OK_FIRST, d("sub/"), sym("inner", "sub"), f("inner/evil", b"x")),
        "beneath 'inner'"),
    "hardlink-passwd": (
        make_tar(OK_FIRST, ("hl", None, {"type": tarfile.LNKTYPE, "linkname": "/etc/passwd"})),
        "hard link"),
    "hardlink-inside": (
        make_tar(OK_FIRST, ("hl", None, {"type": tarfile.LNKTYPE, "linkname": "first.txt"})),
        "hard link"),
    "char-device": (
        make_tar(OK_FIRST, ("mem", None, {"type": tarfile.CHRTYPE, "devmajor": 1,
                                          "devminor": 1})), "device"),
    "block-device": (
        make_tar(OK_FIRST, ("sda", None, {"type": tarfile.BLKTYPE, "devmajor": 8})), "device"),
    "fifo": (make_tar(OK_FIRST, ("p", None, {"type": tarfile.FIFOTYPE})), "fifo"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_entries_leave_host_untouched(
    case: str, sandbox: Sandbox, manager: Manager, guard: HostGuard
) -> None:
    data, reason = REFUSED[case]
    files = workspace(manager, sandbox)
    root = host_root(manager, sandbox)
    outside = sorted(p.name for p in root.parent.iterdir())
    with pytest.raises(PathRefused, match=reason) as info:
        extract_tar(files, "/workspace/dest", io.BytesIO(data), max_bytes=1 << 20)
    assert "archive entry #" in str(info.value)
    guard.check()
    assert sorted(p.name for p in root.parent.iterdir()) == outside
    # Validate-as-you-go: what came before the refused entry stays; nothing else appeared.
    assert sandbox.files.read("dest/first.txt") == "first\n"
    assert run_ok(sandbox, "find / /workspace -xdev -name evil 2>/dev/null | wc -l; "
                           "ls -A /workspace") == "0\ndest\n"
    if case == "symlink-chain":
        assert sorted(e.name for e in sandbox.files.list("dest/p")) == ["q"]
    assert run_ok(sandbox, "echo still works") == "still works\n"


def test_symlink_planted_by_the_sandbox_is_refused(
    sandbox: Sandbox, manager: Manager, guard: HostGuard
) -> None:
    files = workspace(manager, sandbox)
    run_ok(sandbox, f"mkdir dest && ln -s /etc dest/link && ln -s {guard.dir} dest/canary "
                    "&& ln -s ../../../../../../etc dest/climb && ln -s ../inside dest/ok "
                    "&& mkdir inside")
    for name in ("link/evil", "canary/evil", "climb/evil", "link/passwd", "canary/secret.txt"):
        with pytest.raises(PathRefused, match="leaves /workspace"):
            extract_tar(files, "dest", io.BytesIO(make_tar(f(name, b"pwned\n"))),
                        max_bytes=100)
        guard.check()
    # A link that stays inside the workspace is followed, like every other host-side lookup.
    extract_tar(files, "dest", io.BytesIO(make_tar(f("ok/fine.txt", b"fine\n"))), max_bytes=100)
    assert run_ok(sandbox, "cat inside/fine.txt") == "fine\n"
    # A file entry over a planted link replaces the link; it never writes through it.
    extract_tar(files, "dest", io.BytesIO(make_tar(f("link", b"now a file\n"))), max_bytes=100)
    assert run_ok(sandbox, "stat -c %F dest/link; cat dest/link") == "regular file\nnow a file\n"
    guard.check()
    # The destination itself being an escaping link is refused too.
    run_ok(sandbox, "ln -s /etc etcdest")
    with pytest.raises(PathRefused):
        extract_tar(files, "etcdest/sub", io.BytesIO(make_tar(f("x", b"x"))), max_bytes=100)
    guard.check()
    assert run_ok(sandbox, "echo ok") == "ok\n"


def test_oversize_archive_is_refused_before_writing(
    sandbox: Sandbox, manager: Manager, guard: HostGuard
) -> None:
    files = workspace(manager, sandbox)
    data = make_tar(f("small.txt", b"x" * 600), f("big.bin", b"y" * 600))
    report = ExtractReport()
    with pytest.raises(QuotaExceeded, match="'big.bin'.*limit of 1000 bytes") as info:
        extract_tar(files, "dest", io.BytesIO(data), max_bytes=1000, report=report)
    assert "the entry before it was extracted" in str(info.value)
    assert report == ExtractReport(files=1, bytes=600)
    assert sandbox.files.exists("dest/small.txt")
    assert not sandbox.files.exists("dest/big.bin")
    assert run_ok(sandbox, "ls -A dest") == "small.txt\n"  # no temp file left behind
    # A gzip bomb: 50 MB of zeros in about 50 KB.
    bomb = make_tar(f("zeros", bytes(50 << 20)), gz=True)
    assert len(bomb) < 200_000
    with pytest.raises(QuotaExceeded, match="'zeros'"):
        extract_tar(files, "bomb", io.BytesIO(bomb), max_bytes=1 << 20)
    assert sandbox.files.list("bomb") == []
    guard.check()
    assert run_ok(sandbox, "echo ok") == "ok\n"


def test_too_many_entries_is_refused(sandbox: Sandbox, manager: Manager) -> None:
    files = workspace(manager, sandbox)
    data = make_tar(*(f(f"n/{i}", b"") for i in range(10)))
    with pytest.raises(QuotaExceeded, match="more than 3 entries") as info:
        extract_tar(files, ".", io.BytesIO(data), max_bytes=1 << 20, max_entries=3)
    assert "the 3 entries before it were extracted" in str(info.value)
    assert sorted(e.name for e in sandbox.files.list("n")) == ["0", "1", "2"]


def test_not_a_tar_or_truncated(sandbox: Sandbox, manager: Manager) -> None:
    from corral import FileError

    files = workspace(manager, sandbox)
    with pytest.raises(FileError, match="not a valid tar"):
        extract_tar(files, "x", io.BytesIO(os.urandom(4096)), max_bytes=1 << 20)
    truncated = make_tar(f("a.bin", os.urandom(100_000)))[:50_000]
    with pytest.raises(FileError, match="'a.bin'"):
        extract_tar(files, "x", io.BytesIO(truncated), max_bytes=1 << 20)
    assert sandbox.files.list("x") == []  # the partial file's temp copy is gone
    huge_name = make_tar(f("n" * 2_000_000, b"x"))
    with pytest.raises(QuotaExceeded, match="extended header"):
        extract_tar(files, "x", io.BytesIO(huge_name), max_bytes=1 << 20)


# -- memory ------------------------------------------------------------------------------------


def test_200mb_streams_in_and_out_in_bounded_memory(sandbox: Sandbox, manager: Manager) -> None:
    files = workspace(manager, sandbox)
    size = 200 << 20  # the small tier's workspace is 1 GiB
    stream = GeneratedStream(zero_archive("big/zeros.bin", size))
    peak_known = reset_peak_rss()
    before = rss_kib()
    started = time.monotonic()
    try:
        report = extract_tar(files, "/workspace", stream, max_bytes=size)  # type: ignore[arg-type]
        grown = rss_kib() - before
        peak = rss_kib("VmHWM") - before if peak_known else grown
        assert report == ExtractReport(files=1, bytes=size)
        assert stream.consumed >= size
        assert grown < 50 * 1024, f"RSS grew by {grown} KiB while extracting 200 MB"
        assert peak < 50 * 1024, f"RSS peaked {peak} KiB above the start while extracting"
        assert run_ok(sandbox, "stat -c '%s %u' big/zeros.bin") == f"{size} 1000\n"

        reset_peak_rss()
        before = rss_kib()
        total = 0
        for chunk in create_tar(files, "big", max_bytes=size):
            total += len(chunk)
        peak = rss_kib("VmHWM") - before if peak_known else rss_kib() - before
        assert total >= size
        assert peak < 50 * 1024, f"RSS peaked {peak} KiB above the start while archiving"
        assert time.monotonic() - started < 120
    finally:
        files.remove("big")
    assert not sandbox.files.exists("big")
