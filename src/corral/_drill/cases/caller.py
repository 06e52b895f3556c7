"""Caller: the API as a hostile *caller* holding an ordinary tenant key sees it.

The model is Corral's caller too: it picks environment variables, allowlists, templates, tiers,
body sizes. These cases aim what a caller controls at Corral's privileged side and its edge:
loader and interpreter variables that only matter if a host process reads them (the payload
connects to the host-loopback canary, which no sandbox can reach, and writes a marker file by a
host path, which no sandbox can write), environment entries that cannot be real, oversized
bodies before authentication, gateway framing, ceilings, quotas through terminals, and the
browser as caller (rebinding ``Host``, cross-site ``Origin``).

Every case is bounded by construction: bodies claim 1 GiB but at most a few MiB are sent,
loops are capped, listeners are on loopback, and whatever a case creates it deletes.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets as _secrets
import select
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from ..._core.privileged import privileged_env
from ...errors import CommandError, CorralError
from ..case import Case
from ..context import BAIT_ALLOWED, DrillContext
from ..model import Evidence, Outcome

Run = Callable[[DrillContext], Outcome]
SERVICE = frozenset({"service"})
OWN = frozenset({"service", "service-sandbox"})  # a sandbox of the first tenant
OTHER = frozenset({"service", "service-sandbox", "other-tenant"})
_DIR = ".corral-drill"  # where payloads go in a workspace

# -- payloads --------------------------------------------------------------------------------

# Runs wherever it is loaded: writes a marker file and connects to the host-loopback canary.
# Inside a sandbox both land in the sandbox's own /tmp and its own lo (nothing listens there);
# only a process on the host's side can make either visible. ``la_version`` makes it a valid
# LD_AUDIT module too.
_PAYLOAD_C = r"""
#include <arpa/inet.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>

__attribute__((constructor)) static void corral_drill_marker(void) {
    char line[256];
    int n = snprintf(line, sizeof line, "corral-drill-caller %s uid=%d pid=%d\n", TAG,
                     (int)getuid(), (int)getpid());
    int fd = open(MARKER, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (fd >= 0) { (void)!write(fd, line, n); close(fd); }
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s >= 0) {
        struct sockaddr_in a = {0};
        a.sin_family = AF_INET;
        a.sin_port = htons(PORT);
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(s, (struct sockaddr *)&a, sizeof a) == 0) (void)!write(s, line, n);
        close(s);
    }
}

unsigned int la_version(unsigned int version) { return version; }
"""

_SHELL_PAYLOAD = """{{ printf 'corral-drill-caller {tag} shell uid=%s\\n' "$(id -u)" >> {marker}
exec 3<>/dev/tcp/127.0.0.1/{port} && printf 'corral-drill-caller {tag} shell\\n' >&3
exec 3>&-; }} 2>/dev/null
"""

_PYTHON_PAYLOAD = """import os, socket
try:
    with open({marker!r}, "a") as f:
        f.write("corral-drill-caller {tag} python uid=%d\\n" % os.getuid())
    with socket.create_connection(("127.0.0.1", {port}), timeout=1) as s:
        s.sendall(b"corral-drill-caller {tag} python\\n")
except OSError:
    pass
"""


class _Payload:
    """One case's payload files, built on the host, and the marker that proves a host run."""

    def __init__(self, ctx: DrillContext) -> None:
        self.tag = _secrets.token_hex(6)
        self.marker = Path(tempfile.gettempdir()) / f"corral-drill-caller-{self.tag}"
        self.port = ctx.canary.tcp_port
        self._build = Path(tempfile.mkdtemp(prefix="corral-drill-caller-build-"))

    def shared_object(self) -> bytes:
        gcc = shutil.which("gcc") or shutil.which("cc")
        if gcc is None:
            raise RuntimeError("the loader cases build their library with gcc on the host: "
                               "install gcc (apt-get install gcc)")
        source = self._build / "marker.c"
        source.write_text(_PAYLOAD_C)
        out = self._build / "marker.so"
        subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-o", str(out), str(source),
                        f'-DTAG="{self.tag}"', f'-DMARKER="{self.marker}"',
                        f"-DPORT={self.port}"], check=True, capture_output=True, timeout=60,
                       env=privileged_env())
        return out.read_bytes()

    def shell(self) -> bytes:
        return _SHELL_PAYLOAD.format(tag=self.tag, marker=self.marker, port=self.port).encode()

    def python(self) -> bytes:
        return _PYTHON_PAYLOAD.format(tag=self.tag, marker=str(self.marker),
                                      port=self.port).encode()

    def ran_outside(self) -> str | None:
        """What the marker file says, if a host process wrote it."""
        with contextlib.suppress(OSError):
            return self.marker.read_text(errors="replace")[:300]
        return None

    def close(self) -> None:
        shutil.rmtree(self._build, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.marker.unlink()


@contextlib.contextmanager
def _payload(ctx: DrillContext) -> Iterator[_Payload]:
    payload = _Payload(ctx)
    try:
        yield payload
    finally:
        payload.close()


_UPPERDIR = re.compile(r"(?:^|,)upperdir=([^,\s]+)")


def _host_dir(mountinfo: str, known: Path | None) -> tuple[str, str]:
    """The host path of the workspace's payload directory, and how the attacker learnt it: from
    ``/proc/self/mountinfo`` inside (as an attacker would), else from the host side (so the
    loader is still tested where mountinfo no longer shows host paths)."""
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] == "/workspace":
            found = _UPPERDIR.search(line.split(" - ", 1)[-1])
            if found:
                return f"{found.group(1)}/{_DIR}", "read from /proc/self/mountinfo inside"
    if known is not None:
        return f"{known}/{_DIR}", "mountinfo shows no host path; the drill's host-side path"
    return f"/workspace/{_DIR}", "no host path known; the sandbox's own path"


def _known_upper(home: Path | None, sandbox_id: str) -> Path | None:
    """Where the namespace tier keeps a workspace's writable layer (``_backends/host.py``)."""
    if home is None:
        return None
    upper = home / "sandboxes" / sandbox_id / "priv" / "disk" / "upper"
    return upper if upper.is_dir() else None


def _verdict(ctx: DrillContext, payload: _Payload, hits_since: float, inside: str | None,
             expected: Mapping[str, str], evidence: list[Evidence], how: str) -> Outcome:
    """Breached when the canary saw the payload or the host marker exists; held when the
    command saw its own variables (they reached the sandbox, and only the sandbox)."""
    time.sleep(0.1)  # a late connection still counts
    hits = ctx.canary.since(hits_since)
    marker = payload.ran_outside()
    if hits or marker:
        shown = "; ".join(f"{h.proto} {h.data[:60]!r}" for h in hits[:3])
        evidence += [Evidence("observation", f"canary hit {h.proto} from {h.peer}: "
                              f"{h.data[:80]!r}") for h in hits[:3]]
        if marker:
            evidence.append(Evidence("observation", f"host marker {payload.marker}: "
                                                    f"{marker.strip()[:120]}"))
        return Outcome("breached", f"caller-set {', '.join(expected)} ran code outside the "
                       f"sandbox ({how}): {shown or marker}", tuple(evidence))
    if inside is None:
        return Outcome("held", f"refused ({how}); nothing ran outside", tuple(evidence))
    missing = [name for name, value in expected.items() if f"{name}={value}" not in inside]
    if missing:
        return Outcome("error", f"nothing ran outside, but {missing} did not reach the "
                       f"command inside either: {inside[:200]!r}", tuple(evidence))
    return Outcome("held", f"the variables reached the command inside and nothing ran "
                   f"outside ({how}); no canary hit, no host marker", tuple(evidence))


def _loader_files(payload: _Payload, kind: str, host_dir: str) -> tuple[
        dict[str, bytes], dict[str, str]]:
    """Files to put in the workspace's payload directory, and the variables that aim them."""
    if kind == "LD_PRELOAD":
        return {"m.so": payload.shared_object()}, {"LD_PRELOAD": f"{host_dir}/m.so"}
    if kind == "LD_AUDIT":
        return {"m.so": payload.shared_object()}, {"LD_AUDIT": f"{host_dir}/m.so"}
    if kind == "LD_LIBRARY_PATH":
        # A bare preload name is searched along LD_LIBRARY_PATH, so the loader finds the
        # library only through the caller's directory. (A fake of the launcher's own
        # dependency would break it before any constructor ran and prove nothing.)
        return ({"libcorraldrill.so": payload.shared_object()},
                {"LD_LIBRARY_PATH": host_dir, "LD_PRELOAD": "libcorraldrill.so"})
    # Interpreters and libc's charset modules: harmless unless a host helper reads them.
    so = payload.shared_object()
    return ({"env.sh": payload.shell(), "py/sitecustomize.py": payload.python(),
             "startup.py": payload.python(), "drill.so": so,
             "gconv-modules": b"module INTERNAL CORRAL-DRILL// drill 1\n"
                              b"module CORRAL-DRILL// INTERNAL drill 1\n"},
            {"BASH_ENV": f"{host_dir}/env.sh", "ENV": f"{host_dir}/env.sh",
             "PYTHONPATH": f"{host_dir}/py", "PYTHONSTARTUP": f"{host_dir}/startup.py",
             "GCONV_PATH": host_dir, "CHARSET": "CORRAL-DRILL"})


_SHOW_ENV = "env; cat /proc/self/mountinfo >/dev/null"


def _env_case(kind: str) -> Run:
    """Aim ``kind`` at the launcher through the target's own transport (the SDK embedded, or
    the HTTP API with the tenant's key)."""
    def run(ctx: DrillContext) -> Outcome:
        sb = ctx.attacker
        mountinfo = sb.run("cat /proc/self/mountinfo").stdout
        host_dir, how = _host_dir(mountinfo, _known_upper(ctx.target.home, sb.id))
        with _payload(ctx) as payload:
            files, envs = _loader_files(payload, kind, host_dir)
            for name, data in files.items():
                sb.write(f"/workspace/{_DIR}/{name}", data)
            evidence = [Evidence("observation", f"payload at {host_dir} ({how})")]
            started = time.time()
            try:
                result = sb.run(_SHOW_ENV, envs=envs)
            except CommandError as exc:
                # Not what the contract asks (these are real entries), but nothing reached
                # the host either: held, and said so.
                evidence.append(Evidence("response", f"{exc.code}: {exc.message[:160]}"))
                return _verdict(ctx, payload, started, None, envs, evidence, how)
            except CorralError as exc:
                # The launcher failed: the variables reached something, and what ran is
                # unknown unless the canary saw it.
                evidence.append(Evidence("response", f"{exc.code}: {exc.message[:160]}"))
                outcome = _verdict(ctx, payload, started, None, envs, evidence, how)
                if outcome.verdict == "held":
                    return Outcome("error", f"the command failed to start: {exc.code}: "
                                   f"{exc.message[:160]}", outcome.evidence)
                return outcome
            evidence += ctx.evidence(result)
            return _verdict(ctx, payload, started, result.stdout, envs, evidence, how)
    return run


# -- over HTTP, the first tenant's own sandbox ------------------------------------------------


def _client(ctx: DrillContext, key: str | None, timeout: float = 60) -> httpx.Client:
    assert ctx.service is not None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=ctx.service.url, headers=headers, timeout=timeout)


def _http_run(client: httpx.Client, sandbox: str, cmd: str,
              envs: Mapping[str, str] | None = None, timeout: float = 30) -> httpx.Response:
    return client.post(f"/v1/sandboxes/{sandbox}/commands",
                       json={"cmd": cmd, "envs": dict(envs or {}), "timeout": timeout})


def _http_loader(background: bool) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        assert ctx.service is not None and ctx.service_sandbox is not None
        sbx = ctx.service_sandbox
        with _client(ctx, ctx.service.api_key) as api, _payload(ctx) as payload:
            mountinfo = _http_run(api, sbx, "cat /proc/self/mountinfo").json().get("stdout", "")
            host_dir, how = _host_dir(mountinfo, _known_upper(ctx.service.home, sbx))
            files, envs = _loader_files(payload, "LD_PRELOAD", host_dir)
            for name, data in files.items():
                api.put(f"/v1/sandboxes/{sbx}/files/content",
                        params={"path": f"/workspace/{_DIR}/{name}"},
                        content=data).raise_for_status()
            evidence = [Evidence("observation", f"payload at {host_dir} ({how})")]
            started = time.time()
            if background:
                response = api.post(f"/v1/sandboxes/{sbx}/processes",
                                    json={"cmd": _SHOW_ENV, "envs": envs})
                evidence.append(Evidence("response", f"POST /processes -> "
                                                     f"{response.status_code}"))
                if response.status_code != 201:
                    return _verdict(ctx, payload, started, None, envs, evidence,
                                    f"{how}; {response.status_code} {response.text[:100]}")
                pid = response.json()["id"]
                inside = _process_output(api, sbx, pid)
            else:
                response = _http_run(api, sbx, _SHOW_ENV, envs)
                evidence.append(Evidence("response", f"POST /commands -> "
                                                     f"{response.status_code}"))
                if response.status_code != 200:
                    return _verdict(ctx, payload, started, None, envs, evidence,
                                    f"{how}; {response.status_code} {response.text[:100]}")
                inside = str(response.json().get("stdout", ""))
            return _verdict(ctx, payload, started, inside, envs, evidence, how)
    return run


def _process_output(api: httpx.Client, sandbox: str, process: str) -> str:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        state = api.get(f"/v1/sandboxes/{sandbox}/processes/{process}").json()
        if state.get("state") != "running":
            break
        time.sleep(0.2)
    text = api.get(f"/v1/sandboxes/{sandbox}/processes/{process}/output").text
    return "".join(json.loads(line).get("data", "") for line in text.splitlines() if line)


# -- environment entries that cannot be real ---------------------------------------------------


def _bad_env(envs: dict[str, str], what: str) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        try:
            result = ctx.attacker.run("env", envs=envs)
        except CorralError as exc:
            shown = f"{exc.code}: {exc.message[:160]}"
            return Outcome("held", f"refused: {shown}", (Evidence("response", shown),))
        out = result.stdout.replace("\0", "\\0")
        return Outcome("breached", f"{what} was accepted and the command ran "
                       f"(exit {result.exit_code}): {out[-160:]!r}",
                       tuple(ctx.evidence(result)))
    return run


# -- bounded oversized bodies before authentication --------------------------------------------

_CLAIMED = 1 << 30  # what Content-Length says
_SEND_AT_MOST = 4 << 20  # what is really sent
_CHUNK = 64 << 10


def _oversized(ctx: DrillContext, method: str, path: str, key: str | None) -> tuple[
        int | None, int, str]:
    assert ctx.service is not None
    return send_oversized(ctx.service.url, method, path,
                          {"Authorization": f"Bearer {key}"} if key else {})


def send_oversized(base_url: str, method: str, path: str, headers: Mapping[str, str],
                   ) -> tuple[int | None, int, str]:
    """Send a head claiming 1 GiB, then at most 4 MiB of body, watching for an answer between
    chunks. Returns (status or None, bytes of body sent when the answer came, first line)."""
    url = urlsplit(base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    head = (f"{method} {path} HTTP/1.1\r\nHost: {url.netloc}\r\n"
            "Content-Type: application/json\r\n"
            + "".join(f"{name}: {value}\r\n" for name, value in headers.items())
            + f"Content-Length: {_CLAIMED}\r\n\r\n").encode()
    sent = 0
    answer = b""
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(head)
        chunk = b"[" + b"0," * (_CHUNK // 2 - 1)
        try:
            while sent < _SEND_AT_MOST:
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:
                    break
                sock.sendall(chunk)
                sent += len(chunk)
            sock.settimeout(3)
            answer = sock.recv(4096)
        except OSError:
            # The server may close while we are still sending: the answer may be waiting.
            with contextlib.suppress(OSError):
                sock.settimeout(1)
                answer = sock.recv(4096)
    line = answer.split(b"\r\n", 1)[0].decode(errors="replace")
    match = re.match(r"HTTP/1\.[01] (\d{3})", line)
    return (int(match.group(1)) if match else None), sent, line


def _body_case(method: str, path: str, key: str, ok: tuple[int, ...]) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        assert ctx.service is not None
        use = {"none": None, "own": ctx.service.api_key,
               "other": ctx.service.other_api_key}[key]
        target = path.format(sbx=ctx.service_sandbox or "sbx_000000000000")
        status, sent, line = _oversized(ctx, method, target, use)
        shown = (f"{method} {target} claiming {_CLAIMED} bytes -> "
                 f"{line or 'no answer'} after {sent} bytes of body sent")
        evidence = (Evidence("response", shown),)
        if status is None:
            return Outcome("breached", f"no answer after {sent} bytes: the server was still "
                           "reading a body it had not authorised", evidence)
        if status in ok:
            return Outcome("held", shown, evidence)
        return Outcome("breached", shown, evidence)
    return run


# -- the browser as caller ---------------------------------------------------------------------


def _rebinding_host(ctx: DrillContext) -> Outcome:
    assert ctx.service is not None
    with _client(ctx, ctx.service.api_key) as api:
        response = api.get("/v1/sandboxes", headers={"Host": "evil.test"})
    shown = f"GET /v1/sandboxes with Host: evil.test -> {response.status_code} " \
            f"{response.text[:120]}"
    evidence = (Evidence("response", shown),)
    if response.status_code == 421 and "host_refused" in response.text:
        return Outcome("held", shown, evidence)
    return Outcome("breached", shown, evidence)


def _origin_post(ctx: DrillContext) -> Outcome:
    assert ctx.service is not None
    with _client(ctx, ctx.service.api_key) as api:
        response = api.post("/v1/sandboxes", json={"labels": {"corral-drill": "origin"}},
                            headers={"Origin": "http://evil.test"})
        if response.status_code == 201:
            api.delete(f"/v1/sandboxes/{response.json()['id']}")
    shown = f"POST /v1/sandboxes with Origin: http://evil.test -> {response.status_code} " \
            f"{response.text[:120]}"
    evidence = (Evidence("response", shown),)
    if response.status_code == 403 and "origin_refused" in response.text:
        return Outcome("held", shown, evidence)
    return Outcome("breached", shown, evidence)


def _terminal(ctx: DrillContext, sandbox: str, key: str | None,
              origin: str | None = None) -> tuple[bool, str]:
    """Open a terminal: (whether a shell answered, what happened). Bounded: one frame read,
    5 s, then closed with ``exit``."""
    from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
    from websockets.sync.client import connect

    assert ctx.service is not None
    url = ctx.service.url.replace("http", "ws", 1) + f"/v1/sandboxes/{sandbox}/pty"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with connect(url, additional_headers=headers, origin=origin,  # type: ignore[arg-type]
                     open_timeout=10, close_timeout=2) as ws:
            frame = ws.recv(timeout=5)
            # End the shell and wait (5 s at most) for it to finish, so the sandbox is not
            # deleted under a terminal that is still winding down.
            with contextlib.suppress(WebSocketException, TimeoutError):
                ws.send(json.dumps({"type": "input", "data": "exit\n"}))
                end = time.monotonic() + 5
                while time.monotonic() < end:
                    ws.recv(timeout=max(0.1, end - time.monotonic()))
            shown = frame[:60] if isinstance(frame, str) else frame[:60].decode(
                errors="replace")
            return True, f"a shell answered: {shown!r}"
    except InvalidStatus as exc:
        return False, f"handshake refused: {exc.response.status_code}"
    except ConnectionClosed as exc:
        code = exc.rcvd.code if exc.rcvd else None
        return False, f"closed before any output (code {code})"
    except TimeoutError:
        return False, "no output within 5 s"


def _origin_ws(ctx: DrillContext) -> Outcome:
    assert ctx.service is not None and ctx.service_sandbox is not None
    opened, what = _terminal(ctx, ctx.service_sandbox, ctx.service.api_key,
                             origin="http://evil.test")
    evidence = (Evidence("response", f"terminal WebSocket with Origin: http://evil.test: "
                                     f"{what}"),)
    if opened:
        return Outcome("breached", f"a cross-site page got a shell: {what}", evidence)
    return Outcome("held", what, evidence)


# -- quotas through terminals -------------------------------------------------------------------


def _quota_terminals(ctx: DrillContext) -> Outcome:
    assert ctx.service is not None
    key = ctx.service.quota_api_key
    if key is None:
        return Outcome("skipped", "the service gave no quota tenant key (--quota-api-key)")
    with _client(ctx, key) as api:
        created = api.post("/v1/sandboxes", json={"labels": {"corral-drill": "quota"}})
        if created.status_code != 201:
            return Outcome("error", f"the quota tenant could not create a sandbox: "
                           f"{created.status_code} {created.text[:120]}")
        sbx = created.json()["id"]
        try:
            ran, refusal = 0, None
            for _ in range(20):  # the quota tenant's limit is small; never loop unbounded
                response = _http_run(api, sbx, "true")
                if response.status_code != 200:
                    refusal = f"{response.status_code} {response.text[:100]}"
                    break
                ran += 1
            if refusal is None:
                return Outcome("error", f"{ran} commands ran without reaching the quota")
            evidence = [Evidence("response", f"{ran} commands ran, then {refusal}")]
            opened = []
            for _ in range(3):
                is_open, what = _terminal(ctx, sbx, key)
                evidence.append(Evidence("response", f"terminal after the quota: {what}"))
                if is_open:
                    opened.append(what)
            if opened:
                return Outcome("breached", f"{len(opened)} of 3 terminal sessions opened after "
                               "the commands-per-minute quota was spent", tuple(evidence))
            return Outcome("held", "every terminal session was refused once the quota was "
                           "spent", tuple(evidence))
        finally:
            api.delete(f"/v1/sandboxes/{sbx}")


# -- ceilings -----------------------------------------------------------------------------------


def _ceiling_key(ctx: DrillContext) -> tuple[str | None, Outcome | None]:
    assert ctx.service is not None
    if ctx.service.ceiling_api_key is not None:
        return ctx.service.ceiling_api_key, None
    return None, Outcome("skipped", "the service gave no ceiling tenant key "
                         "(--ceiling-api-key)")


def _held_by_ceiling(response: httpx.Response, shown: str) -> Outcome:
    evidence = (Evidence("response", shown),)
    if response.status_code == 403 and '"ceiling_exceeded"' in response.text:
        return Outcome("held", shown, evidence)
    if response.is_success:
        return Outcome("breached", shown, evidence)
    # Refused, but not by the ceiling: the ceiling itself is unproven.
    return Outcome("error", f"refused, but not as ceiling_exceeded: {shown}", evidence)


def _beyond_ceiling(body: dict[str, Any], what: str) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        key, early = _ceiling_key(ctx)
        if early is not None:
            return early
        with _client(ctx, key) as api:
            response = api.post("/v1/sandboxes", json={
                "labels": {"corral-drill": "ceiling"}, **body})
            if response.status_code == 201:
                api.delete(f"/v1/sandboxes/{response.json()['id']}")
        return _held_by_ceiling(response, f"create with {what} -> {response.status_code} "
                                          f"{response.text[:160]}")
    return run


def _image_refused(image: str, what: str) -> Run:
    """Create a sandbox from ``image`` with a tenant key: only ``image_refused`` (403) holds;
    anything else means the service tried (read a host path, or called out to a registry the
    operator never allowed)."""
    def run(ctx: DrillContext) -> Outcome:
        assert ctx.service is not None
        with _client(ctx, ctx.service.api_key) as api:
            response = api.post("/v1/sandboxes", json={"labels": {"corral-drill": "image"},
                                                       "image": image})
            if response.status_code == 201:
                api.delete(f"/v1/sandboxes/{response.json()['id']}")
        shown = f"create from {what} -> {response.status_code} {response.text[:160]}"
        evidence = (Evidence("response", shown),)
        if response.status_code == 403 and '"image_refused"' in response.text:
            return Outcome("held", shown, evidence)
        return Outcome("breached", shown, evidence)
    return run


def _ceiling_network_update(ctx: DrillContext) -> Outcome:
    key, early = _ceiling_key(ctx)
    if early is not None:
        return early
    with _client(ctx, key) as api:
        created = api.post("/v1/sandboxes", json={"labels": {"corral-drill": "ceiling"}})
        if created.status_code != 201:
            return Outcome("error", f"the ceiling tenant could not create a sandbox within "
                           f"its ceiling: {created.status_code} {created.text[:120]}")
        sbx = created.json()["id"]
        try:
            response = api.put(f"/v1/sandboxes/{sbx}/network",
                               json={"allow": ["evil.drill.invalid"]})
        finally:
            api.delete(f"/v1/sandboxes/{sbx}")
    return _held_by_ceiling(response, f"PUT /network allow evil.drill.invalid -> "
                                      f"{response.status_code} {response.text[:160]}")


# -- gateway framing ----------------------------------------------------------------------------

# Sends argv[1] (escaped) to the sandbox's proxy; prints the answer's first line.
_RAW_PROXY = """
import os, socket, sys, urllib.parse
proxy = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
request = sys.argv[1].encode().decode("unicode_escape").encode("latin-1")
try:
    s = socket.create_connection((proxy.hostname, proxy.port), timeout=5)
    s.sendall(request)
    s.settimeout(5)
    print("answer", s.recv(200).split(b"\\r\\n")[0].decode(errors="replace"))
except OSError as e:
    print("failed", e.errno, e.strerror)
"""

_SMUGGLED = "smuggled.drill.invalid"


def _cl_te(host: str, port: int) -> str:
    inner = f"GET /smuggled HTTP/1.1\r\nHost: {_SMUGGLED}\r\n\r\n"
    size = f"{len(inner):x}\r\n"
    body = f"{size}{inner}\r\n0\r\n\r\n"
    # Content-Length covers only the chunk-size line: an upstream that frames by it parses
    # the chunk's data as a second request.
    return (f"POST http://{host}:{port}/ HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Length: {len(size)}\r\nTransfer-Encoding: chunked\r\n"
            f"Connection: close\r\n\r\n{body}")


def _host_mismatch(host: str, port: int) -> str:
    # An absolute-form target the gateway vets, with a Host header naming another site: an
    # upstream (or a CDN in front of it) that routes by Host would serve the other site.
    return (f"GET http://{host}:{port}/x HTTP/1.1\r\nHost: {_SMUGGLED}\r\n"
            "Connection: close\r\n\r\n")


def _pipelined(host: str, port: int) -> str:
    # A vetted first request, then a second one for another host on the same connection: a
    # gateway that keeps the connection to the first upstream would hand it the second.
    return (f"GET http://{host}:{port}/a HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n"
            f"GET http://{_SMUGGLED}/smuggled HTTP/1.1\r\nHost: {_SMUGGLED}\r\n"
            "Connection: close\r\n\r\n")


def _gateway_framing(build: Callable[[str, int], str], what: str) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        from ..upstream import Upstream

        assert ctx.service is not None
        host = ctx.service.upstream_host
        if host is None:
            return Outcome("skipped", "the service has no upstream name pinned to the drill's "
                           "upstream address (--upstream-host)")
        with Upstream() as upstream, _client(ctx, ctx.service.api_key) as api:
            body: dict[str, Any] = {"labels": {"corral-drill": "framing"},
                                    "network": {"allow": [f"{host}:{upstream.port}"]}}
            isolation = ctx.target.describe().get("isolation")
            if isolation in ("namespace", "gvisor"):
                body["isolation"] = isolation
            created = api.post("/v1/sandboxes", json=body)
            if created.status_code != 201:
                return Outcome("error", f"could not create the framing sandbox: "
                               f"{created.status_code} {created.text[:120]}")
            sbx = created.json()["id"]
            try:
                request = build(host, upstream.port).encode("unicode_escape").decode()
                response = api.post(f"/v1/sandboxes/{sbx}/commands", json={
                    "cmd": ["python3", "-c", _RAW_PROXY, request], "timeout": 30})
                result = response.json()
                out = (str(result.get("stdout", "")) + str(result.get("stderr", ""))).strip()
                time.sleep(0.2)
                seen = upstream.seen()
                evidence = [Evidence("response", f"the gateway answered: {out[:120]}"),
                            Evidence("observation", f"the upstream saw {len(seen)} "
                                     f"request(s): {[(r.line, r.host) for r in seen][:3]}")]
                evidence += _decisions(api, sbx, str(result.get("command_id") or ""))
            finally:
                api.delete(f"/v1/sandboxes/{sbx}")
        smuggled = [r for r in seen if _SMUGGLED in r.host or "/smuggled" in r.line]
        if smuggled or len(seen) > 1:
            return Outcome("breached", f"{what}: the upstream saw {len(seen)} requests, "
                           f"{len(smuggled)} for {_SMUGGLED}", tuple(evidence))
        return Outcome("held", f"the upstream saw {len(seen)} request(s), none smuggled; "
                       f"gateway: {out[:80]}", tuple(evidence))
    return run


def _decisions(api: httpx.Client, sandbox: str, command: str) -> list[Evidence]:
    """The service sandbox's gateway decisions, cited by seq (its trail is the service's, not
    this host's data directory, so as observations)."""
    params: dict[str, Any] = {"type": "egress.decision"}
    if command:
        params["command"] = command
    found = []
    for line in api.get(f"/v1/sandboxes/{sandbox}/audit", params=params).text.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            d = event.get("data", {})
            found.append(Evidence("observation", f"egress.decision #{event.get('seq')} "
                                  f"{d.get('verdict')} {d.get('host')}:{d.get('port')} "
                                  f"rule={d.get('rule')} {str(d.get('reason', ''))[:80]}",
                                  sandbox=sandbox))
    return found


UPSTREAM = frozenset({"service", "python3"})

CASES = [
    # Loader and interpreter variables, aimed at the root-owned launcher.
    Case("caller.env-ld-preload", "caller", "run a command with LD_PRELOAD pointing at a "
         "library in the workspace, by its host path (read from mountinfo)",
         "the library never runs outside the sandbox (no canary hit, no host marker); the "
         "command still sees its variable", _env_case("LD_PRELOAD")),
    Case("caller.env-ld-audit", "caller", "the same with LD_AUDIT (an rtld-audit module)",
         "the module never runs outside the sandbox", _env_case("LD_AUDIT")),
    Case("caller.env-ld-library-path", "caller", "LD_LIBRARY_PATH at a workspace directory "
         "and LD_PRELOAD of a bare library name found only there",
         "it never loads outside the sandbox", _env_case("LD_LIBRARY_PATH")),
    Case("caller.env-interpreters", "caller", "BASH_ENV, ENV, PYTHONPATH (sitecustomize), "
         "PYTHONSTARTUP and GCONV_PATH at workspace files",
         "no host process reads them (no canary hit, no host marker)",
         _env_case("interpreters")),
    Case("caller.env-ld-preload-http", "caller", "LD_PRELOAD over HTTP with a tenant key, "
         "for a command in the tenant's own sandbox", "the library never runs outside",
         _http_loader(background=False), OWN),
    Case("caller.env-ld-preload-background", "caller", "LD_PRELOAD over HTTP for a "
         "background process", "the library never runs outside",
         _http_loader(background=True), OWN),
    Case("caller.env-name-equals", "caller", "an env name containing '=' (A=B)",
         "refused (CommandError)", _bad_env({"CORRAL_DRILL=X": "y"}, "a name with '='")),
    Case("caller.env-name-empty", "caller", "an empty env name", "refused",
         _bad_env({"": "y"}, "an empty name")),
    Case("caller.env-name-nul", "caller", "an env name containing NUL", "refused",
         _bad_env({"CORRAL\0DRILL": "y"}, "a name with NUL")),
    Case("caller.env-value-nul", "caller", "an env value containing NUL", "refused",
         _bad_env({"CORRAL_DRILL": "a\0LD_PRELOAD=/x"}, "a value with NUL")),
    # Bounded before trusted.
    Case("caller.body-unauthenticated", "caller", "POST a body claiming 1 GiB without a key "
         "(at most 4 MiB is sent)", "413 or 401, answered before the body was sent",
         _body_case("POST", "/v1/sandboxes", "none", (401, 413)), SERVICE),
    Case("caller.body-other-tenant", "caller", "POST 1 GiB (claimed; at most 4 MiB sent) of "
         "input to another tenant's sandbox", "413, 404 or 401 before the body was sent",
         _body_case("POST", "/v1/sandboxes/{sbx}/processes/proc_drill/input", "other",
                    (401, 403, 404, 413)), OTHER),
    # Gateway framing.
    Case("caller.gateway-cl-te", "caller", "a request with both Content-Length and "
         "Transfer-Encoding through the gateway, smuggling a second request for another host",
         "the upstream sees at most one request, never the smuggled one",
         _gateway_framing(_cl_te, "CL+TE smuggling"), UPSTREAM),
    Case("caller.gateway-host-mismatch", "caller", "an absolute-form request the gateway vets, "
         "with a Host header naming another site", "the upstream never sees the other Host",
         _gateway_framing(_host_mismatch, "absolute-form with a foreign Host"), UPSTREAM),
    Case("caller.gateway-pipelined", "caller", "a vetted request, then a second one for another "
         "host on the same client connection", "the upstream sees at most one request, never "
         "the second", _gateway_framing(_pipelined, "a pipelined request for another host"),
         UPSTREAM),
    # Ceilings.
    Case("caller.ceiling-host", "caller", "create a sandbox allowing a host beyond the "
         "tenant's ceiling", "ceiling_exceeded",
         _beyond_ceiling({"network": {"allow": ["evil.drill.invalid"]}},
                         "allow evil.drill.invalid"), SERVICE),
    Case("caller.ceiling-wildcard", "caller", f"allow *.{BAIT_ALLOWED.split('.', 1)[1]} "
         "(wider than the ceiling's one host)", "ceiling_exceeded",
         _beyond_ceiling({"network": {"allow": [f"*.{BAIT_ALLOWED.split('.', 1)[1]}"]}},
                         "a wildcard wider than the ceiling"), SERVICE),
    Case("caller.ceiling-network-update", "caller", "widen a sandbox's allowlist beyond the "
         "ceiling after creating it", "ceiling_exceeded", _ceiling_network_update, SERVICE),
    Case("caller.ceiling-template", "caller", "create a sandbox from a template beyond the "
         "ceiling (python)", "ceiling_exceeded",
         _beyond_ceiling({"template": "python"}, "template python"), SERVICE),
    Case("caller.ceiling-isolation", "caller", "create a sandbox on a tier beyond the ceiling "
         "(gvisor)", "ceiling_exceeded",
         _beyond_ceiling({"isolation": "gvisor"}, "isolation gvisor"), SERVICE),
    Case("caller.ceiling-resources", "caller", "create a sandbox on a resource tier beyond "
         "the ceiling (large)", "ceiling_exceeded",
         _beyond_ceiling({"resources": "large"}, "resources large"), SERVICE),
    Case("caller.ceiling-secret", "caller", "bind a secret beyond the ceiling",
         "ceiling_exceeded", _beyond_ceiling({"secrets": ["CORRAL_DRILL_CEILING_SECRET"]},
                                             "secret CORRAL_DRILL_CEILING_SECRET"), SERVICE),
    Case("caller.ceiling-lifetime", "caller", "ask for a lifetime beyond the ceiling (2 h)",
         "ceiling_exceeded", _beyond_ceiling({"timeout": 7200}, "timeout 7200 s"), SERVICE),
    # Images: host paths and registries beyond the operator's allowlist.
    Case("caller.image-host-path", "caller", "create a sandbox from an image at a host path "
         "(docker-archive:/etc/shadow)", "403 image_refused, nothing read",
         _image_refused("docker-archive:/etc/shadow", "docker-archive:/etc/shadow"), SERVICE),
    Case("caller.image-registry", "caller", "create a sandbox from an image in a registry the "
         "operator did not allow", "403 image_refused before any connection",
         _image_refused("evil.drill.invalid/x/y:1", "evil.drill.invalid/x/y:1"), SERVICE),
    # Quotas and the browser.
    Case("caller.quota-terminals", "caller", "open terminals after the commands-per-minute "
         "quota is spent", "every terminal is refused", _quota_terminals, SERVICE),
    Case("caller.origin-websocket", "caller", "open a terminal WebSocket with Origin: "
         "http://evil.test (a cross-site page)", "refused at the handshake", _origin_ws, OWN),
    Case("caller.origin-post", "caller", "create a sandbox with Origin: http://evil.test",
         "403 origin_refused", _origin_post, SERVICE),
    Case("caller.host-rebinding", "caller", "call the API with Host: evil.test (DNS "
         "rebinding)", "421 host_refused", _rebinding_host, SERVICE),
]

__all__ = ["CASES"]
