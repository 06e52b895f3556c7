"""Ports of a microVM sandbox, for real (QEMU under TCG here, ``CORRAL_MICROVM_ALLOW_TCG=1``):
``MicrovmBackend.open_port`` reaches a server on the guest's own loopback although the guest has
no network device, through the keeper and the guest agent (``tcp.connect``), with bytes both
ways, half-close each way and back-pressure; nothing listening is ``PortClosed`` at once; the
tier's per-VM cap holds; the connections end with the VM. And the tier refuses volumes and data
mounts before it builds anything.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from corral import Sandbox
from corral._control.manager import Manager
from corral._settings import Settings
from corral.backends import IsolationBackend, Mount, SandboxSpec
from corral.errors import BackendUnavailable, PortClosed, QuotaExceeded

# The first case may build the root image and warm snapshot of a changed agent (minutes).
pytestmark = [pytest.mark.needs_root, pytest.mark.microvm, pytest.mark.timeout(600)]

PORT = 7788
BIG = (4 << 20) + 12345  # over 4 MiB each way, and not a multiple of any chunk size
IO_TIMEOUT_S = 120.0  # for one socket operation under emulation

# One connection, one mode, chosen by its first line:
#   echo       read to EOF, then send it all back swapcased and close
#   pipe       send each chunk back swapcased as it comes (both directions at once), then close
#   push N     send N random bytes, half-close, read to EOF, remember both digests
#   stat       the digests of the last push: "<sent sha> <received bytes> <received sha>"
# One thread for every connection: the sandbox's pids limit (128) would not hold one each.
_SERVER = textwrap.dedent("""
    import asyncio, hashlib, os, sys
    last = {}
    async def serve(reader, writer):
        try:
            mode, _, arg = (await reader.readline()).decode().strip().partition(" ")
            if mode == "echo":
                writer.write((await reader.read()).swapcase())
            elif mode == "pipe":
                while chunk := await reader.read(65536):
                    writer.write(chunk.swapcase())
                    await writer.drain()
            elif mode == "push":
                data = os.urandom(int(arg))
                writer.write(data)
                await writer.drain()
                writer.write_eof()
                got = await reader.read()
                last["push"] = "%s %d %s" % (hashlib.sha256(data).hexdigest(), len(got),
                                             hashlib.sha256(got).hexdigest())
            elif mode == "stat":
                writer.write(last.pop("push", "none").encode())
            await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]), backlog=512)
        print("ready", flush=True)
        await server.serve_forever()
    asyncio.run(main())
""")


@dataclass
class Vm:
    sandbox: Sandbox
    backend: IsolationBackend
    spec: SandboxSpec

    def open(self, port: int = PORT, timeout_s: float = 10.0) -> socket.socket:
        sock = self.backend.open_port(self.spec, port, timeout_s)
        sock.settimeout(IO_TIMEOUT_S)
        return sock


def _vm(manager: Manager, settings: Settings) -> Vm:
    sandbox = Sandbox.create(home=str(settings.home), isolation="microvm")
    return Vm(sandbox, manager.backend_for("microvm"), manager._spec(manager.get(sandbox.id)))


def _wait_for_server(vm: Vm) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            vm.open().close()
            return
        except PortClosed:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture(scope="module")
def vm(manager: Manager, settings: Settings, microvm_problems: list[str]) -> Iterator[Vm]:
    """One sandbox with the server above running in the background, for the module."""
    if microvm_problems:
        pytest.skip("the microVM tier cannot run here: " + "; ".join(microvm_problems))
    vm = _vm(manager, settings)
    try:
        server = vm.sandbox.processes.start(["python3", "-c", _SERVER, str(PORT)])
        try:
            _wait_for_server(vm)
            yield vm
        finally:
            server.kill()
    finally:
        vm.sandbox.kill()


def _read_to_eof(sock: socket.socket) -> bytes:
    data = bytearray()
    while chunk := sock.recv(1 << 16):
        data += chunk
    return bytes(data)


def test_bytes_cross_both_ways_and_the_client_half_closes_first(vm: Vm) -> None:
    payload = os.urandom(BIG)
    with vm.open() as sock:
        sock.sendall(b"echo\n" + payload)
        sock.shutdown(socket.SHUT_WR)  # the server answers only after our EOF
        assert _read_to_eof(sock) == payload.swapcase()


def test_both_directions_stream_at_once_under_back_pressure(vm: Vm) -> None:
    payload = os.urandom(BIG)
    failed: list[BaseException] = []
    with vm.open() as sock:
        def send() -> None:
            try:
                for start in range(0, len(payload), 1 << 20):
                    sock.sendall(payload[start:start + (1 << 20)])
                sock.shutdown(socket.SHUT_WR)
            except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
                failed.append(exc)

        sock.sendall(b"pipe\n")
        sender = threading.Thread(target=send)
        sender.start()
        try:
            # Not reading for a while: the guest's echo must wait, not fill a queue, and the
            # rest of the VM's traffic must not wait behind it.
            time.sleep(1)
            assert vm.sandbox.commands.run(["echo", "meanwhile"]).stdout == "meanwhile\n"
            received = _read_to_eof(sock)
        finally:
            sender.join(IO_TIMEOUT_S)
    assert not failed, failed
    assert len(received) == len(payload)
    assert received == payload.swapcase()


def test_the_guest_half_closes_first_and_still_reads(vm: Vm) -> None:
    ours = os.urandom(BIG)
    with vm.open() as sock:
        sock.sendall(b"push %d\n" % BIG)
        theirs = _read_to_eof(sock)  # the server's SHUT_WR reached us as EOF
        assert len(theirs) == BIG
        sock.sendall(ours)  # our direction stays open
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b""
    expected = f"{hashlib.sha256(theirs).hexdigest()} {BIG} {hashlib.sha256(ours).hexdigest()}"
    deadline = time.monotonic() + 30
    while True:  # the server records the push once it read our EOF
        with vm.open() as sock:
            sock.sendall(b"stat\n")
            stat = _read_to_eof(sock).decode()
        if stat != "none" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stat == expected


def test_a_port_connection_outlives_the_commands_run_meanwhile(vm: Vm) -> None:
    with vm.open() as sock:
        sock.sendall(b"pipe\nbefore")
        assert sock.recv(6) == b"BEFORE"
        assert vm.sandbox.commands.run(["true"]).exit_code == 0
        sock.sendall(b"after")
        sock.shutdown(socket.SHUT_WR)
        assert _read_to_eof(sock) == b"AFTER"


def test_a_port_nothing_listens_on_is_port_closed_at_once(vm: Vm) -> None:
    started = time.monotonic()
    with pytest.raises(PortClosed) as caught:
        vm.open(PORT + 1, timeout_s=30)
    assert time.monotonic() - started < 10  # refused at once, not after the 30 s timeout
    assert vm.sandbox.id in caught.value.message and str(PORT + 1) in caught.value.message
    # Nothing is connected on the host's side: not even in the sandbox's network namespace
    # (QEMU's and the keeper's), where a listener of its egress gateway is bound right now.
    endpoint = vm.backend.egress_endpoint(vm.spec)
    try:
        with pytest.raises(PortClosed):
            vm.open(endpoint.listener.getsockname()[1])
    finally:
        endpoint.listener.close()


def test_a_vm_holds_at_most_256_port_connections(vm: Vm) -> None:
    socks: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while len(socks) < 256:
            try:
                socks.append(vm.open())
            except QuotaExceeded:  # the earlier cases' connections may still be ending there
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        with pytest.raises(QuotaExceeded) as caught:
            vm.open()
        assert "256" in caught.value.message
        with socks[0] as first:  # every one of them is live
            first.sendall(b"pipe\nx")
            assert first.recv(1) == b"X"
    finally:
        for sock in socks:
            sock.close()
    # Closed here, each ends in the guest (its server sees EOF and closes) and frees its slot.
    deadline = time.monotonic() + 120
    while True:
        try:
            with vm.open() as sock:
                sock.sendall(b"pipe\nok")
                sock.shutdown(socket.SHUT_WR)
                assert _read_to_eof(sock) == b"OK"
            break
        except QuotaExceeded:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_port_connections_end_when_the_vm_stops(
    manager: Manager, settings: Settings, microvm_problems: list[str]
) -> None:
    if microvm_problems:
        pytest.skip("the microVM tier cannot run here: " + "; ".join(microvm_problems))
    vm = _vm(manager, settings)
    try:
        vm.sandbox.processes.start(["python3", "-c", _SERVER, str(PORT)])
        _wait_for_server(vm)
        sock = vm.open()
    except BaseException:
        vm.sandbox.kill()
        raise
    with sock:
        try:
            sock.sendall(b"pipe\nping")
            assert sock.recv(4) == b"PING"
        finally:
            vm.sandbox.kill()
        sock.settimeout(30)
        try:  # EOF or a reset, but never a hang
            assert sock.recv(1) == b""
        except ConnectionResetError:
            pass


def test_volumes_and_data_mounts_are_refused_before_anything_is_built(
    manager: Manager, settings: Settings, microvm_problems: list[str]
) -> None:
    if microvm_problems:
        pytest.skip("the microVM tier cannot run here: " + "; ".join(microvm_problems))
    from corral._backends.microvm.backend import RUN_ROOT
    from corral._core.resources import get_tier

    backend = manager.backend_for("microvm")
    sandbox_id = f"sbx_mounts{secrets.token_hex(4)}"
    for mount in (Mount("volume", "vol_1", "/mnt/data", read_only=False),
                  Mount("data", "datasets", "/mnt/datasets")):
        spec = SandboxSpec(id=sandbox_id, uid=settings.uid_start + settings.uid_count - 1,
                           template="base", tier=get_tier("small"), mounts=(mount,))
        for build in (backend.create, backend.reset_workspace):
            with pytest.raises(BackendUnavailable) as caught:
                build(spec)
            assert "namespace or gvisor" in caught.value.message
    assert not (RUN_ROOT / f"{settings.instance}-{sandbox_id}").exists()
    assert not (settings.home / "microvm" / "sandboxes" / sandbox_id).exists()
    assert not (settings.run_dir / f"corral-{settings.instance}-{sandbox_id}").exists()
    assert sandbox_id not in backend.cgroups.children("")  # type: ignore[attr-defined]


def test_an_exposed_port_of_a_microvm_through_the_proxy(vm: Vm, manager: Manager) -> None:
    """The same URL, token, page and WebSocket as on the host tiers (test_ports.py), through
    ``corral serve``'s proxy and the keeper's relay."""
    import httpx
    from websockets.sync.client import connect as ws_connect

    from .servers import Server
    from .test_ports import APP

    app_port = 8000
    vm.sandbox.files.write("portapp.py", APP)
    app = vm.sandbox.processes.start(["python3", "portapp.py", str(app_port)])
    try:
        with Server(manager) as server:
            exposed = httpx.post(f"{server.url}/v1/sandboxes/{vm.sandbox.id}/ports/{app_port}")
            assert exposed.status_code == 201, exposed.text
            url, token = exposed.json()["url"], exposed.json()["token"]
            auth = {"X-Corral-Port-Token": token}
            deadline = time.monotonic() + 60
            while (page := httpx.get(url, headers=auth, timeout=IO_TIMEOUT_S)).status_code == 502:
                assert time.monotonic() < deadline, page.text
                time.sleep(0.3)
            assert page.status_code == 200 and b"hello from the sandbox" in page.content
            assert httpx.get(url).status_code == 401
            # Through the keeper too, no Corral credential reaches the guest's app.
            planted = {"Cookie": "corral_session=us1.a.b; theirs=kept",
                       "Authorization": "Bearer ck_0123456789ab_" + "s" * 32,
                       "X-Api-Key": "e2b_" + "0" * 48, "X-Corral-Ui": "1"}
            seen = httpx.get(url + "headers", headers={**auth, **planted},
                             timeout=IO_TIMEOUT_S).json()["headers"]
            seen = {k.lower(): v for k, v in seen.items()}
            assert seen.get("cookie") == "theirs=kept", seen
            assert not {"authorization", "x-api-key", "x-corral-ui",
                        "x-corral-port-token"} & set(seen), seen
            big = httpx.get(url + f"big?n={BIG}", headers=auth, timeout=IO_TIMEOUT_S)
            assert len(big.content) == BIG
            with ws_connect(url.replace("http://", "ws://") + "ws", additional_headers=auth,
                            open_timeout=IO_TIMEOUT_S) as ws:
                ws.send("from the host")
                assert ws.recv(timeout=IO_TIMEOUT_S) == "echo: from the host"
    finally:
        app.kill()
