"""The microVM tier, for real: QEMU guests under TCG here (``CORRAL_MICROVM_ALLOW_TCG=1``, a test
mode), each with its own kernel, no network device, its workspace on a disk, warm-restored.

What the conformance and isolation suites cannot show because it is this tier's own: the guest
kernel, the limits inside the guest, live memory fork, warm and cold start, a crashed caller, and
the refusal on a host whose KVM is PVM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Sandbox
from corral._settings import Settings

pytestmark = [pytest.mark.needs_root, pytest.mark.microvm]

CORRAL = str(Path(sys.executable).with_name("corral"))


@pytest.fixture
def sb(home: str, microvm_problems: list[str]) -> Iterator[Sandbox]:
    if microvm_problems:
        pytest.skip("the microVM tier cannot run here: " + "; ".join(microvm_problems))
    sandbox = Sandbox.create(home=home, isolation="microvm")
    yield sandbox
    sandbox.kill()


def _qemu_and_keepers() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "qemu-system|microvm.keeper"], capture_output=True,
                         text=True, check=False).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_the_guest_runs_its_own_kernel_with_no_network_device(sb: Sandbox) -> None:
    r = sb.commands.run(["sh", "-c", "uname -r; echo --; tail -n +3 /proc/net/dev | cut -d: -f1;"
                         " echo --; tail -n +3 /proc/partitions | awk '{print $4}'; echo --;"
                         " ls /dev/kvm 2>&1; id -u"])
    assert r.exit_code == 0, r.stderr
    release, netdevs, disks, rest = r.stdout.split("--\n")
    assert release.strip() != os.uname().release  # the guest's own kernel
    assert netdevs.split() == ["lo"]  # no NIC at all: the guest has only loopback
    # The guest kernel knows two disks, its root image and the workspace: nothing of the host.
    assert sorted(disks.split()) == ["vda", "vdb"], disks
    assert "No such file" in rest  # no /dev/kvm inside
    assert rest.split()[-1] == "1000"


def test_a_memory_bomb_is_contained_by_the_guest(sb: Sandbox) -> None:
    code = textwrap.dedent("""
        chunks = []
        for _ in range(64):           # at most 4 GiB asked for, 64 MiB at a time
            chunks.append(bytearray(64 << 20))
        print("survived", flush=True)
    """)
    r = sb.commands.run(["python3", "-c", code], timeout=60)
    assert "survived" not in r.stdout
    assert r.exit_code != 0
    assert sb.commands.run(["echo", "still here"]).stdout == "still here\n"


def test_a_fork_bomb_is_contained_by_the_guest(sb: Sandbox) -> None:
    # Bounded by construction: at most 2000 children, each sleeping 20 s, in a 30 s command.
    bomb = "for i in $(seq 1 2000); do sleep 20 & done 2>&1 | tail -1; wait"
    r = sb.commands.run(["bash", "-c", bomb], timeout=30)
    assert "Resource temporarily unavailable" in r.stdout + r.stderr or r.exit_code != 0
    assert sb.commands.run(["echo", "ok"]).stdout == "ok\n"


def test_a_full_workspace_is_enospc_inside(sb: Sandbox) -> None:
    r = sb.commands.run(["sh", "-c", "fallocate -l 8G /workspace/big; echo rc=$?"])
    assert "No space left on device" in r.stderr
    assert "rc=1" in r.stdout
    sb.commands.run(["rm", "-f", "/workspace/big"])
    sb.files.write("/workspace/after.txt", "fine")
    assert sb.files.read("/workspace/after.txt") == "fine"


_SERVER = textwrap.dedent("""
    import os, socket
    state = {"token": os.urandom(8).hex(), "count": 0, "total": 0}
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 7777))
    srv.listen(8)
    print("ready", state["token"], flush=True)
    while True:
        conn, _ = srv.accept()
        ask = conn.recv(100).decode().split()
        state["count"] += 1
        state["total"] += int(ask[1]) if len(ask) == 2 else 0
        conn.sendall(("%s %d %d %s" % (state["token"], state["count"], state["total"],
                                       os.urandom(8).hex())).encode())
        conn.close()
""")

_CLIENT = textwrap.dedent("""
    import socket, sys, time
    for _ in range(200):
        try:
            c = socket.create_connection(("127.0.0.1", 7777), timeout=5)
            break
        except OSError:
            time.sleep(0.05)
    c.sendall(("add %s" % sys.argv[1]).encode())
    print(c.recv(200).decode())
""")


def _ask(sandbox: Sandbox, add: int) -> list[str]:
    r = sandbox.commands.run(["python3", "-c", _CLIENT, str(add)], timeout=30)
    assert r.exit_code == 0, r.stderr
    return r.stdout.split()


def test_a_memory_snapshot_forks_a_running_process_three_ways(sb: Sandbox, home: str) -> None:
    server = sb.processes.start(["python3", "-c", _SERVER])
    token, count, total, _ = _ask(sb, 5)
    assert (count, total) == ("1", "5")
    snap = sb.snapshot(memory=True)
    children = sb.fork(3, memory=True)
    try:
        answers = [_ask(child, 10 * (i + 1)) for i, child in enumerate(children)]
        # Each copy continues from the parent's memory: its token and counters...
        assert [a[0] for a in answers] == [token] * 3
        assert [a[1] for a in answers] == ["2"] * 3
        # ...and then lives on its own: different input, different state, fresh randomness.
        assert [a[2] for a in answers] == ["15", "25", "35"]
        assert len({a[3] for a in answers}) == 3
        assert _ask(children[0], 1)[1:3] == ["3", "16"]
        # The parent was never touched by its children.
        assert _ask(sb, 0)[1:3] == ["2", "5"]
        from_snapshot = Sandbox.create(home=home, snapshot=snap)
        try:
            assert _ask(from_snapshot, 100)[:3] == [token, "2", "105"]
        finally:
            from_snapshot.kill()
    finally:
        for child in children:
            child.kill()
        server.kill()


def _keeper_mode(settings: Settings, sandbox_id: str) -> str:
    from corral._backends.microvm.backend import RUN_ROOT

    config = RUN_ROOT / f"{settings.instance}-{sandbox_id}" / "keeper.json"
    return str(json.loads(config.read_text())["mode"])


def test_create_restores_the_warm_snapshot_and_cold_boot_still_works(
    sb: Sandbox, settings: Settings, home: str
) -> None:
    assert _keeper_mode(settings, sb.id) == "warm"
    env = {**os.environ, "CORRAL_HOME": home, "CORRAL_MICROVM_WARM": "0",
           "CORRAL_UID_START": str(settings.uid_start), "CORRAL_UID_COUNT": str(settings.uid_count)}
    r = subprocess.run([CORRAL, "run", "--isolation", "microvm", "--", "uname", "-r"],
                       capture_output=True, text=True, env=env, timeout=180, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() != os.uname().release


_CRASHER = textwrap.dedent("""
    import sys, threading
    from corral import Sandbox
    sb = Sandbox.create(home=sys.argv[1], isolation="microvm")
    print(sb.id, flush=True)
    sb.commands.run(["sh", "-c", "echo started; sleep 50"], timeout=55,
                    on_stdout=lambda text: print(text, end="", flush=True))
""")


def test_a_caller_killed_mid_command_leaves_nothing_after_destroy(
    home: str, microvm_problems: list[str]
) -> None:
    if microvm_problems:
        pytest.skip("the microVM tier cannot run here: " + "; ".join(microvm_problems))
    proc = subprocess.Popen([sys.executable, "-c", _CRASHER, home], stdout=subprocess.PIPE,
                            text=True, env={**os.environ})
    assert proc.stdout is not None
    try:
        sandbox_id = proc.stdout.readline().strip()
        assert proc.stdout.readline().strip() == "started"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stdout.close()
    sb = Sandbox.connect(sandbox_id, home=home)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the keeper kills what its dead caller started
        if "sleep 50" not in sb.commands.run(["ps", "-eo", "args"]).stdout:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the command of a killed caller kept running in the guest")
    sb.kill()
    assert not [p for p in _qemu_and_keepers() if sandbox_id in p]
    from corral._backends.microvm.backend import RUN_ROOT

    assert not list(RUN_ROOT.glob(f"*-{sandbox_id}"))


def test_on_a_pvm_host_without_the_test_setting_the_tier_refuses(settings: Settings) -> None:
    from corral._backends.microvm.accel import kvm_kind
    from corral._backends.microvm.hostcheck import check_host

    strict = settings.model_copy(update={"microvm_allow_tcg": False})
    kvm = next(c for c in check_host(strict) if c.name == "kvm")
    if kvm_kind() == "hardware":
        pytest.skip("this host has hardware KVM: nothing to refuse")
    assert not kvm.ok
    assert ("PVM" in kvm.detail) == (kvm_kind() == "pvm")
    assert "CORRAL_MICROVM_ALLOW_TCG" in kvm.fix
    env = {**os.environ, "CORRAL_MICROVM_ALLOW_TCG": "0", "CORRAL_HOME": str(settings.home)}
    r = subprocess.run([CORRAL, "run", "--isolation", "microvm", "--", "true"],
                       capture_output=True, text=True, env=env, timeout=60, check=False)
    assert r.returncode != 0
    assert "refuses to run" in r.stderr and "CORRAL_MICROVM_ALLOW_TCG" in r.stderr
