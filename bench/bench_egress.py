"""Latency and throughput through the egress gateway vs direct, to the same loopback upstream.

Run as root::

    .venv/bin/python bench/bench_egress.py [--requests N] [--out FILE]

An upstream HTTP and HTTPS server runs on 127.0.0.1 in its own process. The same client script
(Debian's python3, one new connection per request, as a proxied client does) runs twice per
round: directly on the host against 127.0.0.1, and inside a sandbox through the gateway, which
the operator allows to reach 127.0.0.1 for this bench (``CORRAL_EGRESS_ALLOW_CIDRS``). Three
paths: plain HTTP (forwarded), HTTPS tunnelled (CONNECT, opaque), HTTPS intercepted (CONNECT to a
host a secret is bound to: TLS terminated with the deployment CA, placeholder swapped, TLS again
to the upstream). A fourth, gateway-only path: refused requests (a host the policy does not
allow), their latency and the audit trail's growth per refusal (refusals are aggregated:
docs/audit.md). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import emit_report, log, machine_info, percentile, teardown  # noqa: E402
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from corral import Sandbox  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

UID_START = 2_070_000_000
BIG_BYTES = 20_000_000
SYSTEM_PYTHON = "/usr/bin/python3"

UPSTREAM = textwrap.dedent("""
    import ssl, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    chain = sys.argv[1]
    BIG = b"x" * %d
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # else delayed ACKs add 40 ms to every TLS response
        def log_message(self, *a): pass
        def do_GET(self):
            body = BIG if self.path == "/big" else b"ok\\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    plain = ThreadingHTTPServer(("127.0.0.1", 0), H)
    tls = ThreadingHTTPServer(("127.0.0.1", 0), H)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(chain)
    tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
    for s in (plain, tls):
        s.daemon_threads = True
        threading.Thread(target=s.serve_forever, daemon=True).start()
    print(plain.server_address[1], tls.server_address[1], flush=True)
    sys.stdin.read()
""") % BIG_BYTES

CLIENT = textwrap.dedent("""
    import http.client, json, os, ssl, sys, time
    mode, host, port, cafile, n, big = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], \\
        int(sys.argv[5]), int(sys.argv[6])
    proxy = os.environ.get("HTTP_PROXY")
    import socket
    _create = socket.create_connection
    def _nodelay(*a, **k):
        # As curl and urllib3 do by default; without it Nagle and delayed ACKs add 40 ms.
        s = _create(*a, **k)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s
    socket.create_connection = _nodelay
    # One context per client, as an HTTP library keeps one: loading a system-sized CA bundle costs
    # ~20 ms, which is not a cost of the path being measured.
    CTX = ssl.create_default_context(cafile=cafile) if mode != "http" else None
    def conn():
        ctx = CTX
        if proxy:
            p = proxy.rsplit(":", 1)
            if mode == "http":
                return http.client.HTTPConnection("127.0.0.1", int(p[1]), timeout=30), \\
                    f"http://{host}:{port}"
            c = http.client.HTTPSConnection("127.0.0.1", int(p[1]), timeout=30, context=ctx)
            c.set_tunnel(host, port)
            return c, ""
        if mode == "http":
            return http.client.HTTPConnection("127.0.0.1", port, timeout=30), ""
        c = http.client.HTTPSConnection("127.0.0.1", port, timeout=30, context=ctx)
        c._tunnel_host = None
        c.host = "127.0.0.1"
        ctx.check_hostname = True
        return c, ""
    def get(path):
        c, prefix = conn()
        if mode != "http" and not proxy:
            raw = socket.create_connection(("127.0.0.1", port), timeout=30)
            c.sock = CTX.wrap_socket(raw, server_hostname=host)
        token = os.environ.get("BENCH_TOKEN", "none")
        c.request("GET", prefix + path,
                  headers={"Host": f"{host}:{port}", "Authorization": "Bearer " + token})
        r = c.getresponse(); body = r.read(); c.close()
        assert r.status == 200, (r.status, body[:200])
        return len(body)
    latencies = []
    for _ in range(n):
        t = time.perf_counter(); get("/"); latencies.append(time.perf_counter() - t)
    rates = []
    for _ in range(big):
        t = time.perf_counter(); size = get("/big"); rates.append(size / (time.perf_counter() - t))
    print(json.dumps({"latencies": latencies, "rates": rates}))
""")


# Refused requests through the proxy, one connection each: their latencies.
REFUSER = textwrap.dedent("""
    import json, os, socket, sys, time
    n = int(sys.argv[1])
    proxy = os.environ["HTTP_PROXY"].rstrip("/").rsplit(":", 1)
    latencies = []
    for i in range(n):
        t = time.perf_counter()
        s = socket.create_connection(("127.0.0.1", int(proxy[1])), timeout=30)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"GET http://denied.test/ HTTP/1.1\\r\\nHost: denied.test\\r\\n\\r\\n")
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        s.close()
        assert data.startswith(b"HTTP/1.1 403"), data[:200]
        latencies.append(time.perf_counter() - t)
    print(json.dumps({"latencies": latencies}))
""")


def _bench_certs(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "corral bench CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(key, hashes.SHA256()))
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench.test")]))
            .issuer_name(ca_name).public_key(leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("bench.test"), x509.DNSName("secret.test")]), critical=False)
            .sign(key, hashes.SHA256()))
    ca_file, chain = directory / "ca.pem", directory / "chain.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    chain.write_bytes(leaf.public_bytes(serialization.Encoding.PEM) + leaf_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return ca_file, chain


def _stats(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)
    return {"n": len(ms), "p50_ms": round(percentile(ms, 0.5), 3),
            "p95_ms": round(percentile(ms, 0.95), 3), "p99_ms": round(percentile(ms, 0.99), 3),
            "mean_ms": round(statistics.fmean(ms), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per path and side")
    parser.add_argument("--downloads", type=int, default=4, help="20 MB downloads per path/side")
    parser.add_argument("--rounds", type=int, default=4, help="alternations of direct/gateway")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        log("bench_egress: run as root")
        return 2
    load_start = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-egress-"))
    tmp.chmod(0o711)  # sandboxes must traverse it to reach the data directory inside
    ca_file, chain = _bench_certs(tmp)
    server = subprocess.Popen([SYSTEM_PYTHON, "-c", UPSTREAM, str(chain)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    http_port, https_port = (int(p) for p in server.stdout.readline().split())
    settings = Settings(home=tmp / "home", uid_start=UID_START, uid_count=100,
                        egress_allow_cidrs="127.0.0.1/32",
                        egress_hosts={"bench.test": ["127.0.0.1"], "secret.test": ["127.0.0.1"]},
                        egress_upstream_ca=ca_file)
    client = tmp / "client.py"
    client.write_text(CLIENT)
    # Every HTTPS client verifies against a full system-sized bundle (loading it costs ~20 ms in
    # OpenSSL): the system bundle plus the bench CA, or (intercepted) the sandbox's bundle, which
    # is the system bundle plus the egress CA. A one-certificate file would flatter "direct".
    system_bundle = Path("/etc/ssl/certs/ca-certificates.crt").read_bytes()
    bundle = tmp / "bundle.pem"
    bundle.write_bytes(system_bundle.rstrip(b"\n") + b"\n" + ca_file.read_bytes())
    samples: dict[str, dict[str, list[float]]] = {}
    leftover: list[str] = []
    try:
        mgr = manager_mod.get_manager(settings)
        mgr.secrets.add("BENCH_TOKEN", "bench-secret-value", [f"secret.test:{https_port}"])
        sb = Sandbox.create(home=str(settings.home), resources="large", secrets=["BENCH_TOKEN"],
                            network={"allow": [f"bench.test:{http_port}",
                                               f"bench.test:{https_port}",
                                               f"secret.test:{https_port}"]})
        sb.files.write("client.py", CLIENT)
        sb.files.write("refuser.py", REFUSER)
        sb.files.write("ca.pem", bundle.read_bytes())
        trail = settings.home / "audit" / f"{sb.id}.jsonl"
        refused: list[float] = []
        refused_growth = 0
        paths = {
            "http": ("http", "bench.test", http_port, "/workspace/ca.pem"),
            "https_tunnel": ("https", "bench.test", https_port, "/workspace/ca.pem"),
            "https_intercepted": ("https", "secret.test", https_port,
                                  "/etc/ssl/certs/ca-certificates.crt"),
        }
        per_round = max(1, args.requests // args.rounds)
        downloads = max(1, args.downloads // args.rounds)
        for name in paths:
            samples[name] = {"direct": [], "gateway": [], "direct_rate": [], "gateway_rate": []}
        for round_no in range(args.rounds):
            for name, (mode, host, port, cafile) in paths.items():
                direct_ca = str(bundle)
                direct = subprocess.run(
                    [SYSTEM_PYTHON, str(client), mode, host, str(port), direct_ca,
                     str(per_round), str(downloads)],
                    capture_output=True, text=True, timeout=600,
                    env={"PATH": "/usr/bin:/bin"})
                assert direct.returncode == 0, direct.stderr
                via = sb.commands.run(
                    ["python3", "client.py", mode, host, str(port), cafile, str(per_round),
                     str(downloads)], timeout=600)
                assert via.exit_code == 0, via.stderr
                for side, out in (("direct", direct.stdout), ("gateway", via.stdout)):
                    data = json.loads(out)
                    samples[name][side] += data["latencies"]
                    samples[name][f"{side}_rate"] += data["rates"]
            before = trail.stat().st_size
            refusing = sb.commands.run(["python3", "refuser.py", str(per_round)], timeout=600)
            assert refusing.exit_code == 0, refusing.stderr
            refused += json.loads(refusing.stdout)["latencies"]
            # Less the command's own start, output and end (a short command's ~1 KB).
            own = sum(len(e.model_dump_json()) + 1 for e in sb.audit.events(
                command=refusing.command_id) if e.type.startswith("command."))
            refused_growth += trail.stat().st_size - before - own
            log(f"round {round_no + 1}/{args.rounds}")
        decisions = sb.audit.events(types=["egress.decision"])
        intercepted = sum(1 for e in decisions if e.data.get("mode") == "intercept"
                          and e.data.get("secrets_substituted") == ["BENCH_TOKEN"])
        cgroups = mgr.backend.cgroups.describe()  # type: ignore[attr-defined]
        sb.kill()
    finally:
        leftover = teardown(settings)
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(timeout=10)
        server.stdout.close()
        for f in tmp.glob("*"):
            if f.is_file():
                f.unlink()
        with_home = tmp / "home"
        if with_home.exists():
            import shutil

            shutil.rmtree(with_home, ignore_errors=True)
        os.rmdir(tmp)
    results: dict[str, Any] = {}
    for name, s in samples.items():
        direct, gateway = _stats(s["direct"]), _stats(s["gateway"])
        results[name] = {
            "direct": direct, "gateway": gateway,
            "added_p50_ms": round(gateway["p50_ms"] - direct["p50_ms"], 3),
            "p99_ratio": round(gateway["p99_ms"] / direct["p99_ms"], 3),
            "throughput_MBps": {
                "direct": round(statistics.fmean(s["direct_rate"]) / 1e6, 1),
                "gateway": round(statistics.fmean(s["gateway_rate"]) / 1e6, 1),
            },
        }
    if refused:
        results["http_refused"] = {
            "gateway": _stats(refused),
            "refusals_per_s": round(len(refused) / sum(refused), 1),
            "trail_bytes_per_refusal": round(refused_growth / len(refused), 1),
        }
    report = {
        "benchmark": "egress gateway vs direct, loopback upstream, one connection per request",
        "requests_per_path_and_side": args.requests, "results": results,
        "targets": {
            "tunnel_added_p50_le_2ms": results["https_tunnel"]["added_p50_ms"] <= 2.0,
            "all_p99_within_2x_direct": all(r["p99_ratio"] <= 2.0 for r in results.values()
                                            if "p99_ratio" in r),
        },
        "intercepted_requests_with_secret_swapped": intercepted,
        "machine": machine_info("bwrap", cgroups, load_start),
        "cleanup": {"ok": not leftover, "leftovers": leftover},
    }
    return emit_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
