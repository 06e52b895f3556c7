"""Scenarios 4-5, PTY and directory watch, through the official Python SDK (latest set): the
sync watch (CreateWatcher + polling) and the async one (the WatchDir stream).

Usage: python pty_watch.py
"""

from __future__ import annotations

import asyncio
import threading
import time

from _steps import done, step
from e2b import AsyncSandbox, PtySize, Sandbox

sb = step("create", lambda: Sandbox.create(timeout=180))
step("id", lambda: sb.sandbox_id)


def read_until(it: object, seen: list[bytes], marker: bytes, start: int = 0) -> None:
    while marker not in b"".join(seen)[start:]:
        _, _, pty = next(it)  # type: ignore[call-overload]
        if pty is not None:
            seen.append(bytes(pty))


def pty_session() -> dict[str, object]:
    handle = sb.pty.create(PtySize(rows=24, cols=80), timeout=0)
    it = iter(handle)
    seen: list[bytes] = []
    # MA''RK: the terminal's echo of the line shows the quotes, so only the output matches.
    sb.pty.send_stdin(handle.pid, b"PS1='RE''ADY> '; echo hi-$((40+2)); stty size; echo MA''RK1\n")
    read_until(it, seen, b"MARK1\r\n")
    before = b"".join(seen)
    sb.pty.resize(handle.pid, PtySize(rows=30, cols=100))
    sb.pty.send_stdin(handle.pid, b"stty size; echo MA''RK2\n")
    read_until(it, seen, b"MARK2\r\n")
    after = b"".join(seen)[len(before):]
    read_until(it, seen, b"READY> ", start=b"".join(seen).rindex(b"MARK2\r\n"))
    # Ctrl-D: the shell ends. A terminal may turn it into a NUL byte that bash ignores when it
    # arrives as readline switches the line discipline (seen on a loaded host with bare bash
    # too): sent again, Ctrl-D only, while the shell has not ended.
    ended = threading.Event()

    def ctrl_d() -> None:
        for _ in range(3):
            try:
                sb.pty.send_stdin(handle.pid, b"\x04")
            except Exception:  # noqa: BLE001 - it ended between the check and the send
                return
            if ended.wait(3):
                return

    sender = threading.Thread(target=ctrl_d, daemon=True)
    sender.start()
    for _ in it:
        pass
    ended.set()
    sender.join()
    result = handle.wait()
    return {"pid": handle.pid, "before": before.decode(errors="replace"),
            "after": after.decode(errors="replace"), "exit_code": result.exit_code}


step("pty", pty_session)


def pty_kill() -> dict[str, object]:
    handle = sb.pty.create(PtySize(rows=24, cols=80), timeout=0)
    killed = sb.pty.kill(handle.pid)
    try:
        code = handle.wait().exit_code
    except Exception as exc:  # noqa: BLE001 - a killed shell ends with CommandExitException
        code = getattr(exc, "exit_code", type(exc).__name__)
    return {"kill": killed, "exit_code": code}


step("pty_kill", pty_kill)


def events_of(handle: object) -> list[list[str]]:
    return [[e.name, str(getattr(e.type, "value", e.type))]
            for e in handle.get_new_events()]  # type: ignore[attr-defined]


def sync_watch() -> dict[str, object]:
    sb.files.make_dir("/home/user/watched/sub")
    handle = sb.files.watch_dir("/home/user/watched")
    sb.files.write("/home/user/watched/a.txt", "one")
    sb.commands.run("echo two >> /home/user/watched/a.txt; rm /home/user/watched/a.txt")
    sb.files.write("/home/user/watched/sub/deep.txt", "not watched: not recursive")
    time.sleep(0.5)
    first = events_of(handle)
    second = events_of(handle)  # everything was drained by the first call
    handle.stop()
    rec = sb.files.watch_dir("/home/user/watched", recursive=True)
    sb.files.write("/home/user/watched/sub/deeper.txt", "seen: recursive")
    time.sleep(0.5)
    recursive = events_of(rec)
    rec.stop()
    return {"first": first, "second": second, "recursive": recursive}


step("watch_sync", sync_watch)
step("watch_missing", lambda: sb.files.watch_dir("/home/user/no-such-dir"))


async def async_watch() -> dict[str, object]:
    asb = await AsyncSandbox.connect(sb.sandbox_id)
    got: list[list[str]] = []
    await asb.files.make_dir("/home/user/awatched")
    handle = await asb.files.watch_dir(
        "/home/user/awatched",
        on_event=lambda e: got.append([e.name, str(getattr(e.type, "value", e.type))]),
        timeout=30)
    await asb.files.write("/home/user/awatched/x.txt", "x")
    await asb.commands.run("rm /home/user/awatched/x.txt")
    for _ in range(40):  # bounded wait for the stream to deliver
        if any(t == "remove" for _, t in got):
            break
        await asyncio.sleep(0.05)
    await handle.stop()
    count = len(got)
    await asb.files.write("/home/user/awatched/after-stop.txt", "y")
    await asyncio.sleep(0.3)
    return {"events": got, "after_stop": got[count:]}


step("watch_async", lambda: asyncio.run(async_watch()))
step("kill_sandbox", lambda: sb.kill())
done()
