"""What a request costs the service beyond the command itself: time, store reads, thread hops.

No root needed: the control plane runs over the in-memory backend (``corral.testing``), so
what is measured is the service's own path, not a tier's start of a process::

    .venv/bin/python bench/bench_request_path.py [--runs N] [--rounds R] [--out FILE]

Three series, interleaved in R rounds of N/R each, in a shuffled order, on one sandbox:

1. ``embedded``: ``Manager.run(["true"])`` called directly: the reference, the control plane's
   own cost (its audit records, one fdatasync, the metrics).
2. ``http``: ``POST /v1/sandboxes/{id}/commands`` through the native API's ASGI app
   (middleware, guards, request model, route, result) in-process, no socket.
3. ``e2b``: envd's ``process.Process/Start`` of ``true`` through the E2B app, as the E2B SDKs
   send it (a Connect-JSON envelope), to its end event.

For each: p50/p95 latency, and per request the store's method calls (reads and writes of the
SQLite store) and the thread-pool hops (``anyio.to_thread.run_sync``), counted over the whole
series. ``overhead_ms`` is a surface's p50 less the embedded p50. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import random
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent / "src"
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio.to_thread  # noqa: E402
import httpx  # noqa: E402
from bench_sandbox import log, summarize  # noqa: E402

from corral import _ids as ids  # noqa: E402
from corral._control import store as store_module  # noqa: E402
from corral._e2b.app import create_e2b_app  # noqa: E402
from corral._e2b.target import ENVD_PORT  # noqa: E402
from corral._server.app import create_app  # noqa: E402
from corral.testing import memory_manager  # noqa: E402

_CLIENT = ("127.0.0.1", 50000)


class Counters:
    """Store calls and thread hops while ``active``, by name."""

    def __init__(self) -> None:
        self.active = False
        self.store: collections.Counter[str] = collections.Counter()
        self.hops = 0

    def install(self) -> None:
        for name, fn in vars(store_module.Store).items():
            if callable(fn) and not name.startswith("_"):
                setattr(store_module.Store, name, self._counted(name, fn))
        original = anyio.to_thread.run_sync

        async def run_sync(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if self.active:
                self.hops += 1
            return await original(fn, *args, **kwargs)

        anyio.to_thread.run_sync = run_sync  # type: ignore[assignment]

    def _counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                self.store[name] += 1
            return fn(*args, **kwargs)

        return call

    def take(self) -> tuple[dict[str, int], int]:
        taken = dict(self.store), self.hops
        self.store.clear()
        self.hops = 0
        return taken


def _envelope(message: dict[str, Any]) -> bytes:
    payload = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(payload)) + payload


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    counters = Counters()
    counters.install()
    home = Path(tempfile.mkdtemp(prefix="corral-bench-path-"))
    manager = memory_manager(home / "home")
    try:
        sandbox = manager.create(timeout=3600).id
        native = create_app(manager)
        e2b = create_e2b_app(manager)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(native, client=_CLIENT),
                                 base_url="http://127.0.0.1")
        envd = httpx.AsyncClient(
            transport=httpx.ASGITransport(e2b, client=_CLIENT), base_url="http://127.0.0.1",
            headers={"E2b-Sandbox-Id": ids.to_e2b(sandbox),
                     "E2b-Sandbox-Port": str(ENVD_PORT),
                     "X-Access-Token": e2b.tokens.envd(sandbox),
                     "connect-protocol-version": "1",
                     "content-type": "application/connect+json"})
        start = _envelope({"process": {"cmd": "true"}})

        async def embedded() -> None:
            result = await anyio.to_thread.run_sync(manager.run, sandbox, ["true"])
            assert result.exit_code == 0

        async def over_http() -> None:
            response = await http.post(f"/v1/sandboxes/{sandbox}/commands",
                                       json={"cmd": ["true"]})
            assert response.status_code == 200 and response.json()["exit_code"] == 0, \
                response.text

        async def over_e2b() -> None:
            response = await envd.post("/process.Process/Start", content=start)
            assert response.status_code == 200 and b'"exitCode":0' in response.content, \
                response.content[:300]

        series: dict[str, Callable[[], Awaitable[None]]] = {
            "embedded": embedded, "http": over_http, "e2b": over_e2b}
        for fn in series.values():  # warm: imports, the first kernel of each path
            for _ in range(5):
                await fn()
        times: dict[str, list[float]] = {name: [] for name in series}
        store: dict[str, collections.Counter[str]] = {n: collections.Counter() for n in series}
        hops = dict.fromkeys(series, 0)
        per_round = max(1, args.runs // args.rounds)
        rng = random.Random(args.seed)
        for round_no in range(args.rounds):
            order = list(series)
            rng.shuffle(order)
            for name in order:
                for _ in range(per_round):
                    counters.active = name != "embedded"  # the reference's hop is the bench's
                    began = time.perf_counter()
                    await series[name]()
                    times[name].append(time.perf_counter() - began)
                    counters.active = False
                    calls, hopped = counters.take()
                    store[name].update(calls)
                    hops[name] += hopped
            log(f"round {round_no + 1}/{args.rounds}")
        await http.aclose()
        await envd.aclose()
        e2b.e2b.close()
        report: dict[str, Any] = {"runs_per_series": per_round * args.rounds, "series": {}}
        reference = summarize(times["embedded"])["p50_ms"]
        for name in series:
            n = len(times[name])
            summary: dict[str, Any] = summarize(times[name])
            if name != "embedded":
                summary["overhead_ms"] = round(summary["p50_ms"] - reference, 3)
                summary["store_calls_per_request"] = round(sum(store[name].values()) / n, 2)
                summary["store_calls"] = {k: round(v / n, 2)
                                          for k, v in sorted(store[name].items())}
                summary["thread_hops_per_request"] = round(hops[name] / n, 2)
            report["series"][name] = summary
        return report
    finally:
        for record in manager.records():
            try:
                manager.destroy(record.id)
            except Exception as exc:  # reported, and the rest still goes
                log(f"destroy {record.id}: {exc}")
        manager.close()
        shutil.rmtree(home, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=600, help="requests per series")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--seed", type=int, default=None, help="seed of the order shuffle")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
