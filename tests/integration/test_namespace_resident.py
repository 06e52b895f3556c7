"""The namespace tier's resident helper (``namespace.resident`` + ``zygote.c``, issue 19): one
bwrap per sandbox in use whose zygote starts each command in fresh namespaces made ahead (from
a sandbox's second command on: its first takes a bwrap of its own).

The tier's behavioural, isolation, limits and drill suites run through it (it is on by
default); these hold what the speed-up must not have cost, seen from the host as well as from
inside: each command in its own PID namespace and its own cgroup from its first instruction, a
fresh ``/tmp``, the filter and no capabilities, nothing of it left once it returns, and the
resident itself stopped when idle, replaced when killed, and gone with a SIGKILLed owner.
Bounded: a timeout on every command, a handful of sandboxes, everything destroyed after.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from corral import Sandbox
from corral._backends._linux.ready import spare_owner
from corral._control.manager import Manager
from corral._settings import Settings

from ..conftest import managed
from .hostprocs import host_procs_of_uid, host_uid, not_resident, status_field

pytestmark = pytest.mark.needs_root


def _cgroup_of(pid: int) -> str:
    """The process's group in the pids hierarchy (relative to Corral's instance)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            return path
    raise LookupError(f"no pids cgroup for {pid}")


def _resident_pids(uid: int) -> list[int]:
    return [pid for pid, _ in host_procs_of_uid(uid) if not not_resident([(pid, "")])]


def _wait_for(path: Path, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.exists(), f"{path} never appeared"


@pytest.fixture
def sandbox(home: str) -> Iterator[Sandbox]:
    """A sandbox past its first command (which takes a bwrap of its own): the next start
    its resident."""
    sb = Sandbox.create(home=home)
    assert sb.commands.run("true").exit_code == 0
    yield sb
    sb.kill()


def test_each_command_has_its_own_pid_namespace_cgroup_and_filter_and_the_sandboxs_tmp(
        sandbox: Sandbox, settings: Settings) -> None:
    """Seen from the host while each command runs: its process is in the command's own
    group (named after its command id), in a PID and mount namespace that is neither the
    resident's nor the previous command's; inside, the sandbox's ``/tmp`` (the previous
    command's file still there), PID 1 its own init, the filter, no capabilities; and nothing of
    a command is left once it returns."""
    uid = host_uid(sandbox.id)
    seen: list[tuple[str, str, str, str]] = []
    for round_ in range(3):
        flag = f"started-{round_}"
        marker = f"corral-resident-{secrets.token_hex(4)}"
        script = (
            f"ls -A /tmp; echo round{round_} > /tmp/mine; "
            f"(exec -a {marker} sleep 1000) & "
            "grep -E '^(Seccomp|NoNewPrivs|CapEff|CapBnd):' /proc/self/status; "
            "ps -eo pid=,comm= | sort -n | head -1; "
            f"touch /workspace/{flag}; "
            f"for i in $(seq 400); do [ -e /workspace/go-{round_} ] && exit 0; sleep 0.05; done; "
            "exit 3")
        pool = concurrent.futures.ThreadPoolExecutor(1)
        running = pool.submit(sandbox.commands.run, script, timeout=30)
        try:
            deadline = time.monotonic() + 15
            while not sandbox.files.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert sandbox.files.exists(flag), "the command never started"
            procs = not_resident(host_procs_of_uid(uid))
            sleeper = [pid for pid, st in procs if status_field(st, "Name") == "sleep"]
            assert sleeper, procs
            pid = sleeper[0]
            group = _cgroup_of(pid)
            assert group.split("/")[-2] == sandbox.id and group.split("/")[-1].startswith("c."), \
                group
            seen.append((group, os.readlink(f"/proc/{pid}/ns/pid"),
                         os.readlink(f"/proc/{pid}/ns/mnt"), os.readlink(f"/proc/{pid}/ns/cgroup")))
            # Not the resident's namespaces: the command's own (an inode number may be used
            # again once a namespace is gone, so earlier commands' are not compared).
            zygote = [p for p, st in host_procs_of_uid(uid) if status_field(st, "Name") == "zygote"]
            assert len(zygote) == 1, host_procs_of_uid(uid)
            for kind, mine in zip(("pid", "mnt", "cgroup"), seen[-1][1:], strict=True):
                assert os.readlink(f"/proc/{zygote[0]}/ns/{kind}") != mine, kind
        finally:
            sandbox.files.write(f"go-{round_}", "")
            pool.shutdown(wait=True)
        r = running.result(timeout=30)
        assert r.exit_code == 0, (r.stdout, r.stderr)
        out = r.stdout.splitlines()
        assert ("mine" in out) == (round_ > 0), out  # /tmp is the sandbox's: the last one's
        fields = dict(line.split(":\t", 1) for line in out if ":\t" in line)
        assert fields["Seccomp"] == "2" and fields["NoNewPrivs"] == "1", fields
        assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0, fields
        assert out[-1].split() == ["1", "init"], out
        # The straggler is gone by the time the result is back: the command's init killed
        # and reaped it before it answered (the host no longer waits for the init's exit).
        assert not [p for p, st in host_procs_of_uid(uid) if status_field(st, "Name") == "sleep"]
        assert sandbox.commands.run(f"pgrep -f '[{marker[0]}]{marker[1:]}'; echo $?",
                                    timeout=10).stdout == "1\n"
    assert len({s[0] for s in seen}) == 3  # a group per command


def test_the_first_instruction_already_runs_in_the_commands_cgroup(sandbox: Sandbox) -> None:
    """The cgroup namespace is made by the init once it is in the command's group: a command
    that looks at once sees itself at the root of its cgroup namespace, and the group's
    ``cgroup.procs`` on the host held it from its first instruction (``pids.max`` counted)."""
    r = sandbox.commands.run("exec cat /proc/self/cgroup", timeout=10)
    assert r.exit_code == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line]
    assert lines and all(line.endswith(":/") for line in lines), lines


def test_a_sandboxs_first_command_and_a_terminal_one_are_born_in_their_cgroup(
        home: str, manager: Manager) -> None:
    """The commands that take a bwrap of their own (a sandbox's first, a terminal's): the
    launch joins the command's group before it execs bwrap, so bwrap makes the cgroup
    namespace inside the group (the command sees its root, and nothing of the host's
    names: instance, sandbox id, owner), and the init is never anywhere else."""
    sb = Sandbox.create(home=home)
    try:
        for result in (sb.commands.run("exec cat /proc/self/cgroup", timeout=10),
                       manager.run(sb.id, ["cat", "/proc/self/cgroup"], pty=(24, 80),
                                   timeout=10)):
            assert result.exit_code == 0, result.stderr
            lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
            assert lines and all(line.endswith(":/") for line in lines), lines
            assert sb.id not in result.stdout
    finally:
        sb.kill()


def test_a_resident_idle_for_long_enough_is_stopped_and_the_next_command_starts_one(
        settings: Settings, manager: Manager) -> None:
    quick = settings.model_copy(update={
        "home": settings.home / "idle", "namespace_idle_s": 0.5,
        "uid_start": settings.uid_start + settings.uid_count // 2,
        "uid_count": settings.uid_count // 4})
    quick.home.mkdir()
    with managed(quick):
        sb = Sandbox.create(home=str(quick.home))
        try:
            uid = host_uid(sb.id)
            assert sb.commands.run("true").exit_code == 0
            assert not _resident_pids(uid), "a resident for a sandbox's first command"
            assert sb.commands.run("true").exit_code == 0
            assert _resident_pids(uid), "no resident after the second command"
            deadline = time.monotonic() + 10
            while _resident_pids(uid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert host_procs_of_uid(uid) == []  # an idle sandbox costs no process
            assert sb.commands.run("echo again").stdout == "again\n"
        finally:
            sb.kill()
        assert host_procs_of_uid(uid) == []


def test_a_sandbox_starts_from_a_mount_namespace_with_its_own_mounts_and_no_others(
        sandbox: Sandbox, settings: Settings) -> None:
    """Every live sandbox adds mounts to the host's table, and a new mount namespace copies
    the table it starts from: a sandbox's bwrap starts from one that holds its own workspace
    and none of another sandbox's, of its data directory or of another one (whose mounts a
    long-lived copy would otherwise keep alive), with fewer mounts than the host's."""
    lean = settings.model_copy(update={
        "home": settings.home / "lean", "uid_start": settings.uid_start
        + 3 * settings.uid_count // 4, "uid_count": settings.uid_count // 4})
    lean.home.mkdir()
    with managed(lean):
        other = Sandbox.create(home=str(lean.home))
        sb = Sandbox.create(home=str(lean.home))
        try:
            # Its first command (a bwrap of its own) makes the lean namespace; its second
            # starts the resident, whose bwrap lives on.
            assert other.commands.run("true").exit_code == 0
            for _ in range(2):
                assert sb.commands.run("true").exit_code == 0
            mine = f" {lean.home}/sandboxes/{sb.id}/"
            theirs = [f" {lean.home}/sandboxes/{other.id}/",
                      f" {settings.home}/sandboxes/{sandbox.id}/"]
            host_mounts = Path("/proc/self/mountinfo").read_text()
            assert mine in host_mounts and all(t in host_mounts for t in theirs)
            seen = []
            for pid, _ in host_procs_of_uid(host_uid(sb.id)):
                with contextlib.suppress(OSError):
                    seen.append(Path(f"/proc/{pid}/mountinfo").read_text())
            outer = [table for table in seen if mine in table]
            assert outer, "no process of the sandbox's sees its host-side mounts"
            for table in outer:
                assert [t for t in theirs if t in table] == []
                assert len(table.splitlines()) < len(host_mounts.splitlines())
            out = sb.commands.run("echo ok > /workspace/f; cat /workspace/f").stdout
            assert out == "ok\n"
        finally:
            sb.kill()
            other.kill()


@pytest.mark.parametrize("value_bytes", [16, 40_000, 120_000])
def test_a_request_reaches_its_command_whole_inline_or_in_a_memfd(
        sandbox: Sandbox, value_bytes: int) -> None:
    """A request up to 32 KiB travels in its message, a larger one in a sealed memfd: both
    reach the command byte for byte (argv, environment, working directory)."""
    value = (secrets.token_hex(8) * (value_bytes // 16 + 1))[:value_bytes]
    sandbox.files.make_dir("/workspace/here")
    result = sandbox.commands.run(
        ["sh", "-c", 'printf "%s %s %s" "$(pwd)" "$1" "$(printf %s "$BIG" | sha256sum)"',
         "sh", "first arg"], envs={"BIG": value}, cwd="/workspace/here", timeout=10)
    digest = hashlib.sha256(value.encode()).hexdigest()
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"/workspace/here first arg {digest}  -"


def test_exec_failures_and_a_script_without_interpreter_line_keep_execvps_rules(
        sandbox: Sandbox) -> None:
    """The command is vforked and exec'd with execvp: a missing program is 127 with a
    message, a file that is no program 126, and a script without ``#!`` runs under
    ``/bin/sh`` (execvp's rule), as in a bwrap of its own."""
    sandbox.files.write("/workspace/plain.sh", "echo from-sh\n")
    sandbox.files.write("/workspace/data.txt", "not a program\n")
    sandbox.commands.run(["chmod", "+x", "/workspace/plain.sh"], timeout=10)
    missing = sandbox.commands.run(["no-such-program-here"], timeout=10)
    assert missing.exit_code == 127
    assert "no-such-program-here" in missing.stderr
    assert sandbox.commands.run(["/workspace/data.txt"], timeout=10).exit_code == 126
    plain = sandbox.commands.run(["/workspace/plain.sh"], timeout=10)
    assert (plain.exit_code, plain.stdout) == (0, "from-sh\n")


def test_a_killed_resident_is_replaced_by_the_next_command(sandbox: Sandbox) -> None:
    uid = host_uid(sandbox.id)
    assert sandbox.commands.run("true").exit_code == 0
    zygotes = [pid for pid, st in host_procs_of_uid(uid) if status_field(st, "Name") == "zygote"]
    assert len(zygotes) == 1, host_procs_of_uid(uid)
    os.kill(zygotes[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while host_procs_of_uid(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host_procs_of_uid(uid) == []  # bwrap and the init made ahead died with it
    assert sandbox.commands.run("echo back", timeout=10).stdout == "back\n"


def test_a_sigkill_in_the_middle_of_a_burst_leaves_nothing_and_loses_no_result(
        settings: Settings, manager: Manager, home: str) -> None:
    """Another process runs commands in several sandboxes at once, printing each result as
    it returns; SIGKILLed in the middle, it leaves no process behind (its residents die with
    it), the next start's sweep removes its groups, and every result it had printed is in its
    sandbox's audit trail."""
    env = {**os.environ, "CORRAL_HOME": str(settings.home),
           "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    code = textwrap.dedent("""
        import threading
        from corral import Sandbox
        from corral._control.manager import get_manager
        lock = threading.Lock()
        def work():
            sb = Sandbox.create()
            with lock:
                print("sandbox", sb.id, get_manager().store.get(sb.id).uid, flush=True)
            for i in range(400):
                r = sb.commands.run(["sh", "-c", "echo $0", str(i)], timeout=30)
                with lock:
                    print("result", sb.id, r.command_id, r.stdout.strip(), flush=True)
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    sandboxes: dict[str, int] = {}
    results: list[tuple[str, str]] = []

    def take(line: str) -> None:
        kind, *rest = line.split()
        if kind == "sandbox":
            sandboxes[rest[0]] = int(rest[1])
        elif kind == "result" and len(rest) >= 2:
            results.append((rest[0], rest[1]))

    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while len(results) < 40 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            take(line)
        assert len(results) >= 40, proc.communicate(timeout=30)[1]
    finally:
        proc.send_signal(signal.SIGKILL)
        rest_of_output, _ = proc.communicate(timeout=30)
    # What the pipe still held was printed before the kill too: results returned to a caller.
    for line in rest_of_output.splitlines():
        take(line)
    deadline = time.monotonic() + 15
    while any(host_procs_of_uid(u) for u in sandboxes.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [host_procs_of_uid(u) for u in sandboxes.values()] == [[]] * len(sandboxes)

    def theirs() -> list[str]:
        return [p.name for p in (settings.home / "sandboxes").iterdir()
                if (spare_owner(p.name) or "").startswith(f"{proc.pid}.")]

    # It had made workspaces ahead of creates (from its second): the sweep takes them too.
    assert theirs() != []
    manager.recover()
    assert theirs() == []
    with open("/proc/self/mountinfo") as f:
        assert [line for line in f if f".{proc.pid}." in line and "/sandboxes/." in line] == []
    for sandbox_id in sandboxes:
        group = Path("/sys/fs/cgroup/pids", f"corral-{settings.instance}", sandbox_id)
        left = [p.name for p in group.iterdir() if p.is_dir()] if group.exists() else []
        assert left == [], left
    finished: dict[str, set[str]] = {}
    for sandbox_id in sandboxes:
        sb = Sandbox.connect(sandbox_id, home=home)
        finished[sandbox_id] = {e.command for e in sb.audit.events(types=["command.finished"])
                                if e.command}
    missing = [(s, c) for s, c in results if c not in finished[s]]
    assert missing == [], missing
    for sandbox_id in sandboxes:  # and each sandbox works on
        sb = Sandbox.connect(sandbox_id, home=home)
        try:
            assert sb.commands.run("echo fine", timeout=10).stdout == "fine\n"
        finally:
            sb.kill()


def test_a_finished_commands_group_is_no_command_and_a_sweep_keeps_its_recorded_end(
        sandbox: Sandbox, manager: Manager, monkeypatch: pytest.MonkeyPatch) -> None:
    """A command's emptied group is removed after its result is returned: until then it
    must not read as a running command, and a crash in between must not have the next
    start's sweep call the finished command interrupted."""
    record = manager.store.get(sandbox.id)
    assert record is not None
    for _ in range(5):
        assert sandbox.commands.run("true").exit_code == 0
        assert not manager.sandboxes.busy(record), "a finished command reads as running"
    backend = manager.backend
    retirer = backend._retirer  # type: ignore[attr-defined]
    # Commands "never pause": the next command's group stays until a batch is full.
    monkeypatch.setattr(retirer, "_quiet_s", 3600.0)
    assert sandbox.commands.run("true").exit_code == 0
    assert retirer.pending(), "no group left to remove"
    assert not manager.sandboxes.busy(record), "a retiring group reads as a command"
    monkeypatch.setattr(retirer, "_quiet_s", 0.02)
    finished = sandbox.commands.run("echo done")
    assert finished.command_id is not None
    cgroups = manager.backend.cgroups  # type: ignore[attr-defined]
    # What a crash leaves between the result and the removal: the command's group, named
    # for an owner that is gone (pid 1 never started at time 0).
    left = f"{sandbox.id}/c.1.0.{finished.command_id}"
    cgroups.create_command(left)
    unfinished = f"cmd_{secrets.token_hex(8)}"
    cgroups.create_command(f"{sandbox.id}/c.1.0.{unfinished}")
    # A crash between one hierarchy's rmdir and the next leaves the group in the others
    # only (the one the sweep used to list among those gone).
    half = f"{sandbox.id}/c.1.0.cmd_{secrets.token_hex(8)}"
    cgroups.create_command(half)
    if cgroups.version == 1:
        for path in cgroups._paths(half)[:3]:
            path.rmdir()
    assert half.rsplit("/", 1)[-1] in cgroups.children(sandbox.id)
    swept = manager.recover()
    assert half.rsplit("/", 1)[-1] not in cgroups.children(sandbox.id)
    if cgroups.version == 1:
        assert not any(path.exists() for path in cgroups._paths(half)), swept
    assert any(finished.command_id in item for item in swept), swept
    assert left.rsplit("/", 1)[-1] not in cgroups.children(sandbox.id)
    ends = sandbox.audit.events(types=["command.finished"])
    mine = [e for e in ends if e.command == finished.command_id]
    assert len(mine) == 1 and not mine[0].data.get("interrupted"), mine
    # One the trail has no end for is still closed as interrupted.
    theirs = [e for e in ends if e.command == unfinished]
    assert len(theirs) == 1 and theirs[0].data.get("interrupted") is True, theirs


def test_finished_commands_groups_go_when_commands_pause_or_a_batch_is_full(
        sandbox: Sandbox, manager: Manager, settings: Settings,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The emptied groups of finished commands are removed off the commands' path: in one
    batch once ``batch`` wait, or once commands pause for ``quiet_s``; each is empty, and none
    is left after the pause. Bounded: a dozen commands, waits of seconds."""
    retirer = manager.backend._retirer  # type: ignore[attr-defined]
    group = Path("/sys/fs/cgroup/pids", f"corral-{settings.instance}", sandbox.id)

    def commands_groups() -> set[str]:
        return {p.name for p in group.iterdir() if p.is_dir() and p.name.startswith("c.")}

    def wait_until(done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 5
        while not done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done()

    wait_until(lambda: not commands_groups())  # the fixture's command's, after a pause
    monkeypatch.setattr(retirer, "_quiet_s", 3600.0)
    monkeypatch.setattr(retirer, "_batch", 4)
    ids = [sandbox.commands.run("true").command_id for _ in range(3)]
    left = commands_groups()
    assert {name.rsplit(".", 1)[-1] for name in left} == set(ids), left
    # Empty: each init emptied its namespace before it answered (and exits right after).
    wait_until(lambda: all((group / name / "pids.current").read_text().strip() == "0"
                           for name in left))
    assert len(retirer.pending()) == 3
    sandbox.commands.run("true")  # the fourth fills the batch
    wait_until(lambda: not commands_groups() and not retirer.pending())
    monkeypatch.setattr(retirer, "_batch", 32)
    monkeypatch.setattr(retirer, "_quiet_s", 0.05)
    sandbox.commands.run("true")
    assert len(retirer.pending()) == 1
    wait_until(lambda: not commands_groups() and not retirer.pending())  # the pause


def test_a_process_that_ends_after_its_commands_leaves_no_group_behind(
        sandbox: Sandbox, manager: Manager, settings: Settings) -> None:
    """A process that runs commands and ends without closing anything (`corral exec`, a
    script) still removes the groups its commands left to the retirer before it is gone, or
    the next process would read them as running commands (a snapshot or fork refused as
    busy). Here the retirer waits for a pause that never comes: only the exit removes them."""
    script = textwrap.dedent(f"""
        from pathlib import Path
        from corral._control.manager import get_manager
        from corral._settings import Settings
        mgr = get_manager(Settings(home=Path({str(settings.home)!r}),
                                   uid_start={settings.uid_start},
                                   uid_count={settings.uid_count}))
        assert mgr.run({sandbox.id!r}, "true").exit_code == 0  # a bwrap of its own
        mgr.backend._retirer._quiet_s = 3600.0
        for _ in range(3):  # from the resident: left for a pause
            assert mgr.run({sandbox.id!r}, "true").exit_code == 0
        assert mgr.backend._retirer.pending()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    group = Path("/sys/fs/cgroup/pids", f"corral-{settings.instance}", sandbox.id)
    left = [p.name for p in group.iterdir() if p.is_dir() and p.name.startswith("c.")]
    assert left == [], left
    record = manager.store.get(sandbox.id)
    assert record is not None and not manager.sandboxes.busy(record)


def test_the_launch_helper_drops_to_the_uid_and_refuses_what_it_cannot_do(
        tmp_path: Path) -> None:
    from corral._backends.namespace.runner import ensure_launch_helper

    helper = str(ensure_launch_helper(tmp_path))

    def launch(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([helper, *args], capture_output=True, text=True, timeout=30)

    # Started with SIGINT and SIGQUIT ignored (as under nohup or `&`): they are reset.
    ok = subprocess.run(
        ["/bin/sh", "-c", 'trap "" INT QUIT; exec "$@"', "sh", helper, "65534", "-", "0",
         "--", "/bin/sh", "-c", "id -u; id -g; id -G; "
         "grep -E '^(CapEff|CapPrm|SigIgn)' /proc/self/status"],
        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.split("\n")
    assert lines[:3] == ["65534", "65534", "65534"], ok.stdout  # no supplementary group
    assert "CapEff:\t0000000000000000" in ok.stdout and "CapPrm:\t0000000000000000" in ok.stdout
    assert "SigIgn:\t0000000000000000" in ok.stdout
    refused = {
        "uid 0": launch("0", "-", "0", "--", "/bin/true"),
        "uid": launch("x", "-", "0", "--", "/bin/true"),
        "join descriptor": launch("65534", "1,x", "0", "--", "/bin/true"),
        "cannot join the command's cgroup": launch("65534", "99", "0", "--", "/bin/true"),
        "/nonexistent": launch("65534", "-", "0", "--", "/nonexistent"),
        "usage": launch("65534", "-", "0", "/bin/true"),
    }
    for what, result in refused.items():
        assert result.returncode == 125 and what in result.stderr, (what, result)
