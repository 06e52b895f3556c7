"""The in-sandbox helper of a resident gVisor sandbox (issue 14; see ``resident``).

This file runs *inside* gVisor as the container's init (``python3 -I -S -c <this source>``), so
it is stdlib only and imports nothing of Corral's. It speaks JSON lines on its stdin and stdout
(runsc's attached pipes, the only channel there is: ``--host-uds=none``):

* host → helper ``{"id", "op": "exec", "argv", "env", "cwd", "tmp_bytes", "nproc"}`` → helper
  ``{"id", "out": "stdout"|"stderr", "data": B64}``... then exactly one of ``{"id", "exit":
  {"code", "cpu_s", "peak_rss_bytes"[, "killed"]}}`` or ``{"id", "error": {"error": M}}``
  (the command never started) or ``{"id", "exit": {"exec_errno": N}}`` (execve failed);
* ``{"id", "op": "kill", "target"}`` → ``{"id", "ok"}``: the command's PID namespace is killed.

The helper only multiplexes; each command's shape comes from the static launcher ``run.c``
(bound at ``/.corral``), started with ``posix_spawn``. Why the helper is root inside, with
KILL, SETGID, SETUID, SETPCAP and SYS_ADMIN in gVisor's kernel only (the Sentry is the
sandbox's runtime uid on the host): the launcher needs them to give each command its own mount
and PID namespace, which neither ``runsc exec`` nor the OCI profile can, then drops them all.
Why the launcher installs the seccomp filter itself: gVisor applies the OCI profile to the
container's init only; a ``runsc exec`` process of runsc 20240729 reports ``Seccomp: 0`` and
may ``unshare(CLONE_NEWUSER)`` (measured by ``bench/bench_gvisor.py``), and the helper must run
unfiltered to make namespaces.
"""

from __future__ import annotations

import base64
import json
import os
import selectors
import signal
import sys
from typing import Any

LAUNCHER = "/.corral/run"
FILTER = "/.corral/filter"


def start_command(req: dict[str, Any]) -> tuple[int, int, int, int]:
    """Spawn the launcher for one command; (pid, stdout, stderr, status read ends)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    st_r, st_w = os.pipe()
    null = os.open("/dev/null", os.O_RDONLY)
    actions = [(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, out_w, 1),
               (os.POSIX_SPAWN_DUP2, err_w, 2), (os.POSIX_SPAWN_DUP2, st_w, 3)]
    argv = [LAUNCHER, FILTER, str(int(req["tmp_bytes"])), str(int(req["nproc"])), req["cwd"],
            "--", *req["argv"]]
    try:
        # posix_spawn is a vfork: no copy of this process (a fork of it costs 20-45 ms here).
        pid = os.posix_spawn(LAUNCHER, argv, req["env"], file_actions=actions)
    finally:
        for fd in (out_w, err_w, st_w, null):
            os.close(fd)
    return pid, out_r, err_r, st_r


def parse_status(line: bytes, cmd: dict[str, Any]) -> None:
    """A launcher's status line (see run.c): "init", "exit", "error" or "exec"."""
    kind, _, rest = line.decode(errors="replace").partition(" ")
    if kind == "init":
        cmd["init"] = int(rest)
    elif kind == "error" and cmd["exit"] is None:
        errno_text, _, what = rest.partition(" ")
        cmd["exit"] = {"error": f"{what}: {os.strerror(int(errno_text))}"}
    elif kind == "exec" and cmd["exit"] is None:
        errno_text, _, _ = rest.partition(" ")
        cmd["exit"] = {"exec_errno": int(errno_text)}
    elif kind == "exit" and cmd["exit"] is None:  # an earlier error wins over init's code
        code, cpu_us, rss_kb = rest.split()
        cmd["exit"] = {"code": int(code), "cpu_s": int(cpu_us) / 1e6,
                       "peak_rss_bytes": int(rss_kb) * 1024}


def main() -> None:
    out = sys.stdout.buffer

    def write(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj).encode() + b"\n")
        out.flush()

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
                        try:
                            pid, o, e, s = start_command(req)
                        except OSError as exc:
                            write({"id": req["id"], "error": {"error": f"launcher: {exc}"}})
                            continue
                        commands[req["id"]] = {"pid": pid, "open": 3, "status": b"", "exit": None}
                        sel.register(o, selectors.EVENT_READ, ("stdout", req["id"]))
                        sel.register(e, selectors.EVENT_READ, ("stderr", req["id"]))
                        sel.register(s, selectors.EVENT_READ, ("status", req["id"]))
                    elif req["op"] == "kill":
                        target = commands.get(req["target"])
                        if target is not None:
                            target["killed"] = True  # killed as soon as its init is known
                            if target.get("init"):
                                os.kill(target["init"], signal.SIGKILL)
                        write({"id": req["id"], "ok": target is not None})
                continue
            cmd = commands[cid]
            data = os.read(key.fd, 65536)
            if data and kind == "status":
                cmd["status"] += data
                for line in cmd["status"].split(b"\n")[:-1]:
                    parse_status(line, cmd)
                    if line.startswith(b"init ") and cmd.get("killed"):
                        os.kill(cmd["init"], signal.SIGKILL)
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
