"""No call waits forever, and a stuck state never spreads (issue 36), on the real tiers and
through ``corral serve`` and the CLI in processes of their own, as an operator runs them.

Every wait here is bounded by construction (subprocess timeouts, polls with a deadline far
above what the work takes) and none assumes how fast the host is: a check waits for the
event it is about, and a bound is only reached when the behaviour is broken."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from corral import Sandbox
from corral._backends.gvisor.bundle import runtime_uid
from corral._control.store import Store
from corral._settings import Settings

from ..conftest import managed, private_settings
from .hostprocs import host_procs_of_uid
from .servers import free_port

pytestmark = pytest.mark.needs_root

# Far above what anything here takes on a loaded host; reached only when something hangs.
_BOUND_S = 120.0


def _env(settings: Settings) -> dict[str, str]:
    return {**os.environ, "CORRAL_HOME": str(settings.home),
            "CORRAL_UID_START": str(settings.uid_start),
            "CORRAL_UID_COUNT": str(settings.uid_count)}


def _cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """``corral ARGS`` in a process of its own; a hang fails the test (TimeoutExpired)."""
    return subprocess.run([sys.executable, "-m", "corral", *args], env=_env(settings),
                          capture_output=True, text=True, timeout=_BOUND_S,
                          stdin=subprocess.DEVNULL)


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {_BOUND_S:.0f} s"
        time.sleep(0.1)


@contextlib.contextmanager
def _service(settings: Settings) -> Iterator[str]:
    """``corral serve`` on ``settings``'s data directory; its URL. Stopped with SIGTERM."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (settings.home / "serve.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "corral", "serve", "--port", str(port)],
                            env=_env(settings), stdout=subprocess.DEVNULL, stderr=log,
                            stdin=subprocess.DEVNULL)
    log.close()

    def up() -> bool:
        assert proc.poll() is None, (settings.home / "serve.log").read_text()[-3000:]
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/healthz", timeout=5).status_code == 200
        return False

    try:
        _until(up, "the service did not start")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=_BOUND_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=_BOUND_S)


def _row(settings: Settings, sandbox_id: str) -> dict[str, object] | None:
    store = Store(settings.home / "corral.db")
    try:
        info = store.get(sandbox_id)
        return None if info is None else {"state": info.state, "uid": info.uid}
    finally:
        store.close()


def _trail(settings: Settings, sandbox_id: str) -> list[dict[str, object]]:
    path = settings.home / "audit" / f"{sandbox_id}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _host_procs(uid: int) -> list[tuple[int, str]]:
    return host_procs_of_uid(uid) + host_procs_of_uid(runtime_uid(uid))


def _cgroup(settings: Settings, sandbox_id: str) -> list[Path]:
    return list(Path("/sys/fs/cgroup").glob(f"*/corral-{settings.instance}/{sandbox_id}"))


# -- a paused sandbox reaching its lifetime ----------------------------------------------------


@pytest.mark.timeout(600)  # two sandboxes through a service; a microVM may boot cold
def test_a_paused_sandbox_past_its_lifetime_never_stops_the_reaper(isolation_all: str) -> None:
    """On 560333e it sticks in ``destroying`` with frozen processes (the namespace tier: its
    resident's close waits out every kill's deadline, minutes) and the reaper reaps nothing
    else meanwhile; a paused sandbox's DELETE waits as long (namespace) or answers 500 from
    an unhandled TimeoutExpired (gVisor)."""
    with private_settings("corral-test-paused-") as settings:
        try:
            with _service(settings) as url:
                paused, deleted = (_paused(url, isolation_all) for _ in range(2))
                answer = httpx.delete(f"{url}/v1/sandboxes/{deleted.id}", timeout=60)
                assert answer.status_code in (202, 204), answer.text
                _until(lambda: _row(settings, deleted.id) is None, "the delete did not finish")
                other = Sandbox.create(url=url, isolation=isolation_all, timeout=600)
                row = _row(settings, paused.id)
                assert row is not None
                uid = int(row["uid"])  # type: ignore[call-overload]
                paused.set_timeout(1)
                other.set_timeout(1)
                _until(lambda: _row(settings, other.id) is None, "the other sandbox was "
                       "not reaped")
                _until(lambda: _row(settings, paused.id) is None, "the paused sandbox was "
                       "not reaped")
                # Promptly answered (the sandbox is gone), not held by a destroy.
                answer = httpx.post(f"{url}/v1/sandboxes/{paused.id}/timeout",
                                    json={"timeout": 60}, timeout=30)
                assert answer.status_code == 404, answer.text
                _until(lambda: not _host_procs(uid), "frozen processes were left")
                assert not _cgroup(settings, paused.id)
                types = [e["type"] for e in _trail(settings, paused.id)]
                assert types.count("sandbox.expired") == 1, types
                assert types[-1] == "sandbox.destroyed", types
        finally:
            with managed(settings):
                pass


def _paused(url: str, isolation: str) -> Sandbox:
    """A paused sandbox with its tier's resident helper up and a background process."""
    sandbox = Sandbox.create(url=url, isolation=isolation, timeout=600)
    sandbox.commands.run("true")
    sandbox.commands.run("true")  # the second starts the tier's resident helper
    sandbox.processes.start("sleep 600")
    sandbox.pause()
    return sandbox


# -- special files in Corral's own directories -------------------------------------------------

_FAKE = "sbx_fifo00000000"


def _fifo(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not os.path.lexists(path):
        os.mkfifo(path, 0o600)


def _socket(path: Path) -> None:
    if os.path.lexists(path) or len(str(path)) > 100:  # sun_path holds 107 bytes
        return
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))


def _state_dirs(home: Path) -> list[Path]:
    """Every directory of the data directory but what a sandbox mounts (its workspace, its
    disk's inside), the templates' and images' trees and gVisor's root skeletons."""
    skipped = ("workspace", "priv", "mounts", "rootfs.", "templates", "images")
    found = [home]
    for parent, dirs, _ in os.walk(home):
        dirs[:] = [d for d in dirs if not d.startswith(skipped)
                   and not os.path.ismount(os.path.join(parent, d))]
        found += [Path(parent) / d for d in dirs]
    return found


def _plant(settings: Settings, live: list[str]) -> list[Path]:
    """A FIFO and a socket in every state directory, and FIFOs named as Corral names what it
    keeps there: a resident's start FIFO a crash left (of a live sandbox and of a gone one),
    a trail, a layer, a workspace, a volume, a lock, a spare, runsc state, a microVM's run
    directory and its pid file, a network namespace pin. The FIFOs planted."""
    home = settings.home
    fifos = []
    for directory in _state_dirs(home):
        _fifo(directory / "fifo-stray")
        _socket(directory / "sock-stray")
        fifos.append(directory / "fifo-stray")
    named = [f"gvisor/bundles/{sid}.0123456789ab.release" for sid in [*live, _FAKE]] + [
        f"gvisor/bundles/{_FAKE}.0123456789ab", f"gvisor/state/runsc-{_FAKE}.0123456789ab.sock",
        f"audit/{_FAKE}.jsonl", f"audit/.inflight/1.1/{_FAKE}.cmd_0123456789ab",
        f"layers/{_FAKE}", f"sandboxes/{_FAKE}", "sandboxes/.ready.1.1.1073741824.0",
        f"volumes/vol_{_FAKE}", f"locks/{_FAKE}", f"microvm/sandboxes/{_FAKE}"]
    for name in named:
        _fifo(home / name)
        fifos.append(home / name)
    run_root = Path("/run/corral-microvm")
    if run_root.is_dir():
        for name in (f"{settings.instance}-{_FAKE}", f"{settings.instance}-{_FAKE}1/keeper.pid"):
            _fifo(run_root / name)
            fifos.append(run_root / name)
    _fifo(settings.run_dir / f"corral-{settings.instance}-{_FAKE}")
    fifos.append(settings.run_dir / f"corral-{settings.instance}-{_FAKE}")
    return fifos


def _tiers(request: pytest.FixtureRequest) -> list[str]:
    tiers = ["namespace"]
    if not request.getfixturevalue("gvisor_problems"):
        tiers.append("gvisor")
    if not request.getfixturevalue("microvm_problems"):
        tiers.append("microvm")
    return tiers


@pytest.mark.timeout(900)  # a sandbox of every tier, a dozen CLI processes, a service
def test_special_files_in_the_state_directories_never_hang_the_cli_or_the_reaper(
        request: pytest.FixtureRequest) -> None:
    """On 560333e `corral reap` blocks for ever opening the FIFO a resident's start left in
    gVisor's bundles (and so did every CLI call that swept them)."""
    with private_settings("corral-test-fifo-") as settings:
        planted: list[Path] = []
        try:
            live = []
            for tier in _tiers(request):
                made = _cli(settings, "create", "--isolation", tier, "--ttl", "900")
                assert made.returncode == 0, made.stderr
                live.append(made.stdout.strip())
                for _ in range(2):  # the second command starts the tier's resident
                    ran = _cli(settings, "exec", live[-1], "--", "true")
                    assert ran.returncode == 0, ran.stderr
            planted = _plant(settings, live)
            for args in (["ls"], ["run", "--", "true"], ["reap"]):
                done = _cli(settings, *args)  # TimeoutExpired if it hangs
                assert done.returncode == 0, (args, done.stderr)
            listed = _cli(settings, "ls", "--json")
            assert sorted(s["id"] for s in json.loads(listed.stdout)) == sorted(live)
            release = settings.home / "gvisor" / "bundles" / f"{_FAKE}.0123456789ab.release"
            planted = _plant(settings, live)
            with _service(settings) as url:
                # The service's reaper sweeps them (its first pass at start, then every
                # few seconds), and the service answers meanwhile.
                _until(lambda: not os.path.lexists(release), "the reaper did not sweep")
                _plant(settings, live)
                _until(lambda: not os.path.lexists(release), "a later pass did not sweep")
                answer = httpx.get(f"{url}/v1/sandboxes", timeout=30)
                assert answer.status_code == 200
                assert sorted(s["id"] for s in answer.json()) == sorted(live)
        finally:
            for path in planted:
                with contextlib.suppress(OSError):
                    path.unlink()
            with contextlib.suppress(OSError):
                (Path("/run/corral-microvm") / f"{settings.instance}-{_FAKE}1").rmdir()
            with managed(settings):
                pass


# -- a create cut short, a command cut short ---------------------------------------------------


def _child(settings: Settings, code: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=_env(settings),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(600)
def test_a_create_cut_short_by_a_crash_is_cleaned_at_once(isolation_all: str) -> None:
    """On 560333e the ``creating`` row (cgroup, network namespace, workspace mounts) stays for
    a minute and `corral reap` right after skips it."""
    with private_settings("corral-test-creating-") as settings:
        try:
            child = _child(settings, f"""
                import os, signal
                from corral._control.manager import Manager
                from corral._settings import Settings
                manager = Manager(Settings())
                backend = manager.backend_for({isolation_all!r})
                made = type(backend).create
                def create(self, spec):
                    made(self, spec)  # every piece made, the row still "creating": killed
                    os.kill(os.getpid(), signal.SIGKILL)
                type(backend).create = create
                manager.create(isolation={isolation_all!r})
            """)
            _, err = child.communicate(timeout=_BOUND_S)
            assert child.returncode == -signal.SIGKILL, err
            store = Store(settings.home / "corral.db")
            try:
                rows = store.list()
            finally:
                store.close()
            assert [r.state for r in rows] == ["creating"]
            sandbox_id = rows[0].id
            assert _cgroup(settings, sandbox_id)
            reaped = _cli(settings, "reap")
            assert reaped.returncode == 0, reaped.stderr
            assert _row(settings, sandbox_id) is None
            assert not _cgroup(settings, sandbox_id)
            assert not (settings.run_dir / f"corral-{settings.instance}-{sandbox_id}").exists()
            with open("/proc/mounts") as f:
                assert sandbox_id not in f.read()
            assert not _host_procs(rows[0].uid)
        finally:
            with managed(settings):
                pass


@pytest.mark.timeout(900)  # processes of their own; a microVM may boot cold, twice
def test_a_command_in_flight_at_a_crash_gets_its_end_in_the_trail(isolation_all: str) -> None:
    """On 560333e only a command in a cgroup of its own got one (the namespace tier's): one
    in gVisor's resident or a microVM got none."""
    with private_settings("corral-test-inflight-") as settings:
        try:
            made = _cli(settings, "create", "--isolation", isolation_all, "--ttl", "900")
            assert made.returncode == 0, made.stderr
            sandbox_id = made.stdout.strip()
            for _ in range(2):  # commands from the resident (the gVisor tier's, the zygote)
                child = _child(settings, f"""
                    from corral._control.manager import Manager
                    from corral._settings import Settings
                    manager = Manager(Settings())
                    manager.run({sandbox_id!r}, ["true"])
                    manager.run({sandbox_id!r}, ["sleep", "600"], timeout=55)
                """)

                def started(child: subprocess.Popen[str]) -> bool:
                    assert child.poll() is None, child.communicate()
                    return any(e["type"] == "command.started"
                               and e["data"]["argv"] == ["sleep", "600"]  # type: ignore[index]
                               and not _ended(settings, sandbox_id, str(e["command"]))
                               for e in _trail(settings, sandbox_id))

                _until(functools.partial(started, child), "the command did not start")
                child.send_signal(signal.SIGKILL)
                child.communicate(timeout=_BOUND_S)
                reaped = _cli(settings, "reap")
                assert reaped.returncode == 0, reaped.stderr
                trail = _trail(settings, sandbox_id)
                begun = {e["command"] for e in trail if e["type"] == "command.started"}
                assert all(_ended(settings, sandbox_id, str(c)) for c in begun), trail[-6:]
                last = [e for e in trail if e["type"] == "command.finished"][-1]
                assert last["data"]["interrupted"] is True, last  # type: ignore[index]
            ran = _cli(settings, "exec", sandbox_id, "--", "echo", "alive")
            assert ran.stdout == "alive\n", ran.stderr
        finally:
            with managed(settings):
                pass


def _ended(settings: Settings, sandbox_id: str, command_id: str) -> bool:
    return any(e["type"] == "command.finished" and e["command"] == command_id
               for e in _trail(settings, sandbox_id))


# -- a clean stop leaves nothing ---------------------------------------------------------------


@pytest.mark.timeout(600)
def test_a_stopped_service_leaves_no_spare_workspace_and_no_cgroup() -> None:
    """On 560333e SIGTERM ended the service before any clean-up (uvicorn raises the signal
    again, with the default handler): its spares stayed mounted until the next sweep, and
    the data directory's ``corral-<tag>`` cgroups stayed for ever."""
    with private_settings("corral-test-sigterm-") as settings:
        spares = settings.home / "sandboxes"
        try:
            with _service(settings) as url:
                made = [Sandbox.create(url=url) for _ in range(3)]  # the second refills
                _until(lambda: any(p.name.startswith(".ready.") for p in spares.iterdir()),
                       "no spare workspace was made")
                for sandbox in made:
                    sandbox.kill()
            assert not [p.name for p in spares.iterdir()
                        if p.name.startswith((".ready.", ".making."))]
            with open("/proc/mounts") as f:
                assert str(settings.home) not in f.read()
            assert not list(Path("/sys/fs/cgroup").glob(f"*/corral-{settings.instance}"))
            # Nor does a CLI call, which never closes its backend: removed at its exit.
            ran = _cli(settings, "run", "--", "true")
            assert ran.returncode == 0, ran.stderr
            assert not list(Path("/sys/fs/cgroup").glob(f"*/corral-{settings.instance}"))
        finally:
            with managed(settings):
                pass
        assert not list(Path("/sys/fs/cgroup").glob(f"*/corral-{settings.instance}"))
