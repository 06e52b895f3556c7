"""Commands in the guest: ``exec`` starts one through the launcher (``/corral/run``, from
``run.c``) in a cgroup of its own, streams its output, enforces its timeout and reports its end.

A command's cgroup is ``cmd/<id>``, or ``cmd/<id>.<n>`` when a group of that name is still
alive (an orphan from before a restore). A ``kill`` that arrives before ``started`` was sent
kills the command the moment it is placed (its ``exit`` then has signal 9).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import fcntl
import hashlib
import os
import posixpath
import select
import struct
import subprocess
import termios
import threading
import time
from typing import TYPE_CHECKING

from . import tunnel
from .channel import Lane
from .commands import STDIN_PENDING, Command, command_pid, remove_cgroup
from .fsrules import WORKSPACE
from .protocol import CHUNK, AgentError, Message, b64
from .system import log, read_int, remount_tmp, syncfs, write_text

if TYPE_CHECKING:
    from .agent import Agent

__all__ = ["run"]

MAX_ARG_STRLEN = 128 << 10
MAX_ARGS_TOTAL = 1 << 20


def _make_cgroup(agent: Agent, rid: int, request: Message) -> str:
    path = os.path.join(agent.cmd_root, str(rid))
    for n in range(1, 1000):
        try:
            os.mkdir(path)
            break
        except FileExistsError:
            path = os.path.join(agent.cmd_root, f"{rid}.{n}")
    else:
        raise AgentError("busy", f"no free cgroup name for command {rid}")
    limits = [("pids.max", str(request["pids"])),
              ("memory.max", str(request["memory_bytes"])),
              ("memory.swap.max", "0")]
    try:
        for name, value in limits:
            target = os.path.join(path, name)
            if not os.path.exists(target):
                if agent.config.strict and name != "memory.swap.max":
                    raise AgentError("io", f"the guest cgroup has no {name}: the kernel "
                                     "or init did not enable the controller")
                continue
            write_text(target, value)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        raise
    return path


def _validate(request: Message) -> tuple[list[str], str, dict[str, str]]:
    argv = request.get("argv")
    if (not isinstance(argv, list) or not argv
            or not all(isinstance(a, str) and a for a in argv[:1])
            or not all(isinstance(a, str) for a in argv)):
        raise AgentError("protocol", "exec: 'argv' must be a non-empty list of strings")
    env = request.get("env")
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise AgentError("protocol", "exec: 'env' must be an object of strings")
    if any("=" in k or not k for k in env):
        raise AgentError("protocol", "exec: an env name is empty or contains '='")
    strings = argv + [f"{k}={v}" for k, v in env.items()]
    if any("\x00" in s for s in strings):
        raise AgentError("protocol", "exec: argv and env must not contain NUL bytes")
    sizes = [len(s.encode("utf-8", "surrogateescape")) + 1 for s in strings]
    if max(sizes) > MAX_ARG_STRLEN or sum(sizes) > MAX_ARGS_TOTAL:
        raise AgentError("e2big", f"the arguments and environment are too large (at most "
                         f"{MAX_ARG_STRLEN} bytes each and {MAX_ARGS_TOTAL} in all)")
    cwd = request.get("cwd")
    if not isinstance(cwd, str) or not cwd.startswith("/") or "\x00" in cwd:
        raise AgentError("protocol", "exec: 'cwd' must be an absolute path")
    timeout = request.get("timeout")
    if timeout is not None and (not isinstance(timeout, int | float)
                                or isinstance(timeout, bool) or timeout <= 0):
        raise AgentError("protocol", "exec: 'timeout' must be a number of seconds > 0")
    if request.get("stdin") not in ("pipe", "null"):
        raise AgentError("protocol", "exec: 'stdin' must be \"pipe\" or \"null\"")
    pty = request.get("pty")
    if pty is not None and not (isinstance(pty, list) and len(pty) == 2 and all(
            isinstance(n, int) and not isinstance(n, bool) and 0 < n < 65536 for n in pty)):
        raise AgentError("protocol", "exec: 'pty' must be null or [rows, cols]")
    for key in ("tmp_bytes", "pids", "memory_bytes"):
        value = request.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise AgentError("protocol", f"exec: {key!r} must be an integer > 0")
    port = request.get("egress_port")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool)
                             or not 0 < port < 65536):
        raise AgentError("protocol", "exec: 'egress_port' must be null or a TCP port")
    return argv, cwd, env


def _seccomp_file(agent: Agent, request: Message) -> str:
    """The file of the exec's syscall filter (the other tiers' own, compiled by the host),
    written once per distinct program; "-" only in the host-side test mode."""
    program = request.get("seccomp")
    if program is None:
        if agent.config.strict:
            raise AgentError("protocol", "exec: 'seccomp' (the syscall filter) is required")
        return "-"
    try:
        data = base64.b64decode(program if isinstance(program, str) else "!", validate=True)
    except (binascii.Error, ValueError):
        raise AgentError("protocol", "exec: 'seccomp' must be base64") from None
    if not data or len(data) % 8 or len(data) > 65536:
        raise AgentError("protocol", "exec: 'seccomp' is not a BPF program")
    path = f"/run/corral/seccomp-{hashlib.sha256(data).hexdigest()[:16]}.bpf"
    if not os.path.exists(path):
        os.makedirs("/run/corral", mode=0o755, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    return path


def _tmp_argument(agent: Agent, size: int) -> str:
    """run's TMP_BYTES: in the guest, "-SIZE" (commands share the guest's /tmp, which
    lives as long as the sandbox; sized here to the tier's, once); in the host-side test
    mode, "SIZE" (a fresh /tmp per command: the host's own is no sandbox's)."""
    if not agent.config.strict:
        return str(size)
    with agent.tmp_lock:
        if agent.tmp_size != size:
            try:
                remount_tmp(size)
            except OSError as exc:
                raise AgentError("io", f"cannot size /tmp: {exc.strerror}") from None
            agent.tmp_size = size
    return f"-{size}"


def _host_cwd(agent: Agent, cwd: str) -> str:
    """The guest's own path; in test mode /workspace is the override directory."""
    normal = posixpath.normpath(cwd)
    if agent.config.workspace != WORKSPACE and (
            normal == WORKSPACE or normal.startswith(WORKSPACE + "/")):
        return agent.config.workspace + normal[len(WORKSPACE):]
    return normal


def run(agent: Agent, rid: int, request: Message) -> None:
    argv, cwd, env = _validate(request)
    started = time.monotonic()
    timeout = request.get("timeout")
    deadline = None if timeout is None else started + float(timeout)
    cgroup = _make_cgroup(agent, rid, request)
    child_fds: list[int] = []
    ours: list[int] = []
    master: int | None = None
    stdin_w: int | None = None
    try:
        info_r, info_w = os.pipe2(os.O_CLOEXEC)
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        ours += [info_r, status_r]
        child_fds += [info_w, status_w]
        pty = request.get("pty")
        if pty is not None:
            master, slave = os.openpty()
            os.set_inheritable(master, False)
            child_fds.append(slave)
            fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", pty[0], pty[1], 0, 0))
            stdio: tuple[int, int, int] = (slave, slave, slave)
            outputs = [("stdout", master)]
        else:
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            ours += [out_r, err_r]
            child_fds += [out_w, err_w]
            if request["stdin"] == "pipe":
                in_r, stdin_w = os.pipe2(os.O_CLOEXEC)
                child_fds.append(in_r)
            else:
                in_r = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                child_fds.append(in_r)
            stdio = (in_r, out_w, err_w)
            outputs = [("stdout", out_r), ("stderr", err_r)]
        run_argv = [agent.config.run, cgroup, _host_cwd(agent, cwd),
                    _tmp_argument(agent, int(request["tmp_bytes"])), str(info_w), str(status_w),
                    "1" if pty is not None else "0", _seccomp_file(agent, request),
                    "--", *argv]
        try:
            proc = subprocess.Popen(run_argv, env=env, stdin=stdio[0], stdout=stdio[1],
                                    stderr=stdio[2], pass_fds=(info_w, status_w))
        except OSError as exc:
            raise AgentError("io", f"cannot start {agent.config.run}: {exc.strerror}") from None
        for fd in child_fds:
            os.close(fd)
        child_fds = []
        _await_start(proc, info_r, cgroup, argv[0], cwd, deadline)
        leader = command_pid(cgroup)
        tag = request.get("tag")
        command = Command(rid, cgroup, proc, leader or proc.pid, leader, master=master,
                          stdin=stdin_w if pty is None else master,
                          tag=tag if isinstance(tag, str) else None)
        if master is not None or stdin_w is not None:
            # The lane owns these descriptors from here: it closes them after its last
            # write, so no op can reach a number the kernel has handed out again.
            command.stdin_lane = Lane(STDIN_PENDING)
            master = stdin_w = None
        with agent.lock:
            agent.commands[rid] = command
            agent.starting.discard(rid)
            if rid in agent.kill_pending:  # killed before it was placed
                agent.kill_pending.discard(rid)
                command.killed = True
                command.kill_tree()
        agent.channel.send({"id": rid, "started": {"pid": command.pid}})
        pumps = [threading.Thread(target=_pump, args=(agent, command, name, fd), daemon=True)
                 for name, fd in outputs]
        for pump in pumps:
            pump.start()
        if request.get("egress_port") is not None:
            tunnel.listen(agent, command, int(request["egress_port"]))
        _wait(agent, command, deadline, started, pumps, status_r)
    except BaseException:
        with agent.lock:
            agent.commands.pop(rid, None)
            agent.starting.discard(rid)
            agent.kill_pending.discard(rid)
        with contextlib.suppress(OSError):
            write_text(os.path.join(cgroup, "cgroup.kill"), "1")
        remove_cgroup(cgroup)
        raise
    finally:
        for leftover in (*child_fds, *ours, master, stdin_w):
            if leftover is not None:
                with contextlib.suppress(OSError):
                    os.close(leftover)


def _await_start(proc: subprocess.Popen[bytes], info_r: int, cgroup: str,
                 program: str, cwd: str, deadline: float | None) -> None:
    """Read the launcher's info pipe: EOF alone means the program was exec'd."""
    data = b""
    while True:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([info_r], [], [], wait)
        if not ready:
            write_text(os.path.join(cgroup, "cgroup.kill"), "1")
            proc.wait()
            # A command's time counts from its request: on a busy host its start alone may
            # use it all, which is a timeout like any other (exit 124), not the VM failing.
            raise AgentError("timeout", "the command did not start before its timeout")
        chunk = os.read(info_r, 4096)
        if not chunk:
            break
        data += chunk[:4096]
    if not data:
        return
    proc.wait()
    kind, _, rest = data.decode(errors="replace").strip().partition(" ")
    code_text, _, what = rest.partition(" ")
    code = int(code_text) if code_text.isdigit() else 0
    reason = os.strerror(code) if code else "unknown error"
    remove_cgroup(cgroup)
    if kind == "cwd":
        raise AgentError("cwd", f"cannot enter the working directory {cwd}: {reason}")
    if kind == "exec":
        if code == errno.E2BIG:
            raise AgentError("e2big", f"{program!r}: the arguments and environment are "
                             "too large")
        if code in (errno.ENOENT, errno.ENOTDIR):
            raise AgentError("not_found", f"{program!r} was not found (not a file, nor on "
                             "the PATH given in env)")
        raise AgentError("not_found", f"{program!r} cannot be executed: {reason}")
    raise AgentError("io", f"the command launcher failed to {what or kind}: {reason}")


def _pump(agent: Agent, command: Command, name: str, fd: int) -> None:
    while True:
        try:
            data = os.read(fd, CHUNK)
        except InterruptedError:
            continue
        except OSError:  # EIO: the PTY's last slave end closed
            return
        if not data:
            return
        if not command.detached:  # after a restore the output has no reader: drain it
            command.emit(agent.channel, {"out": name, "data": b64(data)})


def _wait(agent: Agent, command: Command, deadline: float | None, started: float,
          pumps: list[threading.Thread], status_r: int) -> None:
    timed_out = False
    # Woken by the exit itself (a pidfd): Popen.wait(timeout) polls with sleeps that
    # double up to 50 ms, which a short command pays in full under emulation.
    try:
        exited: int | None = os.pidfd_open(command.proc.pid)
    except OSError:
        exited = None
    try:
        while True:
            wait = None if deadline is None or command.detached else max(
                0.0, deadline - time.monotonic())
            if timed_out and wait is not None:
                wait = 0.05  # killed: its tree is going; look again shortly
            try:
                if exited is None:
                    command.proc.wait(timeout=wait)
                    break
                if select.select([exited], [], [], wait)[0]:
                    command.proc.wait()
                    break
            except subprocess.TimeoutExpired:
                pass
            if command.detached:
                continue
            timed_out = True
            command.kill_tree()
    finally:
        if exited is not None:
            os.close(exited)
    # Whatever the command left behind dies before exit is reported.
    command.kill_tree()
    events = os.path.join(command.cgroup, "cgroup.events")
    settle = time.monotonic() + 10
    while read_int(events, "populated") and time.monotonic() < settle:
        time.sleep(0.005)
    for pump in pumps:
        pump.join(timeout=5)
    if command.stdin_lane is not None:
        command.stdin_lane.submit(command.close_fds, 0)
        command.stdin_lane.close()
    tunnel.close_for_command(agent, command)
    status = b""
    with contextlib.suppress(OSError):
        os.set_blocking(status_r, False)
        status = os.read(status_r, 64)
    word, _, number = status.decode(errors="replace").strip().partition(" ")
    signal_no: int | None = None
    if word == "exit" and number.isdigit():
        code = int(number)
    elif word == "signal" and number.isdigit():
        signal_no = int(number)
        code = 128 + signal_no
    elif command.killed or timed_out:
        signal_no, code = 9, 137
    else:
        returncode = command.proc.returncode
        code = returncode if returncode >= 0 else 128 - returncode
        signal_no = -returncode if returncode < 0 else None
    sync_error = None
    try:
        syncfs(agent.config.workspace)
    except OSError as exc:
        sync_error = exc.strerror
    cpu = read_int(os.path.join(command.cgroup, "cpu.stat"), "usage_usec") / 1e6
    peak = read_int(os.path.join(command.cgroup, "memory.peak"))
    oom = read_int(os.path.join(command.cgroup, "memory.events"), "oom_kill") > 0
    remove_cgroup(command.cgroup)
    with agent.lock, command.lock:
        # One a wake holds for the host's attach stays findable until then (the attach
        # sends its exit and removes it).
        if agent.commands.get(command.id) is command and command.held is None:
            del agent.commands[command.id]
    if not command.detached:
        if sync_error is not None:
            log(f"syncfs of the workspace failed: {sync_error}")
        command.emit(agent.channel, {"exit": {
            "code": code, "signal": signal_no, "timed_out": timed_out,
            "wall_s": round(time.monotonic() - started, 6), "cpu_s": cpu,
            "peak_memory_bytes": peak, "oom_killed": oom}})
    command.done.set()
