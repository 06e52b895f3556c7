"""Defects found while treating the caller as untrusted (issue 11): a start-up deadlock, deep
trees, names that are not UTF-8, and listings a hostile name could forge."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral._control.manager import Manager
from corral._settings import Settings

pytestmark = pytest.mark.needs_root


@pytest.fixture
def own_home(settings: Settings) -> Iterator[dict[str, str]]:
    """A data directory of its own (so recovery at start-up sees exactly what the test put there),
    as the environment a CLI process needs; everything in it is destroyed afterwards."""
    home = Path(tempfile.mkdtemp(prefix="corral-test-rel-", dir=settings.home.parent))
    os.chmod(home, 0o711)
    start = settings.uid_start + settings.uid_count - 1000  # the tail of the session's range
    env = {**os.environ, "CORRAL_HOME": str(home), "CORRAL_UID_START": str(start),
           "CORRAL_UID_COUNT": "1000"}
    try:
        yield env
    finally:
        from corral.errors import BackendUnavailable
        from tests.conftest import managed

        with managed(Settings(home=home, uid_start=start, uid_count=1000)) as mgr:
            with contextlib.suppress(BackendUnavailable):
                mgr.backend_for("gvisor")
            for info in mgr.store.list():
                mgr._destroy(info, reason="cleanup")
            for backend in list(mgr._backends.values()):
                backend.sweep(set())
        shutil.rmtree(home, ignore_errors=True)


def _cli(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "corral", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_listing_with_a_sandbox_of_the_other_tier_returns_promptly(
    own_home: dict[str, str], gvisor_problems: list[str]
) -> None:
    """Recovery at start-up loads the other tier's backend; it once did so under the very lock
    recovery held, and every later CLI process hung for ever."""
    if gvisor_problems:
        pytest.skip("the gVisor tier cannot run on this host: " + "; ".join(gvisor_problems))
    created = _cli(own_home, "create", "--isolation", "gvisor", "--json")
    assert created.returncode == 0, created.stderr
    sandbox_id = json.loads(created.stdout)["id"]
    try:
        listed = _cli(own_home, "ls", "--json", timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("`corral ls` hung with a gVisor sandbox in the store")
    assert listed.returncode == 0, listed.stderr
    assert [s["id"] for s in json.loads(listed.stdout)] == [sandbox_id]
    assert _cli(own_home, "rm", sandbox_id, timeout=30).returncode == 0


DEEP = 2000


@pytest.fixture
def deep_sandbox(where: dict[str, str]) -> Iterator[object]:
    """A sandbox whose workspace holds ``DEEP`` nested directories (a file at every level)."""
    from corral import Sandbox

    sb = Sandbox.create(**where)  # type: ignore[arg-type]
    try:
        made = sb.commands.run(["python3", "-c", (
            "import os\n"
            f"for _ in range({DEEP}):\n"
            "    os.mkdir('d'); open('f', 'w').close(); os.symlink('/', 'l'); os.chdir('d')\n")])
        assert made.exit_code == 0, made.stderr
        yield sb
    finally:
        sb.kill()


def test_removing_a_very_deep_tree_removes_it(deep_sandbox) -> None:  # type: ignore[no-untyped-def]
    """A tree deeper than Python's stack (and with more levels than `MAX_OPEN` descriptors)
    goes, and the links in it are removed, not followed."""
    sb = deep_sandbox
    sb.files.remove("/workspace/d")
    assert not sb.files.exists("d")
    assert sb.commands.run("ls -A /workspace").stdout.split() == ["f", "l"]


def test_walking_a_very_deep_tree_is_refused_with_a_corral_error(  # type: ignore[no-untyped-def]
    deep_sandbox, where: dict[str, str],
) -> None:
    from corral import CorralError, FileError

    sb = deep_sandbox
    # Over HTTP the refusal comes after the archive has begun streaming, so the service can
    # only cut the stream: the SDK still raises one of its own errors.
    expected = FileError if where.get("home") else CorralError
    with pytest.raises(expected, match="nested over" if expected is FileError else None):
        b"".join(sb.files.download("/workspace"))
    deep = "/workspace/" + "d/" * (DEEP // 2)
    assert {e.name for e in sb.files.list(deep)} == {"d", "f", "l"}
    assert sb.files.stat(deep + "f").type == "file"


def test_names_that_are_not_utf8_give_corral_errors_or_escaped_names(  # type: ignore[no-untyped-def]
    where: dict[str, str],
) -> None:
    """A sandbox can give any name bytes that are not UTF-8: listings show them escaped,
    downloads keep them exact, and a path holding one is refused by every file call with a
    PathRefused that says what to do, never a raw UnicodeError (nor an HTTP 500)."""
    import io
    import tarfile

    from corral import PathRefused, Sandbox

    sb = Sandbox.create(**where)  # type: ignore[arg-type]
    try:
        made = sb.commands.run(["python3", "-c", (
            "import os; os.makedirs(b'box/d\\xff'); open(b'box/d\\xff/f\\xfe', 'w').write('x');"
            "os.symlink(b't\\xfd', b'box/l\\xfc'); open(b'box/g\\xfb', 'w').write('y')")])
        assert made.exit_code == 0, made.stderr
        listed = sb.files.list("box")
        assert [(e.name, e.path) for e in listed] == [
            ("d\\xff", "/workspace/box/d\\xff"), ("g\\xfb", "/workspace/box/g\\xfb"),
            ("l\\xfc", "/workspace/box/l\\xfc")]
        # JSON- and terminal-safe as they are:
        json.dumps([dataclasses.asdict(e) for e in listed], ensure_ascii=False).encode()
        # The escaped form names nothing (a real name may hold a backslash): a clear not-found.
        assert not sb.files.exists("box/d\\xff")

        with tarfile.open(fileobj=io.BytesIO(b"".join(sb.files.download("box")))) as tar:
            assert {m.name for m in tar.getmembers()} >= {
                "d\udcff", "d\udcff/f\udcfe", "g\udcfb", "l\udcfc"}

        raw = "box/d\udcff"
        calls = {
            "read": lambda: sb.files.read(raw + "/f\udcfe"),
            "read bytes": lambda: sb.files.read(raw + "/f\udcfe", format="bytes"),
            "write": lambda: sb.files.write(raw + "/new", "z"),
            "list": lambda: sb.files.list(raw),
            "stat": lambda: sb.files.stat(raw),
            "exists": lambda: sb.files.exists(raw),
            "make_dir": lambda: sb.files.make_dir("box/n\udcfa"),
            "rename from": lambda: sb.files.rename(raw, "box/plain"),
            "rename to": lambda: sb.files.rename("box", "x\udcf9"),
            "remove": lambda: sb.files.remove(raw),
            "download": lambda: b"".join(sb.files.download(raw)),
            "upload": lambda: sb.files.upload(b"\0" * 1024, raw),
        }
        for name, call in calls.items():
            with pytest.raises(PathRefused, match="is not valid UTF-8; file calls take UTF-8"):
                call()
                pytest.fail(f"{name} accepted a path that is not UTF-8")
        # What is left to do with such names works: the tree holding them goes.
        sb.files.remove("box")
        assert not sb.files.exists("box")
    finally:
        sb.kill()


def test_files_ls_prints_one_line_per_entry_whatever_the_names(  # type: ignore[no-untyped-def]
    settings: Settings, home: str,
) -> None:
    """A name can hold a newline, a terminal escape or a bidi override: the table shows them
    escaped, one entry per line; --json gives the names exactly."""
    from corral import Sandbox

    env = {**os.environ, "CORRAL_HOME": str(settings.home),
           "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    names = ["a\nfake 0644 1 b", "esc\x1b[2Jx", "rtl\u202etxt.exe", "tab\there", "plain"]
    sb = Sandbox.create(home=home)
    try:
        for name in names:
            sb.files.write(name, "x")
        made = sb.commands.run(["python3", "-c", "open(b'raw\\xff', 'w')"])
        assert made.exit_code == 0, made.stderr
        table = _cli(env, "files", "ls", sb.id)
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert len(lines) == len(names) + 1
        shown = sorted(line[len("0644 ") + 11:] for line in lines)
        assert shown == sorted(["a\\x0afake 0644 1 b", "esc\\x1b[2Jx", "rtl\\u202etxt.exe",
                                "tab\\x09here", "plain", "raw\\xff"])
        assert "\x1b" not in table.stdout and "\u202e" not in table.stdout
        listed = _cli(env, "files", "ls", sb.id, "--json")
        assert listed.returncode == 0, listed.stderr
        assert sorted(e["name"] for e in json.loads(listed.stdout)) == sorted(
            [*names, "raw\\xff"])
    finally:
        sb.kill()


def test_tree_removal_holds_few_descriptors_and_never_follows_links(tmp_path: Path) -> None:
    """Below a descriptor limit far under the tree's depth, the tree still goes; what its links
    point at (outside the tree) stays."""
    import gc
    import resource

    from corral._workspace.removal import MAX_OPEN, remove_tree

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("k")
    tree = tmp_path / "tree"
    level = tree
    for i in range(600):
        level.mkdir()
        (level / "f").write_text("x")
        (level / "out").symlink_to(outside)
        if i % 100 == 0:
            for j in range(50):  # wide here and there
                (level / f"w{j}").mkdir()
        level = level / "d"
    failure = tmp_path / "child-failure"
    pid = os.fork()
    if pid == 0:  # the child removes the tree with few descriptors to spare
        code = 1
        try:
            # Only what this test opens counts: the suite's own descriptors (inherited, often
            # numbered past the limit) would leave no free number under it. The suite's objects
            # that owned them live on in this copy: a garbage collection here would have one
            # close its old number, by then one of the tree's (EBADF, seen once in CI).
            gc.disable()
            os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN + 40, MAX_OPEN + 40))
            fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
            remove_tree(fd, "tree")
            code = 0
        except BaseException as exc:  # told to the parent, whose assertion shows it
            with contextlib.suppress(BaseException):
                open_fds = sorted(int(n) for n in os.listdir("/proc/self/fd"))
                failure.write_text(f"{exc!r}; open descriptors: {open_fds}")
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, (
        failure.read_text() if failure.exists() else "no report")
    assert not tree.exists()
    assert (outside / "keep").read_text() == "k"


def test_names_that_are_not_utf8_through_the_async_sdk(where: dict[str, str]) -> None:
    import asyncio

    from corral import AsyncSandbox, PathRefused

    async def scenario() -> None:
        async with await AsyncSandbox.create(**where) as sb:  # type: ignore[arg-type]
            made = await sb.commands.run(["python3", "-c", "open(b'x\\xff', 'w').write('1')"])
            assert made.exit_code == 0, made.stderr
            assert [e.name for e in await sb.files.list()] == ["x\\xff"]
            with pytest.raises(PathRefused, match="is not valid UTF-8"):
                await sb.files.read("x\udcff")
            with pytest.raises(PathRefused, match="is not valid UTF-8"):
                await sb.files.rename("x\udcff", "y")

    asyncio.run(scenario())


def test_a_destroy_beside_one_under_way_returns_once_the_sandbox_is_gone(
        manager: Manager, monkeypatch: pytest.MonkeyPatch) -> None:
    # A kill while the reaper (or another request) is destroying the same sandbox must not
    # return before it is gone: a snapshot delete right after would find it still built on.
    info = manager.create()
    record = manager.store.get(info.id)
    assert record is not None
    backend = manager.sandboxes.backend(record)
    started = threading.Event()
    real_destroy = backend.destroy

    def slow_destroy(spec: Any) -> None:
        started.set()
        time.sleep(1.0)  # a destroy that takes a while (many processes, a slow disk)
        real_destroy(spec)

    monkeypatch.setattr(backend, "destroy", slow_destroy)
    first = threading.Thread(target=manager.sandboxes.destroy, args=(record,),
                             kwargs={"reason": "requested"})
    first.start()
    try:
        assert started.wait(10)
        manager.sandboxes.destroy(record, reason="interrupted")
        assert manager.store.get(info.id) is None
    finally:
        first.join(30)
