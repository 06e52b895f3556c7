"""Scenario 2, commands, through the official Python SDK (any set from 2.7.0 on).

Usage: python commands.py
"""

from __future__ import annotations

import time

from _steps import done, step
from e2b import Sandbox

sb = step("create", lambda: Sandbox.create(timeout=180))
step("id", lambda: sb.sandbox_id)


def run(cmd: str, **kw: object) -> dict[str, object]:
    r = sb.commands.run(cmd, **kw)
    return {"stdout": r.stdout, "stderr": r.stderr, "exit_code": r.exit_code}


step("echo", lambda: run("echo hello e2b"))
step("stderr", lambda: run("echo oops >&2"))
step("exit3", lambda: run("echo partial; exit 3"))
step("home", lambda: run("pwd; echo \"$HOME $USER\""))
step("cwd", lambda: run("mkdir -p /home/user/sub && cd /home/user/sub && touch here")
     and run("pwd; ls", cwd="/home/user/sub"))
step("envs", lambda: run("echo \"$FOO-$BAR\"", envs={"FOO": "foo", "BAR": "bar baz"}))


def streamed() -> dict[str, object]:
    out: list[str] = []
    err: list[str] = []
    r = sb.commands.run("for i in 1 2 3; do echo line$i; echo err$i >&2; done",
                        on_stdout=out.append, on_stderr=err.append)
    return {"on_stdout": "".join(out), "on_stderr": "".join(err), "stdout": r.stdout}


step("callbacks", streamed)


def timed_out() -> dict[str, object]:
    start = time.monotonic()
    try:
        sb.commands.run("sleep 30; echo overslept", timeout=1)
    except Exception as exc:  # noqa: BLE001 - the exception is the result
        took = time.monotonic() - start
        # The client's deadline and the server's kill race by a hair, and a loaded host takes
        # a while to write the kill's audit record: give it 10 s, still well short of the sleep.
        for _ in range(100):
            left = [p.args for p in sb.commands.list() if "sleep 30" in " ".join(p.args)]
            if not left:
                break
            time.sleep(0.1)
        return {"error": type(exc).__name__, "seconds": took, "left": left,
                "bases": [c.__name__ for c in type(exc).__mro__[1:]]}
    return {"error": None, "seconds": time.monotonic() - start, "left": []}


step("timeout", timed_out)


def background() -> dict[str, object]:
    out: dict[str, object] = {}
    handle = sb.commands.run("cat", background=True, stdin=True, timeout=0)
    out["pid"] = handle.pid
    listed = sb.commands.list()
    out["listed"] = [{"pid": p.pid, "cmd": p.cmd, "args": p.args} for p in listed]
    sb.commands.send_stdin(handle.pid, "first line\n")
    time.sleep(0.3)
    handle.disconnect()
    sb.commands.send_stdin(handle.pid, "after reconnect\n")
    again = sb.commands.connect(handle.pid)
    sb.commands.send_stdin(handle.pid, "seen by the new handle\n")
    time.sleep(0.5)
    out["kill"] = sb.commands.kill(handle.pid)
    try:
        result = again.wait()
        out["wait"] = {"exit_code": result.exit_code, "stdout": result.stdout}
    except Exception as exc:  # noqa: BLE001 - a killed wait raises CommandExitException
        out["wait"] = {"error": type(exc).__name__, "exit_code": getattr(exc, "exit_code", None),
                       "stdout": getattr(exc, "stdout", None)}
    out["after_kill"] = [p.pid for p in sb.commands.list()]
    out["kill_again"] = sb.commands.kill(handle.pid)
    return out


step("background", background)


def stdin_stream_and_close() -> dict[str, object]:
    """StreamInput (a client stream) then CloseStdin: cat sees EOF and ends by itself."""
    if not hasattr(sb.commands, "stream_input"):
        return {"unsupported": True}
    handle = sb.commands.run("cat; echo cat-ended", background=True, stdin=True, timeout=30)
    sb.commands.stream_input(handle.pid, iter(["streamed ", b"in\n"]))
    sb.commands.close_stdin(handle.pid)
    result = handle.wait()
    return {"stdout": result.stdout, "exit_code": result.exit_code}


step("stdin_stream_close", stdin_stream_and_close)
step("kill_unknown", lambda: sb.commands.kill(4_000_000_000))
step("bash_login", lambda: run("shopt -q login_shell && echo login; echo $0"))
step("kill_sandbox", lambda: sb.kill())
done()
