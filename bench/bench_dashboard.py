"""The web dashboard under load, in a real headless Chromium (Debian's, via Playwright).

Run as root::

    .venv/bin/python bench/bench_dashboard.py [--sandboxes 2000] [--events 50000] [--out FILE]

It starts the service on loopback over a fresh data directory, creates ``--sandboxes`` real
sandboxes and one sandbox whose audit trail holds ``--events`` events, then measures, each
several times with a fresh page:

* ``list_first_render``: from navigation to the first page of the sandbox list drawn (target
  1 s), beside ``list_page_fetch`` (the same page of data fetched by the page's own script,
  the floor) and ``list_all_fetch`` (``GET /v1/sandboxes``, every sandbox);
* ``timeline_first_render``: from navigation to the long trail's last 1,000 events drawn;
* ``timeline_live``: from an audit event committed (its append returned) to it appearing on
  the open timeline (target 200 ms);
* ``list_live``: from a create returned to its row appearing on the open list.

The browser reaches loopback only; every other request is aborted and counted (must be 0).
Prints one JSON document (progress on stderr); exit status 1 when anything is left behind.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import emit_report, log, summarize  # noqa: E402

from corral._control.manager import get_manager  # noqa: E402
from corral._serve.app import create_app  # noqa: E402
from corral._settings import Settings  # noqa: E402

ROUNDS = 5
LIVE_ROUNDS = 20
_CHROMIUM_ARGS = ["--no-sandbox", "--no-proxy-server",
                  "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.*"]


def _serve(app: Any) -> tuple[str, Any]:
    import socket

    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", type=int, default=2000)
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        log("bench_dashboard: run as root")
        return 2
    chromium = shutil.which("chromium")
    if chromium is None:
        log("bench_dashboard: needs Debian's chromium (scripts/bootstrap --test)")
        return 2
    from playwright.sync_api import sync_playwright

    home = Path(tempfile.mkdtemp(prefix="corral-bench-ui-"))
    home.chmod(0o711)
    manager = get_manager(Settings(home=home, uid_start=2_140_000_000,
                                   uid_count=args.sandboxes + 1000))
    report: dict[str, Any] = {"benchmark": "the web dashboard in headless Chromium",
                              "sandboxes": args.sandboxes, "events": args.events,
                              "started_at": time.strftime("%FT%T%z"),
                              "load_start": os.getloadavg()[0]}
    left: list[str] = []
    blocked: list[str] = []
    server = None
    try:
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: manager.create(labels={"n": str(i)}, timeout=3600),
                          range(args.sandboxes)))
        log(f"{args.sandboxes} sandboxes in {time.perf_counter() - started:.1f} s")
        big = manager.create(labels={"trail": "long"}, timeout=3600)
        started = time.perf_counter()
        for i in range(args.events):
            manager.auditor.event(big.id, "file.read", {"path": f"/workspace/f{i}",
                                                        "bytes": i})
        log(f"{args.events} audit events in {time.perf_counter() - started:.1f} s")
        url, server = _serve(create_app(manager))
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True,
                                         chromium_sandbox=False, args=_CHROMIUM_ARGS)
            # bypass_csp: the measuring scripts are evaluated strings, which the page's own
            # policy (no eval) would refuse; the page's code is the same either way.
            context = browser.new_context(service_workers="block", bypass_csp=True)
            context.set_default_timeout(60_000)

            def refuse(route: Any) -> None:
                blocked.append(route.request.url)
                route.abort("blockedbyclient")

            context.route(lambda u: not u.startswith(url), refuse)
            first, page_fetch, all_fetch = [], [], []
            for _ in range(ROUNDS):
                page = context.new_page()
                page.goto(f"{url}/ui")
                page.wait_for_function("document.querySelectorAll('tr[data-id]').length >= 50")
                first.append(page.evaluate("performance.now()") / 1000)
                page_fetch.append(page.evaluate("""async () => { const t = performance.now();
                    await (await fetch('/ui/api/sandboxes?limit=50',
                                       {headers: {'X-Corral-UI': '1'}})).json();
                    return performance.now() - t; }""") / 1000)
                all_fetch.append(page.evaluate("""async () => { const t = performance.now();
                    await (await fetch('/v1/sandboxes', {headers: {'X-Corral-UI': '1'}})).json();
                    return performance.now() - t; }""") / 1000)
                page.close()
            report["list_first_render"] = summarize(first)
            report["list_page_fetch"] = summarize(page_fetch)
            report["list_all_fetch"] = summarize(all_fetch)
            log(f"list first render p50 {report['list_first_render']['p50_ms']} ms")

            page = context.new_page()
            page.goto(f"{url}/ui")
            page.wait_for_function("document.querySelectorAll('tr[data-id]').length >= 50")
            page.wait_for_selector(".live")
            list_live = []
            for i in range(ROUNDS):
                page.evaluate("""() => { const seen = window.__seen = {};
                    new MutationObserver(() => {
                      for (const row of document.querySelectorAll('tr[data-id]'))
                        if (!(row.dataset.id in seen)) seen[row.dataset.id] = Date.now();
                    }).observe(document.querySelector('tbody'),
                               {childList: true, subtree: true}); }""")
                made = manager.create(labels={"live": str(i)}, timeout=600)
                committed = time.time()
                page.wait_for_function(f"window.__seen['{made.id}'] !== undefined")
                list_live.append(page.evaluate(f"window.__seen['{made.id}']") / 1000 - committed)
                manager.destroy(made.id)
            page.close()
            report["list_live"] = summarize(list_live)

            timeline = []
            for _ in range(ROUNDS):
                page = context.new_page()
                page.goto(f"{url}/ui#/sandboxes/{big.id}")
                page.wait_for_function("document.querySelectorAll('li[data-type]').length >= 1000")
                timeline.append(page.evaluate("performance.now()") / 1000)
                page.close()
            report["timeline_first_render"] = summarize(timeline)
            log(f"timeline first render p50 {report['timeline_first_render']['p50_ms']} ms")

            page = context.new_page()
            page.goto(f"{url}/ui#/sandboxes/{big.id}")
            page.wait_for_function("document.querySelectorAll('li[data-type]').length >= 1000")
            page.evaluate("""() => { window.__seen = {}; new MutationObserver((changes) => {
                for (const change of changes) for (const node of change.addedNodes) {
                    const text = node.textContent || ''; const m = text.match(/live-(\\d+)/);
                    if (m && !(m[1] in window.__seen)) window.__seen[m[1]] = Date.now(); }
                }).observe(document.querySelector('ol.timeline'), {childList: true}); }""")
            live = []
            for i in range(LIVE_ROUNDS):
                manager.auditor.event(big.id, "file.read", {"path": f"/workspace/live-{i}"})
                committed = time.time()
                page.wait_for_function(f"window.__seen['{i}'] !== undefined")
                live.append(page.evaluate(f"window.__seen['{i}']") / 1000 - committed)
                time.sleep(0.1)
            page.close()
            report["timeline_live"] = summarize(live)
            log(f"timeline live p50 {report['timeline_live']['p50_ms']} ms")
            browser.close()
        report["blocked_requests"] = len(blocked)
        report["targets"] = {
            "list_first_render_at_most_1s": report["list_first_render"]["p50_ms"] <= 1000,
            "timeline_first_render_at_most_1s":
                report["timeline_first_render"]["p50_ms"] <= 1000,
            "timeline_live_at_most_200ms": report["timeline_live"]["p95_ms"] <= 200,
            "nothing_left_the_machine": not blocked}
    finally:
        if server is not None:
            server.should_exit = True
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for info in manager.list():
                pool.submit(manager.destroy, info.id)
        log(f"destroyed in {time.perf_counter() - started:.1f} s")
        left = [info.id for info in manager.list()]
        manager.close()
        shutil.rmtree(home, ignore_errors=True)
    report["load_end"] = os.getloadavg()[0]
    report["cleanup"] = {"ok": not left, "leftovers": left}
    return emit_report(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
