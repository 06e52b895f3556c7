"""The HTTP service through real HTTP (uvicorn on loopback): the same SDK behaviour embedded and
remote, tenants, keys, quotas, and a server killed with SIGKILL mid-command."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral import (
    AuthError,
    CommandError,
    PathRefused,
    QuotaExceeded,
    Sandbox,
    SandboxNotFound,
    UsageError,
)
from corral._control.manager import Manager
from corral._control.plane import TenantDirectory
from corral._serve.app import create_app
from corral._settings import Settings

from ..conftest import managed, private_settings
from .hostprocs import host_procs_of_uid
from .servers import Server as _Server
from .servers import free_port as _free_port

pytestmark = pytest.mark.needs_root


# -- one behavioural suite, both transports ----------------------------------------------------


def test_commands_behave_the_same(where: dict[str, str]) -> None:
    with Sandbox.create(**where) as sb:
        result = sb.commands.run("echo out; echo err >&2; exit 3")
        assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
        assert result.command_id.startswith("cmd_")
        seen: list[str] = []
        streamed = sb.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done",
                                   on_stdout=seen.append)
        assert "".join(seen) == streamed.stdout == "1\n2\n3\n"
        assert sb.commands.run(["wc", "-c"], stdin="12345").stdout.strip() == "5"
        sb.files.make_dir("d")
        assert sb.commands.run("pwd; echo $X", cwd="/workspace/d",
                               envs={"X": "y"}).stdout == "/workspace/d\ny\n"
        timed = sb.commands.run("sleep 10", timeout=0.5)
        assert timed.timed_out and timed.exit_code == 124
        with pytest.raises(CommandError):
            sb.commands.run("")
        with pytest.raises(UsageError):
            sb.commands.run("true", timeout=100_000)


def test_files_behave_the_same(where: dict[str, str]) -> None:
    with Sandbox.create(**where) as sb:
        entry = sb.files.write("a/b.txt", "hello")
        assert entry.path == "/workspace/a/b.txt" and entry.size == 5
        assert sb.files.read("a/b.txt") == "hello"
        assert sb.files.read("a/b.txt", format="bytes") == b"hello"
        assert [e.name for e in sb.files.list("a")] == ["b.txt"]
        assert sb.files.stat("a").type == "dir"
        assert sb.files.exists("a/b.txt") and not sb.files.exists("nope")
        with pytest.raises(PathRefused):
            sb.files.read("../../etc/passwd")
        sb.commands.run("ln -s /etc/passwd leak")
        with pytest.raises(PathRefused):
            sb.files.read("leak")
        sb.files.remove("a")
        assert not sb.files.exists("a")


def test_lifecycle_errors_and_audit_behave_the_same(where: dict[str, str]) -> None:
    with pytest.raises(UsageError, match="unknown resource tier"):
        Sandbox.create(resources="xl", **where)
    with pytest.raises(SandboxNotFound):
        Sandbox.connect("sbx_000000000000", **where)
    sb = Sandbox.create(network={"allow": ["pypi.org"]}, labels={"k": "v"}, **where)
    try:
        assert sb.id in {i.id for i in Sandbox.list(**where)}
        assert sb.network.get()["allow"] == ["pypi.org"]
        sb.network.update(allow=["example.com"], deny=["bad.example.com"])
        assert sb.network.get() == {"mode": "allowlist", "allow": ["example.com"],
                                    "deny": ["bad.example.com"]}
        sb.set_timeout(600)
        run = sb.commands.run("echo audited")
        types = [e.type for e in sb.audit.events(command=run.command_id)]
        assert types == ["command.started", "command.output", "command.finished"]
        assert "sandbox.policy_changed" in {e.type for e in sb.audit.events()}
    finally:
        sb.kill()
    with pytest.raises(SandboxNotFound):
        Sandbox.connect(sb.id, **where)


# -- the API itself ----------------------------------------------------------------------------


def test_errors_are_json_with_fitting_status(server: _Server) -> None:
    with httpx.Client(base_url=server.url) as client:
        missing = client.get("/v1/sandboxes/sbx_000000000000")
        assert missing.status_code == 404 and missing.json()["error"] == "sandbox_not_found"
        bad = client.post("/v1/sandboxes", json={"resources": "xl"})
        assert bad.status_code == 400 and bad.json()["error"] == "usage_error"
        extra = client.post("/v1/sandboxes", json={"nope": 1})
        assert extra.status_code == 422 and extra.json()["error"] == "invalid_request"
        assert client.get("/openapi.json").json()["info"]["title"] == "Corral"
        assert "corral_commands_started_total" in client.get("/metrics").text


# -- tenants, keys, quotas ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tenant_service() -> Iterator[tuple[_Server, dict[str, str], Manager]]:
    with private_settings("corral-test-tenants-") as settings, managed(settings) as mgr:
        directory = TenantDirectory(mgr.store)
        directory.add_tenant("alpha", max_sandboxes=2, tiers=["small"], commands_per_minute=5)
        directory.add_tenant("beta", max_sandboxes=5, tiers=["small", "large"],
                             commands_per_minute=100)
        keys = {name: directory.create_key(name)[1] for name in ("alpha", "beta")}
        revoked_id, revoked = directory.create_key("beta")
        mgr.store.revoke_key(revoked_id)
        keys["revoked"] = revoked
        with _Server(mgr) as srv:
            yield srv, keys, mgr


def test_every_endpoint_requires_a_valid_key_once_keys_exist(
    tenant_service: tuple[_Server, dict[str, str], Manager]
) -> None:
    srv, keys, _ = tenant_service
    # Every HTTP operation the app has, from its own document: routers included with
    # include_router are not flattened into app.routes (FastAPI >= 0.16x).
    paths = create_app(tenant_service[2]).openapi()["paths"]
    routes = [(m.upper(), path) for path, ops in paths.items() for m in ops
              if path.startswith("/v1") or path == "/metrics"]
    assert len(routes) >= 13
    with httpx.Client(base_url=srv.url) as client:
        for auth in (None, "Bearer nonsense", f"Bearer {keys['revoked']}",
                     "Bearer ck_000000000000_" + "x" * 32):
            for method, path in routes:
                url = path.replace("{sandbox_id}", "sbx_000000000000")
                headers = {"authorization": auth} if auth else {}
                response = client.request(method, url, headers=headers, params={"path": "x"})
                assert response.status_code == 401, (method, path, auth, response.text)
                assert response.json()["error"] == "unauthorized"
        assert client.get("/healthz").status_code == 200


def test_tenants_cannot_see_or_touch_each_other(
    tenant_service: tuple[_Server, dict[str, str], Manager]
) -> None:
    srv, keys, _ = tenant_service
    alpha = Sandbox.create(url=srv.url, api_key=keys["alpha"])
    try:
        alpha.files.write("secret.txt", "alpha only")
        assert alpha.id not in {i.id for i in Sandbox.list(url=srv.url, api_key=keys["beta"])}
        for attempt in (
            lambda: Sandbox.connect(alpha.id, url=srv.url, api_key=keys["beta"]),
        ):
            with pytest.raises(SandboxNotFound):
                attempt()
        with httpx.Client(base_url=srv.url,
                          headers={"authorization": f"Bearer {keys['beta']}"}) as beta:
            base = f"/v1/sandboxes/{alpha.id}"
            for method, path, kwargs in [
                ("GET", base, {}), ("DELETE", base, {}),
                ("POST", f"{base}/commands", {"json": {"cmd": "cat secret.txt"}}),
                ("GET", f"{base}/files/content", {"params": {"path": "secret.txt"}}),
                ("PUT", f"{base}/files/content", {"params": {"path": "x"}, "content": b"x"}),
                ("GET", f"{base}/files", {}), ("GET", f"{base}/audit", {}),
                ("PUT", f"{base}/network", {"json": {"allow": ["a.com"]}}),
                ("POST", f"{base}/timeout", {"json": {"timeout": 5}}),
            ]:
                response = beta.request(method, path, **kwargs)
                assert response.status_code == 404, (method, path, response.text)
        assert alpha.files.read("secret.txt") == "alpha only"
    finally:
        alpha.kill()
    # Even after it is gone, its trail stays the owner's.
    with httpx.Client(base_url=srv.url,
                      headers={"authorization": f"Bearer {keys['beta']}"}) as beta:
        assert beta.get(f"/v1/sandboxes/{alpha.id}/audit").status_code == 404


def test_quotas_are_refused_with_429(
    tenant_service: tuple[_Server, dict[str, str], Manager]
) -> None:
    srv, keys, _ = tenant_service
    kw: dict[str, Any] = {"url": srv.url, "api_key": keys["alpha"]}
    with pytest.raises(QuotaExceeded, match="may not use the 'large' tier"):
        Sandbox.create(resources="large", **kw)
    first, second = Sandbox.create(**kw), Sandbox.create(**kw)
    try:
        with pytest.raises(QuotaExceeded, match="already has 2 sandboxes"):
            Sandbox.create(**kw)
        with pytest.raises(QuotaExceeded, match="commands per minute"):
            for _ in range(6):
                first.commands.run("true")
    finally:
        first.kill()
        second.kill()
    with pytest.raises(AuthError):
        Sandbox.list(url=srv.url, api_key=keys["revoked"])


# -- crash and restart -------------------------------------------------------------------------


def test_sigkill_of_the_server_mid_command_and_restart() -> None:
    home = Path(tempfile.mkdtemp(prefix="corral-test-serve-"))
    settings = Settings(home=home, uid_start=2_140_000_000 + secrets.randbelow(100) * 1000,
                        uid_count=1000)
    env = {**os.environ, "CORRAL_HOME": str(home), "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    port = _free_port()
    url = f"http://127.0.0.1:{port}"

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", "corral", "serve", "--port", str(port)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
            time.sleep(0.1)

    server = start()
    outcome: list[BaseException] = []

    def long_command() -> None:
        try:
            sb.commands.run("sleep 300", timeout=60)
        except Exception as exc:  # the server dies under it: a transport error is expected
            outcome.append(exc)

    try:
        sb = Sandbox.create(url=url)
        sb.files.write("kept.txt", "before the crash")
        runner = threading.Thread(target=long_command, daemon=True)
        runner.start()
        from corral._control.store import Store

        store = Store(home / "corral.db")
        uid = store.get(sb.id).uid  # type: ignore[union-attr]
        store.close()
        deadline = time.monotonic() + 20
        while not host_procs_of_uid(uid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert host_procs_of_uid(uid), "the command never started"
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
        runner.join(timeout=30)
        assert outcome and type(outcome[0]).__name__ == "TransportError", outcome
        deadline = time.monotonic() + 10
        while host_procs_of_uid(uid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert host_procs_of_uid(uid) == [], "sandbox processes outlived the server"
        server = start()
        again = Sandbox.connect(sb.id, url=url)
        assert again.files.read("kept.txt") == "before the crash"
        finished = again.audit.events(types=["command.finished"])
        assert finished and finished[-1].data.get("interrupted") is True, finished
        assert again.commands.run("echo alive").stdout == "alive\n"
        again.kill()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        with managed(settings):
            pass
        shutil.rmtree(home, ignore_errors=True)


def test_pause_freezes_a_running_process_and_resume_continues(where: dict[str, str]) -> None:
    with Sandbox.create(**where) as sb:
        results: list[Any] = []
        counter = threading.Thread(target=lambda: results.append(sb.commands.run(
            "i=0; while [ $i -lt 400 ]; do i=$((i+1)); echo $i > n; sleep 0.02; done; echo done",
            timeout=50)))
        counter.start()
        time.sleep(0.5)
        sb.pause()
        assert sb.get_info().state == "paused"
        frozen_at = sb.files.read("n")  # files stay reachable while paused
        time.sleep(0.6)
        assert sb.files.read("n") == frozen_at, "a paused process kept running"
        from corral import SandboxBusy

        with pytest.raises(SandboxBusy, match="paused"):
            sb.commands.run("true")
        sb.resume()
        time.sleep(0.5)
        assert int(sb.files.read("n")) > int(frozen_at)
        counter.join(timeout=30)
        assert results and results[0].stdout.endswith("done\n")
        types = [e.type for e in sb.audit.events(types=["sandbox.*"])]
        assert "sandbox.paused" in types and "sandbox.resumed" in types


def test_a_running_command_can_be_killed_by_id(where: dict[str, str]) -> None:
    with Sandbox.create(**where) as sb:
        results: list[Any] = []
        runner = threading.Thread(target=lambda: results.append(
            sb.commands.run("sleep 30 & sleep 30; echo never", timeout=50)))
        runner.start()
        deadline = time.monotonic() + 10
        started: list[Any] = []
        while not started and time.monotonic() < deadline:
            started = [e for e in sb.audit.events(types=["command.started"])]
            time.sleep(0.05)
        from corral import CommandNotFound

        # "started" is recorded just before the process is spawned: retry until it runs.
        deadline = time.monotonic() + 10
        while True:
            try:
                sb.commands.kill(started[0].command)
                break
            except CommandNotFound:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        runner.join(timeout=10)
        assert results and results[0].exit_code == 137 and "never" not in results[0].stdout

        with pytest.raises(CommandNotFound):
            sb.commands.kill(started[0].command)


def test_the_cli_works_against_a_server(server: _Server) -> None:
    env = {**os.environ, "CORRAL_URL": server.url}
    env.pop("CORRAL_HOME", None)

    def corral(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "corral", *args], env=env,
                              capture_output=True, text=True, timeout=60)

    sandbox_id = corral("create").stdout.strip()
    try:
        done = corral("exec", sandbox_id, "--json", "--", "echo remote; exit 4")
        assert done.returncode == 4 and '"stdout": "remote\\n"' in done.stdout
        assert sandbox_id in corral("ls", "--json").stdout
    finally:
        assert corral("rm", sandbox_id).returncode == 0
    assert corral("exec", sandbox_id, "--", "true").returncode == 4


def _tar(entries: list[tuple[str, str, bytes | str]]) -> bytes:
    """(kind, name, data-or-link-target) -> tar bytes."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for kind, name, data in entries:
            info = tarfile.TarInfo(name)
            if kind == "file":
                assert isinstance(data, bytes)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                info.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
                info.linkname = str(data)
                tar.addfile(info)
    return buf.getvalue()


def test_tree_upload_download_and_refusals(where: dict[str, str]) -> None:
    from corral import PathRefused

    with Sandbox.create(**where) as sb:
        report = sb.files.upload(_tar([("file", "app/main.py", b"print(7)\n"),
                                       ("file", "app/data/x.bin", b"\x00\x01"),
                                       ("symlink", "app/link", "main.py")]), "/workspace/up")
        assert report["files"] == 2 and report["symlinks"] == 1
        assert sb.commands.run("python3 up/app/link").stdout == "7\n"
        import io
        import tarfile

        archive = b"".join(sb.files.download("/workspace/up"))
        names = sorted(tarfile.open(fileobj=io.BytesIO(archive)).getnames())
        assert "app/main.py" in names and "app/link" in names
        for bad in ([("file", "../evil", b"x")], [("file", "/etc/evil", b"x")],
                    [("symlink", "out", "/etc"), ("file", "out/evil", b"x")],
                    [("hardlink", "hard", "/etc/passwd")]):
            with pytest.raises(PathRefused):
                sb.files.upload(_tar(bad), "/workspace/bad")
        assert not os.path.exists("/etc/evil")
        sb.files.rename("up/app/main.py", "moved/main.py")
        assert sb.commands.run("cat moved/main.py").stdout == "print(7)\n"


def test_background_processes_start_list_reconnect_input_kill(where: dict[str, str]) -> None:
    with Sandbox.create(**where) as sb:
        server = sb.processes.start(
            ["python3", "-u", "-c",
             "import sys\nprint('ready', flush=True)\n"
             "for line in sys.stdin:\n    print('echo:', line.strip(), flush=True)"])
        assert server.id.startswith("proc_")
        assert [p.id for p in sb.processes.list()] == [server.id]
        greeting, offset = "", 0
        for at, stream, text in server.output(follow=True, wait_s=10):
            assert stream == "stdout"
            greeting, offset = greeting + text, at + len(text)
            if greeting.endswith("\n"):
                break
        assert greeting == "ready\n"
        server.send("hello\n")
        # Reconnect from the last offset, as a new client would.
        seen = ""
        for _, _, text in sb.processes.get(server.id).output(offset, follow=True, wait_s=10):
            seen += text
            if seen.endswith("\n"):  # print() may arrive in pieces; the line ends the reply
                break
        assert seen == "echo: hello\n"
        # Commands still run beside it (each in its own PID namespace: they cannot see it).
        assert sb.commands.run("ps -e -o comm= | grep -c python3 || true").stdout.strip() == "0"
        server.kill()
        info = server.wait(timeout=10)
        assert info["state"] == "exited" and info["exit_code"] == 137
        replayed = "".join(t for _, _, t in server.output())
        assert replayed == "ready\necho: hello\n"


def test_background_processes_die_with_the_sandbox(where: dict[str, str]) -> None:
    sb = Sandbox.create(**where)
    sb.processes.start("sleep 300")
    uid_probe = sb.commands.run("id -u").stdout
    assert uid_probe.strip() == "1000"
    sb.kill()
    with pytest.raises(SandboxNotFound):
        Sandbox.connect(sb.id, **where)


def test_a_terminal_over_websocket(server: _Server) -> None:
    import asyncio
    import json as jsonlib

    import websockets

    sb = Sandbox.create(url=server.url)

    async def session() -> str:
        url = server.url.replace("http", "ws") + f"/v1/sandboxes/{sb.id}/pty?rows=24&cols=80"
        screen = ""
        async with websockets.connect(url) as ws:
            # Generous: every wait ends on an event, so a busy machine only makes it slower.
            async def read_until(marker: str, timeout: float = 60, after: int = 0) -> None:
                nonlocal screen
                async with asyncio.timeout(timeout):
                    while marker not in screen[after:]:
                        frame = await ws.recv()
                        screen += frame.decode() if isinstance(frame, bytes) else frame

            await read_until("$ ")
            await ws.send(jsonlib.dumps({"type": "input", "data": "echo typed-$((6*7))\n"}))
            await read_until("typed-42")
            await ws.send(jsonlib.dumps({"type": "resize", "rows": 40, "cols": 100}))
            await ws.send(jsonlib.dumps({"type": "input", "data": "stty size\n"}))
            await read_until("40 100")
            # Interrupt only once the command certainly runs in the foreground: it prints the
            # marker itself, after the shell made it the terminal's foreground group, and
            # exec keeps that process (a signal sent earlier could reach the shell instead).
            await ws.send(jsonlib.dumps({
                "type": "input", "data": "sh -c 'echo sleeping-$((2+3)); exec sleep 60'\n"}))
            await read_until("sleeping-5")
            await ws.send(jsonlib.dumps({"type": "signal", "signal": "INT"}))
            await read_until("^C")
            # Typed only once bash shows its prompt again: while it takes the terminal back
            # from the killed job, what arrives can be lost.
            await read_until("$ ", after=screen.index("^C"))
            await ws.send(jsonlib.dumps({"type": "input", "data": "echo after-$((1+1))\n"}))
            await read_until("after-2")
            await ws.send(jsonlib.dumps({"type": "input", "data": "exit 5\n"}))
            await read_until('"exit_code": 5')
        return screen

    try:
        screen = asyncio.run(session())
        assert "typed-42" in screen and "40 100" in screen and "after-2" in screen
    finally:
        sb.kill()
    # Foreign or missing sandboxes are refused at the handshake, with their HTTP status.
    async def refused() -> int:
        url = server.url.replace("http", "ws") + "/v1/sandboxes/sbx_000000000000/pty"
        try:
            async with websockets.connect(url) as ws:
                await ws.recv()
        except websockets.exceptions.ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd else 0
        except websockets.exceptions.InvalidStatus as exc:
            return exc.response.status_code
        return 0

    assert asyncio.run(refused()) == 404  # an HTTP denial, with the JSON error


def test_idle_sandboxes_are_reaped_busy_ones_are_not(where: dict[str, str], manager: Manager
                                                      ) -> None:
    idle = Sandbox.create(idle_timeout=1, **where)
    busy = Sandbox.create(idle_timeout=1, **where)
    try:
        worker = busy.processes.start("sleep 30")
        time.sleep(1.3)
        manager.recover()  # what the service's reaper does every few seconds
        with pytest.raises(SandboxNotFound):
            Sandbox.connect(idle.id, **where)
        assert busy.get_info().state == "running"  # a process runs: not idle
        worker.kill()
    finally:
        busy.kill()
        with contextlib.suppress(SandboxNotFound):
            idle.kill()


def test_listening_beyond_loopback_needs_keys(manager: Manager) -> None:
    from corral import ConfigError
    from corral._serve.run import serve

    assert manager.store.live_key_count() == 0
    with pytest.raises(ConfigError, match="without API keys"):
        serve(manager, host="0.0.0.0", port=_free_port())
