"""Audit floods: what a sandbox makes the host write about it is bounded, and the bound is
recorded, never a silently cut trail nor a full disk.

Each case floods for a few seconds, and on a host too loaded to make a flood of that in time
until it has made one (bounded by a longest duration and a request cap, loopback only),
ends its sandbox (which writes the counts still pending) and reads the trail back: held when
the flood's events stay within the documented bound (docs/audit.md: per interval and key, the
first ``burst`` in full and one summary) and their counts add up exactly to what the client
saw. The bound is computed from the interval and burst of the drill's own settings
(``CORRAL_AUDIT_AGGREGATE_*``; a service drilled over HTTP must run with the same).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable
from typing import Any

import httpx

from ..._settings import Settings
from ..case import Case
from ..context import BAIT_ALLOWED, DrillContext
from ..model import Evidence, Outcome

# The documented size of a line (docs/audit.md): a repeated event written in full, a summary,
# each data bound plus the envelope. Constants here, not imported: the drill is the
# attacker's view, and it must run against a build that has no such bound.
FULL_LINE = 3 * 1024 + 256
SUMMARY_LINE = 8 * 1024 + 256
FLOOD_S = 5.0
CAP = 200_000
# A flood is at least this many requests, however slow a loaded host makes each one: it goes
# on past FLOOD_S until it has them (up to FLOOD_MAX_S, within a small tier's command limit).
FLOOD_LEAST = 100
FLOOD_MAX_S = 40.0

# Refused requests through the gateway for a few seconds, one connection each; prints how many
# were refused by rule no-match, what else came back, and when the first and last were sent.
FLOOD = r"""
import os, socket, sys, time
duration, cap, least, most = (float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                              float(sys.argv[4]))
proxy = os.environ["HTTP_PROXY"].rstrip("/").rsplit("//", 1)[1]
host, port = proxy.rsplit(":", 1)
refused = other = 0
first = time.time()
began = time.monotonic()
def going():
    sent, spent = refused + other, time.monotonic() - began
    return sent < cap and spent < most and (spent < duration or sent < least)
while going():
    target = f"flood{(refused + other) % 50}.refused.drill.invalid"
    try:
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(f"GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        s.close()
    except OSError:
        data = b""
    if data.startswith(b"HTTP/1.1 403") and b"rule=no-match" in data:
        refused += 1
    else:
        other += 1
print(refused, other, first, time.time())
"""


def _limits() -> tuple[float, int]:
    """(interval, burst) as the drill's settings say (the defaults on a build without)."""
    settings = Settings()
    return (float(getattr(settings, "audit_aggregate_window_s", 30.0)),
            int(getattr(settings, "audit_aggregate_burst", 5)))


def _bound(seconds: float) -> tuple[int, int, int]:
    """(intervals, most events, most bytes) a flood of ``seconds`` may leave under one key."""
    interval, burst = _limits()
    # (+1 s: the service records an event a moment after the client has its answer)
    intervals = int((seconds + 1) // interval) + 1
    return intervals, intervals * (burst + 1), intervals * (burst * FULL_LINE + SUMMARY_LINE)


def _verdict(what: str, seen: int, full: Iterable[dict[str, Any]],
             summaries: Iterable[dict[str, Any]], seconds: float,
             evidence: list[Evidence]) -> Outcome:
    """Held when the flood's events are within the bound and count exactly what was seen."""
    full, summaries = list(full), list(summaries)
    written = len(full) + len(summaries)
    size = sum(len(json.dumps(e, separators=(",", ":"))) + 1 for e in [*full, *summaries])
    counted = len(full) + sum(int(e["data"].get("count", 0)) for e in summaries)
    intervals, most, most_bytes = _bound(seconds)
    evidence.append(Evidence("observation", f"{seen} {what} in {seconds:.1f} s; the trail "
                             f"holds {len(full)} in full and {len(summaries)} summaries "
                             f"({size} bytes) counting {counted}; bound for {intervals} "
                             f"interval(s): {most} events, {most_bytes} bytes"))
    if written > most or size > most_bytes:
        return Outcome("breached", f"{seen} {what} in {seconds:.1f} s wrote {written} events "
                       f"({size} bytes) to the trail, over the bound of {most} events "
                       f"({most_bytes} bytes)", tuple(evidence))
    if counted != seen:
        return Outcome("breached", f"the trail counts {counted} {what}, the client saw "
                       f"{seen}: counts were lost or made up", tuple(evidence))
    return Outcome("held", f"{seen} {what} in {seconds:.1f} s: {len(full)} in full and "
                   f"{len(summaries)} summaries ({size} bytes), counting all of them",
                   tuple(evidence))


def _refusal_flood(ctx: DrillContext) -> Outcome:
    sb = ctx.fresh(network={"allow": [BAIT_ALLOWED]})
    try:
        result = ctx.run(["python3", "-c", FLOOD, str(FLOOD_S), str(CAP), str(FLOOD_LEAST),
                          str(FLOOD_MAX_S)], sandbox=sb, timeout=FLOOD_MAX_S + 15)
    finally:
        ctx.discard(sb)  # the end of the trail: pending counts are written before it
    evidence = [e for e in ctx.evidence(result, sb) if e.kind != "gateway"][:1]
    words = result.stdout.split()
    if result.exit_code != 0 or len(words) != 4:
        return Outcome("error", f"the flood did not run: exit {result.exit_code} "
                       f"{(result.stdout + result.stderr)[:200]}", tuple(evidence))
    refused, other = int(words[0]), int(words[1])
    seconds = float(words[3]) - float(words[2])
    if refused < FLOOD_LEAST or other:
        return Outcome("error", f"not a flood of refusals: {refused} refused, {other} other "
                       "answers", tuple(evidence))
    events = [e.model_dump() for e in sb.events(command=result.command_id)]
    full = [e for e in events if e["type"] == "egress.decision"
            and e["data"].get("rule") == "no-match"]
    summaries = [e for e in events if e["type"] == "egress.summary"
                 and (e["data"].get("key") or {}).get("rule") == "no-match"]
    for event in summaries[:2]:
        evidence.append(Evidence("audit", f"summary: {event['data'].get('count')} refusals, "
                                 f"rule {event['data']['key'].get('rule')}", sandbox=sb.id,
                                 seq=event["seq"], event=event["type"]))
    return _verdict("refusals", refused, full, summaries, seconds, evidence)


def _public_port_flood(ctx: DrillContext) -> Outcome:
    """Unauthenticated requests to a public port, as anyone on the internet may send them."""
    assert ctx.service is not None
    headers = {"Authorization": f"Bearer {ctx.service.api_key}"} if ctx.service.api_key else {}
    evidence: list[Evidence] = []
    with httpx.Client(base_url=ctx.service.url, headers=headers, timeout=30) as api, \
            httpx.Client(timeout=30) as anyone:
        body: dict[str, Any] = {"labels": {"corral-drill": "scratch"}}
        isolation = ctx.target.describe().get("isolation")
        if isolation not in (None, "default"):
            body["isolation"] = isolation  # the tier the drill runs on
        made = api.post("/v1/sandboxes", json=body)
        if made.status_code != 201:
            return Outcome("error", f"could not create a sandbox: {made.status_code} "
                           f"{made.text[:200]}")
        sandbox_id = str(made.json()["id"])
        try:
            started = api.post(f"/v1/sandboxes/{sandbox_id}/processes", json={
                "cmd": ["python3", "-m", "http.server", "8000", "--bind", "0.0.0.0"],
                "cwd": "/workspace"})
            if started.status_code != 201:
                return Outcome("error", f"could not start a server: {started.text[:200]}")
            # Private while probed with its token (those are not the public's), then public.
            port = api.post(f"/v1/sandboxes/{sandbox_id}/ports/8000", json={"public": False})
            url = port.json().get("url") if port.status_code == 201 else None
            if not url:
                return Outcome("skipped", f"the service gave no URL for an exposed port "
                               f"({port.status_code} {port.text[:150]})")
            token = {"X-Corral-Port-Token": str(port.json()["token"])}
            deadline = time.monotonic() + 30
            while anyone.get(url, headers=token).status_code != 200:
                if time.monotonic() > deadline:
                    return Outcome("error", "the server in the sandbox never answered")
                time.sleep(0.1)
            api.post(f"/v1/sandboxes/{sandbox_id}/ports/8000", json={"public": True})
            answered = 0
            first = time.time()
            began = time.monotonic()
            while answered < CAP and (spent := time.monotonic() - began) < FLOOD_MAX_S \
                    and (spent < FLOOD_S or answered < FLOOD_LEAST):
                if anyone.get(url, params={"n": answered}).status_code not in (200, 404):
                    break
                answered += 1
            seconds = time.time() - first
        finally:
            with contextlib.suppress(httpx.HTTPError):
                api.delete(f"/v1/sandboxes/{sandbox_id}")  # pending counts are written first
        trail = api.get(f"/v1/sandboxes/{sandbox_id}/audit",
                        params=[("type", "port.connection"), ("type", "port.summary")])
    if trail.status_code != 200:
        return Outcome("error", f"could not read the trail: {trail.status_code}")
    events = [json.loads(line) for line in trail.text.splitlines() if line.strip()]
    full = [e for e in events if e["type"] == "port.connection"
            and e["data"].get("who") == "public"]
    summaries = [e for e in events if e["type"] == "port.summary"]
    if answered < FLOOD_LEAST:
        return Outcome("error", f"not a flood: {answered} answers in {seconds:.1f} s")
    return _verdict("public connections", answered, full, summaries, seconds, evidence)


CASES = [
    Case("audit.refusal-flood", "audit", f"send refused requests through the egress gateway "
         f"as fast as one process can for {FLOOD_S:.0f} s (at least {FLOOD_LEAST})",
         "the trail grows by at most the documented bound (per interval: a few refusals in "
         "full and one summary) and its counts add up to the refusals the client saw",
         _refusal_flood, frozenset({"python3"})),
    Case("audit.public-port-flood", "audit", f"hit a public exposed port without credentials "
         f"as fast as one client can for {FLOOD_S:.0f} s (at least {FLOOD_LEAST})",
         "the trail grows by at most the documented bound and its counts add up to the "
         "connections made", _public_port_flood, frozenset({"python3", "service"})),
]
