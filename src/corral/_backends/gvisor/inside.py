"""The in-sandbox helper of a resident gVisor sandbox (issue 14; see ``resident``).

This file runs *inside* gVisor as the container's init (``python3 -I -S -c <this source>``), so
it is stdlib only and imports nothing of Corral's. It speaks JSON lines on its stdin and stdout
(runsc's attached pipes, the only channel there is: ``--host-uds=none``):

* host → helper ``{"id", "op": "exec", "argv", "env", "cwd", "tmp_bytes", "nproc"[, "stdin":
  B64][, "interactive": true]}`` → helper
  ``{"id", "out": "stdout"|"stderr", "data": B64}``... then exactly one of ``{"id", "exit":
  {"code", "cpu_s", "peak_rss_bytes"[, "killed"]}}`` or ``{"id", "error": {"error": M}}``
  (the command never started) or ``{"id", "exit": {"exec_errno": N}}`` (execve failed);
* ``{"id", "op": "kill", "target"}`` → ``{"id", "ok"}``: the command's PID namespace is killed;
* ``{"op": "stdin", "target", "data": B64}`` and ``{"op": "close_stdin", "target"}`` (no answer):
  an interactive command's input. A command's stdin is a pipe: what ``stdin`` gave, then EOF
  (at once for a command given none, on ``close_stdin`` for an interactive one). The helper
  buffers what the command has not read yet and never blocks on it.

The helper only multiplexes; each command's shape comes from the static launcher ``run.c``
(bound at ``/.corral``), started with ``posix_spawn``; after each command the helper sets up
the next one's launcher ahead (``Launchers``: namespaces, mounts and init made while nothing
runs, init already the command's uid with its filter), so a command waits only for its
request, a vfork and its exec; the launcher itself exits once it has made init (init is the
helper's child), so no exit of its lies between the command's end and the answer.

Why the helper is root inside, with
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
import contextlib
import json
import os
import selectors
import signal
import sys
from typing import Any

LAUNCHER = "/.corral/run"
FILTER = "/.corral/filter"


Launch = dict[str, Any]  # {"pid", "stdin", "out", "err", "status", "request" (pooled only)}


def spawn_launcher(tail: list[str], env: dict[str, str], pooled: bool) -> Launch:
    """Start the launcher with fresh pipes; ``tail`` follows FILTER on its command line."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    st_r, st_w = os.pipe()
    os.set_blocking(in_w, False)  # a command that does not read must not stall the helper
    mine, theirs = [in_r, out_w, err_w, st_w], []
    actions = [(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1),
               (os.POSIX_SPAWN_DUP2, err_w, 2), (os.POSIX_SPAWN_DUP2, st_w, 3)]
    if pooled:
        req_r, req_w = os.pipe()
        os.set_inheritable(req_w, False)
        mine.append(req_r)
        theirs.append(req_w)
        actions.append((os.POSIX_SPAWN_DUP2, req_r, 4))
    try:
        # posix_spawn is a vfork: no copy of this process (a fork of it costs 20-45 ms here).
        # SIGPIPE: ignored here (a dead launcher's pipe is an error, not our death), default
        # in the command.
        pid = os.posix_spawn(LAUNCHER, [LAUNCHER, FILTER, *tail], env, file_actions=actions,
                             setsigdef=(signal.SIGPIPE,))
    except OSError:
        for fd in (in_w, out_r, err_r, st_r, *theirs):
            os.close(fd)
        raise
    finally:
        for fd in mine:
            os.close(fd)
    launch: Launch = {"pid": pid, "stdin": in_w, "out": out_r, "err": err_r, "status": st_r}
    if pooled:
        launch["request"] = theirs[0]
    return launch


def reap(launcher: int, init: int | None) -> None:
    """Reap a command's launcher (gone since it made init) and its init, whose reaping is the
    proof that the command's whole PID namespace is dead."""
    for pid in (launcher, init):
        if pid is not None:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def encode_request(req: dict[str, Any]) -> bytes:
    """The pooled launcher's request (see run.c): cwd, argc, argv, envc, env; NUL-separated."""
    argv = [os.fsencode(a) for a in req["argv"]]
    env = [os.fsencode(f"{k}={v}") for k, v in req["env"].items()]
    fields = [os.fsencode(req["cwd"]), str(len(argv)).encode(), *argv,
              str(len(env)).encode(), *env]
    return b"".join(f + b"\0" for f in fields)


class Launchers:
    """One launcher set up ahead per (tmp size, pid limit), used by the next command."""

    def __init__(self) -> None:
        self.pool: dict[tuple[int, int], Launch] = {}

    def start(self, req: dict[str, Any]) -> Launch:
        key = (int(req["tmp_bytes"]), int(req["nproc"]))
        launch = self.pool.pop(key, None)
        if launch is not None:
            try:
                data = encode_request(req)
                while data:
                    data = data[os.write(launch["request"], data):]
                os.close(launch["request"])
                return launch
            except OSError:  # it died while waiting: start the command the direct way
                self.discard(launch)
        tail = [str(key[0]), str(key[1]), req["cwd"], "--", *req["argv"]]
        return spawn_launcher(tail, req["env"], pooled=False)

    def refill(self, tmp_bytes: int, nproc: int) -> None:
        key = (tmp_bytes, nproc)
        if key not in self.pool:
            try:
                self.pool[key] = spawn_launcher([str(tmp_bytes), str(nproc), "--pool"],
                                                {}, pooled=True)
            except OSError:
                pass  # the next command starts the direct way

    @staticmethod
    def discard(launch: Launch) -> None:
        """A launcher no command will use: EOF on its request ends its init (nothing ran);
        init (our child: run.c's CLONE_PARENT) is named on the status pipe, and both are
        reaped."""
        with contextlib.suppress(OSError):
            os.close(launch.pop("request"))
        status = b""
        with contextlib.suppress(OSError):
            while chunk := os.read(launch["status"], 4096):
                status += chunk
        for name in ("stdin", "out", "err", "status"):
            with contextlib.suppress(OSError):
                os.close(launch[name])
        cmd: dict[str, Any] = {"exit": None}
        for line in status.split(b"\n"):
            parse_status(line, cmd)
        reap(launch["pid"], cmd.get("init"))

    def close(self) -> None:
        for launch in self.pool.values():
            self.discard(launch)
        self.pool.clear()


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


def pump_stdin(sel: selectors.BaseSelector, cid: int, cmd: dict[str, Any]) -> None:
    """Write what the command has not read yet without blocking; close its stdin once all is
    written and it is to end. Waits for the pipe to drain through the selector."""
    fd = cmd.get("in_fd")
    if fd is None:
        return
    try:
        while cmd["inbuf"]:
            del cmd["inbuf"][:os.write(fd, cmd["inbuf"])]
    except BlockingIOError:
        if not cmd["in_waiting"]:
            sel.register(fd, selectors.EVENT_WRITE, ("stdin", cid))
            cmd["in_waiting"] = True
        return
    except OSError:  # the command stopped reading (EPIPE): what is left is dropped
        cmd["inbuf"].clear()
        cmd["in_close"] = True
    if cmd["in_waiting"]:
        sel.unregister(fd)
        cmd["in_waiting"] = False
    if cmd["in_close"]:
        os.close(fd)
        cmd["in_fd"] = None


def main() -> None:
    out = sys.stdout.buffer

    def write(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj).encode() + b"\n")
        out.flush()

    launchers = Launchers()
    sel = selectors.DefaultSelector()
    stdin = sys.stdin.fileno()  # read raw: the buffered reader would hide queued lines
    sel.register(stdin, selectors.EVENT_READ, ("ctl", None))
    commands: dict[int, dict[str, Any]] = {}  # id -> {"pid", "init", "open", ...}
    # A request with a command's stdin is one long line (64 MiB of stdin: 85 MiB of base64):
    # only the bytes not yet searched are searched for its end, and none is copied again.
    buf = bytearray()
    searched = 0
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
                    launchers.close()
                    return
                buf += data
                while (end := buf.find(b"\n", searched)) >= 0:
                    line = bytes(buf[:end])
                    del buf[:end + 1]
                    searched = 0
                    req: dict[str, Any] = json.loads(line)
                    if req["op"] == "exec":
                        try:
                            launch = launchers.start(req)
                        except (OSError, ValueError) as exc:
                            write({"id": req["id"], "error": {"error": f"launcher: {exc}"}})
                            continue
                        commands[req["id"]] = cmd = {
                            "pid": launch["pid"], "open": 3, "status": b"", "exit": None,
                            "key": (int(req["tmp_bytes"]), int(req["nproc"])),
                            "in_fd": launch["stdin"], "in_waiting": False,
                            "inbuf": bytearray(base64.b64decode(req.get("stdin") or "")),
                            "in_close": not req.get("interactive")}
                        pump_stdin(sel, req["id"], cmd)
                        sel.register(launch["out"], selectors.EVENT_READ, ("stdout", req["id"]))
                        sel.register(launch["err"], selectors.EVENT_READ, ("stderr", req["id"]))
                        sel.register(launch["status"], selectors.EVENT_READ,
                                     ("status", req["id"]))
                    elif req["op"] == "kill":
                        target = commands.get(req["target"])
                        if target is not None:
                            target["killed"] = True  # killed as soon as its init is known
                            if target.get("init"):
                                os.kill(target["init"], signal.SIGKILL)
                        write({"id": req["id"], "ok": target is not None})
                    elif req["op"] in ("stdin", "close_stdin"):
                        target = commands.get(req["target"])
                        if target is not None and target["in_fd"] is not None:
                            target["inbuf"] += base64.b64decode(req.get("data") or "")
                            target["in_close"] |= req["op"] == "close_stdin"
                            pump_stdin(sel, req["target"], target)
                searched = len(buf)
                continue
            cmd = commands[cid]
            if kind == "stdin":
                pump_stdin(sel, cid, cmd)
                continue
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
                if cmd["in_fd"] is not None:  # it ended without reading all it was given
                    if cmd["in_waiting"]:
                        sel.unregister(cmd["in_fd"])
                    os.close(cmd["in_fd"])
                reap(cmd["pid"], cmd.get("init"))
                # No report from an init that was up: it was SIGKILLed (by us, or by gVisor's
                # OOM handling; never by the command, whose signals to it fail with EPERM:
                # see run.c), and the tree died with it.
                result = cmd["exit"] or (
                    {"code": 137, "cpu_s": 0.0, "peak_rss_bytes": 0, "killed": True}
                    if cmd.get("killed") or cmd.get("init")
                    else {"error": "the command's namespace died"})
                if "error" in result:
                    write({"id": cid, "error": result})
                else:
                    write({"id": cid, "exit": result})
                del commands[cid]
                # Between commands, not in one's way: set up the launcher for the next.
                launchers.refill(*cmd["key"])


if __name__ == "__main__":
    main()
