"""Hibernation on the host tiers: nothing of a hibernated sandbox is left in the kernel, and it
wakes (by a command, a file call, a port request, a resume) with its files and /tmp intact.
Real namespaces, mounts, loop devices, cgroups and runsc: nothing here is mocked."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from corral import Process, Sandbox, SandboxBusy, SandboxNotFound
from corral._backends.gvisor.bundle import runtime_uid
from corral._control.manager import Manager
from corral._control.tenants import Ceiling, TenantDirectory
from corral._serve.app import create_app
from corral._settings import Settings
from corral.errors import BackendError, QuotaExceeded
from corral.models import Lifecycle

from .hostprocs import host_procs_of_uid, host_uid
from .servers import Server

pytestmark = pytest.mark.needs_root

AWAKE = {"auto_resume": True}


def kernel_pieces(settings: Settings, sandbox_id: str, uid: int) -> dict[str, list[str]]:
    """Everything of a sandbox the host's kernel holds: mounts below its directory, loop
    devices backed by its files, cgroups, its pinned network namespace, and processes of its
    host uid (and, on gVisor, of the uid its kernel runs as)."""
    base = str(settings.home / "sandboxes" / sandbox_id)
    with open("/proc/self/mountinfo") as mountinfo:
        mounts = [line.split()[4] for line in mountinfo if base in line.split()[4]]
    listed = subprocess.run(["losetup", "--json", "--list"], capture_output=True, text=True,
                            check=True).stdout
    loops = [d["name"] for d in (json.loads(listed)["loopdevices"] if listed.strip() else [])
             if (d.get("back-file") or "").startswith(base)]
    tag = f"corral-{settings.instance}"
    cgroups = [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{tag}/{sandbox_id}")]
    netns = [str(p) for p in settings.run_dir.glob(f"*{sandbox_id}*")] + [
        str(p) for p in Path("/run/netns").glob(f"*{sandbox_id}*")]
    procs = [f"{pid}" for pid, _ in host_procs_of_uid(uid) + host_procs_of_uid(runtime_uid(uid))]
    return {"mounts": mounts, "loops": loops, "cgroups": cgroups, "netns": netns,
            "processes": procs}


def trail_types(manager: Manager, sandbox_id: str) -> list[tuple[str, dict[str, object]]]:
    return [(e.type, e.data) for e in manager.auditor.trail(sandbox_id).events
            if e.type in ("sandbox.paused", "sandbox.hibernated", "sandbox.resumed")]


def test_a_hibernated_sandbox_leaves_nothing_in_the_kernel_and_wakes_whole(
        home: str, settings: Settings, manager: Manager, isolation: str) -> None:
    with Sandbox.create(home=home, isolation=isolation, lifecycle=AWAKE) as sb:
        setup = sb.commands.run(
            "echo kept > /workspace/w.txt && mkdir -p /tmp/d && echo scratch > /tmp/d/s.txt"
            " && chmod 000 /tmp/d/s.txt && ln -s /etc/passwd /tmp/link && echo ok")
        assert setup.stdout == "ok\n", setup.stderr
        uid = host_uid(sb.id)
        assert kernel_pieces(settings, sb.id, uid)["mounts"]  # it has some while it runs
        sb.hibernate()
        info = sb.get_info()
        assert info.state == "hibernated" and info.sleeping_since is not None
        left = kernel_pieces(settings, sb.id, uid)
        assert left == {k: [] for k in left}, left
        assert sb.id in {i.id for i in Sandbox.list(home=home)}  # listed while it sleeps
        sb.hibernate()  # again: nothing to do
        # The next command wakes it: files and /tmp as they were (modes and links too).
        woke = sb.commands.run("cat /workspace/w.txt; stat -c %a /tmp/d/s.txt; "
                               "readlink /tmp/link; chmod 600 /tmp/d/s.txt; cat /tmp/d/s.txt")
        assert woke.stdout == "kept\n0\n/etc/passwd\nscratch\n", woke.stderr
        assert sb.get_info().state == "running" and sb.get_info().sleeping_since is None
        events = trail_types(manager, sb.id)
        hibernated = [d for t, d in events if t == "sandbox.hibernated"]
        resumed = [d for t, d in events if t == "sandbox.resumed"]
        assert len(hibernated) == 1 and float(hibernated[0]["duration_ms"]) > 0
        assert resumed[-1]["from"] == "hibernated" and resumed[-1]["reason"] == "a call needed it"
        assert float(resumed[-1]["duration_ms"]) > 0


def test_a_file_call_wakes_it_and_without_auto_resume_calls_are_refused(
        home: str, isolation: str) -> None:
    with Sandbox.create(home=home, isolation=isolation, lifecycle=AWAKE) as sb:
        sb.files.write("notes.txt", "written before")
        sb.hibernate()
        assert sb.files.read("notes.txt") == "written before"
        assert sb.get_info().state == "running"
    with Sandbox.create(home=home, isolation=isolation) as sb:
        sb.files.write("notes.txt", "still here")
        sb.hibernate()
        with pytest.raises(SandboxBusy, match="hibernated; resume"):
            sb.files.read("notes.txt")
        with pytest.raises(SandboxBusy, match="hibernated; resume"):
            sb.commands.run("true")
        sb.resume()
        assert sb.files.read("notes.txt") == "still here"


def test_a_sandbox_with_a_process_running_is_not_hibernated(home: str, isolation: str) -> None:
    with Sandbox.create(home=home, isolation=isolation) as sb:
        process = sb.processes.start(["sleep", "600"])
        with pytest.raises(SandboxBusy, match="processes running"):
            sb.hibernate()
        assert sb.get_info().state == "running"  # left as it was, not paused
        assert sb.commands.run("echo fine").stdout == "fine\n"
        process.kill()


def test_a_tampered_image_is_refused_and_left_as_it_is(
        home: str, settings: Settings, manager: Manager) -> None:
    with Sandbox.create(home=home) as sb:
        sb.commands.run("echo secret > /tmp/t")
        sb.hibernate()
        archive = settings.home / "sandboxes" / sb.id / "priv" / "tmp.tar"
        kept = archive.read_bytes()
        archive.write_bytes(kept.replace(b"secret", b"sEcret"))
        with pytest.raises(BackendError, match="changed on disk since it hibernated"):
            sb.resume()
        assert sb.get_info().state == "hibernated"
        archive.write_bytes(kept)  # put back by the operator: it wakes
        sb.resume()
        assert sb.commands.run("cat /tmp/t").stdout == "secret\n"


def test_hibernated_sandboxes_survive_a_restart_of_the_control_plane(
        home: str, settings: Settings) -> None:
    """Another process over the same data directory (a restarted service, or the CLI) lists
    it hibernated and wakes it."""
    sb = Sandbox.create(home=home, lifecycle=AWAKE)
    try:
        sb.commands.run("echo across > /tmp/x && echo files > f")
        sb.hibernate()
        env = {**os.environ, "CORRAL_HOME": home, "CORRAL_UID_START": str(settings.uid_start),
               "CORRAL_UID_COUNT": str(settings.uid_count)}
        other = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            from corral import Sandbox
            print({{i.id: i.state for i in Sandbox.list()}}.get("{sb.id}"))
            print(Sandbox.connect("{sb.id}").commands.run("cat /tmp/x f").stdout, end="")
            """)], env=env, capture_output=True, text=True, timeout=300, check=False)
        assert other.stdout == "hibernated\nacross\nfiles\n", other.stderr
        assert sb.get_info().state == "running"
    finally:
        sb.kill()


def test_the_reaper_hibernates_a_sandbox_paused_past_its_hibernate_after(
        home: str, manager: Manager) -> None:
    with Sandbox.create(home=home, lifecycle={"hibernate_after": 0.2}) as idle, \
            Sandbox.create(home=home, lifecycle={"hibernate_after": 0.2}) as working:
        working.processes.start(["sleep", "600"])
        idle.pause()
        working.pause()
        time.sleep(0.3)
        manager.recover()
        assert idle.get_info().state == "hibernated"
        assert working.get_info().state == "paused"  # its process would be lost: kept frozen
        manager.recover()  # not asked again while it sleeps
        types = [t for t, _ in trail_types(manager, working.id)]
        assert "sandbox.hibernated" not in types


def test_a_port_request_wakes_a_hibernated_sandbox(manager: Manager) -> None:
    info = manager.create(lifecycle=Lifecycle(auto_resume=True), timeout=300)
    try:
        manager.ports.expose(info.id, 8000)
        manager.hibernate(info.id)
        with Server(manager, create_app(manager)) as server:
            port = manager.ports.list(info.id)[0]
            url = f"{server.url}/ports/{info.id}/8000/"
            answer = httpx.get(url, headers={"X-Corral-Port-Token": port.token or ""})
        # Woken: nothing listens on the port (a hibernate ends every process), which the
        # answer says, instead of "paused".
        assert answer.status_code == 502 and answer.json()["error"] == "port_closed", answer.text
        assert manager.get(info.id).state == "running"
    finally:
        manager.destroy(info.id)


def test_the_cli_and_the_http_api_hibernate_and_wake(
        home: str, settings: Settings, manager: Manager) -> None:
    env = {**os.environ, "CORRAL_HOME": home, "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}

    def corral(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "corral", *args], env=env, text=True,
                              capture_output=True, timeout=300, check=False)

    made = corral("create", "--auto-resume", "--hibernate-after", "120")
    assert made.returncode == 0, made.stderr
    sandbox_id = made.stdout.strip()
    try:
        slept = corral("hibernate", sandbox_id, "--json")
        assert slept.returncode == 0, slept.stderr
        described = json.loads(slept.stdout)
        assert described["state"] == "hibernated"
        assert described["lifecycle"]["hibernate_after"] == 120
        listed = corral("ls")
        row = next(line for line in listed.stdout.splitlines() if line.startswith(sandbox_id))
        assert " hibernated " in row and "ASLEEP" in listed.stdout
        assert corral("exec", sandbox_id, "--", "echo up").stdout == "up\n"
        with Server(manager, create_app(manager)) as server:
            answer = httpx.post(f"{server.url}/v1/sandboxes/{sandbox_id}/hibernate")
            assert answer.status_code == 200 and answer.json()["state"] == "hibernated"
            assert answer.json()["sleeping_since"] is not None
            woke = httpx.post(f"{server.url}/v1/sandboxes/{sandbox_id}/resume")
            assert woke.status_code == 200 and woke.json()["state"] == "running"
            manager.processes.start(sandbox_id, ["sleep", "600"])
            refused = httpx.post(f"{server.url}/v1/sandboxes/{sandbox_id}/hibernate")
            assert refused.status_code == 409, refused.text
            assert "processes running" in refused.json()["message"]
    finally:
        corral("rm", sandbox_id)


def test_a_microvm_sandbox_hibernates_and_boots_again_from_its_disk(
        home: str, settings: Settings, manager: Manager, request: pytest.FixtureRequest) -> None:
    """Under TCG here (a test mode, not an isolation claim): the VM, its keeper, cgroup and
    network namespace go; the qcow2 workspace stays, and the next call boots it again."""
    problems: list[str] = request.getfixturevalue("microvm_problems")
    if problems:
        pytest.skip("; ".join(problems))
    with Sandbox.create(home=home, isolation="microvm", lifecycle=AWAKE) as sb:
        sb.commands.run("echo kept > /workspace/w.txt")
        uid = host_uid(sb.id)
        sb.hibernate()
        assert sb.get_info().state == "hibernated"
        left = kernel_pieces(settings, sb.id, uid)
        assert left == {k: [] for k in left}, left
        assert sb.commands.run("cat /workspace/w.txt").stdout == "kept\n"
        resumed = [d for t, d in trail_types(manager, sb.id) if t == "sandbox.resumed"]
        assert resumed[-1]["from"] == "hibernated"


def _ticks(process: Process) -> list[int]:
    text = "".join(t for _, stream, t in process.output() if stream == "stdout")
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith("tick ")]


def _until(what: Callable[[], bool], timeout_s: float = 120.0) -> None:
    """Wait for ``what`` (emulated guests are slow on a loaded host: the bound is far above
    the work, and each look is cheap)."""
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_microvm_sandbox_hibernates_with_its_processes_and_they_go_on(
        home: str, settings: Settings, manager: Manager, request: pytest.FixtureRequest) -> None:
    """Its memory saved with it (under TCG here). Paused, then hibernated by the reaper on its
    policy; while it sleeps nothing of it is in the kernel. A request through its preview URL
    wakes it and the same web server answers; a code context's variable is still there; a
    terminal's shell reads the line typed after the wake; a background process is the same
    one, counting on from where it was (no tick lost, none twice), its output read through
    the same process record."""
    problems: list[str] = request.getfixturevalue("microvm_problems")
    if problems:
        pytest.skip("; ".join(problems))
    with Sandbox.create(home=home, isolation="microvm",
                        lifecycle={"auto_resume": True, "hibernate_after": 0.2}) as sb, \
            Server(manager, create_app(manager)) as server:
        assert sb.run_code("x = 41").error is None
        ticker = sb.processes.start(
            ["sh", "-c", "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.1; done"])
        sb.files.write("hello.txt", "served from memory")
        web = sb.processes.start(["python3", "-m", "http.server", "8000", "--bind",
                                  "127.0.0.1", "--directory", "/workspace"])
        term = manager.processes.start(sb.id, ["sh", "-c", "read line; echo got $line"],
                                       pty=(24, 80))
        token = manager.ports.expose(sb.id, 8000).token or ""
        url = f"{server.url}/ports/{sb.id}/8000/hello.txt"

        def served() -> bool:
            return httpx.get(url, headers={"X-Corral-Port-Token": token}).status_code == 200

        _until(served)
        _until(lambda: len(_ticks(ticker)) >= 3)
        uid = host_uid(sb.id)
        sb.pause()
        time.sleep(0.3)
        manager.recover()  # the reaper: paused past its hibernate_after
        assert sb.get_info().state == "hibernated"
        left = kernel_pieces(settings, sb.id, uid)
        assert left == {k: [] for k in left}, left
        hibernated = [d for t, d in trail_types(manager, sb.id) if t == "sandbox.hibernated"]
        assert int(hibernated[-1]["memory_bytes"]) > 0  # type: ignore[call-overload]
        asleep = _ticks(ticker)
        assert ticker.info()["state"] == web.info()["state"] == "running"  # asleep with it
        # The request wakes it, and the server that was running answers.
        answer = httpx.get(url, headers={"X-Corral-Port-Token": token}, timeout=300)
        assert (answer.status_code, answer.text) == (200, "served from memory")
        assert sb.get_info().state == "running"
        assert "GET /hello.txt" in "".join(t for _, _, t in web.output())
        kept = sb.run_code("x + 1")  # the kernel kept its variable
        assert kept.text == "42", ([(p.argv[:2], p.state, p.result)
                                    for p in manager.processes.list(sb.id)], kept)
        term.send(b"hello\n")  # the terminal's shell was waiting on its line: it reads it
        _until(lambda: "got hello" in "".join(t for _, _, t in term.output()))
        _until(lambda: len(_ticks(ticker)) >= len(asleep) + 3)
        ticks = _ticks(ticker)
        assert ticks == list(range(1, len(ticks) + 1)), ticks  # the same process, gap-free
        ticker.kill()
        assert ticker.wait(timeout=60)["state"] == "exited"


def test_a_tenant_ceiling_bounds_how_long_its_sandboxes_sleep(
        manager: Manager, isolation: str) -> None:
    """``max_asleep_s``: the reaper destroys a sandbox asleep longer, hibernated (nothing to
    release but files) or paused, and says why; an awake one of the same tenant stays."""
    name = f"sleepy-{secrets.token_hex(4)}"
    tenant = TenantDirectory(manager.store).add_tenant(
        name, max_sandboxes=5, ceiling=Ceiling.build(max_asleep_s=1))
    deep = manager.create(caller=tenant, isolation=isolation, timeout=300)
    frozen = manager.create(caller=tenant, isolation=isolation, timeout=300)
    awake = manager.create(caller=tenant, isolation=isolation, timeout=300)
    try:
        manager.hibernate(deep.id)
        manager.pause(frozen.id)
        manager.recover()  # not yet: asleep for less than the bound
        assert {manager.get(i).state for i in (deep.id, frozen.id)} == {"hibernated", "paused"}
        time.sleep(1.2)
        manager.recover()
        for gone in (deep.id, frozen.id):
            with pytest.raises(SandboxNotFound):
                manager.get(gone)
            expired = [e.data for e in manager.auditor.trail(gone).events
                       if e.type == "sandbox.expired"]
            assert expired and expired[-1]["max_asleep_s"] == 1
        assert manager.get(awake.id).state == "running"
    finally:
        for info in (deep, frozen, awake):
            with contextlib.suppress(SandboxNotFound):
                manager.destroy(info.id)


def test_a_tenant_ceiling_bounds_how_many_of_its_sandboxes_hibernate(
        manager: Manager, isolation: str) -> None:
    """``max_hibernated``: past it a hibernate is refused (the sandbox left as it was, running
    or paused) and says what to do; a place freed by a wake is taken again."""
    name = f"deep-{secrets.token_hex(4)}"
    tenant = TenantDirectory(manager.store).add_tenant(
        name, max_sandboxes=5, ceiling=Ceiling.build(max_hibernated=1))
    first = manager.create(caller=tenant, isolation=isolation, timeout=300)
    second = manager.create(caller=tenant, isolation=isolation, timeout=300)
    other = manager.create(isolation=isolation, timeout=300)  # another tenant's: unbounded
    try:
        assert manager.hibernate(first.id).state == "hibernated"
        with pytest.raises(QuotaExceeded, match="max_hibernated"):
            manager.hibernate(second.id)
        assert manager.get(second.id).state == "running"
        assert manager.run(second.id, "echo still", timeout=30).stdout == "still\n"
        manager.pause(second.id)
        with pytest.raises(QuotaExceeded):
            manager.hibernate(second.id)
        assert manager.get(second.id).state == "paused"
        assert manager.store.intents(second.id) == []
        assert manager.hibernate(other.id).state == "hibernated"
        manager.resume(first.id)  # its place is free
        assert manager.hibernate(second.id).state == "hibernated"
    finally:
        for info in (first, second, other):
            with contextlib.suppress(SandboxNotFound):
                manager.destroy(info.id)


def test_concurrent_calls_wait_for_one_wake(home: str, manager: Manager) -> None:
    with Sandbox.create(home=home, lifecycle=AWAKE) as sb:
        sb.commands.run("echo 1 > /tmp/n")
        sb.hibernate()
        with ThreadPoolExecutor(max_workers=6) as pool:
            outputs = list(pool.map(lambda _: sb.commands.run("cat /tmp/n").stdout, range(6)))
        assert outputs == ["1\n"] * 6
        woke = [d for t, d in trail_types(manager, sb.id) if t == "sandbox.resumed"]
        assert len(woke) == 1 and woke[0]["from"] == "hibernated"
