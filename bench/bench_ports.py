"""Exposed ports: a server in a sandbox reached through ``corral serve``'s proxy vs directly.

Run as root::

    .venv/bin/python bench/bench_ports.py [--requests N] [--downloads N] [--websockets N]
                                          [--out FILE]

``corral serve`` runs as users run it, ``.venv/bin/corral serve --port P`` in a subprocess on
127.0.0.1 with its own data directory and uid range (anonymous, as on loopback with no keys).
One ``large`` sandbox (its pids limit allows a thread per connection) runs the stdlib app of the
port tests (``tests/integration/portapp.py``) on port 8000, exposed through the API. The same
client code (raw sockets, one new connection per request, ``TCP_NODELAY``) reaches it two ways:

* ``proxy``: ``127.0.0.1:P/ports/<sandbox>/8000/...`` with the port's token;
* ``direct``: ``127.0.0.1:8000`` inside the sandbox's network namespace, through a socket made
  in that namespace (the namespace pinned under /run/netns) and connected from the host.

Three parts:

1. ``latency``: N small GETs (``/headers``) each way, interleaved in shuffled rounds, and the
   server's ``floor`` (a request it refuses itself, before any work).
2. ``download``: 100 MB downloads (``/big``) each way, interleaved, read and discarded; the CPU
   time of the server process, of the client and of the host during each.
3. ``websockets``: N WebSockets (``/ws`` echo) through the proxy open at once, each exchanging
   messages; errors, time to open, round trips, and the server process's RSS before, at peak
   and after; the same through direct sockets as the reference.

Prints one JSON document (progress on stderr). Everything it made is removed at the end (server,
sandbox, cgroups, network namespaces, mounts, data directory) and checked for leftovers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import emit_report, log, machine_info, percentile, teardown  # noqa: E402
from bench_service import Server, rss_bytes  # noqa: E402
from websockets.asyncio.client import ClientConnection, connect  # noqa: E402

from corral import Sandbox  # noqa: E402
from corral._backends._linux.netns import Spawner  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

# Apart from the other benches (2_050_… to 2_090_…) and the tests (2_100_… and up).
UID_START = 2_095_000_000
APP_PORT = 8000
APP = ROOT / "tests" / "integration" / "portapp.py"
SMALL_PATH = "/headers"
DOWNLOAD_BYTES = 100_000_000
WS_MESSAGES = 20
WARMUP = 10
SANDBOX_LIFETIME_S = 3 * 3600.0
TOKEN_HEADER = "X-Corral-Port-Token"
# The app as the tests run it, with one change: the stdlib server's listen backlog is 5, so 200
# connections at once would wait for SYN retransmits (1 s, 3 s...) on the app's side, whichever
# way they come. A backlog of 1024 measures the proxy, not that.
LAUNCHER = (
    "import http.server, runpy, sys\n"
    "http.server.ThreadingHTTPServer.request_queue_size = 1024\n"
    "sys.argv = ['portapp.py', sys.argv[1], '0.0.0.0']\n"
    "runpy.run_path('portapp.py', run_name='__main__')\n"
)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def open_files_limit(pid: int) -> int | None:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    return None


def stats(seconds: list[float]) -> dict[str, float | int]:
    if not seconds:
        return {"n": 0}
    ms = sorted(s * 1000.0 for s in seconds)
    return {"n": len(ms), "p50_ms": round(percentile(ms, 0.50), 3),
            "p90_ms": round(percentile(ms, 0.90), 3), "p99_ms": round(percentile(ms, 0.99), 3),
            "mean_ms": round(sum(ms) / len(ms), 3), "min_ms": round(ms[0], 3),
            "max_ms": round(ms[-1], 3)}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("corral", "uvicorn", "h11", "websockets", "uvloop", "starlette", "httpx"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


# -- the two ways in, and one client for both ---------------------------------------------------


class Ways:
    """How a connection to the app is made and what a request says, for each way in: the proxy
    (a host socket to ``corral serve``) and direct (a socket made in the sandbox's network
    namespace, to 127.0.0.1:8000 there). The request carries the same headers both ways."""

    def __init__(self, server_port: int, sandbox_id: str, token: str, netns: Path) -> None:
        self.netns = netns
        self.token = token
        self._spawner = Spawner()  # its thread enters the namespace only to make the socket
        self.where = {"proxy": ("127.0.0.1", server_port), "direct": ("127.0.0.1", APP_PORT)}
        self.prefix = {"proxy": f"/ports/{sandbox_id}/{APP_PORT}", "direct": ""}

    def floor_request(self) -> bytes:
        """A request ``corral serve`` answers itself, before any work or thread: a port URL
        with a Host that is not a name of the service (421 from the routing). The floor of any
        answer from the server, for reading the proxy's share of its latency."""
        return (f"GET {self.prefix['proxy']}{SMALL_PATH} HTTP/1.1\r\nHost: floor.invalid\r\n"
                f"{TOKEN_HEADER}: {self.token}\r\nConnection: close\r\n\r\n").encode()

    def new_socket(self, way: str) -> socket.socket:
        """A fresh, unconnected TCP socket in the right namespace (not timed)."""
        if way == "direct":
            sock = self._spawner.run(self.netns,
                                     lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as curl and urllib3 do
        return sock

    def request(self, way: str, path: str) -> bytes:
        host, port = self.where[way]
        return (f"GET {self.prefix[way]}{path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"{TOKEN_HEADER}: {self.token}\r\nConnection: close\r\n\r\n").encode()

    def ws_url(self, way: str) -> str:
        host, port = self.where[way]
        return f"ws://{host}:{port}{self.prefix[way]}/ws"


_BUFFER = bytearray(1 << 20)


def http_get(sock: socket.socket, address: tuple[str, int], request: bytes) -> tuple[int, int]:
    """Connect, send one GET, read the whole response (by its Content-Length, or to EOF), and
    discard the body: (status, body bytes). The same code for both ways."""
    view = memoryview(_BUFFER)
    sock.connect(address)
    sock.sendall(request)
    head = b""
    while b"\r\n\r\n" not in head:
        n = sock.recv_into(view)
        if not n:
            raise ConnectionError(f"closed before the response head ({head[:80]!r})")
        head += view[:n]
    head, _, rest = head.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = None
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    got = len(rest)
    while length is None or got < length:
        n = sock.recv_into(view)
        if not n:
            if length is None:
                break
            raise ConnectionError(f"closed after {got} of {length} body bytes")
        got += n
    return status, got


def timed_get(ways: Ways, way: str, path: str) -> tuple[float, int, int]:
    """(seconds from connect to the last byte, status, body bytes); the socket is made before
    and closed after the clock. ``way`` "floor": the server's own refusal (``floor_request``)."""
    sock = ways.new_socket("proxy" if way == "floor" else way)
    request = ways.floor_request() if way == "floor" else ways.request(way, path)
    try:
        sock.settimeout(60)
        start = time.perf_counter()
        status, size = http_get(sock, ways.where["proxy" if way == "floor" else way], request)
        elapsed = time.perf_counter() - start
    finally:
        sock.close()
    return elapsed, status, size


def wait_listening(ways: Ways) -> None:
    """The app starts in the background: the proxy answers 502 until it listens."""
    deadline = time.monotonic() + 30
    while True:
        try:
            _, status, _ = timed_get(ways, "proxy", SMALL_PATH)
        except OSError:
            status = 0
        if status == 200:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the app in the sandbox never answered (last status {status})")
        time.sleep(0.1)


# -- 1. latency ---------------------------------------------------------------------------------


def bench_latency(ways: Ways, requests: int, rng: random.Random) -> dict[str, Any]:
    samples: dict[str, list[float]] = {"proxy": [], "direct": [], "floor": []}
    errors: dict[str, list[str]] = {way: [] for way in samples}
    expected = {"proxy": 200, "direct": 200, "floor": 421}
    order = list(samples)
    for _ in range(WARMUP):
        for way in order:
            timed_get(ways, way, SMALL_PATH)
    for i in range(requests):
        rng.shuffle(order)
        for way in order:
            try:
                elapsed, status, _ = timed_get(ways, way, SMALL_PATH)
            except OSError as exc:
                errors[way].append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            if status != expected[way]:
                errors[way].append(f"{way}: HTTP {status}")
            else:
                samples[way].append(elapsed)
        if (i + 1) % max(1, requests // 4) == 0:
            log(f"  latency: {i + 1}/{requests}")
    results = {way: stats(values) for way, values in samples.items()}
    proxy, direct, floor = results["proxy"], results["direct"], results["floor"]
    both = bool(proxy["n"] and direct["n"])

    def added(q: str) -> float | None:
        return round(proxy[q] - direct[q], 3) if both else None

    return {
        "what": f"GET {SMALL_PATH} (a small JSON answer), a new TCP connection per request; "
                "timed from connect() to the last body byte (socket made before, closed after); "
                "rounds of one request each way in shuffled order. floor: a request corral "
                "serve refuses itself before any work (a port URL with a Host that is not the "
                "service's: 421), the cost of any answer from the server",
        "requests_per_way": requests,
        "warmup_per_way": WARMUP,
        "results": results,
        "proxy_added_p50_ms": added("p50_ms"),
        "proxy_added_p90_ms": added("p90_ms"),
        "proxy_added_p99_ms": added("p99_ms"),
        # What is neither the server's floor nor the app's own answer: admission, connecting
        # inside the sandbox, relaying (medians do not add up exactly; an estimate).
        "proxy_beyond_floor_and_direct_p50_ms": round(
            proxy["p50_ms"] - floor["p50_ms"] - direct["p50_ms"], 3)
        if both and floor["n"] else None,
        "errors": {way: len(e) for way, e in errors.items()},
        "error_examples": sorted({x for e in errors.values() for x in e})[:5],
        "target": {"proxy_adds_at_most_1ms_p50": both and proxy["p50_ms"] - direct["p50_ms"] <= 1},
    }


# -- 2. download throughput ---------------------------------------------------------------------


def bench_download(ways: Ways, server_pid: int, downloads: int,
                   rng: random.Random) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"proxy": [], "direct": []}
    server_cpu: dict[str, list[float]] = {"proxy": [], "direct": []}
    client_cpu: dict[str, list[float]] = {"proxy": [], "direct": []}
    host_busy: dict[str, list[float]] = {"proxy": [], "direct": []}
    errors: list[str] = []
    order = list(rates)
    path = f"/big?n={DOWNLOAD_BYTES}"
    for way in order:  # one warm-up each (page cache of the app, the server's first big body)
        timed_get(ways, way, path)
    for i in range(downloads):
        rng.shuffle(order)
        for way in order:
            cpu0, client0, host0 = cpu_seconds(server_pid), time.thread_time(), host_cpu()
            elapsed, status, size = timed_get(ways, way, path)
            cpu1, client1, host1 = cpu_seconds(server_pid), time.thread_time(), host_cpu()
            if status != 200 or size != DOWNLOAD_BYTES:
                errors.append(f"{way}: HTTP {status}, {size} bytes")
                continue
            rates[way].append(size / elapsed / 1e6)
            server_cpu[way].append(cpu1 - cpu0)
            client_cpu[way].append(client1 - client0)
            host_busy[way].append(100 * (host1[0] - host0[0]) / max(1, host1[1] - host0[1]))
        log(f"  download: {i + 1}/{downloads} (proxy {rates['proxy'][-1:]}, "
            f"direct {rates['direct'][-1:]} MB/s)")

    def median(values: list[float], digits: int) -> float | None:
        return round(percentile(sorted(values), 0.5), digits) if values else None

    def summary(way: str) -> dict[str, Any]:
        values = rates[way]
        return {"n": len(values), "runs_MBps": [round(v, 1) for v in values],
                "median_MBps": median(values, 1),
                "min_MBps": round(min(values), 1) if values else None,
                "max_MBps": round(max(values), 1) if values else None,
                # Where the CPU went: the corral serve process (in clock ticks, 10 ms), this
                # client's thread, and both host CPUs (near 100 %: the cores were the limit).
                "server_cpu_ms_per_download": median([c * 1000 for c in server_cpu[way]], 1),
                "client_cpu_ms_per_download": median([c * 1000 for c in client_cpu[way]], 1),
                "host_cpu_busy_percent": median(host_busy[way], 1)}

    results = {way: summary(way) for way in rates}
    ratio = None
    if rates["proxy"] and rates["direct"]:
        ratio = round(results["proxy"]["median_MBps"] / results["direct"]["median_MBps"], 3)
    return {
        "what": f"GET /big of {DOWNLOAD_BYTES} bytes (MB = 10^6 bytes), a new connection each, "
                "read into a 1 MiB buffer and discarded; timed from connect() to the last byte; "
                "rounds of one download each way in shuffled order, after a warm-up each",
        "downloads_per_way": downloads,
        "results": results,
        "proxy_over_direct": ratio,
        "errors": errors,
        "target": {"proxy_at_least_80_percent": ratio is not None and ratio >= 0.8},
    }


# -- 3. many WebSockets at once -----------------------------------------------------------------


class RssSampler:
    """VmRSS of a process every few milliseconds, on a thread, while a phase runs."""

    def __init__(self, pid: int, every_s: float = 0.01) -> None:
        self.pid, self.every_s = pid, every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            self._stop.wait(self.every_s)

    def __enter__(self) -> RssSampler:
        self.peak = rss_bytes(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes(self.pid))


async def _websockets(ways: Ways, way: str, count: int, messages: int) -> dict[str, Any]:
    """``count`` WebSockets opened at once; when all are open (or failed), each sends
    ``messages`` text messages one after another and checks each echo; all stay open until every
    one is done, then all close."""
    loop = asyncio.get_running_loop()
    options: dict[str, Any] = {"compression": None, "ping_interval": None, "open_timeout": 60,
                               "close_timeout": 10}
    if way == "proxy":
        options["additional_headers"] = {TOKEN_HEADER: ways.token}
    open_s: list[float] = []
    rtt_s: list[float] = []
    errors: list[str] = []
    settled = 0
    all_open, all_done = asyncio.Event(), asyncio.Event()
    finished = 0

    def settle() -> None:
        nonlocal settled
        settled += 1
        if settled == count:
            all_open.set()

    def done() -> None:
        nonlocal finished
        finished += 1
        if finished == count:
            all_done.set()

    async def open_one() -> ClientConnection:
        if way == "proxy":
            return await connect(ways.ws_url(way), **options)
        sock = await loop.run_in_executor(None, ways.new_socket, way)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ways.where[way])
        except BaseException:
            sock.close()
            raise
        return await connect(ways.ws_url(way), sock=sock, **options)

    async def one(i: int) -> None:
        ws: ClientConnection | None = None
        try:
            t0 = time.perf_counter()
            try:
                ws = await open_one()
            except Exception as exc:  # counted: the error count is the measure
                errors.append(f"open: {type(exc).__name__}: {exc}"[:200])
                return
            open_s.append(time.perf_counter() - t0)
        finally:
            settle()
        try:
            await all_open.wait()
            for m in range(messages):
                text = f"connection {i} message {m}"
                t0 = time.perf_counter()
                await ws.send(text)
                got = await asyncio.wait_for(ws.recv(), 30)
                rtt_s.append(time.perf_counter() - t0)
                if got != f"echo: {text}":
                    errors.append(f"wrong echo: {str(got)[:80]!r}")
        except Exception as exc:
            errors.append(f"exchange: {type(exc).__name__}: {exc}"[:200])
        finally:
            done()
            await all_done.wait()
            try:
                await ws.close()
                if ws.close_code not in (1000, None):
                    errors.append(f"close code {ws.close_code}")
            except Exception as exc:
                errors.append(f"close: {type(exc).__name__}: {exc}"[:200])

    started = time.perf_counter()
    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    # A connection that failed to open never reaches done(): count it done here.
    await all_open.wait()
    all_open_s = time.perf_counter() - started
    for _ in range(count - len(open_s)):
        done()
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - started
    return {
        "connections": count,
        "opened": len(open_s),
        "time_to_open_all_s": round(all_open_s, 3),
        "open": stats(open_s),
        "messages_per_connection": messages,
        "round_trips": len(rtt_s),
        "round_trip": stats(rtt_s),
        "wall_s": round(wall, 3),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:5],
    }


def bench_websockets(ways: Ways, server: Server, count: int, messages: int,
                     rng: random.Random) -> dict[str, Any]:
    """Two proxy runs (RSS measured around each: the second shows whether memory comes back)
    and one direct run as the reference, in a shuffled order."""
    order = ["proxy", "proxy", "direct"]
    rng.shuffle(order)
    runs: dict[str, list[dict[str, Any]]] = {"proxy": [], "direct": []}
    for way in order:
        time.sleep(1)  # let the previous part's connections and threads go
        before = rss_bytes(server.pid)
        with RssSampler(server.pid) as sampler:
            result = asyncio.run(_websockets(ways, way, count, messages))
        time.sleep(2)
        after = rss_bytes(server.pid)
        result["server_rss_mib"] = {"before": round(before / 2**20, 1),
                                    "peak": round(sampler.peak / 2**20, 1),
                                    "after_close": round(after / 2**20, 1)}
        if way == "proxy":
            result["server_rss_peak_growth_per_connection_mib"] = round(
                (sampler.peak - before) / 2**20 / count, 4)
            result["server_rss_kept_after_close_mib"] = round((after - before) / 2**20, 1)
        runs[way].append(result)
        log(f"  websockets {way}: {result['opened']}/{count} open in "
            f"{result['time_to_open_all_s']} s, {result['errors']} errors, round trip p50 "
            f"{result['round_trip'].get('p50_ms')} ms")
    proxy_errors = sum(r["errors"] + count - r["opened"] for r in runs["proxy"])
    growth = [r["server_rss_peak_growth_per_connection_mib"] for r in runs["proxy"]]
    # The first proxy run also pays one-time costs (the server's WebSocket code is imported and
    # its allocator grows); what the second keeps after closing is what connections leave.
    second = runs["proxy"][-1]
    kept_kib = (second["server_rss_mib"]["after_close"] - second["server_rss_mib"]["before"]
                ) * 1024 / count
    return {
        "what": f"{count} WebSockets to the app's /ws echo opened at once (asyncio, the "
                "websockets client, no compression, no pings); when all are open each sends "
                f"{messages} text messages one at a time and checks each echo; all close "
                "together once every one is done. Two proxy runs and one direct run (sockets "
                "made in the sandbox's namespace) in shuffled order; the server's VmRSS is "
                "sampled every 10 ms during each run, and 2 s after the close",
        "order": order,
        "runs": runs,
        "server_rss_kept_per_connection_kib_second_proxy_run": round(kept_kib, 1),
        "target": {
            "zero_errors_through_proxy": proxy_errors == 0,
            "server_rss_peak_growth_per_connection_mib_max": max(growth),
            # Bounded: a run of connections leaves less than 10 KiB each behind.
            "server_rss_bounded": kept_kib < 10,
        },
    }


# -- set-up -------------------------------------------------------------------------------------


def start_app(url: str) -> tuple[Sandbox, str]:
    sb = Sandbox.create(url=url, resources="large", timeout=SANDBOX_LIFETIME_S)
    sb.files.write("portapp.py", APP.read_bytes())
    sb.files.write("launch.py", LAUNCHER.encode())
    sb.processes.start(["python3", "launch.py", str(APP_PORT)])
    port = sb.ports.expose(APP_PORT)
    assert port.token is not None and port.url is not None, port
    return sb, port.token


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _run_parts(args: argparse.Namespace, server: Server, settings: Settings,
               report: dict[str, Any], rng: random.Random,
               cleanup: list[Callable[[], object]]) -> None:
    sb, token = start_app(server.url)
    cleanup.append(sb.kill)
    netns = settings.run_dir / f"corral-{settings.instance}-{sb.id}"
    _check(netns.exists(), f"the sandbox's network namespace is not at {netns}")
    ways = Ways(server.port, sb.id, token, netns)
    wait_listening(ways)
    report["sandbox"] = {"id": sb.id, "resources": "large", "netns": str(netns),
                         "app": "tests/integration/portapp.py (backlog 1024), port 8000"}
    report["server_rss_mib_at_start"] = round(rss_bytes(server.pid) / 2**20, 1)
    report["server_open_files_limit"] = open_files_limit(server.pid)
    log(f"latency: {args.requests} GETs each way, interleaved")
    report["latency"] = bench_latency(ways, args.requests, rng)
    log(f"download: {args.downloads} x {DOWNLOAD_BYTES / 1e6:.0f} MB each way, interleaved")
    report["download"] = bench_download(ways, server.pid, args.downloads, rng)
    if args.websockets:
        log(f"websockets: {args.websockets} at once, {WS_MESSAGES} messages each")
        report["websockets"] = bench_websockets(ways, server, args.websockets, WS_MESSAGES, rng)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="small GETs each way")
    parser.add_argument("--downloads", type=int, default=5, help="100 MB downloads each way")
    parser.add_argument("--websockets", type=int, default=200,
                        help="WebSockets open at once (0: skip)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the order shuffle")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    if min(args.requests, args.downloads) < 1 or args.websockets < 0:
        parser.error("--requests and --downloads must be at least 1, --websockets at least 0")
    if os.geteuid() != 0:
        log("bench_ports: run as root (sandboxes need namespaces, cgroups and mounts)")
        return 2
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    load_start = os.getloadavg()[0]
    started = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-ports-"))
    tmp.chmod(0o711)  # sandboxes must traverse it to reach the data directory inside
    settings = Settings(home=tmp / "home", uid_start=UID_START, uid_count=100)
    server_log = Path(tempfile.mkstemp(prefix="corral-bench-ports-", suffix=".log")[1])
    server = Server(settings, server_log)
    report: dict[str, Any] = {
        "benchmark": "exposed ports: corral serve's proxy vs direct into the sandbox's netns"}
    cleanup: list[Callable[[], object]] = []
    leftovers: list[str] = []
    cgroups = "unknown"
    try:
        log(f"bench_ports: server {server.url}, home {settings.home}, seed {seed}")
        server.start()
        report["server"] = {"argv": server.argv, "pid": server.pid}
        _run_parts(args, server, settings, report, rng, cleanup)
    except Exception as exc:
        log(f"bench_ports: failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        for step in reversed(cleanup):
            try:
                step()
            except Exception as exc:  # teardown() below removes what is left
                log(f"bench_ports: clean-up step failed: {type(exc).__name__}: {exc}")
        server.stop()
        if server.proc is not None and server.proc.poll() is None:
            leftovers.append(f"server process {server.proc.pid} still running")
        # The server's sandboxes (if a part failed half-way) go with its home: open that home
        # here, now that the server is gone, and tear it down like any other.
        mgr = manager_mod.get_manager(settings)
        try:
            cgroups = mgr.backend.cgroups.describe()  # type: ignore[attr-defined]
        except Exception:
            cgroups = "unknown"
        leftovers += teardown(settings)
        shutil.rmtree(tmp, ignore_errors=True)
        if tmp.exists():
            leftovers.append(str(tmp))
        if leftovers:
            log("bench_ports: leftovers after clean-up:\n  " + "\n  ".join(leftovers))
    troubled = bool(leftovers) or bool(report.get("latency", {}).get("error_examples")) or bool(
        report.get("download", {}).get("errors")) or not report.get("websockets", {}).get(
        "target", {}).get("zero_errors_through_proxy", True)
    if troubled:
        report["server_log"] = str(server_log)  # tracebacks of 5xx answers are there
    else:
        server_log.unlink(missing_ok=True)
    report.update({
        "seed": seed,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "versions": versions(),
        "machine": machine_info("bwrap", cgroups, load_start),
        "cleanup": {"ok": not leftovers, "leftovers": leftovers},
    })
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
