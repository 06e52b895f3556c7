"""The in-sandbox helper of a long-lived gVisor sandbox (issue 14): a prototype, not wired in.

This file runs *inside* gVisor, as the container's init (``python3 -I -S -c <this source>``),
so it is stdlib only and imports nothing of Corral's. It speaks JSON lines on its stdin and
stdout (runsc's attached pipes, the only channel: ``--host-uds=none``):

* host → helper, first line: ``{"filter": B64}``, the namespace tier's seccomp BPF program
  (``_linux.seccomp.compile_filter``), installed by the helper into every command because
  ``runsc exec`` processes and anything the init forks before its own filter are *not*
  covered by the OCI profile (measured: ``Seccomp: 0`` and ``unshare(CLONE_NEWUSER)`` allowed
  in a ``runsc exec`` process of runsc 20240729);
* ``{"id", "op": "exec", "argv", "env", "cwd", "tmp_bytes", "nproc"}`` → ``{"id", "out":
  "stdout"|"stderr", "data": B64}``... then ``{"id", "exit": {"code", "cpu_s",
  "peak_rss_bytes"}}`` or ``{"id", "error": M}``;
* ``{"id", "op": "kill", "target"}`` → the command's PID namespace is killed.

Why the helper is root inside (with only SYS_ADMIN, SETUID, SETGID, KILL in gVisor's own
kernel, nothing on the host: the Sentry is the sandbox's runtime uid): it gives every command
the namespace tier's shape, which ``runsc exec`` cannot. Per command it forks a child that
unshares a mount and a PID namespace and mounts a fresh size-limited ``/tmp`` and ``/dev/shm``;
that child forks the namespace's init, which mounts ``/proc``, forks the command and reaps
until the command exits, then exits itself, and gVisor's kernel kills whatever is left in the
namespace (the tree is gone on return, as with bwrap's init). The command itself runs as
1000:1000 with no capabilities, ``no_new_privs``, its rlimits and the seccomp filter, set
between fork and exec.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import resource
import selectors
import signal
import sys
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 0x4000, 1 << 18
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_CAPBSET_DROP = 38, 22, 24
SECCOMP_MODE_FILTER = 2
UID = GID = 1000
# The helper's own (resident._HELPER_CAPS): KILL, SETGID, SETUID, SETPCAP, SYS_ADMIN.
HELPER_CAPS = (5, 6, 7, 8, 21)

libc = ctypes.CDLL(None, use_errno=True)


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: bytes | None, target: bytes, fstype: bytes | None, flags: int,
          data: bytes | None) -> None:
    check(libc.mount(source, target, fstype, ctypes.c_ulong(flags), data),
          f"mount {target.decode()}")


def drop_and_exec(req: dict[str, Any], program: bytes, fds: tuple[int, int, int]) -> None:
    """In the command's process: become 1000 with nothing, filtered, then exec."""
    stdin, stdout, stderr = fds
    os.dup2(stdin, 0)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.setsid()
    for cap in HELPER_CAPS:
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop capability")
    os.setgroups([])
    os.setresgid(GID, GID, GID)
    os.setresuid(UID, UID, UID)  # from 0 to non-zero without keepcaps: every capability drops
    nproc = req.get("nproc")
    if nproc:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.chdir(req["cwd"])
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    prog = SockFprog(len(program) // 8, program)
    # The last thing before exec: from here on every call is filtered, exec included.
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")
    os.execvpe(req["argv"][0], req["argv"], req["env"])


def namespace_init(req: dict[str, Any], program: bytes, fds: tuple[int, int, int],
                   status: int) -> None:
    """PID 1 of the command's namespace: /proc, the command, reap until it exits."""
    mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV, None)
    pid = os.fork()
    if pid == 0:
        try:
            drop_and_exec(req, program, fds)
        except OSError as exc:
            os.write(status, json.dumps({"error": str(exc), "errno": exc.errno}).encode() + b"\n")
        os._exit(127)
    for fd in fds:
        os.close(fd)
    cpu, peak, code = 0.0, 0, 0
    while True:
        try:
            child, wstatus, usage = os.wait4(-1, 0)
        except ChildProcessError:
            break
        cpu += usage.ru_utime + usage.ru_stime
        peak = max(peak, usage.ru_maxrss * 1024)
        if child == pid:
            code = os.waitstatus_to_exitcode(wstatus)
            code = 128 - code if code < 0 else code
            break
    os.write(status, json.dumps({"code": code, "cpu_s": cpu, "peak_rss_bytes": peak}).encode()
             + b"\n")
    os._exit(0)  # and the kernel kills what is left in the namespace


def start_command(req: dict[str, Any], program: bytes) -> tuple[int, int, int, int]:
    """Fork the command's set-up child; returns (pid, stdout, stderr, status read ends)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    st_r, st_w = os.pipe()
    null = os.open("/dev/null", os.O_RDONLY)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(out_r)
            os.close(err_r)
            os.close(st_r)
            check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare")
            mount(None, b"/", None, MS_REC | MS_PRIVATE, None)
            size = str(int(req["tmp_bytes"])).encode()
            for target in (b"/tmp", b"/dev/shm"):
                mount(b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV,
                      b"size=" + size + b",mode=1777")
            init = os.fork()
            if init == 0:
                namespace_init(req, program, (null, out_w, err_w), st_w)
            os.write(st_w, json.dumps({"init": init}).encode() + b"\n")
            _, wstatus = os.waitpid(init, 0)
            os._exit(0 if os.waitstatus_to_exitcode(wstatus) == 0 else 1)
        except BaseException as exc:  # noqa: BLE001 - report and leave, never return to the loop
            try:
                os.write(st_w, json.dumps({"error": str(exc)}).encode() + b"\n")
            finally:
                os._exit(1)
    for fd in (out_w, err_w, st_w, null):
        os.close(fd)
    return pid, out_r, err_r, st_r


def main() -> None:
    out = sys.stdout.buffer

    def write(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj).encode() + b"\n")
        out.flush()

    program = base64.b64decode(json.loads(sys.stdin.buffer.readline())["filter"])
    if not program or len(program) % 8:
        write({"fatal": "no seccomp filter"})
        return
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sel = selectors.DefaultSelector()
    stdin = sys.stdin.fileno()  # read raw: the buffered reader would hide queued lines
    sel.register(stdin, selectors.EVENT_READ, ("ctl", None))
    commands: dict[int, dict[str, Any]] = {}  # id -> {"pid", "init", "open", ...}
    buf = b""
    write({"ready": True})
    while True:
        for key, _ in sel.select():
            kind, cid = key.data
            if kind == "ctl":
                data = os.read(stdin, 65536)
                if not data:
                    for cmd in commands.values():
                        if cmd.get("init"):
                            os.kill(cmd["init"], signal.SIGKILL)
                    return
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    req: dict[str, Any] = json.loads(line)
                    if req["op"] == "exec":
                        pid, o, e, s = start_command(req, program)
                        commands[req["id"]] = {"pid": pid, "open": 3, "status": b"", "exit": None}
                        sel.register(o, selectors.EVENT_READ, ("stdout", req["id"]))
                        sel.register(e, selectors.EVENT_READ, ("stderr", req["id"]))
                        sel.register(s, selectors.EVENT_READ, ("status", req["id"]))
                    elif req["op"] == "kill":
                        target = commands.get(req["target"])
                        if target and target.get("init"):
                            os.kill(target["init"], signal.SIGKILL)
                            target["killed"] = True
                        write({"id": req["id"], "ok": target is not None})
                continue
            cmd = commands[cid]
            data = os.read(key.fd, 65536)
            if data and kind == "status":
                cmd["status"] += data
                for line in cmd["status"].split(b"\n")[:-1]:
                    msg = json.loads(line)
                    if "init" in msg:
                        cmd["init"] = msg["init"]
                    elif cmd["exit"] is None or "error" not in cmd["exit"]:
                        cmd["exit"] = msg  # a failed exec's report wins over init's 127
                cmd["status"] = cmd["status"].rsplit(b"\n", 1)[-1]
            elif data:
                write({"id": cid, "out": kind, "data": base64.b64encode(data).decode()})
            else:
                sel.unregister(key.fd)
                os.close(key.fd)
                cmd["open"] -= 1
            if cmd["open"] == 0:
                os.waitpid(cmd["pid"], 0)
                result = cmd["exit"] or (
                    {"code": 137, "cpu_s": 0.0, "peak_rss_bytes": 0, "killed": True}
                    if cmd.get("killed") else {"error": "the command's namespace died"})
                if "error" in result:
                    write({"id": cid, "error": result})
                else:
                    write({"id": cid, "exit": result})
                del commands[cid]


if __name__ == "__main__":
    main()
