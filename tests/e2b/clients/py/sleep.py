"""A sandbox paused at its timeout and woken (issue 40), through the official Python SDK:
``lifecycle={"on_timeout": "pause"}`` then ``Sandbox.connect`` resumes it with its files and
processes; with ``auto_resume`` the next call wakes it by itself; hibernated while paused (by
the operator, over Corral's own API: ``CORRAL_URL`` and ``CORRAL_KEY``), ``connect`` wakes it
with its files.

Usage: python sleep.py
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

from _steps import done, step
from e2b import Sandbox

TIMEOUT_S = 3


def paused(sandbox_id: str) -> str:
    """Its state once its timeout has passed (get_info: the server pauses it then at the
    latest; its reaper may have already)."""
    deadline = time.monotonic() + 30
    state = "?"
    while time.monotonic() < deadline:
        state = str(Sandbox.get_info(sandbox_id).state.value)
        if state == "paused":
            break
        time.sleep(0.5)
    return state


# Paused at the timeout, resumed by connect.
sb = step("create", lambda: Sandbox.create(timeout=TIMEOUT_S,
                                           lifecycle={"on_timeout": "pause"}), seconds=90)
sid = sb.sandbox_id if sb else "sbx-missing"
step("id", lambda: sid)
step("write", lambda: sb.files.write("/home/user/kept.txt", "kept across the pause") and None)
# A background process counting into a file: it must still be counting after the resume.
step("count", lambda: sb.commands.run(
    "i=0; while :; do i=$((i+1)); echo $i > /home/user/count; sleep 0.2; done",
    background=True).pid)
step("info_lifecycle", lambda: dict(Sandbox.get_info(sid).lifecycle))
step("paused", lambda: paused(sid))
step("refused_while_paused", lambda: sb.commands.run("true", timeout=10).exit_code)
woken = step("connect", lambda: Sandbox.connect(sid, timeout=60), seconds=60)
step("state_after_connect", lambda: str(Sandbox.get_info(sid).state.value))
step("kept", lambda: woken.files.read("/home/user/kept.txt"))


def still_counting() -> list[int]:
    first = int(woken.files.read("/home/user/count").strip() or 0)
    time.sleep(1.0)
    return [first, int(woken.files.read("/home/user/count").strip() or 0)]


step("counting", still_counting)
step("processes", lambda: len(woken.commands.list()))
step("kill", lambda: woken.kill())

# Paused at the timeout, woken by the next call on its own.
auto = step("create_auto", lambda: Sandbox.create(
    timeout=TIMEOUT_S, lifecycle={"on_timeout": "pause", "auto_resume": True}), seconds=90)
aid = auto.sandbox_id if auto else "sbx-missing"
step("auto_write", lambda: auto.files.write("/home/user/a.txt", "auto") and None)
step("auto_paused", lambda: paused(aid))
step("auto_run", lambda: auto.commands.run("cat /home/user/a.txt", timeout=30).stdout)
step("auto_state", lambda: str(Sandbox.get_info(aid).state.value))
step("auto_kill", lambda: auto.kill())


def hibernate(e2b_id: str) -> str:
    """Corral's own call (no E2B equivalent): hibernate, as the same tenant, by its id."""
    corral_id = e2b_id.replace("-", "_", 1)
    request = urllib.request.Request(
        f"{os.environ['CORRAL_URL']}/v1/sandboxes/{corral_id}/hibernate", method="POST",
        headers={"Authorization": f"Bearer {os.environ['CORRAL_KEY']}"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return str(json.load(answer)["state"])


# Paused at its timeout, then hibernated (nothing of it left in the kernel), woken by connect.
deep = step("create_deep", lambda: Sandbox.create(timeout=TIMEOUT_S,
                                                  lifecycle={"on_timeout": "pause"}), seconds=90)
did = deep.sandbox_id if deep else "sbx-missing"
step("deep_id", lambda: did)
step("deep_write", lambda: deep.files.write("/home/user/deep.txt", "kept while hibernated")
     and None)
step("deep_paused", lambda: paused(did))
step("deep_hibernate", lambda: hibernate(did))
step("deep_state", lambda: str(Sandbox.get_info(did).state.value))
deep_woken = step("deep_connect", lambda: Sandbox.connect(did, timeout=60), seconds=60)
step("deep_kept", lambda: deep_woken.files.read("/home/user/deep.txt"))
step("deep_run", lambda: deep_woken.commands.run("echo awake", timeout=30).stdout)
step("deep_kill", lambda: deep_woken.kill())
done()
