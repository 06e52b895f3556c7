"""Isolation, proven against real sandboxes: each test attacks from inside and checks the host.

Nothing is mocked. Every attack is written so that it stays harmless even if the sandbox were
broken: nothing is written to an existing host file (files are opened for writing, never written),
the only addresses touched are 127.0.0.1 and ::1, and every process started is bounded in time.

Many probes tell seccomp's answer apart from the kernel's own: the filter answers EPERM where the
kernel, without it, would have said something else (ENOTTY for TIOCSTI on a non-tty, EINVAL for an
unknown bpf command, ENOSPC for a user namespace under ``--disable-userns``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import json
import os
import secrets
import socket
import subprocess
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import PathRefused, Sandbox

from . import conftest as integration
from .hostprocs import host_procs_of_uid, not_resident, status_field
from .hostprocs import host_uid as uid_of

pytestmark = pytest.mark.needs_root

# Every tier, the microVM one included (its guest kernel is the boundary; the probes are the same).
isolation = integration.isolation_all


@pytest.fixture
def sandbox(home: str, isolation: str) -> Iterator[Sandbox]:
    """A fresh sandbox of each isolation tier in turn (``isolation`` in conftest.py)."""
    sb = Sandbox.create(home=home, isolation=isolation)
    yield sb
    sb.kill()


# -- helpers --------------------------------------------------------------------------------------


def py(sb: Sandbox, code: str, *args: str, timeout: float = 30, **kw: object):  # type: ignore[no-untyped-def]
    """Run a Python snippet inside the sandbox (the sandbox's own /usr/bin/python3)."""
    return sb.commands.run(["python3", "-c", textwrap.dedent(code), *args], timeout=timeout, **kw)


def py_json(sb: Sandbox, code: str, *args: str, **kw: object) -> dict:  # type: ignore[type-arg]
    """Run a snippet whose last stdout line is a JSON object; return it."""
    r = py(sb, code, *args, **kw)
    assert r.exit_code == 0, f"probe failed: exit {r.exit_code}\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def host_procs_with_marker(marker: str) -> list[int]:
    """Host processes whose argv[0] contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read().split(b"\0", 1)[0]:
                    found.append(int(entry))
        except OSError:
            continue
    return found


def errname(code: int | None) -> str:
    return errno.errorcode.get(code or 0, str(code))


@contextlib.contextmanager
def tcp_server(family: socket.AddressFamily, addr: str) -> Iterator[tuple[int, list[object]]]:
    """A host TCP listener on ``addr``; yields (port, list of peers that connected)."""
    srv = socket.socket(family, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, 0))
    srv.listen(16)
    srv.settimeout(0.1)
    accepted: list[object] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, peer = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(peer)
            conn.close()

    thread = threading.Thread(target=loop, name="corral-test-tcp", daemon=True)
    thread.start()
    try:
        yield srv.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join(5)
        srv.close()


def ipv6_loopback_available() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


# -- privileges -----------------------------------------------------------------------------------


_PRIVILEGES_PROBE = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
PR_GET_SECCOMP, PR_CAPBSET_READ, PR_GET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 21, 23, 39, 47
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]
header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
assert libc.capget(ctypes.byref(header), data) == 0
sets = {name: [getattr(d, name) for d in data]
        for name in ("effective", "permitted", "inheritable")}
print(json.dumps({
    "capget": sets,
    "bounding": [c for c in range(64) if libc.prctl(PR_CAPBSET_READ, c, 0, 0, 0) == 1],
    "ambient": [c for c in range(64) if libc.prctl(PR_CAP_AMBIENT, 1, c, 0, 0) == 1],
    "no_new_privs": libc.prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0),
    "seccomp": libc.prctl(PR_GET_SECCOMP, 0, 0, 0, 0),
    "uids": os.getresuid(), "gids": os.getresgid(), "groups": os.getgroups(),
}))
"""


def test_inside_no_capabilities_no_new_privs_seccomp_on(sandbox: Sandbox, isolation: str) -> None:
    # What the kernel (Linux or gVisor's) answers, through the system calls themselves.
    out = py_json(sandbox, _PRIVILEGES_PROBE)
    assert out["capget"] == {k: [0, 0] for k in ("effective", "permitted", "inheritable")}, out
    assert out["bounding"] == [] and out["ambient"] == [], out
    assert out["no_new_privs"] == 1, out
    assert out["seccomp"] == 2, out  # filter mode
    assert out["uids"] == [1000] * 3 and out["gids"] == [1000] * 3, out
    assert out["groups"] in ([], [1000]), out
    # And what /proc says. gVisor's /proc/self/status has no CapAmb or NoNewPrivs line (the
    # probe above read both through prctl), so only the lines it has are required there.
    r = sandbox.commands.run("cat /proc/self/status; id -u")
    assert r.exit_code == 0, r.stderr
    status = r.stdout
    caps = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
    for cap in caps if isolation == "namespace" else caps[:-1]:
        assert int(status_field(status, cap), 16) == 0, f"{cap} is {status_field(status, cap)}"
    if isolation == "namespace":
        assert status_field(status, "NoNewPrivs") == "1"
    assert status_field(status, "Seccomp") == "2"  # filter mode
    assert status_field(status, "Uid").split() == ["1000"] * 4
    assert r.stdout.strip().splitlines()[-1] == "1000"


def _host_userns() -> str:
    return os.readlink("/proc/self/ns/user")


def test_host_sees_commands_running_as_the_sandbox_uid_never_root(
    sandbox: Sandbox, isolation: str
) -> None:
    """On the host, a command runs as the sandbox's own uid, never as root. In the gVisor tier the
    host processes are gVisor's (runsc's gofer, the Sentry, the systrap stubs that execute the
    command's code), and they run as the sandbox's runtime uid (its uid + 2**31) in a user
    namespace of their own, so the capabilities they hold there are none on the host; nothing
    at all runs as the uid that owns the workspace."""
    uid = uid_of(sandbox.id)
    assert uid != 0
    host_uid = uid
    if isolation == "gvisor":
        from corral._backends.gvisor.bundle import runtime_uid

        host_uid = runtime_uid(uid)
    if isolation == "microvm":
        _check_only_qemu_on_the_host(sandbox, uid)
        return
    # Past the first command (the namespace tier's takes a bwrap of its own): the one below
    # starts the resident. The gVisor tier may already have its resident up (from create).
    assert sandbox.commands.run("true").exit_code == 0
    assert host_procs_of_uid(uid) == [] and not_resident(host_procs_of_uid(host_uid)) == []
    waiter = (
        "touch /workspace/started; "
        "for i in $(seq 400); do [ -e /workspace/go ] && exit 0; sleep 0.05; done; exit 3"
    )
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(sandbox.commands.run, waiter, timeout=30)
        try:
            procs: list[tuple[int, str]] = []
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not sandbox.files.exists("started"):
                time.sleep(0.05)
            time.sleep(0.1)
            procs = host_procs_of_uid(host_uid)
            assert procs, "no process of the sandbox's uid seen on the host while a command ran"
            names = sorted(status_field(s, "Name") for _, s in procs)
            if isolation == "namespace":
                assert "bwrap" in names and "zygote" in names and "bash" in names, names
            else:
                assert host_procs_of_uid(uid) == [], names
                # runsc-gofer, runsc-sandbox (or "exe" once re-executed) and stubs.
                assert len(procs) >= 2, names
            for pid, status in procs:
                uids = status_field(status, "Uid").split()
                gids = status_field(status, "Gid").split()
                assert uids == [str(host_uid)] * 4, (pid, uids)
                assert "0" not in gids, (pid, gids)
                assert status_field(status, "Groups") in ("", str(uid)), (pid, status)
                try:
                    userns = os.readlink(f"/proc/{pid}/ns/user")
                except FileNotFoundError:
                    continue  # exited meanwhile
                if (isolation == "namespace" and not_resident([(pid, status)])) \
                        or userns == _host_userns():
                    assert int(status_field(status, "CapEff"), 16) == 0, (pid, status)
                    assert int(status_field(status, "CapPrm"), 16) == 0, (pid, status)
                elif isolation == "namespace":
                    # The resident's zygote and the init made ahead: CAP_SYS_ADMIN and
                    # CAP_SETPCAP, in the sandbox's own user namespace only, and nothing else.
                    assert userns != _host_userns(), (pid, status)
                    assert int(status_field(status, "CapEff"), 16) & ~_RESIDENT_CAPS == 0, \
                        (pid, status)
        finally:
            sandbox.files.write("go", "")
            result = future.result(timeout=30)
    assert result.exit_code == 0, result
    # The gVisor tier keeps its resident sandbox between commands (runtime uid, its own group)
    # until it is idle, as the namespace tier its bwrap and zygote (the sandbox's uid, groups
    # of their own); nothing else of the command may be left.
    assert not_resident(host_procs_of_uid(uid)) == []
    assert not_resident(host_procs_of_uid(host_uid)) == []


def _check_only_qemu_on_the_host(sandbox: Sandbox, uid: int) -> None:
    """The microVM tier: commands run in the guest's kernel, so the host never sees them; the
    one host process of the sandbox's uid is its QEMU, confined (no capabilities, no new
    privileges, no root group), before, during and after a command."""
    waiter = ("touch /workspace/started; "
              "for i in $(seq 400); do [ -e /workspace/go ] && exit 0; sleep 0.05; done; exit 3")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(sandbox.commands.run, waiter, timeout=30)
        try:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not sandbox.files.exists("started"):
                time.sleep(0.05)
            procs = host_procs_of_uid(uid)
            assert [status_field(s, "Name") for _, s in procs] == ["qemu-system-x86"], procs
            for pid, status in procs:
                assert status_field(status, "Uid").split() == [str(uid)] * 4, (pid, status)
                assert "0" not in status_field(status, "Gid").split(), (pid, status)
                assert status_field(status, "Groups") in ("", str(uid)), (pid, status)
                assert int(status_field(status, "CapEff"), 16) == 0, (pid, status)
                assert int(status_field(status, "CapPrm"), 16) == 0, (pid, status)
                assert int(status_field(status, "CapBnd"), 16) == 0, (pid, status)
                assert status_field(status, "NoNewPrivs") == "1", (pid, status)
                assert status_field(status, "Seccomp") == "2", (pid, status)  # -sandbox on
        finally:
            sandbox.files.write("go", "")
            result = future.result(timeout=30)
    assert result.exit_code == 0, result


def _microvm_top(home: str, sandbox_id: str) -> Path:
    disks = Path(home) / "microvm" / "sandboxes" / sandbox_id
    return disks / os.readlink(disks / "top")


# CAP_SYS_ADMIN (21) and CAP_SETPCAP (8): what a namespace sandbox's zygote holds in its own
# user namespace (``_backends/namespace/bwrap.py``).
_RESIDENT_CAPS = (1 << 21) | (1 << 8)


def _host_procs_of_commands(uid: int, isolation: str) -> list[tuple[int, str]]:
    """Host processes of the sandbox's uid that a command could have left: all of them, but
    on the microVM tier its QEMU (the VM itself, there for the sandbox's whole life)."""
    procs = host_procs_of_uid(uid)
    if isolation == "microvm":
        procs = [(p, s) for p, s in procs if status_field(s, "Name") != "qemu-system-x86"]
    # A namespace sandbox's resident helper (its bwrap and zygote, and the next command's init
    # made ahead: each in a group of its own) stays until it is idle; nothing of a command may.
    return not_resident(procs)


# -- filesystem -----------------------------------------------------------------------------------

_WRITE_PROBE = """
import errno, json, os, sys
name = "corral-probe-" + sys.argv[1]
dirs = ["/", "/usr", "/usr/bin", "/usr/local", "/usr/lib", "/etc", "/etc/ssl", "/home", "/root",
        "/var", "/var/tmp", "/opt", "/srv", "/mnt", "/run", "/boot", "/bin", "/sbin", "/lib",
        "/proc", "/proc/sys", "/proc/self", "/sys", "/dev", "/dev/shm", "/dev/pts", "/dev/mqueue",
        "/tmp", "/workspace"]
writable, denied = [], {}
for d in dirs:
    p = os.path.join(d, name)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        denied[d] = errno.errorcode.get(e.errno, str(e.errno))
        try:
            os.mkdir(p)
        except OSError:
            pass
        else:
            os.rmdir(p)
            writable.append(d)
        continue
    os.close(fd)
    os.unlink(p)
    writable.append(d)
# Existing files: opened for writing (never written, never truncated) and their mode changed.
files = ["/etc/passwd", "/etc/hosts", "/etc/resolv.conf", "/etc/ld.so.cache", "/usr/bin/env",
         "/bin/sh", "/usr/lib/os-release", "/proc/sysrq-trigger", "/proc/sys/kernel/hostname",
         "/proc/sys/kernel/core_pattern", "/proc/sys/vm/drop_caches"]
opened, chmodded = [], []
for f in files:
    try:
        fd = os.open(f, os.O_WRONLY)
    except OSError:
        pass
    else:
        os.close(fd)
        opened.append(f)
    try:
        st = os.stat(f)
        os.chmod(f, st.st_mode)
    except OSError:
        pass
    else:
        chmodded.append(f)
print(json.dumps({"writable": writable, "denied": denied, "opened": opened, "chmod": chmodded}))
"""


def test_only_workspace_tmp_and_dev_shm_are_writable(sandbox: Sandbox) -> None:
    """`/workspace` and `/tmp` are the writable places; `/dev/shm` is allowed too (POSIX shared
    memory and semaphores, e.g. Python's multiprocessing, need it). Everything else, `/dev`
    itself included, must refuse new files. bwrap's ``--dev`` mounts a fresh tmpfs on `/dev`
    owned by the sandbox's uid and makes `/dev/shm` a plain directory inside it, so unless the
    backend remounts `/dev` read-only afterwards, `/dev` is writable (and unbounded by the /tmp
    size limit)."""
    token = secrets.token_hex(6)
    out = py_json(sandbox, _WRITE_PROBE, token)
    assert out["opened"] == [], f"existing files opened for writing: {out['opened']}"
    assert out["chmod"] == [], f"existing files whose mode could be changed: {out['chmod']}"
    assert sorted(out["writable"]) == ["/dev/shm", "/tmp", "/workspace"], (
        f"writable: {out['writable']}; denied: {out['denied']}"
    )
    # Nothing reached the host's own directories.
    for d in ("/", "/usr", "/usr/bin", "/usr/local", "/usr/lib", "/etc", "/home", "/root", "/var",
              "/opt", "/srv", "/mnt", "/run", "/boot", "/dev", "/dev/shm"):
        assert not os.path.lexists(os.path.join(d, f"corral-probe-{token}")), d


def test_workspace_and_tmp_writes_persist_and_dev_shm_does_not(sandbox: Sandbox) -> None:
    """/tmp lives as long as the sandbox, as on any Linux host (a tool installed there by one
    command is run by the next); /dev/shm is still each command's own."""
    r = sandbox.commands.run(
        "echo w > /workspace/keep && echo t > /tmp/kept && echo s > /dev/shm/gone"
    )
    assert r.exit_code == 0, r.stderr
    r = sandbox.commands.run("cat /workspace/keep /tmp/kept; ls /dev/shm")
    assert r.stdout.split() == ["w", "t"], r.stdout


def test_host_secrets_are_not_visible(sandbox: Sandbox, isolation: str) -> None:
    assert Path("/etc/shadow").exists()  # the host has one; the sandbox must not see it
    r = sandbox.commands.run(
        "cat /etc/shadow; cat /etc/gshadow; cat /proc/1/root/etc/shadow; cat /usr/../etc/shadow; "
        "ls -la /root; cat /root/.bashrc; ls /etc/ssh; ls /etc/ssl/private; "
        "cat /proc/kcore | head -c 16 | wc -c; exit 0"
    )
    assert "root:" not in r.stdout
    assert "$" not in r.stdout.replace("\n", "")  # no password hash of any form
    assert r.stdout.strip() == "0", r.stdout  # only `wc -c` printed, and it counted nothing
    for path in ("/etc/shadow", "/etc/gshadow", "/proc/1/root/etc/shadow", "/root",
                 "/root/.bashrc", "/etc/ssh", "/etc/ssl/private"):
        refusals = ["No such file or directory"]
        if path.startswith("/proc/1/root"):
            # gVisor refuses /proc/<pid>/root outright (EACCES, its ptrace-access check); in
            # the microVM pid 1 is the launcher's init, root's, so the user may not look in;
            # in the namespace tier pid 1 is the command's init, which is not dumpable.
            # The file is not in the sandbox's root either way (the first line checks that).
            refusals.append("Permission denied")
        assert any(f"{path}: {why}" in r.stderr or f"'{path}': {why}" in r.stderr
                   for why in refusals), f"{path} seems visible:\n{r.stderr}"
    # /home holds only E2B's /home/user, which is the workspace again, not the host's homes.
    r = sandbox.commands.run("ls -a /home; echo mark > /workspace/.home-probe; "
                             "cat /home/user/.home-probe; rm /workspace/.home-probe")
    assert r.stdout.split() == [".", "..", "user", "mark"], (r.stdout, r.stderr)
    # The user database is the sandbox's own, not the host's.
    r = sandbox.commands.run("getent passwd | cut -d: -f1")
    assert sorted(r.stdout.split()) == ["nobody", "root", "user"], r.stdout


def test_other_sandbox_workspace_is_invisible(sandbox: Sandbox, home: str, isolation: str) -> None:
    token = secrets.token_hex(8)
    victim = sandbox
    r = victim.commands.run(f"echo {token} > /workspace/secret-{token}.txt && mkdir -p d && "
                            f"echo {token} > d/inner-{token}")
    assert r.exit_code == 0, r.stderr
    host_path = Path(home) / "sandboxes" / victim.id / "workspace" / f"secret-{token}.txt"
    if isolation == "microvm":
        # The workspace is a disk the guest owns; on the host it is the sandbox's qcow2 top.
        host_path = _microvm_top(home, victim.id)
        assert host_path.is_file()
    else:
        assert host_path.read_text().strip() == token  # where it really lives on the host

    other = Sandbox.create(home=home, isolation=isolation)
    try:
        assert uid_of(other.id) != uid_of(victim.id)
        r = other.commands.run(
            f"cat /workspace/secret-{token}.txt; ls -la /workspace; "
            f"cat {host_path}; ls {host_path.parent}; ls {home}; ls {Path(home) / 'sandboxes'}; "
            f"find / \\( -path /proc -o -path /usr \\) -prune -o -name '*{token}*' -print; "
            f"grep -rs {token} /workspace /tmp /dev /etc; "
            f"ls /proc/*/root/workspace 2>&1 | grep -c {token}; exit 0",
            timeout=30,
        )
        assert token not in r.stdout, r.stdout
        assert f"{host_path}: No such file or directory" in r.stderr, r.stderr
        # The SDK's file API refuses the host path too.
        with pytest.raises(PathRefused):
            other.files.read(str(host_path))
        with pytest.raises(PathRefused):
            other.files.read(f"../../{victim.id}/workspace/secret-{token}.txt")
        # The victim's secret is still there and unchanged.
        assert victim.commands.run(f"cat secret-{token}.txt").stdout.strip() == token
    finally:
        other.kill()


def test_other_sandbox_workspace_unreadable_by_another_sandbox_uid_on_host(
    sandbox: Sandbox, home: str, isolation: str
) -> None:
    """Defence in depth: the per-sandbox uid exists so that a process that escaped one sandbox's
    mount namespace still cannot touch another sandbox. Read the victim's files on the host as the
    other sandbox's uid (a real process with that uid, no namespaces)."""
    token = secrets.token_hex(8)
    r = sandbox.commands.run(f"echo {token} > /workspace/secret.txt; mkdir -p sub; "
                             f"echo {token} > sub/inner.txt")
    assert r.exit_code == 0, r.stderr
    ws = Path(home) / "sandboxes" / sandbox.id / "workspace"
    if isolation == "microvm":
        ws = _microvm_top(home, sandbox.id).parent  # the disk directory: its top holds the files
        assert ws.is_dir()
    other = Sandbox.create(home=home, isolation=isolation)
    try:
        other_uid = uid_of(other.id)
        attempts = {
            "cat": ["cat", str(ws / "secret.txt")],
            "cat-disk": ["sh", "-c", f"cat {ws}/top*.qcow2 >/dev/null"],
            "ls": ["ls", str(ws)],
            "cat-sub": ["cat", str(ws / "sub" / "inner.txt")],
            "write": ["sh", "-c", f"echo x > {ws / ('planted-' + token)}"],
        }
        leaked = {}
        for name, argv in attempts.items():
            proc = subprocess.run(argv, user=other_uid, group=other_uid, extra_groups=[],
                                  capture_output=True, text=True, timeout=10, cwd="/")
            if proc.returncode == 0:
                leaked[name] = proc.stdout.strip()
        assert not (ws / f"planted-{token}").exists()
        assert leaked == {}, (
            f"sandbox uid {other_uid} can reach sandbox {sandbox.id}'s workspace on the host: "
            f"{leaked}"
        )
    finally:
        other.kill()


# -- processes ------------------------------------------------------------------------------------


def test_only_own_processes_are_visible(sandbox: Sandbox, isolation: str) -> None:
    # Past the first command (the namespace tier's takes a bwrap of its own), as most are.
    assert sandbox.commands.run("true").exit_code == 0
    r = sandbox.commands.run("ps -eo pid=,comm=; ls -d /proc/[0-9]* | wc -l")
    assert r.exit_code == 0, r.stderr
    *rows, count = r.stdout.strip().splitlines()
    comms = sorted(line.split()[1] for line in rows)
    # pid 1 is the command's init, which reaps: the resident zygote's in the namespace tier,
    # the launcher's (``run``) in the resident gVisor sandbox or the guest.
    expected = {"namespace": ["bash", "init", "ps"]}.get(isolation, ["bash", "ps", "run"])
    assert comms == expected, rows
    pids = sorted(int(line.split()[0]) for line in rows)
    assert pids[0] == 1 and pids[-1] < 20, pids  # a PID namespace of its own
    assert int(count) <= 5


def test_cannot_signal_host_processes(sandbox: Sandbox, isolation: str) -> None:
    uid = uid_of(sandbox.id)
    # A disposable host process running under the very same uid as the sandbox: without the
    # PID namespace, the sandbox could signal it.
    decoy = subprocess.Popen(["sleep", "60"], user=uid, group=uid, extra_groups=[],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, cwd="/")
    try:
        me = os.getpid()
        assert me > 50 and decoy.pid > 50
        r = sandbox.commands.run(
            f"kill -0 {me}; echo rc=$?; kill -KILL {decoy.pid}; echo rc=$?; "
            f"ls /proc/{me}; cat /proc/{decoy.pid}/cmdline; echo done"
        )
        assert "rc=1\nrc=1\n" in r.stdout, r.stdout
        assert f"kill: ({me}) - No such process" in r.stderr, r.stderr
        assert f"kill: ({decoy.pid}) - No such process" in r.stderr, r.stderr
        time.sleep(0.2)
        assert decoy.poll() is None, "the host decoy process died"
    finally:
        decoy.kill()
        decoy.wait(10)
    assert _host_procs_of_commands(uid, isolation) == []


def test_a_command_cannot_stop_or_kill_its_init(sandbox: Sandbox) -> None:
    # pid 1 reaps the command and reports its end. Linux drops a signal sent to a namespace's
    # init from inside it; gVisor does not, and its init's real uid is not the command's so
    # that the signal is refused there (EPERM), as on the microVM tier (a root init). A
    # stopped init reaped nothing: the command hung until its timeout.
    stop = sandbox.commands.run("kill -STOP 1; echo after", timeout=60)
    assert (stop.exit_code, stop.stdout, stop.timed_out) == (0, "after\n", False), stop
    kill = sandbox.commands.run("kill -KILL 1; echo after", timeout=60)
    assert (kill.exit_code, kill.stdout, kill.timed_out) == (0, "after\n", False), kill
    # Stopped again and again, from a process that outlives the command's main one.
    again = sandbox.commands.run("(for i in $(seq 20000); do kill -STOP 1; done 2>/dev/null) & "
                                 "for i in 1 2 3 4 5; do kill -STOP 1 2>/dev/null; sleep 0.1; "
                                 "done; echo after", timeout=60)
    assert (again.exit_code, again.stdout, again.timed_out) == (0, "after\n", False), again
    assert sandbox.commands.run("echo next", timeout=60).stdout == "next\n"


def test_a_command_that_stops_itself_ends_at_its_timeout(sandbox: Sandbox) -> None:
    # Its own process group, then a background process: what Corral waits on ends at the
    # timeout or the kill, stopped or not.
    stopped = sandbox.commands.run("kill -STOP 0; echo never", timeout=2)
    assert stopped.timed_out and stopped.exit_code == 124 and stopped.stdout == "", stopped
    process = sandbox.processes.start(["sh", "-c", "(sleep 0.2; echo up) & kill -STOP $$"])
    for _, _, text in process.output(0, follow=True, wait_s=60):
        if "up" in text:  # said after the stop
            break
    process.kill()
    assert process.wait(timeout=60)["state"] == "exited"
    assert sandbox.commands.run("echo next", timeout=60).stdout == "next\n"


_COUNT_MARKED = """
import os, sys
n = 0
for e in os.listdir("/proc"):
    if e.isdigit():
        try:
            argv0 = open(f"/proc/{e}/cmdline", "rb").read().split(b"\\0", 1)[0]
        except OSError:
            continue
        n += sys.argv[1].encode() in argv0
print(n)
"""


def test_no_process_survives_its_command(sandbox: Sandbox, isolation: str,
                                        manager: object) -> None:
    uid = uid_of(sandbox.id)
    token = secrets.token_hex(6)
    m1, m2, m3 = (f"corral-linger{i}-{token}" for i in range(3))
    sandbox.files.write("count.py", _COUNT_MARKED)
    double_fork = textwrap.dedent(f"""
        import os
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                fd = os.open("/dev/null", os.O_RDWR)
                for i in (0, 1, 2):
                    os.dup2(fd, i)
                os.execvp("sleep", ["{m3}", "1000"])
            os._exit(0)
        os.wait()
    """)
    script = (
        # Plain background job that keeps the command's stdout open.
        f"(exec -a {m1} sleep 1000) &\n"
        # setsid + nohup, detached from all our fds.
        f"setsid nohup bash -c 'exec -a {m2} sleep 1000' </dev/null >/dev/null 2>&1 &\n"
        # Classic daemon double fork.
        f"python3 -c '{double_fork}'\n"
        f"for i in $(seq 100); do\n"
        f"  n=$(python3 count.py {token})\n"
        f"  [ \"$n\" -ge 3 ] && break; sleep 0.05\n"
        f"done\n"
        f"echo alive=$n\n"
    )
    started = time.monotonic()
    r = sandbox.commands.run(script, timeout=20)
    assert time.monotonic() - started < 15
    # The stragglers really were running when the command ended...
    assert "alive=3" in r.stdout, (r.stdout, r.stderr)
    # ...and are gone now, from the host's point of view...
    assert host_procs_with_marker(token) == []
    assert _host_procs_of_commands(uid, isolation) == []
    if isolation == "microvm":
        # ...and from the guest kernel's: the agent sees no process left in any command's
        # group (the tier's own view, the one `busy` answers from).
        from corral._control.manager import Manager

        assert isinstance(manager, Manager)
        info = manager.store.get(sandbox.id)
        assert info is not None
        assert manager.sandboxes.backend(info).busy(manager.sandboxes.spec(info)) is False
    # ...and from the sandbox's.
    r = sandbox.commands.run(f"python3 count.py {token}; ps -eo comm=")
    lines = r.stdout.split()
    assert lines[0] == "0", r.stdout
    assert "sleep" not in lines, r.stdout


# -- network --------------------------------------------------------------------------------------

_CONNECT_PROBE = """
import json, socket, sys
family = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
try:
    s = socket.socket(family, socket.SOCK_STREAM)
except OSError as e:  # the microVM's kernel has no IPv6 at all
    print(json.dumps({"result": "no socket: " + str(e.errno)}))
    sys.exit(0)
s.settimeout(3)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    result = "CONNECTED"
except OSError as e:
    result = type(e).__name__
print(json.dumps({"result": result}))
"""


@pytest.mark.parametrize("addr", ["127.0.0.1", "::1"])
def test_cannot_reach_host_loopback_tcp(sandbox: Sandbox, addr: str, isolation: str) -> None:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    if family == socket.AF_INET6 and not ipv6_loopback_available():
        pytest.skip("no ::1 on this host")
    with tcp_server(family, addr) as (port, accepted):
        # The listener works: the host itself can connect.
        with socket.create_connection((addr, port), timeout=3):
            pass
        deadline = time.monotonic() + 3
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert accepted, "the test server is broken"
        accepted.clear()

        out = py_json(sandbox, _CONNECT_PROBE, addr, str(port))
        no_ipv6 = isolation == "microvm" and family == socket.AF_INET6
        refused = f"no socket: {errno.EAFNOSUPPORT}" if no_ipv6 else "ConnectionRefusedError"
        assert out["result"] == refused, out
        r = sandbox.commands.run(f"exec 3<>/dev/tcp/{addr}/{port} && echo CONNECTED", timeout=10)
        assert "CONNECTED" not in r.stdout
        assert r.exit_code != 0
        why = "Address family not supported" if no_ipv6 else "Connection refused"
        assert why in r.stderr, r.stderr
        time.sleep(0.2)
        assert accepted == [], f"the sandbox reached the host: {accepted}"


def test_cannot_reach_host_abstract_unix_socket(sandbox: Sandbox) -> None:
    """Abstract unix sockets belong to the network namespace; a host one must be unreachable."""
    name = f"corral-test-{secrets.token_hex(6)}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind("\0" + name)
        srv.listen(4)
        srv.settimeout(0.5)
        out = py_json(sandbox, """
            import json, socket, sys
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect("\\0" + sys.argv[1]); r = "CONNECTED"
            except OSError as e:
                r = type(e).__name__
            print(json.dumps({"result": r}))
        """, name)
        assert out["result"] == "ConnectionRefusedError", out
        with pytest.raises(TimeoutError):
            srv.accept()
    finally:
        srv.close()


def test_udp_to_host_loopback_never_arrives(sandbox: Sandbox) -> None:
    token = secrets.token_hex(8)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx:
        rx.bind(("127.0.0.1", 0))
        port = rx.getsockname()[1]
        # The receiver works.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
            tx.sendto(b"self-test", ("127.0.0.1", port))
        rx.settimeout(2)
        assert rx.recvfrom(64)[0] == b"self-test"

        r = py(sandbox, """
            import socket, sys, time
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sent = 0
            for _ in range(20):
                try:
                    s.sendto(sys.argv[1].encode(), ("127.0.0.1", int(sys.argv[2])))
                    sent += 1
                except OSError as e:
                    print("error", type(e).__name__)
                time.sleep(0.01)
            print("sent", sent)
        """, token, str(port))
        assert r.exit_code == 0, r.stderr
        rx.settimeout(1.0)
        got = []
        with contextlib.suppress(TimeoutError):
            while True:
                got.append(rx.recvfrom(256))
        assert got == [], f"UDP from the sandbox arrived on the host: {got}"


def test_no_name_resolution_and_only_lo(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("getent hosts example.com; echo rc=$?; getent ahosts example.com; "
                             "echo rc=$?")
    assert "rc=2\nrc=2\n" in r.stdout, r.stdout
    out = py_json(sandbox, """
        import json, socket
        res = {}
        for host in ("example.com", "example.com."):
            try:
                res[host] = repr(socket.getaddrinfo(host, 443))
            except socket.gaierror as e:
                res[host] = "gaierror"
        ifs = [l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]]
        routes = open("/proc/net/route").read().splitlines()[1:]
        try:
            routes6 = [l for l in open("/proc/net/ipv6_route").read().splitlines()
                       if not l.split()[-1] == "lo"]
        except FileNotFoundError:  # a kernel without IPv6 (the microVM's)
            routes6 = []
        print(json.dumps({"dns": res, "ifs": ifs, "routes": routes, "routes6": routes6}))
    """)
    assert set(out["dns"].values()) == {"gaierror"}, out["dns"]
    assert out["ifs"] == ["lo"], out
    assert out["routes"] == [] and out["routes6"] == [], out
    r = sandbox.commands.run("grep -c nameserver /etc/resolv.conf")
    assert r.stdout.strip() == "0"


# -- seccomp and kernel attack surface ------------------------------------------------------------

def libc_probe(body: str) -> str:
    """A probe with ``sc(nr, *args) -> (return value, errno name or "OK")`` for raw syscalls."""
    return _LIBC + textwrap.dedent(body)


_LIBC = """
import ctypes, errno, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(nr, *args):
    ctypes.set_errno(0)
    args = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    r = libc.syscall(ctypes.c_long(nr), *args)
    return r, errno.errorcode.get(ctypes.get_errno(), "") if r == -1 else "OK"
"""


def test_mount_refused(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("mkdir -p /tmp/m && mount -t tmpfs none /tmp/m; echo rc=$?; "
                             "unshare -rm mount -t tmpfs none /tmp/m; echo rc=$?; "
                             "stat -c %d /tmp /tmp/m")
    rcs = [line for line in r.stdout.splitlines() if line.startswith("rc=")]
    assert all(rc != "rc=0" for rc in rcs), r.stdout
    devs = r.stdout.split()[-2:]
    assert devs[0] == devs[1], "something got mounted on /tmp/m"
    out = py_json(sandbox, libc_probe("""
        os.makedirs("/tmp/m", exist_ok=True)
        MS_REMOUNT, MS_BIND = 32, 4096
        res = {
            "mount": sc(165, b"none", b"/tmp/m", b"tmpfs", 0, 0)[1],
            "remount_root_rw": sc(165, 0, b"/", 0, MS_REMOUNT | MS_BIND, 0)[1],
            "umount_tmp": sc(166, b"/tmp", 2)[1],  # MNT_DETACH
            "fsopen": sc(430, b"tmpfs", 0)[1],
            "open_tree": sc(428, -100, b"/workspace", 1)[1],
            "pivot_root": sc(155, b"/tmp", b"/tmp/m")[1],
            "chroot": sc(161, b"/tmp")[1],
        }
        res["same_dev"] = os.stat("/tmp").st_dev == os.stat("/tmp/m").st_dev
        print(json.dumps(res))
    """))
    assert out.pop("same_dev") is True
    assert out == dict.fromkeys(out, "EPERM"), out


def test_ptrace_refused(sandbox: Sandbox) -> None:
    out = py_json(sandbox, libc_probe("""
        import time
        res = {"traceme": sc(101, 0, 0, 0, 0)[1]}  # the kernel itself would allow TRACEME
        child = os.fork()
        if child == 0:
            time.sleep(5)
            os._exit(0)
        res["attach_child"] = sc(101, 16, child, 0, 0)[1]  # PTRACE_ATTACH
        res["seize_child"] = sc(101, 0x4206, child, 0, 0)[1]  # PTRACE_SEIZE
        buf = ctypes.create_string_buffer(8)
        iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
        iov_p = ctypes.addressof(iov)
        res["process_vm_readv"] = sc(310, child, iov_p, 1, iov_p, 1, 0)[1]
        os.kill(child, 9)
        os.waitpid(child, 0)
        print(json.dumps(res))
    """))
    assert out == dict.fromkeys(out, "EPERM"), out
    r = sandbox.commands.run("strace -f true")
    assert r.exit_code != 0
    assert "Operation not permitted" in r.stderr, r.stderr


def test_bpf_and_other_kernel_surface_refused(sandbox: Sandbox) -> None:
    out = py_json(sandbox, libc_probe("""
        # BPF_MAP_CREATE with a small valid array-map attribute; and an unknown command, which the
        # kernel itself answers with EINVAL, so EPERM there is the filter's answer.
        attr = (ctypes.c_uint32 * 32)(2, 4, 4, 1)
        res = {
            "bpf_map_create": sc(321, 0, ctypes.addressof(attr), ctypes.sizeof(attr))[1],
            "bpf_prog_load": sc(321, 5, ctypes.addressof(attr), ctypes.sizeof(attr))[1],
            "bpf_unknown_cmd": sc(321, 9999, 0, 0)[1],
            "perf_event_open": sc(298, 0, 0, -1, -1, 0)[1],
            "userfaultfd": sc(323, 0)[1],
            "io_uring_setup": sc(425, 1, 0)[1],
            "keyctl": sc(250, 0, 0, 0)[1],
            "add_key": sc(248, b"user", b"x", b"y", 1, -2)[1],
            "init_module": sc(175, 0, 0, b"")[1],
            "kexec_load": sc(246, 0, 0, 0, 0)[1],
            "syslog_read_all": sc(103, 3, 0, 0)[1],
            "open_by_handle_at": sc(304, -100, 0, 0)[1],
        }
        print(json.dumps(res))
    """))
    assert out == dict.fromkeys(out, "EPERM"), out


def test_clone3_answers_enosys_so_libc_uses_clone(sandbox: Sandbox, isolation: str) -> None:
    """clone3 takes its flags in memory, where a filter cannot look; answering ENOSYS makes libc
    fall back to clone, whose flags the filter checks (CLONE_NEWUSER)."""
    # In gVisor too: there the command gets this filter from the resident sandbox's launcher,
    # not from the OCI profile (whose denials gVisor answers with EPERM only). A PTY command's
    # own gVisor sandbox still has the OCI profile, and clone3 allowed (a user namespace made
    # with it would live in gVisor's kernel, never the host's).
    out = py_json(sandbox, libc_probe("""
        print(json.dumps({"clone3": sc(435, 0, 0)[1]}))
    """))
    assert out["clone3"] == "ENOSYS", out


def test_no_new_user_namespace(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("unshare -U true; echo rc=$?; unshare -r id; echo rc=$?; "
                             "bwrap --ro-bind / / true; echo rc=$?")
    assert [line for line in r.stdout.splitlines() if line.startswith("rc=")] == [
        "rc=1", "rc=1", "rc=1"], (r.stdout, r.stderr)
    out = py_json(sandbox, libc_probe("""
        CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x20000, 0x40000000, 17
        res = {
            "unshare_user": sc(272, CLONE_NEWUSER)[1],
            "unshare_mount": sc(272, CLONE_NEWNS)[1],
            "unshare_net": sc(272, CLONE_NEWNET)[1],
            "unshare_user_hi_bits": sc(272, CLONE_NEWUSER | (1 << 32))[1],
            # (the microVM's kernel has no user namespaces at all: no ns/user to name)
            "setns": sc(308, os.open(next(p for p in ("/proc/self/ns/user", "/proc/self/ns/mnt")
                                          if os.path.exists(p)), os.O_RDONLY), 0)[1],
        }
        # Raw clone: if it ever succeeded, the child must leave at once.
        r, e = sc(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
        if r == 0:
            os._exit(0)
        if r > 0:
            os.waitpid(r, 0)
        res["clone_newuser"] = e
        print(json.dumps(res))
    """))
    assert out == dict.fromkeys(out, "EPERM"), out


def test_tiocsti_refused(sandbox: Sandbox, isolation: str) -> None:
    probe = libc_probe("""
        import fcntl, pty, termios
        res = {}
        def ioctl(fd, req, arg):
            try:
                fcntl.ioctl(fd, req, arg)
                return "OK"
            except OSError as e:
                return errno.errorcode.get(e.errno)
        # fd 0 is not a tty: the kernel says ENOTTY (checked with a harmless ioctl), so EPERM
        # for TIOCSTI can only come from the filter.
        res["fd0_tiocgwinsz"] = ioctl(0, termios.TIOCGWINSZ, b"\\0" * 8)
        res["fd0_tiocsti"] = ioctl(0, termios.TIOCSTI, b"x")
        res["fd0_tiocsti_hi_bits"] = sc(16, 0, termios.TIOCSTI | (1 << 32), b"x")[1]
        res["fd0_tioclinux"] = ioctl(0, 0x541C, b"\\x06")
        try:
            os.open("/dev/tty", os.O_RDWR)
            res["dev_tty"] = "OPENED"
        except OSError as e:
            res["dev_tty"] = errno.errorcode.get(e.errno)
        # The real attack: a pty that is our controlling terminal.
        pid, master = pty.fork()
        if pid == 0:
            a = ioctl(0, termios.TIOCGWINSZ, b"\\0" * 8)
            b = ioctl(0, termios.TIOCSTI, b"x")
            os.write(1, f"\\nCHILD {a} {b}\\n".encode())
            os._exit(0)
        data = b""
        while True:
            try:
                chunk = os.read(master, 1024)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
        os.waitpid(pid, 0)
        line = [l for l in data.decode(errors="replace").splitlines() if l.startswith("CHILD")]
        res["pty_ctty"] = line[0] if line else data.decode(errors="replace")
        print(json.dumps(res))
    """)
    out = py_json(sandbox, probe)
    assert out["fd0_tiocgwinsz"] == "ENOTTY", out
    assert out["fd0_tiocsti"] == "EPERM", out
    assert out["fd0_tiocsti_hi_bits"] == "EPERM", out
    assert out["fd0_tioclinux"] == "EPERM", out
    # No controlling terminal (bwrap's --new-session; a fresh session in gVisor, whose kernel
    # answers EIO where Linux answers ENXIO).
    # No controlling terminal: Linux (the host's, or the microVM guest's) says ENXIO; gVisor EIO.
    assert out["dev_tty"] == ("EIO" if isolation == "gvisor" else "ENXIO"), out
    assert out["pty_ctty"] == "CHILD OK EPERM", out
    # With stdin a pipe, too.
    out = py_json(sandbox, probe, stdin="some input")
    assert out["fd0_tiocsti"] == "EPERM", out


_SOCKET_CASES = {
    "inet_raw": (socket.AF_INET, socket.SOCK_RAW),
    "inet6_raw": (socket.AF_INET6, socket.SOCK_RAW),
    "inet_raw_cloexec": (socket.AF_INET, socket.SOCK_RAW | socket.SOCK_CLOEXEC),
    "packet_raw": (socket.AF_PACKET, socket.SOCK_RAW),
    "packet_dgram": (socket.AF_PACKET, socket.SOCK_DGRAM),
    "netlink_raw": (socket.AF_NETLINK, socket.SOCK_RAW),
    "netlink_dgram": (socket.AF_NETLINK, socket.SOCK_DGRAM),
    "netlink_dgram_cloexec": (socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC),
}


def _socket_probe(high_bits: bool) -> str:
    cases = {name: (int(fam) | (1 << 32) if high_bits else int(fam), int(st))
             for name, (fam, st) in _SOCKET_CASES.items()}
    return libc_probe(f"""
        res = {{}}
        for name, (fam, st) in {cases!r}.items():
            r, e = sc(41, fam, st, 0)
            if r >= 0:
                s = socket.socket(fileno=r)
                e = f"OPENED as family {{int(s.family)}} type {{int(s.type)}}"
                s.close()
            res[name] = e
        print(json.dumps(res))
    """)


def test_raw_packet_netlink_sockets_refused(sandbox: Sandbox) -> None:
    """Raw IP, packet and netlink sockets. Without the filter the kernel itself would hand out
    netlink sockets to anyone, so refusing those is the filter's doing."""
    out = py_json(sandbox, _socket_probe(high_bits=False))
    refused = {k: v for k, v in out.items() if v in ("EPERM", "EAFNOSUPPORT")}
    assert refused == out, {k: v for k, v in out.items() if k not in refused}
    r = sandbox.commands.run("ip link; echo rc=$?; ip route; echo rc=$?")
    assert r.stdout.split() == ["rc=1", "rc=1"], (r.stdout, r.stderr)


def test_socket_family_upper_bits_do_not_dodge_the_filter(sandbox: Sandbox) -> None:
    """The same, via the raw syscall with garbage in the upper 32 bits of the family argument.
    The kernel takes ``int family`` and so sees AF_NETLINK / AF_PACKET; a filter that compares all
    64 bits (libseccomp's EQ) does not match and lets the call through."""
    out = py_json(sandbox, _socket_probe(high_bits=True))
    opened = {k: v for k, v in out.items() if v not in ("EPERM", "EAFNOSUPPORT")}
    assert opened == {}, f"opened despite the filter: {opened}"


def _int80_probe() -> str:
    return textwrap.dedent("""
        import ctypes, mmap, os
        # mov eax, 20 (getpid in the i386 table); int 0x80; ret
        code = bytes([0xB8, 0x14, 0, 0, 0, 0xCD, 0x80, 0xC3])
        buf = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        buf.write(code)
        fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
        print("before", os.getpid(), flush=True)
        print("after", fn(), flush=True)
    """)


def test_32bit_syscall_kills_the_process(sandbox: Sandbox, isolation: str) -> None:
    """A 32-bit system call (other numbers, so it would dodge every rule) does nothing: the
    filter's action for a foreign architecture kills the process (SIGSYS) on the namespace
    tier and in gVisor, where the command gets the same filter (gVisor has no 32-bit ABI and
    would answer ENOSYS without running anything)."""
    # Baseline on the host: the 32-bit ABI works here, so the probe is meaningful.
    host = subprocess.run(["/usr/bin/python3", "-c", _int80_probe()], capture_output=True,
                          text=True, timeout=30)
    if host.returncode != 0 or "after" not in host.stdout:
        pytest.skip(f"the host kernel has no 32-bit ABI to test ({host.returncode})")
    r = sandbox.commands.run(["python3", "-c", _int80_probe()], timeout=30)
    assert "before" in r.stdout
    if isolation == "microvm":
        # The guest kernel is built without the 32-bit ABI (IA32_EMULATION=n): int 0x80 is a
        # general protection fault, SIGSEGV, before any filter is asked.
        assert "after" not in r.stdout, r.stdout
        assert r.exit_code == 128 + 11, (r.exit_code, r.stderr)
    else:
        assert "after" not in r.stdout, r.stdout
        assert r.exit_code == 128 + 31, (r.exit_code, r.stderr)  # SIGSYS: KILL_PROCESS
    assert sandbox.commands.run("echo ok").stdout == "ok\n"


# -- devices --------------------------------------------------------------------------------------


def test_no_kvm_no_block_devices_no_sys(sandbox: Sandbox) -> None:
    out = py_json(sandbox, """
        import json, os, stat
        found = []
        for root, dirs, files in os.walk("/dev"):
            for n in dirs + files:
                p = os.path.join(root, n)
                st = os.lstat(p)
                m = st.st_mode
                kind = ("blk" if stat.S_ISBLK(m) else "chr" if stat.S_ISCHR(m)
                        else "lnk" if stat.S_ISLNK(m) else "dir" if stat.S_ISDIR(m) else "other")
                found.append([p, kind, os.major(st.st_rdev), os.minor(st.st_rdev)])
        opens = {}
        for p in ("/dev/kvm", "/dev/mem", "/dev/kmsg", "/dev/vda", "/dev/sda", "/dev/loop0",
                  "/dev/loop-control", "/dev/net/tun", "/dev/fuse", "/dev/console", "/proc/kcore",
                  "/proc/kmsg"):
            try:
                os.close(os.open(p, os.O_RDONLY))
                opens[p] = "OPENED"
            except OSError as e:
                opens[p] = e.errno
        print(json.dumps({"dev": found, "sys": os.path.exists("/sys"),
                          "sys_block": os.path.exists("/sys/block"), "opens": opens}))
    """)
    kinds = {p: (k, ma, mi) for p, k, ma, mi in out["dev"]}
    assert not [p for p, (k, _, _) in kinds.items() if k == "blk"], kinds
    allowed_chr = {(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 2)}  # null zero full
    # random urandom tty ptmx; pty slaves (major 136) appear only while in use.
    bad_chr = {p: v for p, v in kinds.items()
               if v[0] == "chr" and (v[1], v[2]) not in allowed_chr and v[1] != 136}
    assert bad_chr == {}, bad_chr
    assert "/dev/kvm" not in kinds
    assert out["sys"] is False or out["sys_block"] is False, out
    assert "OPENED" not in out["opens"].values(), out["opens"]
