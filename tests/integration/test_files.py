"""The host-side file API into a sandbox's ``/workspace``, against real sandboxes (no mocks).

Three things are proven here: files move both ways between the SDK and commands with the right
owner; every path that would leave ``/workspace`` (by ``..``, an absolute path, or a symlink the
sandbox planted, also while the sandbox swaps it) is refused and never touches a host file; and
a full workspace raises ``QuotaExceeded`` without damaging what was there.

Host files used as targets live in a temporary directory the test creates (``canary``): the
sandbox cannot see it, but it can plant symlinks naming its host path, which the host would
follow if it resolved paths as strings.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from corral import FileError, FileNotFound, PathRefused, QuotaExceeded, Sandbox, UsageError
from corral.errors import CorralError

pytestmark = pytest.mark.needs_root


@dataclass
class Canary:
    """A host directory outside every workspace, holding a secret file and a victim file."""

    dir: Path
    secret_file: Path
    secret: bytes
    victim: Path

    def snapshot(self) -> dict[str, tuple[bytes, int, int]]:
        """Content, mtime and inode of every file in the directory."""
        out = {}
        for p in sorted(self.dir.iterdir()):
            st = p.lstat()
            out[p.name] = (p.read_bytes(), st.st_mtime_ns, st.st_ino)
        return out


@pytest.fixture
def canary() -> Iterator[Canary]:
    d = Path(tempfile.mkdtemp(prefix="corral-canary-"))
    try:
        secret = f"CANARY-SECRET-{secrets.token_hex(16)}\n".encode()
        secret_file = d / "secret.txt"
        secret_file.write_bytes(secret)
        victim = d / "victim"
        victim.write_bytes(b"do not touch\n")
        # Back-date, so a rewrite within the same second still shows in mtime.
        for p in (secret_file, victim):
            os.utime(p, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
        yield Canary(dir=d, secret_file=secret_file, secret=secret, victim=victim)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run_ok(sb: Sandbox, cmd: str, timeout: float = 30) -> str:
    r = sb.commands.run(cmd, timeout=timeout)
    assert r.exit_code == 0, f"{cmd!r} exited {r.exit_code}: {r.stdout!r} {r.stderr!r}"
    return r.stdout


def up(path: str) -> str:
    """A relative symlink target that climbs far above any directory and lands on ``path``."""
    return "../" * 24 + path.lstrip("/")


# -- both directions ---------------------------------------------------------------------------


def test_files_persist_across_commands(sandbox: Sandbox) -> None:
    run_ok(sandbox, "echo one > f1 && mkdir -p deep/er && printf two > deep/er/f2")
    assert run_ok(sandbox, "cat f1 deep/er/f2") == "one\ntwo"
    assert sandbox.files.read("f1") == "one\n"
    assert sandbox.files.read("/workspace/deep/er/f2") == "two"
    assert sandbox.files.read("./deep/er/f2") == "two"


def test_sdk_write_is_visible_owned_and_writable_inside(sandbox: Sandbox) -> None:
    entry = sandbox.files.write("a/b/c.txt", "from the host\n")
    assert entry.name == "c.txt"
    assert entry.path == "/workspace/a/b/c.txt"
    assert entry.type == "file"
    assert entry.size == len("from the host\n")

    out = run_ok(sandbox, "cat a/b/c.txt; stat -c '%u:%g %U' a a/b a/b/c.txt")
    assert out == "from the host\n" + "1000:1000 user\n" * 3
    # The sandbox can append to it, create next to it, rename and delete it.
    run_ok(sandbox, "echo appended >> a/b/c.txt && touch a/b/new && cp a/b/c.txt a/copy")
    assert sandbox.files.read("a/b/c.txt") == "from the host\nappended\n"
    assert sandbox.files.exists("a/b/new")
    run_ok(sandbox, "mv a/copy a/moved && rm a/moved && rm -r a/b")
    assert not sandbox.files.exists("a/b")


def test_command_written_file_is_readable_and_overwritable_by_sdk(sandbox: Sandbox) -> None:
    run_ok(sandbox, "printf 'made inside' > inside.txt && chmod 600 inside.txt")
    assert sandbox.files.read("inside.txt") == "made inside"
    sandbox.files.write("inside.txt", "replaced by host")
    out = run_ok(sandbox, "cat inside.txt; echo; stat -c '%u:%g' inside.txt; "
                          "echo more >> inside.txt")
    assert out == "replaced by host\n1000:1000\n"
    assert sandbox.files.read("inside.txt") == "replaced by host" + "more\n"


def test_binary_round_trip(sandbox: Sandbox) -> None:
    data = bytes(range(256)) * 64 + os.urandom(1 << 20) + b"\x00\r\n\x00"
    sandbox.files.write("bin/blob", data)
    assert run_ok(sandbox, "sha256sum < bin/blob").split()[0] == hashlib.sha256(data).hexdigest()
    assert sandbox.files.read("bin/blob", format="bytes") == data

    digest = run_ok(sandbox, "head -c 300000 /dev/urandom > rnd && sha256sum < rnd").split()[0]
    got = sandbox.files.read("rnd", format="bytes")
    assert isinstance(got, bytes) and len(got) == 300000
    assert hashlib.sha256(got).hexdigest() == digest


def test_non_utf8_content(sandbox: Sandbox) -> None:
    raw = b"ok \xff\xfe caf\xc3\xa9 \x80 end"
    run_ok(sandbox, r"printf 'ok \377\376 caf\303\251 \200 end' > latin")
    assert sandbox.files.read("latin", format="bytes") == raw
    assert sandbox.files.read("latin") == "ok \ufffd\ufffd café \ufffd end"
    sandbox.files.write("latin2", raw)
    assert sandbox.files.read("latin2", format="bytes") == raw
    assert sandbox.files.read("latin2") == raw.decode("utf-8", errors="replace")
    with pytest.raises(UsageError):
        sandbox.files.read("latin", format="base64")  # type: ignore[call-overload]


def test_overwrite(sandbox: Sandbox) -> None:
    sandbox.files.write("o.txt", "a much longer first version\n")
    entry = sandbox.files.write("o.txt", "short")
    assert entry.size == 5
    assert sandbox.files.read("o.txt") == "short"
    assert run_ok(sandbox, "cat o.txt") == "short"
    sandbox.files.write("/workspace/o.txt", b"")
    assert sandbox.files.read("o.txt") == ""
    # No temporary files are left behind by atomic writes.
    assert [e.name for e in sandbox.files.list()] == ["o.txt"]


def test_write_onto_directory_is_a_clear_error(sandbox: Sandbox) -> None:
    sandbox.files.write("dir/keep", "kept")
    with pytest.raises(FileError) as info:
        sandbox.files.write("dir", "x")
    assert info.type is FileError
    assert sandbox.files.read("dir/keep") == "kept"
    assert [e.name for e in sandbox.files.list()] == ["dir"]
    sandbox.files.write("plain", "x")
    with pytest.raises(FileError) as info:
        sandbox.files.write("plain/under", "x")  # a parent that is a file
    assert info.type is FileError
    assert sandbox.files.read("plain") == "x"


def test_make_dir_creates_parents(sandbox: Sandbox) -> None:
    assert sandbox.files.make_dir("x/y/z") is True
    assert sandbox.files.make_dir("/workspace/x/y/z") is False
    assert sandbox.files.make_dir("x") is False
    assert sandbox.files.make_dir("/workspace") is False
    assert sandbox.files.stat("x/y/z").type == "dir"
    out = run_ok(sandbox, "touch x/y/z/t && stat -c '%u %F' x x/y x/y/z")
    assert out == "1000 directory\n" * 3
    assert sandbox.files.exists("x/y/z/t")
    sandbox.files.write("f", "file")
    with pytest.raises(FileError) as info:
        sandbox.files.make_dir("f/sub")
    assert info.type is FileError


def test_list_stat_exists(sandbox: Sandbox) -> None:
    run_ok(sandbox, "mkdir -p d/sub && printf 12345 > d/five && ln -s five d/link && mkfifo d/fifo")
    entries = sandbox.files.list("d")
    assert [(e.name, e.type) for e in entries] == [
        ("fifo", "other"), ("five", "file"), ("link", "symlink"), ("sub", "dir"),
    ]
    by_name = {e.name: e for e in entries}
    assert by_name["five"].size == 5 and by_name["five"].path == "/workspace/d/five"
    assert [e.name for e in sandbox.files.list()] == ["d"]
    assert [e.name for e in sandbox.files.list("/workspace/")] == ["d"]

    st = sandbox.files.stat("d/five")
    assert (st.type, st.size, st.mode) == ("file", 5, 0o644)
    assert abs(st.modified_at - time.time()) < 120
    assert sandbox.files.stat("/workspace").type == "dir"
    assert sandbox.files.stat("d/link").type == "symlink"  # stat does not follow

    assert sandbox.files.exists("d/five")
    assert sandbox.files.exists("d/sub")
    assert sandbox.files.exists("d/link")
    assert sandbox.files.exists("/workspace")
    assert not sandbox.files.exists("d/missing")
    assert not sandbox.files.exists("nope/deeper/still")
    assert not sandbox.files.exists("d/five/under")

    with pytest.raises(FileNotFound):
        sandbox.files.list("missing")
    with pytest.raises(FileError) as info:
        sandbox.files.list("d/five")
    assert info.type is FileError
    with pytest.raises(FileNotFound):
        sandbox.files.stat("d/missing")
    with pytest.raises(FileNotFound):
        sandbox.files.stat("missing/deeper")


def test_read_errors_are_corral_errors(sandbox: Sandbox) -> None:
    run_ok(sandbox, "mkdir dir && mkfifo fifo && printf x > file && ln -s nowhere dangling")
    with pytest.raises(FileNotFound) as nf:
        sandbox.files.read("missing.txt")
    assert "/workspace/missing.txt" in str(nf.value)
    with pytest.raises(FileNotFound):
        sandbox.files.read("missing/deeper.txt")
    with pytest.raises(FileNotFound):
        sandbox.files.read("dangling")
    with pytest.raises(FileError) as isdir:
        sandbox.files.read("dir")
    assert isdir.type is FileError and "directory" in str(isdir.value)
    with pytest.raises(FileError) as notdir:
        sandbox.files.read("file/under")
    assert notdir.type is FileError
    # A FIFO is neither read nor waited on.
    started = time.monotonic()
    with pytest.raises(FileError) as fifo:
        sandbox.files.read("fifo")
    assert fifo.type is FileError
    assert time.monotonic() - started < 5
    for exc in (nf.value, isdir.value, notdir.value, fifo.value):
        assert isinstance(exc, CorralError) and not isinstance(exc, OSError)


def test_remove_file_and_tree(sandbox: Sandbox, canary: Canary) -> None:
    sandbox.files.write("one.txt", "1")
    sandbox.files.remove("one.txt")
    assert not sandbox.files.exists("one.txt")
    with pytest.raises(FileNotFound):
        sandbox.files.remove("one.txt")

    # A tree made inside, with symlinks out to the host canary and to /etc inside it:
    # removing the tree removes the links, never what they point at.
    run_ok(sandbox, f"mkdir -p t/a/b && echo x > t/a/b/f && echo y > t/g "
                    f"&& ln -s {canary.dir} t/a/hostdir && ln -s {up(str(canary.dir))} t/rel "
                    f"&& ln -s /etc t/a/b/etc && chmod 500 t/a")
    before = canary.snapshot()
    sandbox.files.remove("/workspace/t")
    assert not sandbox.files.exists("t")
    assert run_ok(sandbox, "ls -A") == ""
    assert canary.snapshot() == before
    assert Path("/etc/passwd").exists()


def test_remove_symlink_removes_link_not_target(sandbox: Sandbox, canary: Canary) -> None:
    run_ok(sandbox, f"mkdir sub && echo real > sub/real.txt && ln -s sub/real.txt in-file "
                    f"&& ln -s sub in-dir && ln -s {canary.secret_file} out-file "
                    f"&& ln -s {canary.dir} out-dir && ln -s /etc etc-link")
    before = canary.snapshot()
    for link in ("in-file", "in-dir", "out-file", "out-dir", "etc-link"):
        sandbox.files.remove(link)
        assert not sandbox.files.exists(link)
    assert sandbox.files.read("sub/real.txt") == "real\n"
    assert canary.snapshot() == before
    assert Path("/etc/passwd").is_file()


def test_remove_workspace_itself_is_refused(sandbox: Sandbox) -> None:
    sandbox.files.write("stay.txt", "here")
    for path in ("/workspace", "/workspace/", ".", "./", "/workspace/a/.."):
        with pytest.raises(PathRefused):
            sandbox.files.remove(path)
    assert sandbox.files.read("stay.txt") == "here"


# -- refusals ----------------------------------------------------------------------------------

BAD_PATHS = [
    "..", "../x", "/workspace/../etc/passwd", "/etc/passwd", "/", "a/../../x", "./../x",
    "/workspace/..", "/workspacex/y", "/workspace2", "//etc/passwd", "a\x00b", "\x00", "",
    "x" * 5000,
]


@pytest.mark.parametrize("path", BAD_PATHS, ids=repr)
def test_bad_paths_are_refused_everywhere(sandbox: Sandbox, path: str) -> None:
    with pytest.raises(PathRefused):
        sandbox.files.read(path)
    with pytest.raises(PathRefused):
        sandbox.files.read(path, format="bytes")
    with pytest.raises(PathRefused):
        sandbox.files.write(path, "pwned")
    with pytest.raises(PathRefused):
        sandbox.files.stat(path)
    with pytest.raises(PathRefused):
        sandbox.files.exists(path)
    with pytest.raises(PathRefused):
        sandbox.files.list(path)
    with pytest.raises(PathRefused):
        sandbox.files.remove(path)
    with pytest.raises(PathRefused):
        sandbox.files.make_dir(path)
    assert sandbox.files.list() == []
    assert Path("/etc/passwd").is_file()


@pytest.mark.parametrize("path", [None, 5, b"/workspace/x", Path("x"), ["x"]], ids=repr)
def test_non_string_paths_are_refused(sandbox: Sandbox, path: object) -> None:
    for call in (sandbox.files.read, sandbox.files.stat, sandbox.files.exists,
                 sandbox.files.list, sandbox.files.remove, sandbox.files.make_dir):
        with pytest.raises(PathRefused):
            call(path)  # type: ignore[arg-type, call-overload]
    with pytest.raises(PathRefused):
        sandbox.files.write(path, "x")  # type: ignore[arg-type]


def test_overlong_name_is_refused(sandbox: Sandbox) -> None:
    with pytest.raises(PathRefused):
        sandbox.files.write("n" * 300, "x")
    with pytest.raises(PathRefused):
        sandbox.files.read("n" * 300)


def _plant_leaf_links(sb: Sandbox, canary: Canary) -> None:
    run_ok(sb, f"ln -s /etc/passwd leak && ln -s ../../../../etc/passwd leak2 "
               f"&& ln -s {canary.secret_file} hostleak && ln -s {up(str(canary.secret_file))} "
               f"hostleak2 && ln -s loop loop")


LEAF_LINKS = ["leak", "leak2", "hostleak", "hostleak2", "/workspace/hostleak", "loop"]


def test_read_through_leaf_symlink_out_is_refused(sandbox: Sandbox, canary: Canary) -> None:
    _plant_leaf_links(sandbox, canary)
    for link in LEAF_LINKS:
        for fmt in ("text", "bytes"):
            with pytest.raises(PathRefused):
                sandbox.files.read(link, format=fmt)


def test_stat_and_list_do_not_follow_leaf_symlink_out(sandbox: Sandbox, canary: Canary) -> None:
    _plant_leaf_links(sandbox, canary)
    for link, target in [("leak", "/etc/passwd"), ("leak2", "../../../../etc/passwd"),
                         ("hostleak", str(canary.secret_file)),
                         ("hostleak2", up(str(canary.secret_file)))]:
        st = sandbox.files.stat(link)
        # Describes the link itself (size = length of the target string), not the target.
        assert (st.type, st.size) == ("symlink", len(target)), link
        assert sandbox.files.exists(link)
    listed = {e.name: e for e in sandbox.files.list()}
    assert listed["hostleak"].type == "symlink"
    assert listed["hostleak"].size == len(str(canary.secret_file))
    with pytest.raises(PathRefused):
        sandbox.files.list("leak")  # listing a link to a file outside: refused, not ENOTDIR


def test_write_through_leaf_symlink_never_touches_target(sandbox: Sandbox, canary: Canary) -> None:
    """Whatever write() does with a planted leaf symlink, the target outside is never written."""
    _plant_leaf_links(sandbox, canary)
    before = canary.snapshot()
    passwd = Path("/etc/passwd")
    passwd_before = (passwd.read_bytes(), passwd.stat().st_mtime_ns)
    for link in ("hostleak", "hostleak2", "leak", "leak2"):
        try:
            sandbox.files.write(link, b"PWNED")
        except PathRefused:
            continue
        # Not refused: then the link itself must have been replaced by a file in the workspace.
        assert sandbox.files.stat(link).type == "file"
        assert sandbox.files.read(link) == "PWNED"
    assert canary.snapshot() == before
    assert (passwd.read_bytes(), passwd.stat().st_mtime_ns) == passwd_before


def test_write_through_leaf_symlink_out_is_refused(sandbox: Sandbox, canary: Canary) -> None:
    """The documented contract (``Files``: symlinks pointing out raise PathRefused) for write."""
    _plant_leaf_links(sandbox, canary)
    before = canary.snapshot()
    for link in ("hostleak", "hostleak2", "leak", "leak2"):
        with pytest.raises(PathRefused):
            sandbox.files.write(link, b"PWNED")
        assert sandbox.files.stat(link).type == "symlink", f"{link} was replaced"
    assert canary.snapshot() == before


def test_ancestor_symlink_out_is_refused(sandbox: Sandbox, canary: Canary) -> None:
    name = f"corral-test-{secrets.token_hex(6)}"
    run_ok(sandbox, f"ln -s / rootlink && ln -s /etc dir && ln -s {canary.dir} hostdir "
                    f"&& ln -s {up(str(canary.dir))} hostdir2 && mkdir real "
                    f"&& ln -s ../../../.. real/up && ln -s ../rootlink real/viaroot")
    before = canary.snapshot()
    files = sandbox.files
    calls: list[tuple[str, object]] = []
    for path in ("rootlink/etc/passwd", "dir/passwd", "hostdir/secret.txt",
                 "hostdir2/secret.txt", "real/up/etc/passwd", "real/viaroot/etc/passwd",
                 "/workspace/rootlink/etc/hostname"):
        calls += [(f"read({path!r})", lambda p=path: files.read(p)),
                  (f"stat({path!r})", lambda p=path: files.stat(p))]
    for path in ("rootlink", "rootlink/etc", "dir", "hostdir", "hostdir2", "real/up"):
        calls.append((f"list({path!r})", lambda p=path: files.list(p)))
    for path in (f"dir/{name}", f"rootlink/{name}", f"hostdir/{name}", f"hostdir2/{name}",
                 f"real/up/tmp/{name}", f"dir/{name}/deeper", "hostdir/victim"):
        calls.append((f"write({path!r})", lambda p=path: files.write(p, b"PWNED")))
    for path in (f"hostdir/{name}", f"dir/{name}", f"rootlink/tmp/{name}"):
        calls.append((f"make_dir({path!r})", lambda p=path: files.make_dir(p)))
    for path in ("hostdir/victim", "hostdir2/victim", "dir/hostname", "rootlink/etc/hostname"):
        calls.append((f"remove({path!r})", lambda p=path: files.remove(p)))

    wrong: list[str] = []
    for label, call in calls:
        try:
            call()  # type: ignore[operator]
        except PathRefused:
            continue
        except Exception as exc:  # noqa: BLE001 - collected, so one run shows every mismatch
            wrong.append(f"{label} raised {type(exc).__name__}: {exc}")
        else:
            wrong.append(f"{label} succeeded")
    try:
        assert canary.snapshot() == before
        for host in (Path("/etc") / name, Path("/") / name, Path("/tmp") / name):
            assert not host.exists(), f"{host} was created on the host"
    finally:
        for host in (Path("/etc") / name, Path("/") / name, Path("/tmp") / name):
            if host.is_dir() and not host.is_symlink():
                shutil.rmtree(host)
            elif host.exists() or host.is_symlink():
                host.unlink()
    # The links themselves are untouched.
    assert {e.name: e.type for e in sandbox.files.list()} == {
        "dir": "symlink", "hostdir": "symlink", "hostdir2": "symlink", "real": "dir",
        "rootlink": "symlink",
    }
    assert wrong == [], "not refused with PathRefused:\n" + "\n".join(wrong)


def test_symlink_inside_workspace_can_be_read(sandbox: Sandbox) -> None:
    run_ok(sandbox, "mkdir -p sub/deep && echo inside > sub/deep/real.txt "
                    "&& ln -s sub/deep/real.txt rel && ln -s /workspace/sub/deep/real.txt abs "
                    "&& ln -s sub subl && ln -s ../sub/deep/real.txt sub/back "
                    "&& ln -s rel chain")
    assert sandbox.files.read("rel") == "inside\n"
    assert sandbox.files.read("chain") == "inside\n"
    assert sandbox.files.read("subl/deep/real.txt") == "inside\n"
    assert sandbox.files.read("sub/back") == "inside\n"
    assert [e.name for e in sandbox.files.list("subl")] == ["back", "deep"]
    # An absolute link names a workspace file only as the sandbox sees it: the host may refuse
    # it, or resolve it against the workspace, but never against its own root.
    assert run_ok(sandbox, "cat abs") == "inside\n"
    try:
        assert sandbox.files.read("abs") == "inside\n"
    except PathRefused:
        pass


# -- the race ----------------------------------------------------------------------------------

RACE_SCRIPT = r"""
import ctypes, os, shutil, sys, time

canary_dir, canary_file = sys.argv[1], sys.argv[2]
max_iter, seconds = int(sys.argv[3]), float(sys.argv[4])
up = lambda p: "../" * 24 + p.lstrip("/")
dir_targets = ["/", "/etc", canary_dir, up(canary_dir), "..", "../..", "../../..", "/tmp"]
leaf_targets = [canary_file, up(canary_file), "/etc/passwd"]
os.chdir("/workspace")

def quiet(fn, *args):
    try:
        fn(*args)
        return True
    except OSError:
        return False

def clear(name):
    if os.path.islink(name) or os.path.isfile(name):
        quiet(os.unlink, name)
    elif os.path.isdir(name):
        shutil.rmtree(name, ignore_errors=True)

def fill(d, i):
    quiet(os.mkdir, d)
    try:
        with open(d + "/secret.txt", "w") as f:
            f.write("inside-ws")
    except OSError:
        pass
    if i % 3 == 0:  # sometimes the leaf itself is a symlink out
        quiet(os.unlink, d + "/secret.txt")
        quiet(os.symlink, leaf_targets[i % len(leaf_targets)], d + "/secret.txt")

open("race-started", "w").close()
iterations = swaps = 0
# Phase 1: mkdir d; fill; rename it away; symlink d -> outside; rm; repeat.
end = time.monotonic() + seconds / 2
i = 0
while i < max_iter // 2 and time.monotonic() < end:
    i += 1
    fill("d", i)
    old = "old%d" % i
    quiet(os.rename, "d", old)
    if quiet(os.symlink, dir_targets[i % len(dir_targets)], "d"):
        swaps += 1
    time.sleep(0)
    clear("d")
    clear(old)
iterations += i

# Phase 2: atomic swaps with renameat2(RENAME_EXCHANGE): d is always either a real directory
# or a symlink out, never missing.
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
clear("d")
fill("d", 1)
quiet(os.symlink, "/", "s")
end = time.monotonic() + seconds / 2
j = 0
while j < max_iter // 2 and time.monotonic() < end:
    j += 1
    if libc.renameat2(AT_FDCWD, b"d", AT_FDCWD, b"s", RENAME_EXCHANGE) == 0:
        swaps += 1
    if j % 64 == 0:
        # Retarget whichever of the two is the symlink; refill whichever is the directory.
        link = "d" if os.path.islink("d") else "s"
        quiet(os.unlink, link)
        quiet(os.symlink, dir_targets[j % len(dir_targets)], link)
        fill("s" if link == "d" else "d", j)
iterations += j
print(iterations, swaps)
"""


def _host_leftovers(home: str, names: list[str], canary: Canary) -> list[Path]:
    """Paths outside any workspace where one of ``names`` appeared."""
    found: list[Path] = []
    for base in (Path("/"), Path("/etc"), Path("/tmp"), canary.dir):
        found += [base / n for n in names if (base / n).exists() or (base / n).is_symlink()]
    for dirpath, dirnames, filenames in os.walk(home):
        # Skip mounted workspaces: there the names are legitimate.
        dirnames[:] = [d for d in dirnames if not os.path.ismount(os.path.join(dirpath, d))]
        found += [Path(dirpath) / n for n in names if n in filenames or n in dirnames]
    return found


def test_concurrent_swaps_never_escape(sandbox: Sandbox, canary: Canary, home: str) -> None:
    token = secrets.token_hex(6)
    pwn = f"pwn-{token}"
    newdir = f"newdir-{token}"
    before = canary.snapshot()
    passwd = Path("/etc/passwd")
    passwd_before = (passwd.read_bytes(), passwd.stat().st_mtime_ns)

    sandbox.files.write("race.py", RACE_SCRIPT)
    result: dict[str, object] = {}

    def attacker() -> None:
        try:
            result["r"] = sandbox.commands.run(
                ["python3", "race.py", str(canary.dir), str(canary.secret_file), "20000", "5"],
                timeout=15,
            )
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            result["exc"] = exc

    thread = threading.Thread(target=attacker, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not sandbox.files.exists("race-started"):
        assert thread.is_alive(), f"the attacker exited early: {result}"
        assert time.monotonic() < deadline, "the attacker did not start in 10 s"
        time.sleep(0.01)

    allowed_names = {"secret.txt", pwn, newdir}
    counts = {"ok": 0, "refused": 0, "not_found": 0, "file_error": 0}
    problems: list[str] = []

    def attempt(what: str, fn, check=None) -> None:  # type: ignore[no-untyped-def]
        try:
            value = fn()
        except PathRefused:
            counts["refused"] += 1
            return
        except FileNotFound:
            counts["not_found"] += 1
            return
        except FileError as exc:
            if type(exc) is not FileError:
                problems.append(f"{what}: unexpected {type(exc).__name__}: {exc}")
            counts["file_error"] += 1
            return
        except Exception as exc:  # noqa: BLE001 - anything else is a finding
            problems.append(f"{what}: raised {type(exc).__name__}: {exc!r}")
            return
        counts["ok"] += 1
        if check is not None:
            bad = check(value)
            if bad:
                problems.append(f"{what}: {bad}")

    def check_secret(data: bytes) -> str | None:
        if data not in (b"", b"inside-ws"):
            return f"read returned foreign content {data[:80]!r}"
        return None

    def check_list(entries) -> str | None:  # type: ignore[no-untyped-def]
        names = {e.name for e in entries if not e.name.startswith(".corral-tmp-")}
        if not names <= allowed_names:
            return f"listed foreign entries {sorted(names - allowed_names)[:10]}"
        return None

    def check_stat(entry) -> str | None:  # type: ignore[no-untyped-def]
        if entry.type == "file" and entry.size not in (0, len("inside-ws")):
            return f"stat saw a foreign file of size {entry.size}"
        return None

    rounds = 0
    stop_at = time.monotonic() + 8
    while thread.is_alive() and rounds < 20000 and time.monotonic() < stop_at:
        rounds += 1
        attempt("write d/pwn", lambda: sandbox.files.write(f"d/{pwn}", b"PWNED"))
        attempt("read d/secret.txt",
                lambda: sandbox.files.read("d/secret.txt", format="bytes"), check_secret)
        attempt("read d/passwd", lambda: sandbox.files.read("d/passwd", format="bytes"),
                lambda data: f"read d/passwd succeeded: {data[:40]!r}")
        attempt("list d", lambda: sandbox.files.list("d"), check_list)
        attempt("stat d/secret.txt", lambda: sandbox.files.stat("d/secret.txt"), check_stat)
        attempt("make_dir d/newdir", lambda: sandbox.files.make_dir(f"d/{newdir}"))
        attempt("remove d/victim", lambda: sandbox.files.remove("d/victim"),
                lambda _: "remove d/victim succeeded: something outside was deleted")
    thread.join(timeout=20)
    assert not thread.is_alive(), "the attacker command did not finish"

    leftovers = _host_leftovers(home, [pwn, newdir, "victim"], canary)
    print(f"race: {rounds} host rounds, outcomes {counts}, attacker {result.get('r')}")
    try:
        assert "exc" not in result, f"the attacker command raised {result['exc']!r}"
        r = result["r"]
        assert r.exit_code == 0, (r.stdout, r.stderr)  # type: ignore[attr-defined]
        iterations, swaps = map(int, r.stdout.split())  # type: ignore[attr-defined]
        assert problems == [], problems[:20]
        # The race really ran: many swaps while the host made many calls, some refused.
        assert iterations > 100 and swaps > 100, (iterations, swaps)
        assert rounds > 50, rounds
        assert counts["refused"] > 0 and counts["ok"] > 0, counts
        # Nothing was created, changed or deleted outside the workspace.
        assert leftovers == [Path(canary.dir) / "victim"], leftovers
        assert canary.snapshot() == before
        assert (passwd.read_bytes(), passwd.stat().st_mtime_ns) == passwd_before
    finally:
        for p in leftovers:
            if p == canary.victim:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


# -- full workspace ----------------------------------------------------------------------------


def test_full_workspace_raises_quota_and_keeps_old_content(sandbox: Sandbox) -> None:
    sandbox.files.write("keep.txt", "old content\n")
    sandbox.files.write("dir/keep2.bin", b"\x01" * 10000)
    # Fill it from inside: preallocate what is free (metadata only, no data written to the
    # host disk), then top off block by block. Bounded: the default tier's disk is 1 GiB.
    run_ok(sandbox, "avail=$(df --output=avail -B1 /workspace | tail -1); "
                    "test $avail -lt 1300000000 && fallocate -l $avail fill; "
                    "dd if=/dev/zero of=fill2 bs=4096 count=300000 2>/dev/null; "
                    "df --output=avail -B1 /workspace | tail -1", timeout=60)
    free = sandbox.commands.run("df --output=avail -B1 /workspace | tail -1").stdout.strip()
    assert int(free) < 64 * 1024, free

    for path, data in [("keep.txt", b"new"), ("keep.txt", os.urandom(1 << 20)),
                       ("dir/keep2.bin", b"\x02" * 10000), ("brand-new.txt", b"x" * 65536),
                       ("newdir/deeper/file", b"y" * 65536)]:
        with pytest.raises(QuotaExceeded) as info:
            sandbox.files.write(path, data)
        assert "/workspace/" in str(info.value)
    assert sandbox.files.read("keep.txt") == "old content\n"
    assert sandbox.files.read("dir/keep2.bin", format="bytes") == b"\x01" * 10000
    assert run_ok(sandbox, "cat keep.txt") == "old content\n"
    assert not sandbox.files.exists("brand-new.txt")
    # No temporary files left behind by the failed writes.
    leftovers = [e.name for d in ("/workspace", "dir") for e in sandbox.files.list(d)
                 if e.name.startswith(".corral-tmp-")]
    assert leftovers == []

    # Free space (from the host) and writing works again.
    sandbox.files.remove("fill")
    sandbox.files.remove("fill2")
    sandbox.files.write("keep.txt", "new content\n")
    assert sandbox.files.read("keep.txt") == "new content\n"
    assert run_ok(sandbox, "cat keep.txt && echo ok > after") == "new content\n"
    assert sandbox.files.read("after") == "ok\n"


def test_write_follows_symlinks_that_stay_inside(sandbox: Sandbox) -> None:
    run_ok(sandbox, "mkdir -p real/sub && echo old > real/sub/f && ln -s real/sub subl "
                    "&& ln -s real/sub/f flink && ln -s real/sub/new dangling")
    sandbox.files.write("flink", "via leaf link")
    sandbox.files.write("subl/g", "via dir link")
    sandbox.files.write("dangling", "made through a dangling link")
    out = run_ok(sandbox, "cat real/sub/f real/sub/g real/sub/new; test -L flink && echo link")
    assert out == "via leaf link" "via dir link" "made through a dangling link" "link\n"
