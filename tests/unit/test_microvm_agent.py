"""The microVM guest agent (the ``corral._guest`` zipapp + ``run.c``), run for real on the host.

The agent runs as root under ``unshare --mount --pid --net`` (loopback up, a fresh ``/run``)
over a socketpair, with a temporary directory as its workspace and a fresh group under the
host's cgroup2 mount as its cgroup root; ``run.c`` is compiled with ``gcc -static -Os`` as the
root image build does. On this host the cgroup2 mount has no controllers, so these tests cover
the protocol, streaming, stdin, the PTY, signals, timeouts, kills, files, the tunnel and
errors; pids/memory limits, peak memory and oom are left to the in-VM tests
(``tests/integration/test_microvm_agent.py``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import queue
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from corral._backends.microvm import rootimage
from corral._guest import fs, protocol, workspace

pytestmark = pytest.mark.needs_root

RUN_C = Path(rootimage.__file__).with_name("run.c")
CGROUP2 = "/sys/fs/cgroup/unified"
PYTHON = "/usr/bin/python3"
WAIT = 20.0


def _cgroup2() -> str | None:
    for path in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        if os.path.exists(os.path.join(path, "cgroup.procs")) and os.path.exists(
                os.path.join(path, "cgroup.subtree_control")):
            return path
    return None


@pytest.fixture(scope="module")
def run_binary() -> Iterator[Path]:
    if shutil.which("gcc") is None or shutil.which("unshare") is None:
        pytest.skip("needs gcc and unshare")
    out = Path(tempfile.mkdtemp(prefix="corral-run-", dir="/var/tmp"))
    binary = out / "run"
    subprocess.run(["gcc", "-static", "-Os", "-Wall", "-Wextra", "-Werror", "-o", str(binary),
                    str(RUN_C)], check=True, timeout=120)
    # The agent as the guest gets it: the zipapp the root image build writes.
    (out / rootimage.AGENT).write_bytes(rootimage.agent_zipapp())
    yield binary
    shutil.rmtree(out, ignore_errors=True)


class Client:
    """The host end of the channel: a reader thread sorts messages by id / conn."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.messages: dict[Any, queue.Queue[dict[str, Any]]] = {}
        self.conns: queue.Queue[dict[str, Any]] = queue.Queue()
        self.lock = threading.Lock()
        self.next_id = 100
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _queue(self, key: Any) -> queue.Queue[dict[str, Any]]:
        with self.lock:
            return self.messages.setdefault(key, queue.Queue())

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = self.sock.recv(1 << 20)
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                message = json.loads(line)
                if "conn" in message:
                    self.conns.put(message)
                else:
                    self._queue(message.get("id")).put(message)

    def send(self, message: dict[str, Any]) -> None:
        self.send_raw(json.dumps(message).encode() + b"\n")

    def send_raw(self, data: bytes) -> None:
        with self.lock:
            self.sock.sendall(data)

    def new_id(self) -> int:
        with self.lock:
            self.next_id += 1
            return self.next_id

    def get(self, key: Any, timeout: float = WAIT) -> dict[str, Any]:
        return self._queue(key).get(timeout=timeout)

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        rid = self.new_id()
        self.send({"id": rid, "op": op, **fields})
        return self.get(rid)

    def ok(self, op: str, **fields: Any) -> Any:
        reply = self.request(op, **fields)
        assert "ok" in reply, reply
        return reply["ok"]

    def start(self, argv: list[str], **fields: Any) -> int:
        rid = self.new_id()
        request = {"id": rid, "op": "exec", "argv": argv, "cwd": "/workspace",
                   "env": {"PATH": "/usr/bin:/bin", "HOME": "/workspace"}, "timeout": 20,
                   "stdin": "null", "pty": None, "tmp_bytes": 16 << 20, "pids": 64,
                   "memory_bytes": 256 << 20, "egress_port": None}
        request.update(fields)
        self.send(request)
        return rid

    def finish(self, rid: int, timeout: float = WAIT) -> dict[str, Any]:
        """Collect a command's events up to its end: {"out": {...}, "exit"|"error", "started"}."""
        result: dict[str, Any] = {"stdout": b"", "stderr": b"", "chunks": []}
        deadline = time.monotonic() + timeout
        while True:
            message = self.get(rid, max(0.1, deadline - time.monotonic()))
            if "out" in message:
                data = base64.b64decode(message["data"])
                result["chunks"].append(len(data))
                result[message["out"]] += data
            elif "started" in message:
                result["started"] = message["started"]
            else:
                result.update(message)
                return result

    def run(self, argv: list[str], **fields: Any) -> dict[str, Any]:
        return self.finish(self.start(argv, **fields))

    def wait_output(self, rid: int, text: bytes, into: dict[str, Any]) -> None:
        deadline = time.monotonic() + WAIT
        while text not in into.setdefault("stdout", b""):
            message = self.get(rid, max(0.1, deadline - time.monotonic()))
            if "out" in message:
                into["stdout"] += base64.b64decode(message["data"])
            elif "started" in message:
                into["started"] = message["started"]
            else:
                raise AssertionError(f"the command ended before printing {text!r}: {message}")



@dataclass
class Guest:
    client: Client
    workspace: Path
    cgroup_root: Path
    proc: subprocess.Popen[bytes]
    ready: dict[str, Any]


@pytest.fixture
def guest(run_binary: Path) -> Iterator[Guest]:
    cgroup2 = _cgroup2()
    if cgroup2 is None:
        pytest.skip("needs a cgroup2 mount")
    workspace = Path(tempfile.mkdtemp(prefix="corral-agent-ws-", dir="/var/tmp"))
    os.chown(workspace, 1000, 1000)
    workspace.chmod(0o755)
    cgroup_root = Path(cgroup2) / f"corral-agent-test-{secrets.token_hex(4)}"
    cgroup_root.mkdir()
    ours, theirs = socket.socketpair()
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
           "CORRAL_AGENT_CHANNEL": f"fd:{theirs.fileno()}",
           "CORRAL_AGENT_WORKSPACE": str(workspace),
           "CORRAL_AGENT_CGROUP": str(cgroup_root), "CORRAL_AGENT_RUN": str(run_binary)}
    proc = subprocess.Popen(
        ["unshare", "--mount", "--pid", "--mount-proc", "--net", "--kill-child", "--", "sh", "-c",
         # A /run of its own: the agent writes the guest's /run/corral (its sandbox id, the
         # filters it compiles), which must not land in the host's.
         'mount -t tmpfs -o mode=0755 tmpfs /run && ip link set lo up && exec "$0" -I -S "$1"',
         PYTHON, str(run_binary.with_name(rootimage.AGENT))],
        env=env, pass_fds=(theirs.fileno(),))
    theirs.close()
    client = Client(ours)
    try:
        ready = client.get(0)
        yield Guest(client, workspace, cgroup_root, proc, ready)
    finally:
        with contextlib.suppress(OSError):  # EOF: the agent kills its commands and exits
            ours.shutdown(socket.SHUT_RDWR)
        ours.close()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        cmd = cgroup_root / "cmd"
        if cmd.exists():
            for group in cmd.iterdir():
                if group.is_dir():
                    with contextlib.suppress(OSError):
                        (group / "cgroup.kill").write_text("1")
                    for _ in range(200):
                        with contextlib.suppress(FileNotFoundError):
                            if (group / "cgroup.events").read_text().find("populated 0") >= 0:
                                break
                        time.sleep(0.01)
                    group.rmdir()
            cmd.rmdir()
        cgroup_root.rmdir()
        shutil.rmtree(workspace, ignore_errors=True)


def groups(guest: Guest) -> list[str]:
    """The command groups left under the agent's cgroup root."""
    return [p.name for p in (guest.cgroup_root / "cmd").iterdir() if p.is_dir()]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# -- start and protocol ---------------------------------------------------------------------


def test_ready_names_the_kernel_and_the_agent_version(guest: Guest) -> None:
    assert guest.ready == {"id": 0, "ready": {"release": os.uname().release, "agent": 1}}
    assert guest.client.ok("ping") is True


def test_protocol_errors_are_precise_and_the_agent_keeps_serving(guest: Guest) -> None:
    c = guest.client
    reply = c.request("no.such.op")
    assert reply["error"]["kind"] == "protocol" and "no.such.op" in reply["error"]["message"]
    c.send_raw(b"this is not json\n")
    assert c.get(None)["error"]["kind"] == "protocol"
    c.send_raw(b'{"id": "x", "op": "ping"}\n')
    assert "integer 'id'" in c.get(None)["error"]["message"]
    # A line over the 4 MiB bound is dropped whole (bounded buffer), then the agent goes on.
    c.send_raw(b'{"id": 1, "op": "ping", "pad": "' + b"x" * (5 << 20) + b'"}\n')
    assert "dropped" in c.get(None)["error"]["message"]
    assert c.ok("ping") is True
    reply = c.request("exec", argv="ls")
    assert reply["error"]["kind"] == "protocol" and "argv" in reply["error"]["message"]


# -- exec ---------------------------------------------------------------------------------


def test_exec_streams_stdout_and_stderr_and_reports_the_exit(guest: Guest) -> None:
    result = guest.client.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert result["stdout"] == b"out\n" and result["stderr"] == b"err\n"
    assert result["started"]["pid"] > 0
    exit_ = result["exit"]
    assert exit_["code"] == 3 and exit_["signal"] is None and exit_["timed_out"] is False
    assert exit_["oom_killed"] is False and exit_["wall_s"] > 0
    assert not groups(guest)  # the group is gone


def test_the_command_runs_confined_as_user_1000_with_exactly_its_env(guest: Guest) -> None:
    script = ("id -u; id -g; id -G; echo pid=$$; ulimit -c; "
              "grep NoNewPrivs /proc/self/status; cat /proc/self/oom_score_adj; "
              "ls /proc | grep -c '^[0-9]'; pwd")
    result = guest.client.run(["sh", "-c", script])
    lines = result["stdout"].decode().split()
    assert lines[:4] == ["1000", "1000", "1000", "pid=2"], result
    assert lines[4] == "0"  # no core dumps
    assert lines[5:7] == ["NoNewPrivs:", "1"]
    assert lines[7] == "0"  # not the agent's -1000: the OOM killer may pick it
    assert int(lines[8]) <= 4  # its own /proc: init, sh, ls, grep
    assert lines[9] == str(guest.workspace)  # /workspace (mapped in test mode)
    env = guest.client.run(["/usr/bin/env"], env={"A": "1", "B": "two words"})
    assert env["stdout"] == b"A=1\nB=two words\n"


def test_tmp_is_a_fresh_tmpfs_of_the_given_size_per_command(guest: Guest) -> None:
    c = guest.client
    probe = ("import os; s = os.statvfs('/tmp'); print(s.f_blocks * s.f_frsize); "
             "print(sorted(os.listdir('/tmp'))); open('/tmp/mark', 'w').write('x')")
    first = c.run([PYTHON, "-c", probe], tmp_bytes=8 << 20)
    assert first["stdout"].decode().split("\n")[:2] == [str(8 << 20), "[]"], first
    second = c.run([PYTHON, "-c", probe], tmp_bytes=4 << 20)
    assert second["stdout"].decode().split("\n")[:2] == [str(4 << 20), "[]"], second


def test_a_missing_program_or_cwd_is_reported_distinctly(guest: Guest) -> None:
    c = guest.client
    missing = c.run(["/no/such/program"])
    assert missing["error"]["kind"] == "not_found" and "started" not in missing
    assert "/no/such/program" in missing["error"]["message"]
    assert c.run(["no-such-program-on-path"])["error"]["kind"] == "not_found"
    cwd = c.run(["true"], cwd="/workspace/missing")
    assert cwd["error"]["kind"] == "cwd" and "/workspace/missing" in cwd["error"]["message"]
    big = c.run(["echo", "x" * (200 << 10)])
    assert big["error"]["kind"] == "e2big"
    assert not groups(guest)


def test_death_by_signal_is_told_from_an_exit_status(guest: Guest) -> None:
    c = guest.client
    killed = c.run(["sh", "-c", "kill -TERM $$"])["exit"]
    assert (killed["code"], killed["signal"]) == (143, 15)
    exited = c.run(["sh", "-c", "exit 143"])["exit"]
    assert (exited["code"], exited["signal"]) == (143, None)


def test_a_timeout_kills_the_whole_tree_before_exit(guest: Guest) -> None:
    c = guest.client
    started = time.monotonic()
    result = c.run(["sh", "-c", "sleep 60 & sleep 60 & echo up; wait"], timeout=0.5)
    assert result["stdout"] == b"up\n"
    exit_ = result["exit"]
    assert exit_["timed_out"] is True and (exit_["code"], exit_["signal"]) == (137, 9)
    assert time.monotonic() - started < 10
    assert not groups(guest)  # no process was left to hold it


def test_kill_ends_a_running_command_and_answers_false_for_others(guest: Guest) -> None:
    c = guest.client
    rid = c.start(["sleep", "60"])
    assert "started" in c.get(rid)
    assert c.ok("procs") == {"commands": [rid], "orphans": 0}
    assert c.ok("kill", target=rid) is True
    exit_ = c.finish(rid)["exit"]
    assert exit_["signal"] == 9 and exit_["timed_out"] is False
    assert c.ok("kill", target=rid) is False
    assert c.ok("signal", target=12345, signal=15) is False
    assert c.ok("procs") == {"commands": [], "orphans": 0}


def test_a_kill_sent_right_after_exec_is_not_lost(guest: Guest) -> None:
    c = guest.client
    rid = c.start(["sleep", "60"])
    assert c.ok("kill", target=rid) is True  # before ``started``: still honoured
    result = c.finish(rid)
    assert result["exit"]["signal"] == 9 and result["exit"]["timed_out"] is False


def test_stdin_pipe_and_close(guest: Guest) -> None:
    c = guest.client
    rid = c.start(["sh", "-c", "cat; echo done"], stdin="pipe")
    assert "started" in c.get(rid)
    assert c.ok("stdin", target=rid, data=b64(b"hello ")) is True
    assert c.ok("stdin", target=rid, data=b64(b"world\n")) is True
    assert c.ok("stdin_close", target=rid) is True
    result = c.finish(rid)
    assert result["stdout"] == b"hello world\ndone\n" and result["exit"]["code"] == 0
    assert c.ok("stdin", target=rid, data=b64(b"late")) is False
    null = c.run(["cat"])  # stdin "null": EOF at once
    assert null["stdout"] == b"" and null["exit"]["code"] == 0


def test_a_command_not_reading_stdin_never_stalls_the_agent(guest: Guest) -> None:
    c = guest.client
    stuck = c.start(["sleep", "60"], stdin="pipe")
    assert "started" in c.get(stuck)
    pending = [c.new_id() for _ in range(4)]
    for rid in pending:  # 4 MiB: far over the 64 KiB pipe, so the writer blocks
        c.send({"id": rid, "op": "stdin", "target": stuck, "data": b64(b"x" * (1 << 20))})
    quick = c.run(["echo", "meanwhile"])
    assert quick["stdout"] == b"meanwhile\n"
    assert c.ok("fs.exists", path="/workspace") is True
    assert c.ok("kill", target=stuck) is True
    assert c.finish(stuck)["exit"]["signal"] == 9
    for rid in pending:  # every write is answered: false once the command is gone
        assert c.get(rid)["ok"] in (True, False)


def test_output_is_streamed_in_bounded_chunks(guest: Guest) -> None:
    result = guest.client.run(["head", "-c", "3000000", "/dev/zero"])
    assert len(result["stdout"]) == 3_000_000 and result["stdout"].count(0) == 3_000_000
    assert max(result["chunks"]) <= protocol.CHUNK and len(result["chunks"]) > 10


def test_many_commands_at_once(guest: Guest) -> None:
    c = guest.client
    rids = [c.start(["sh", "-c", f"sleep 0.3; echo {n}"]) for n in range(6)]
    started = time.monotonic()
    results = [c.finish(rid) for rid in rids]
    assert [r["stdout"] for r in results] == [f"{n}\n".encode() for n in range(6)]
    assert time.monotonic() - started < 5  # concurrently, not one after another


def test_pty_is_the_controlling_terminal_and_resizes(guest: Guest) -> None:
    c = guest.client
    # `[ -t 0 ]`, not `tty`: the command has a devpts of its own (as bwrap's --dev gives on the
    # namespace tier), so the terminal's name is not under its /dev/pts.
    rid = c.start(["sh", "-c", "[ -t 0 ] && echo is-a-tty; stty size; read line; stty size; "
                   "echo got=$line"], pty=[33, 101], stdin="pipe")
    seen: dict[str, Any] = {}
    c.wait_output(rid, b"33 101", seen)
    assert b"is-a-tty" in seen["stdout"]
    assert c.ok("resize", target=rid, rows=40, cols=120) is True
    assert c.ok("stdin", target=rid, data=b64(b"abc\n")) is True
    result = c.finish(rid)
    out = seen["stdout"] + result["stdout"]
    assert b"40 120" in out and b"got=abc" in out, out
    assert result["stderr"] == b"" and result["exit"]["code"] == 0
    plain = c.start(["sleep", "5"])
    assert "started" in c.get(plain)
    assert c.ok("resize", target=plain, rows=1, cols=1) is False  # no PTY
    assert c.ok("kill", target=plain) is True
    c.finish(plain)


def test_signals_go_to_the_command_process_group(guest: Guest) -> None:
    c = guest.client
    rid = c.start(["sh", "-c", 'trap "echo got; exit 7" USR1; echo ready; '
                   "while :; do sleep 0.1; done"])
    seen: dict[str, Any] = {}
    c.wait_output(rid, b"ready", seen)
    assert c.ok("signal", target=rid, signal=10) is True
    result = c.finish(rid)
    assert b"got" in seen["stdout"] + result["stdout"] and result["exit"]["code"] == 7
    assert c.request("signal", target=rid, signal=99)["error"]["kind"] == "protocol"


def test_a_hostile_command_cannot_reach_the_agent(guest: Guest) -> None:
    c = guest.client
    result = c.run(["sh", "-c", "kill -9 -1; kill -9 1; echo still"])
    assert result["exit"]["code"] in (0, 1, 137)
    assert c.ok("ping") is True
    assert c.run(["echo", "fine"])["stdout"] == b"fine\n"


def test_cpu_time_is_measured_from_the_cgroup(guest: Guest) -> None:
    result = guest.client.run([PYTHON, "-c", "import time\nt = time.process_time()\n"
                               "while time.process_time() - t < 0.3: pass"])
    assert result["exit"]["cpu_s"] >= 0.2


def test_freeze_pauses_every_command_group(guest: Guest) -> None:
    c = guest.client
    rid = c.start(["sh", "-c", "while :; do echo tick; sleep 0.05; done"])
    seen: dict[str, Any] = {}
    c.wait_output(rid, b"tick", seen)
    assert c.ok("freeze", frozen=True) is True
    group = guest.cgroup_root / "cmd" / str(rid)
    deadline = time.monotonic() + WAIT
    while "frozen 1" not in (group / "cgroup.events").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert c.ok("freeze", frozen=False) is True
    assert c.ok("kill", target=rid) is True
    c.finish(rid)


def test_resume_detaches_the_commands_of_the_snapshot(guest: Guest) -> None:
    c = guest.client
    rid = c.start(["sleep", "60"])
    assert "started" in c.get(rid)
    reply = c.request("resume", seed=b64(os.urandom(64)), time_ns=time.time_ns(),
                      hostname="sandbox", sandbox_id="sbx_test")
    assert reply["ok"] is True
    procs = c.ok("procs")
    assert procs["commands"] == [] and procs["orphans"] >= 1
    assert c.ok("kill", target=rid) is False  # it belongs to no command of this session
    bad = c.request("resume", seed=b64(b"short"), time_ns=1)
    assert bad["error"]["kind"] == "protocol" and "64 bytes" in bad["error"]["message"]


def test_a_wake_from_hibernation_keeps_commands_for_attach_and_holds_their_output(
        guest: Guest) -> None:
    """``resume`` with ``keep_commands`` (a wake from hibernation): the commands stay, and what
    they write before the host attaches is held, then sent under the attach's id, in order,
    after ``started``; an exit meanwhile too. ``attach`` of a tag no command has: not_found."""
    c = guest.client
    ticker = c.start(["sh", "-c", "echo one; read line; echo two; read line; exit 7"],
                     stdin="pipe", tag="cmd_ticker")
    seen: dict[str, Any] = {}
    c.wait_output(ticker, b"one\n", seen)
    assert c.ok("resume", seed=b64(os.urandom(64)), time_ns=time.time_ns(),
                hostname="sandbox", sandbox_id="sbx_test", keep_commands=True) is True
    assert c.ok("procs")["commands"] == [ticker]
    # Input still reaches it by tag; it writes "two" and exits while no host is attached.
    assert c.ok("stdin", tag="cmd_ticker", data=b64(b"go\ngo\n")) is True
    time.sleep(0.5)
    assert c._queue(ticker).empty()  # held, not sent under the old id
    # An id another command has is refused: the two commands' events would mix.
    other = c.start(["sleep", "60"])
    assert "started" in c.get(other)
    c.send({"id": other, "op": "attach", "tag": "cmd_ticker"})
    clash = c.get(other)
    assert clash["error"]["kind"] == "protocol" and "another command" in clash["error"]["message"]
    assert c.ok("kill", target=other) is True
    c.finish(other)
    rid = c.new_id()
    c.send({"id": rid, "op": "attach", "tag": "cmd_ticker"})
    again = c.finish(rid)
    assert again["started"]["pid"] == seen["started"]["pid"]
    assert again["stdout"] == b"two\n" and again["exit"]["code"] == 7, again
    assert c.ok("procs")["commands"] == []
    missing = c.request("attach", tag="cmd_ticker")
    assert missing["error"]["kind"] == "not_found"


def test_unmount_is_refused_while_a_command_runs(guest: Guest) -> None:
    c = guest.client
    rid = c.start(["sleep", "60"])
    assert "started" in c.get(rid)
    assert c.request("unmount")["error"]["kind"] == "busy"
    assert c.ok("kill", target=rid) is True
    c.finish(rid)
    assert c.ok("sync") is True
    assert c.request("mount", fresh=True)["error"]["kind"] == "io"  # no disk in test mode


# -- the egress tunnel --------------------------------------------------------------------


def test_egress_connections_become_tunnel_streams(guest: Guest) -> None:
    c = guest.client
    script = ("import socket, time\n"
              "for _ in range(200):\n"
              "    try:\n"
              "        s = socket.create_connection(('127.0.0.1', 8099)); break\n"
              "    except OSError: time.sleep(0.02)\n"
              "s.sendall(b'hello'); s.shutdown(socket.SHUT_WR)\n"
              "data = b''\n"
              "while chunk := s.recv(100): data += chunk\n"
              "print(data.decode())\n")
    rid = c.start([PYTHON, "-c", script], egress_port=8099)
    opened = c.conns.get(timeout=WAIT)
    assert opened["op"] == "tcp.open" and opened["port"] == 8099
    conn = opened["conn"]
    c.send({"conn": conn, "opened": True})
    received = b""
    while True:
        message = c.conns.get(timeout=WAIT)
        assert message["conn"] == conn
        if message.get("eof"):
            break
        received += base64.b64decode(message["data"])
    assert received == b"hello"
    c.send({"conn": conn, "data": b64(received.upper())})
    c.send({"conn": conn, "eof": True})
    assert c.conns.get(timeout=WAIT) == {"conn": conn, "closed": True}
    result = c.finish(rid)
    assert result["stdout"] == b"HELLO\n", result


def test_a_tunnel_the_host_refuses_is_closed_in_the_guest(guest: Guest) -> None:
    c = guest.client
    script = ("import socket, time\n"
              "for _ in range(200):\n"
              "    try:\n"
              "        s = socket.create_connection(('127.0.0.1', 8098)); break\n"
              "    except OSError: time.sleep(0.02)\n"
              "print(repr(s.recv(10)))\n")
    rid = c.start([PYTHON, "-c", script], egress_port=8098)
    opened = c.conns.get(timeout=WAIT)
    c.send({"conn": opened["conn"], "closed": True, "error": "policy"})
    result = c.finish(rid)
    assert result["stdout"] in (b"b''\n",) or b"Error" in result["stderr"], result


# -- files ----------------------------------------------------------------------------------


def _write(c: Client, path: str, data: bytes, **fields: Any) -> dict[str, Any]:
    handle = c.ok("fs.write_begin", path=path, mode=fields.pop("mode", 0o644),
                  follow_symlinks=fields.pop("follow_symlinks", True))["handle"]
    for start in range(0, len(data), 100_000):
        assert c.ok("fs.write_chunk", handle=handle,
                    data=b64(data[start:start + 100_000])) is True
    return c.ok("fs.write_end", handle=handle, mtime=fields.pop("mtime", None))


def test_files_write_read_stat_and_ownership(guest: Guest) -> None:
    c = guest.client
    data = os.urandom(300_000)
    entry = _write(c, "/workspace/dir/sub/file.bin", data, mode=0o600, mtime=1_700_000_000.5)
    assert entry == {"name": "file.bin", "path": "/workspace/dir/sub/file.bin", "kind": "file",
                     "size": 300_000, "mode": 0o600, "mtime": 1_700_000_000.5,
                     "link_target": None}
    host = guest.workspace / "dir/sub/file.bin"
    assert host.read_bytes() == data
    for made in (host, host.parent, host.parent.parent):
        assert (made.stat().st_uid, made.stat().st_gid) == (1000, 1000)
    read = c.ok("fs.read", path="dir/sub/file.bin", offset=1000, length=5000)
    assert base64.b64decode(read["data"]) == data[1000:6000] and read["size"] == 300_000
    assert c.ok("fs.stat", path="/workspace/dir")["kind"] == "dir"
    assert c.ok("fs.stat", path="/workspace")["path"] == "/workspace"
    assert c.ok("fs.exists", path="dir/nope") is False
    assert c.ok("fs.exists", path="dir/sub/file.bin/x") is False
    assert c.request("fs.read", path="dir", offset=0, length=10)["error"]["kind"] == "is_dir"
    too = c.request("fs.read", path="dir/sub/file.bin", offset=0, length=(1 << 20) + 1)
    assert too["error"]["kind"] == "too_large"
    assert c.request("fs.stat", path="nope")["error"]["kind"] == "not_found"
    assert c.request("fs.stat", path="dir/sub/file.bin/x")["error"]["kind"] == "not_dir"


def test_write_is_atomic_and_abort_leaves_the_old_content(guest: Guest) -> None:
    c = guest.client
    _write(c, "f.txt", b"old")
    handle = c.ok("fs.write_begin", path="f.txt", mode=0o644, follow_symlinks=True)["handle"]
    assert c.ok("fs.write_chunk", handle=handle, data=b64(b"new content")) is True
    assert (guest.workspace / "f.txt").read_bytes() == b"old"  # not in place before the end
    assert c.ok("fs.write_abort", handle=handle) is True
    assert (guest.workspace / "f.txt").read_bytes() == b"old"
    assert sorted(p.name for p in guest.workspace.iterdir()) == ["f.txt"]  # no temp litter
    gone = c.request("fs.write_chunk", handle=handle, data=b64(b"x"))
    assert gone["error"]["kind"] == "protocol" and str(handle) in gone["error"]["message"]


def test_paths_and_symlinks_cannot_leave_the_workspace(guest: Guest) -> None:
    c = guest.client
    for path in ("../etc/passwd", "/etc/passwd", "/workspace/../etc/passwd"):
        assert c.request("fs.stat", path=path)["error"]["kind"] == "refused", path
    link = c.ok("fs.symlink", path="out", target="/etc")
    assert link["kind"] == "symlink" and link["link_target"] == "/etc"
    assert os.lstat(guest.workspace / "out").st_uid == 1000
    assert c.ok("fs.readlink", path="out") == "/etc"
    assert c.request("fs.read", path="out/passwd", offset=0, length=10)["error"]["kind"] == \
        "refused"
    assert c.request("fs.write_begin", path="out/x", mode=0o644,
                     follow_symlinks=True)["error"]["kind"] == "refused"
    c.ok("fs.symlink", path="esc", target="../../../../etc/passwd")
    assert c.request("fs.write_begin", path="esc", mode=0o644,
                     follow_symlinks=True)["error"]["kind"] == "refused"
    # Not following: the link itself is replaced by the file.
    _write(c, "esc", b"mine", follow_symlinks=False)
    assert (guest.workspace / "esc").read_bytes() == b"mine"
    # A link that stays inside is followed for writes.
    _write(c, "real.txt", b"1")
    c.ok("fs.symlink", path="alias", target="real.txt")
    _write(c, "alias", b"2")
    assert (guest.workspace / "real.txt").read_bytes() == b"2"
    assert os.path.islink(guest.workspace / "alias")


def test_list_mkdir_rename_remove(guest: Guest) -> None:
    c = guest.client
    assert c.ok("fs.mkdir", path="a/b/c") is True
    assert c.ok("fs.mkdir", path="a/b/c") is False
    _write(c, "a/b/c/f", b"x")
    _write(c, "a/g", b"y")
    names = [e["name"] for e in c.ok("fs.list", path="/workspace/a")]
    assert names == ["b", "g"]
    moved = c.ok("fs.rename", src="a/g", dst="z/moved")
    assert moved["path"] == "/workspace/z/moved" and (guest.workspace / "z/moved").exists()
    assert c.request("fs.rename", src="a/none", dst="q")["error"]["kind"] == "not_found"
    assert c.ok("fs.remove", path="a") is True
    assert not (guest.workspace / "a").exists()
    assert c.request("fs.remove", path="a")["error"]["kind"] == "not_found"
    assert c.request("fs.list", path="z/moved")["error"]["kind"] == "not_dir"


def test_walk_is_sorted_bounded_and_batched(guest: Guest) -> None:
    c = guest.client
    tree = guest.workspace / "t"
    (tree / "d").mkdir(parents=True)
    for n in range(2500):
        (tree / "d" / f"f{n:04}").write_bytes(b"ab")
    os.symlink("d/f0000", tree / "link")
    rid = c.new_id()
    c.send({"id": rid, "op": "fs.walk", "path": "/workspace/t"})
    batches: list[list[dict[str, Any]]] = []
    while True:
        message = c.get(rid)
        if "more" in message:
            batches.append(message["more"])
            continue
        batches.append(message["ok"])
        break
    assert len(batches) == 2 and len(batches[0]) == fs.BATCH_ENTRIES
    entries = [e for batch in batches for e in batch]
    assert [e["path"] for e in entries[:3]] == ["d", "d/f0000", "d/f0001"]
    assert entries[-1] == {**entries[-1], "path": "link", "kind": "symlink",
                           "link_target": "d/f0000"}
    assert len(entries) == 2502 and entries[1]["size"] == 2
    deep = guest.workspace / "deep"
    path = deep
    for _ in range(workspace.MAX_WALK_DEPTH + 2):
        path = path / "d"
    path.mkdir(parents=True)
    too_deep = c.request("fs.walk", path="deep")
    assert too_deep["error"]["kind"] == "too_large" and "deep" in too_deep["error"]["message"]
    assert c.ok("fs.remove", path="deep") is True  # removal does not recurse on the stack
    assert not deep.exists()

