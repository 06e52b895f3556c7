"""Scenario 1, lifecycle, through the official Python SDK (any set from 2.7.0 on).

Usage: python lifecycle.py TAG    (TAG marks this run's sandboxes in their metadata)
"""

from __future__ import annotations

import datetime as dt
import sys

from _steps import done, step
from e2b import Sandbox, SandboxQuery

tag = sys.argv[1]
envs = {"GREETING": "hello from envs"}
sb = step("create", lambda: Sandbox.create(timeout=120, metadata={"suite": tag, "role": "main"},
                                           envs=envs))
sid = sb.sandbox_id if sb else "sbx-missing"
step("id", lambda: sid)
step("sandbox_envs", lambda: sb.commands.run("echo \"$GREETING\"").stdout)


def info_of(sandbox_id: str) -> dict[str, object]:
    info = Sandbox.get_info(sandbox_id)
    return {
        "types": {k: type(getattr(info, k)).__name__
                  for k in ("sandbox_id", "template_id", "metadata", "started_at", "end_at",
                            "cpu_count", "memory_mb", "envd_version")},
        "sandbox_id": info.sandbox_id,
        "metadata": info.metadata,
        "state": str(getattr(getattr(info, "state", None), "value", getattr(info, "state", ""))),
        "cpu_count": info.cpu_count,
        "memory_mb": info.memory_mb,
        "ttl_s": (info.end_at - dt.datetime.now(dt.UTC)).total_seconds(),
        "lifetime_s": (info.end_at - info.started_at).total_seconds(),
    }


step("get_info", lambda: info_of(sid))

other = step("create_second", lambda: Sandbox.create(timeout=120,
                                                     metadata={"suite": tag, "role": "other"}))
step("second_id", lambda: other.sandbox_id)


def pages(query: SandboxQuery, limit: int) -> list[list[str]]:
    paginator = Sandbox.list(query=query, limit=limit)
    out: list[list[str]] = []
    while paginator.has_next and len(out) < 6:  # bounded: a server that never ends the list
        out.append(sorted(s.sandbox_id for s in paginator.next_items()))
    return out


step("list_paged", lambda: pages(SandboxQuery(metadata={"suite": tag}), 1))
step("list_filtered", lambda: pages(SandboxQuery(metadata={"suite": tag, "role": "main"}), 10))
step("list_nothing", lambda: pages(SandboxQuery(metadata={"suite": tag + "-none"}), 10))


def set_timeout() -> float:
    sb.set_timeout(300)
    return float(info_of(sid)["ttl_s"])  # type: ignore[arg-type]


step("set_timeout", set_timeout)
step("connect_running", lambda: Sandbox.connect(sid).commands.run("echo connected").stdout)


def pause() -> object:
    pause_fn = getattr(sb, "pause", None) or sb.beta_pause  # 2.7.0 has only beta_pause
    return pause_fn()


step("pause", pause)
step("paused_state", lambda: info_of(sid)["state"])
step("connect_paused", lambda: Sandbox.connect(sid).commands.run("echo resumed").stdout)
step("resumed_state", lambda: info_of(sid)["state"])
step("kill", lambda: sb.kill())
step("kill_again", lambda: Sandbox.kill(sid))
step("killed_connect", lambda: Sandbox.connect(sid))
step("killed_get_info", lambda: Sandbox.get_info(sid))
step("killed_rpc", lambda: sb.commands.run("true"))
step("killed_is_running", lambda: sb.is_running())
step("bad_key_create", lambda: Sandbox.create(api_key="e2b_" + "0" * 48))
step("bad_key_list", lambda: Sandbox.list(api_key="e2b_" + "0" * 48).next_items())
step("kill_second", lambda: other.kill())
done()
