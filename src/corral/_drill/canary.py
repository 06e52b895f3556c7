"""Canaries: listeners on the host's loopback that a sandbox must never reach.

A sandbox's network namespace has its own ``lo``; 127.0.0.1 inside it is not the host's. So a
connection or datagram that arrives here came from a sandbox that reached the host's network
(or through a gateway that connected where it must not): a breach, with the payload to show
what got out. Loopback only, so a broken configuration cannot send anything off the machine.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

__all__ = ["Canary", "Hit", "host_address"]


@dataclass(frozen=True, slots=True)
class Hit:
    proto: str
    peer: str
    data: bytes
    at: float


@dataclass
class Canary:
    """TCP on 127.0.0.1 and [::1] (same port) and UDP on 127.0.0.1; records every hit."""

    tcp_port: int = 0
    udp_port: int = 0
    hits: list[Hit] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._socks: list[socket.socket] = []
        tcp4 = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp4.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp4.bind(("127.0.0.1", 0))
        self.tcp_port = tcp4.getsockname()[1]
        self._listen(tcp4)
        with contextlib.suppress(OSError):  # a host without IPv6 loopback
            tcp6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            tcp6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            tcp6.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp6.bind(("::1", self.tcp_port))
            self._listen(tcp6)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("127.0.0.1", 0))
        udp.setblocking(False)
        self.udp_port = udp.getsockname()[1]
        self._socks.append(udp)
        self._sel.register(udp, selectors.EVENT_READ, "udp")
        self._thread = threading.Thread(target=self._serve, name="corral-drill-canary",
                                        daemon=True)
        self._thread.start()

    def _listen(self, sock: socket.socket) -> None:
        sock.listen(64)
        sock.setblocking(False)
        self._socks.append(sock)
        self._sel.register(sock, selectors.EVENT_READ, "listen")

    def _record(self, proto: str, peer: str, data: bytes) -> None:
        with self._lock:
            if len(self.hits) < 1000:  # bounded, whatever a broken sandbox sends
                self.hits.append(Hit(proto, peer, data[:4096], time.time()))

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if key.data == "udp":
                    with contextlib.suppress(OSError):
                        data, peer = sock.recvfrom(65536)
                        self._record("udp", str(peer[0]), data)
                elif key.data == "listen":
                    with contextlib.suppress(OSError):
                        conn, peer = sock.accept()
                        conn.setblocking(False)
                        self._sel.register(conn, selectors.EVENT_READ, ("conn", str(peer[0])))
                        self._record("tcp", str(peer[0]), b"")
                else:
                    _, peer = key.data
                    data = b""
                    with contextlib.suppress(OSError):
                        data = sock.recv(65536)
                    if data:
                        self._record("tcp-data", peer, data)
                    else:
                        self._sel.unregister(sock)
                        sock.close()

    def since(self, t: float) -> list[Hit]:
        with self._lock:
            return [h for h in self.hits if h.at >= t]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for key in list(self._sel.get_map().values()):
            with contextlib.suppress(Exception):
                key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()


def host_address() -> str | None:
    """The host's own primary IPv4 address (the source of its default route), or None. A UDP
    ``connect`` picks the route without sending anything."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            address = str(s.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address
