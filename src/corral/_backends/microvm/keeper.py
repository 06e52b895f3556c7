"""The keeper: one small host process per running microVM, which owns it.

Why a process of its own: a sandbox is used by many Corral processes at once (the service, an
embedded SDK, the CLI), as on the other tiers, but a VM has one QMP socket and one agent channel.
The keeper holds both and serves a unix socket (root-only) speaking the agent protocol, so any
Corral process on the host can run commands and file operations in the VM; request ids are
rewritten per client, so clients never see each other's traffic.

It runs as root inside the sandbox's network namespace (started there by the backend), outside
the sandbox's cgroup (its own Python is not the sandbox's memory); QEMU runs confined by
``vm``: the sandbox's uid, bwrap, ``-sandbox on``, in the sandbox's cgroup before the guest runs
an instruction, and it dies with the keeper. The keeper also terminates the egress tunnel: a
``tcp.open`` from the guest becomes a connection to ``127.0.0.1:<port>`` in the namespace, where
only Corral's per-command gateway listeners are bound. Port connections go the other way: a
client whose first line on a fresh connection is ``{"op": "port.connect", "port", "timeout"}``
gets one answer line (``{"ok": true}`` or ``{"error": {"kind", "message"}}``) and from then on
that connection is a raw byte stream to a connection the agent made to ``127.0.0.1:<port>`` in
the guest (``tcp.connect``). For those the keeper connects nothing on the host: it only relays,
with the agent's window each way, and ends them all when the VM stops.

When a client goes away (its process died, even by SIGKILL), the keeper kills the commands it
started: nothing outlives its caller. When QEMU dies or stops on an error, every pending request
gets an error at once and the keeper exits.

Run by the backend as ``python -m corral._backends.microvm.keeper RUN_DIR``; RUN_DIR holds
``keeper.json`` (a ``KeeperConfig``), and receives ``keeper.sock`` once the VM answers,
``keeper.pid``, ``keeper.log`` and, on a failed start, ``keeper.error``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import queue
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._core.owner import this_owner
from .wire import ProtocolError, b64, encode, read_lines, read_one, unb64

__all__ = ["KeeperConfig", "main"]

log = logging.getLogger("corral.microvm.keeper")

CONFIG = "keeper.json"
SOCKET = "keeper.sock"
PIDFILE = "keeper.pid"
ERROR = "keeper.error"
_CONNECT_TIMEOUT_S = 5.0
_START_DEADLINE_S = 60.0
_OP_DEADLINE_S = 300.0
# The agent's PORT_WINDOW: what a port connection may have in flight unacked, each way. It
# bounds the keeper's memory too (a slow client's connection holds at most this here).
_PORT_WINDOW = 256 << 10
# What a guest that ignores the window may queue here before its port connection is cut (a
# guest that keeps it queues at most the window and one read past it).
_PORT_QUEUE_MAX = 2 * _PORT_WINDOW
# Past a port connection's own connect timeout, for an emulated, busy guest to answer.
PORT_GRACE_S = 10.0
_PORT_MAX_TIMEOUT_S = 300.0
_PORT_CHUNK = 64 * 1024
_PORT_KINDS = frozenset({"port_closed", "busy", "protocol", "io"})


@dataclass(frozen=True, slots=True)
class KeeperConfig:
    """What the backend tells a keeper (``keeper.json``)."""

    sandbox_id: str
    instance: str  # the cgroup prefix of this data directory (``corral-<instance>``)
    uid: int
    kernel: str
    root_image: str
    top: str
    memory_mib: int
    cpus: int
    accel: str  # "kvm" | "tcg"
    cpu_model: str
    mode: str  # "cold" | "warm" | "memory"
    warm_ram: str = ""
    warm_state: str = ""
    memory_image: str = ""
    # A wake from hibernation (mode "memory"): the guest keeps its commands for ``attach``.
    keep_commands: bool = False
    fresh_disk: bool = False
    backing: tuple[str, ...] = ()  # the read-only files under ``top`` (its qcow2 chain)
    netns: str = ""
    # The sandbox's QEMU group (``cgroup.procs`` files, one per v1 hierarchy): QEMU is placed
    # there before the guest runs, by writing its pid, so the keeper loads no cgroup driver.
    cgroup_procs: tuple[str, ...] = ()
    owner: str = ""  # "<pid>.<start time>" of the keeper, set by the keeper itself

    @classmethod
    def load(cls, path: Path) -> KeeperConfig:
        data = json.loads(path.read_text())
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in names}
        for name in ("cgroup_procs", "backing"):
            fields[name] = tuple(fields.get(name, ()))
        return cls(**fields)

    def dump(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self)))
        os.replace(tmp, path)


@dataclass(eq=False)
class _Client:
    sock: socket.socket
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The client's own exec ids -> the keeper's ids, while they run.
    execs: dict[int, int] = field(default_factory=dict)
    alive: bool = True

    def send(self, message: dict[str, Any]) -> None:
        data = encode(message)
        with self.lock:
            if not self.alive:
                return
            try:
                self.sock.sendall(data)
            except OSError:
                self.alive = False


@dataclass(eq=False)
class _Port:
    """One port connection: a client's socket relayed to the guest connection ``id`` (< 0)."""

    id: int
    sock: socket.socket
    answered: threading.Event = field(default_factory=threading.Event)
    answer: dict[str, Any] = field(default_factory=dict)
    relaying: bool = False
    ended: bool = False
    # What may still go to the guest before it acks more (its window).
    credit: int = _PORT_WINDOW
    credited: threading.Condition = field(default_factory=threading.Condition)
    # What the guest sent, for the writer thread to hand the client in order: data, b"" for
    # the guest's EOF, None for the end. The agent's reader thread never blocks on a client.
    outbox: queue.SimpleQueue[bytes | None] = field(default_factory=queue.SimpleQueue)
    queued: int = 0


@dataclass(frozen=True, slots=True)
class _Route:
    deliver: Callable[[dict[str, Any]], None]
    client: _Client | None  # None: a request of the keeper's own
    client_id: int
    is_exec: bool


class Keeper:
    def __init__(self, run_dir: Path, config: KeeperConfig, vm: Any, channel: socket.socket):
        self._run_dir = run_dir
        self._config = config
        self._vm = vm
        self._channel = channel
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._ids = itertools.count(1_000_000)
        self._routes: dict[int, _Route] = {}
        self._clients: set[_Client] = set()
        self._tunnels: dict[int, socket.socket] = {}
        # Port connections' ids are negative: the guest's own connections count up from 1.
        self._port_ids = itertools.count(-1, -1)
        self._ports: dict[int, _Port] = {}
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None

    # -- the guest side -------------------------------------------------------------------

    def to_agent(self, message: dict[str, Any]) -> None:
        data = encode(message)
        with self._send_lock:
            self._channel.sendall(data)

    def number_past(self, used: list[int]) -> None:
        """Give this keeper's requests ids above ``used``: a guest woken from hibernation keeps
        its commands under the ids an earlier keeper gave them (each keeper counts from the
        same start), and an id given twice would mix two commands' events."""
        start = max(next(self._ids), max(used, default=0) + 1)
        self._ids = itertools.count(start)

    def call_agent(self, op: str, timeout: float = 30.0, **fields: Any) -> Any:
        """One request of the keeper's own (resume, mount, unmount) and its answer."""
        done = threading.Event()
        answer: dict[str, Any] = {}
        gid = next(self._ids)

        def deliver(message: dict[str, Any]) -> None:
            answer.update(message)
            done.set()

        with self._lock:
            self._routes[gid] = _Route(deliver, None, gid, False)
        self.to_agent({"id": gid, "op": op, **fields})
        if not done.wait(timeout):
            with self._lock:
                self._routes.pop(gid, None)
            raise RuntimeError(f"the guest agent did not answer {op} within {timeout:.0f} s")
        if "error" in answer:
            error = answer["error"]
            raise RuntimeError(f"the guest agent refused {op}: {error.get('message', error)}")
        return answer.get("ok")

    def read_agent(self) -> None:
        try:
            for message in read_lines(self._channel):
                if "conn" in message:
                    self._tunnel_from_guest(message)
                    continue
                gid = message.get("id")
                if not isinstance(gid, int):
                    continue
                with self._lock:
                    route = self._routes.get(gid)
                    if route is None:
                        continue
                    final = ("exit" in message or "error" in message
                             or (not route.is_exec and "ok" in message))
                    if final:
                        del self._routes[gid]
                        if route.is_exec and route.client is not None:
                            route.client.execs.pop(route.client_id, None)
                route.deliver({**message, "id": route.client_id})
        except ProtocolError as exc:
            log.error("the guest broke the protocol: %s", exc)
        self._fail("the microVM's agent channel closed (the VM stopped or crashed)")

    # -- the egress tunnel --------------------------------------------------------------

    def _tunnel_from_guest(self, message: dict[str, Any]) -> None:
        conn = message.get("conn")
        if not isinstance(conn, int) or isinstance(conn, bool):
            return
        if conn < 0:
            self._port_from_guest(conn, message)
            return
        if message.get("op") == "tcp.open":
            port = message.get("port")
            threading.Thread(target=self._open_tunnel, args=(conn, port), daemon=True,
                             name=f"tunnel-{conn}").start()
            return
        with self._lock:
            sock = self._tunnels.get(conn)
        if sock is None:
            return
        try:
            if "data" in message:
                sock.sendall(unb64(message["data"]))
            elif message.get("eof"):
                sock.shutdown(socket.SHUT_WR)
            elif message.get("closed"):
                self._close_tunnel(conn)
        except (OSError, ProtocolError):
            self._close_tunnel(conn, tell_guest=True)

    def _open_tunnel(self, conn: int, port: object) -> None:
        if not isinstance(port, int) or not 0 < port < 65536:
            self.to_agent({"conn": conn, "closed": True, "error": "bad port"})
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(_CONNECT_TIMEOUT_S)
        try:
            # Only Corral's gateway listeners are bound in this namespace (it holds only lo).
            sock.connect(("127.0.0.1", port))
        except OSError as exc:
            sock.close()
            self.to_agent({"conn": conn, "closed": True,
                           "error": f"the egress gateway did not accept: {exc.strerror}"})
            return
        sock.settimeout(None)
        with self._lock:
            self._tunnels[conn] = sock
        self.to_agent({"conn": conn, "opened": True})
        try:
            while True:
                data = sock.recv(64 * 1024)
                if not data:
                    self.to_agent({"conn": conn, "eof": True})
                    return
                self.to_agent({"conn": conn, "data": b64(data)})
        except OSError:
            self._close_tunnel(conn, tell_guest=True)

    def _close_tunnel(self, conn: int, *, tell_guest: bool = False) -> None:
        with self._lock:
            sock = self._tunnels.pop(conn, None)
        if sock is not None:
            sock.close()
            if tell_guest:
                with contextlib.suppress(OSError):
                    self.to_agent({"conn": conn, "closed": True})

    # -- port connections ---------------------------------------------------------------

    def _serve_port(self, sock: socket.socket, request: dict[str, Any]) -> None:
        """A client's connection that asked for a port: one answer line, then raw bytes both
        ways until both ends are done (the client's socket is closed by the caller)."""
        port, timeout = request.get("port"), request.get("timeout", _CONNECT_TIMEOUT_S)
        problem = None
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            problem = "port.connect: 'port' must be a TCP port"
        elif not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
            problem = "port.connect: 'timeout' must be a number of seconds > 0"
        if problem is not None:
            with contextlib.suppress(OSError):
                sock.sendall(encode({"error": {"kind": "protocol", "message": problem}}))
            return
        timeout = min(float(timeout), _PORT_MAX_TIMEOUT_S)
        with self._lock:
            conn = _Port(next(self._port_ids), sock)
            self._ports[conn.id] = conn
        try:
            self.to_agent({"conn": conn.id, "op": "tcp.connect", "port": port,
                           "timeout": timeout})
        except OSError:
            self._end_port(conn, why="the microVM's agent channel closed")
        if not conn.answered.wait(timeout + PORT_GRACE_S):
            self._end_port(conn, tell_guest=True, kind="port_closed",
                           why="the guest did not answer in time")
        with self._lock:
            answer = conn.answer
            conn.relaying = "ok" in answer and not conn.ended
        try:
            sock.sendall(encode(answer))
        except OSError:
            self._end_port(conn, tell_guest=True)
            return
        if not conn.relaying:
            return
        writer = threading.Thread(target=self._port_writer, args=(conn,), daemon=True,
                                  name=f"port{conn.id}")
        writer.start()
        self._port_reader(conn)
        writer.join()

    def _port_reader(self, conn: _Port) -> None:
        """The client's bytes to the guest, never more than the guest's window ahead."""
        while True:
            with conn.credited:
                while conn.credit <= 0 and not conn.ended:
                    conn.credited.wait()
                if conn.ended:
                    return
                size = min(_PORT_CHUNK, conn.credit)
            try:
                data = conn.sock.recv(size)
            except OSError:
                self._end_port(conn, tell_guest=True)
                return
            if conn.ended:
                return
            try:
                if not data:
                    self.to_agent({"conn": conn.id, "eof": True})
                    return
                with conn.credited:
                    conn.credit -= len(data)
                self.to_agent({"conn": conn.id, "data": b64(data)})
            except OSError:
                return  # the channel is gone: read_agent fails the keeper and ends this

    def _port_writer(self, conn: _Port) -> None:
        """The guest's bytes to the client, each chunk acked once the client's socket took it."""
        while (item := conn.outbox.get()) is not None:
            if not item:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_WR)
                continue
            try:
                conn.sock.sendall(item)
            except OSError:
                self._end_port(conn, tell_guest=True)
                break
            with self._lock:
                conn.queued -= len(item)
            try:
                self.to_agent({"conn": conn.id, "ack": len(item)})
            except OSError:
                break
        with contextlib.suppress(OSError):  # wakes the reader if it still waits on the client
            conn.sock.shutdown(socket.SHUT_RDWR)

    def _port_from_guest(self, cid: int, message: dict[str, Any]) -> None:
        if "op" in message:
            return  # the guest opens only its own (positive) connections
        with self._lock:
            conn = self._ports.get(cid)
        if conn is None:
            if message.get("opened") is True:  # ended here meanwhile: not left open there
                with contextlib.suppress(OSError):
                    self.to_agent({"conn": cid, "closed": True})
            return
        with self._lock:
            if not conn.answered.is_set() and not conn.ended:
                if message.get("opened") is True:
                    conn.answer = {"ok": True}
                elif message.get("closed") is True:
                    kind = message.get("kind")
                    conn.answer = {"error": {
                        "kind": kind if kind in _PORT_KINDS else "io",
                        "message": str(message.get("error") or "the guest refused")[:500]}}
                    conn.ended = True
                    del self._ports[cid]
                else:
                    return
                conn.answered.set()
                return
        ack = message.get("ack")
        if "data" in message:
            try:
                data = unb64(message["data"])
            except ProtocolError:
                self._end_port(conn, tell_guest=True)
                return
            if not data:
                return  # an empty chunk would read as the guest's EOF
            with self._lock:
                conn.queued += len(data)
                over = conn.queued > _PORT_QUEUE_MAX
            if over:
                log.warning("the guest overran the window of port connection %d", cid)
                self._end_port(conn, tell_guest=True)
                return
            conn.outbox.put(data)
        elif isinstance(ack, int) and not isinstance(ack, bool) and ack > 0:
            with conn.credited:
                conn.credit = min(_PORT_WINDOW, conn.credit + ack)
                conn.credited.notify_all()
        elif message.get("eof") is True:
            conn.outbox.put(b"")
        elif message.get("closed") is True:
            self._end_port(conn, flush=True)

    def _end_port(self, conn: _Port, *, tell_guest: bool = False, flush: bool = False,
                  kind: str = "io", why: str = "") -> None:
        """End a port connection. ``flush``: the guest closed it, and what it sent before
        reaches the client first; otherwise it is cut at once. Before the answer line went
        out, the client gets ``why`` as the answer's error."""
        with self._lock:
            if conn.ended:
                return
            conn.ended = True
            self._ports.pop(conn.id, None)
            if not conn.answered.is_set():
                conn.answer = {"error": {"kind": kind, "message": why or "the port "
                                         "connection ended"}}
                conn.answered.set()
            relaying = conn.relaying
        with conn.credited:
            conn.credited.notify_all()
        conn.outbox.put(None)
        if relaying and not flush:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        if tell_guest:
            with contextlib.suppress(OSError):
                self.to_agent({"conn": conn.id, "closed": True})

    # -- clients ----------------------------------------------------------------------------

    def serve(self, listener: socket.socket) -> None:
        self._listener = listener
        while not self._stopping.is_set():
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            client = _Client(sock)
            with self._lock:
                self._clients.add(client)
            threading.Thread(target=self._serve_client, args=(client,), daemon=True,
                             name="keeper-client").start()

    def _serve_client(self, client: _Client) -> None:
        try:
            # Read apart from the rest: after a port.connect line come the port's raw bytes.
            first = read_one(client.sock)
            if first is not None and first.get("op") == "port.connect":
                self._serve_port(client.sock, first)
                return
            if first is not None:
                self._from_client(client, first)
                for message in read_lines(client.sock):
                    self._from_client(client, message)
        except ProtocolError as exc:
            client.send({"id": None, "error": {"kind": "protocol", "message": str(exc)}})
        except OSError:
            pass  # the client went away
        finally:
            self._drop_client(client)

    def _drop_client(self, client: _Client) -> None:
        with self._lock:
            client.alive = False
            self._clients.discard(client)
            orphaned = list(client.execs.values())
            client.execs.clear()
            for gid, route in list(self._routes.items()):
                if route.client is client:
                    del self._routes[gid]
        # Its caller is gone: what it started dies, as on the other tiers.
        for gid in orphaned:
            with contextlib.suppress(OSError):
                self.to_agent({"id": next(self._ids), "op": "kill", "target": gid})
        client.sock.close()

    def _from_client(self, client: _Client, message: dict[str, Any]) -> None:
        cid, op = message.get("id"), message.get("op")
        if not isinstance(cid, int) or not isinstance(op, str):
            client.send({"id": cid, "error": {
                "kind": "protocol", "message": "a request needs an integer id and an op"}})
            return
        if op.startswith("vm."):
            threading.Thread(target=self._vm_op, args=(client, cid, op, message), daemon=True,
                             name=op).start()
            return
        gid = next(self._ids)
        forwarded = {**message, "id": gid}
        with self._lock:
            if "target" in message:
                target = client.execs.get(message["target"])
                if target is None:
                    client.send({"id": cid, "ok": False})
                    return
                forwarded["target"] = target
            is_exec = op in ("exec", "attach")  # a command's events follow, under this id
            self._routes[gid] = _Route(client.send, client, cid, is_exec)
            if is_exec:
                client.execs[cid] = gid
        try:
            self.to_agent(forwarded)
        except OSError:
            self._fail("the microVM's agent channel closed")

    def _vm_op(self, client: _Client, cid: int, op: str, message: dict[str, Any]) -> None:
        try:
            result = self._run_vm_op(op, message)
        except Exception as exc:  # noqa: BLE001 - every failure is the client's answer
            log.exception("%s failed", op)
            client.send({"id": cid, "error": {"kind": "io", "message": f"{op} failed: {exc}"}})
            return
        client.send({"id": cid, "ok": result})
        if op in ("vm.quit", "vm.hibernate"):
            self.stop()

    def _run_vm_op(self, op: str, message: dict[str, Any]) -> Any:
        vm = self._vm
        deadline = time.monotonic() + _OP_DEADLINE_S
        if op == "vm.status":
            return {"state": vm.state.value, "pid": vm.pid, "rss_bytes": vm.rss_bytes(),
                    "pss_bytes": vm.pss_bytes(), "accel": self._config.accel}
        if op == "vm.pause":
            vm.pause(deadline) if message.get("paused") else vm.cont(deadline)
            return True
        if op == "vm.snapshot_memory":
            return self._snapshot_memory(
                Path(message["top_path"]), Path(message["new_top_path"]),
                Path(message["layer_path"]), Path(message["memory_path"]), deadline)
        if op == "vm.quit":
            with contextlib.suppress(Exception):
                self.call_agent("unmount", timeout=10)
            return True
        if op == "vm.hibernate":
            return self._hibernate(Path(message["memory_path"]), deadline)
        raise ValueError(f"unknown keeper op {op!r}")

    def _hibernate(self, memory: Path, deadline: float) -> int:
        """Stop the guest where it is and save its RAM and devices to ``memory``; the keeper
        then stops (QEMU quits with the guest never run on: its disk is as the state says).
        The image is the sandbox's uid's only (its QEMU restores from it); its size."""
        self._vm.save_memory(memory, deadline)
        os.chown(memory, self._config.uid, self._config.uid)
        os.chmod(memory, 0o400)
        return memory.stat().st_size

    def _snapshot_memory(self, top: Path, new_top: Path, layer: Path, memory: Path,
                         deadline: float) -> bool:
        """One instant for disk and memory: stop, put ``new_top`` on live over ``top`` (which
        becomes ``layer``: a second name for the same file, since QEMU reopens its disks by
        name and a disk in use is never renamed), save RAM and devices to ``memory``, run on."""
        vm = self._vm
        os.link(top, layer)
        vm.pause(deadline)
        try:
            vm.seal_live(new_top, layer, deadline)
            vm.save_memory(memory, deadline)
        finally:
            vm.cont(deadline)
        os.chown(layer, 0, 0)  # read-only from now on, for every sandbox built on it
        os.chmod(layer, 0o644)
        os.chown(memory, 0, 0)
        os.chmod(memory, 0o644)
        return True

    # -- ending -----------------------------------------------------------------------------

    def _fail(self, why: str) -> None:
        with self._lock:
            routes = list(self._routes.items())
            self._routes.clear()
        for _, route in routes:
            route.deliver({"id": route.client_id, "error": {"kind": "io", "message": why}})
        self.stop()

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        with self._lock:
            ports = list(self._ports.values())
        for port in ports:  # and any asked for from now on finds the channel closed
            self._end_port(port, why="the microVM stopped")
        with contextlib.suppress(Exception):
            self._vm.quit(time.monotonic() + 5)
        with contextlib.suppress(Exception):
            self._vm.kill()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        with self._lock:
            clients = list(self._clients)
        for client in clients:
            with contextlib.suppress(OSError):
                client.sock.shutdown(socket.SHUT_RDWR)
        (self._run_dir / SOCKET).unlink(missing_ok=True)

    def wait(self) -> None:
        self._stopping.wait()

    def watch(self) -> None:
        """A guest that stopped on an error (QEMU pauses and stays alive: it looks hung), or a
        QEMU that died, fails every pending request at once instead of at its deadline."""
        while not self._stopping.wait(0.2):
            fatal = self._vm.fatal
            if fatal is not None:
                log.error("the microVM stopped: %s", fatal)
                self._fail(f"the microVM stopped: {fatal}")
                return


@dataclass(frozen=True, slots=True)
class _Warm:
    ram: Path
    state: Path


def _start_vm(run_dir: Path, config: KeeperConfig) -> tuple[Any, socket.socket]:
    """Launch QEMU for ``config`` and connect to its agent (a cold boot waits for the agent's
    ready line; a restored guest's agent is already running and is told to ``resume``)."""
    from .accel import Accel
    from .vm import Vm, VmConfig

    def attach(pid: int) -> None:
        for procs in config.cgroup_procs:
            with open(procs, "w") as f:
                f.write(str(pid))

    vm_config = VmConfig(
        kernel=Path(config.kernel), root_image=Path(config.root_image),
        # QEMU's own directory (it owns it as the sandbox's uid); the keeper's files stay in
        # the root-only directory above, out of a compromised QEMU's reach.
        run_dir=run_dir / "vm", work_dir=Path(config.top).parent,
        accel=Accel(config.accel, config.cpu_model,  # type: ignore[arg-type]
                    "hardware" if config.accel == "kvm" else "none"),
        memory_mib=config.memory_mib, vcpus=config.cpus, top_disk=Path(config.top),
        backing=tuple(Path(p) for p in config.backing), uid=config.uid, gid=config.uid,
        attach=attach)
    deadline = time.monotonic() + _START_DEADLINE_S
    if config.mode == "cold":
        vm = Vm.boot(vm_config, deadline)
    elif config.mode == "warm":
        vm = Vm.restore_warm(vm_config, _Warm(Path(config.warm_ram), Path(config.warm_state)),
                             deadline)
    else:
        vm = Vm.restore_memory(vm_config, Path(config.memory_image), deadline)
    try:
        channel = vm.connect(deadline)
        if config.mode == "cold":
            vm.read_line(channel, bytearray(), deadline, "the guest agent to start")
        channel.settimeout(None)
    except BaseException:
        vm.kill()
        raise
    return vm, channel


def _prepare_guest(keeper: Keeper, config: KeeperConfig) -> None:
    if config.mode in ("warm", "memory"):
        keeper.call_agent("resume", seed=b64(secrets.token_bytes(64)), time_ns=time.time_ns(),
                          hostname="sandbox", sandbox_id=config.sandbox_id,
                          keep_commands=config.keep_commands)
        if config.keep_commands:
            keeper.number_past(list(keeper.call_agent("procs")["commands"]))
    if config.mode in ("warm", "cold"):
        keeper.call_agent("mount", fresh=config.fresh_disk)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m corral._backends.microvm.keeper RUN_DIR\n")
        return 2
    run_dir = Path(args[0])
    logging.basicConfig(filename=run_dir / "keeper.log", level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    owner = this_owner()
    (run_dir / PIDFILE).write_text(owner + "\n")
    config = dataclasses.replace(KeeperConfig.load(run_dir / CONFIG), owner=owner)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # QEMU dies with us (pdeathsig)
    started = time.monotonic()
    try:
        vm, channel = _start_vm(run_dir, config)
    except Exception as exc:  # noqa: BLE001 - the backend reads the reason from the file
        log.exception("the microVM did not start")
        (run_dir / ERROR).write_text(str(exc) or type(exc).__name__)
        return 1
    keeper = Keeper(run_dir, config, vm, channel)
    threading.Thread(target=keeper.read_agent, daemon=True, name="agent-reader").start()
    threading.Thread(target=keeper.watch, daemon=True, name="watch").start()
    booted = time.monotonic()
    try:
        _prepare_guest(keeper, config)
    except Exception as exc:  # noqa: BLE001
        log.exception("the guest could not be prepared")
        (run_dir / ERROR).write_text(str(exc))
        keeper.stop()
        return 1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = run_dir / f".{SOCKET}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    listener.bind(str(tmp))
    os.chmod(tmp, 0o600)
    listener.listen(64)
    os.replace(tmp, run_dir / SOCKET)  # clients see the socket only once it serves
    log.info("%s VM of %s up: QEMU + %s %.0f ms, guest ready %.0f ms", config.mode,
             config.sandbox_id, "boot" if config.mode == "cold" else "restore",
             (booted - started) * 1000, (time.monotonic() - booted) * 1000)
    threading.Thread(target=keeper.serve, args=(listener,), daemon=True, name="accept").start()
    keeper.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
