"""A naive HTTP upstream on the host's loopback, for the gateway's framing cases.

It frames requests by ``Content-Length`` alone and reads as many requests as a connection
carries, the way the upstreams that request smuggling fools do: a body the gateway forwarded
with both ``Content-Length`` and ``Transfer-Encoding`` shows up here as a second request. It
records each request line and ``Host`` and answers 200 to each. Bounded: a few KiB per request
head, 64 KiB per connection, 100 records, one short-lived thread per connection.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field

__all__ = ["UPSTREAM_ADDRESS", "Upstream", "UpstreamRequest"]

# Not 127.0.0.1: an operator CIDR that lets a gateway reach this address must not also open
# the canaries (which listen on 127.0.0.1) to the names the drill's bait rules allow.
UPSTREAM_ADDRESS = "127.0.0.2"
_MAX_CONNECTION = 64 * 1024
_MAX_RECORDS = 100


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    line: str
    host: str


@dataclass
class Upstream:
    """Listens on ``UPSTREAM_ADDRESS``; a context manager."""

    port: int = 0
    requests: list[UpstreamRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((UPSTREAM_ADDRESS, 0))
        self._sock.listen(16)
        self._sock.settimeout(0.1)
        self.port = int(self._sock.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, name="corral-drill-upstream",
                                        daemon=True)
        self._thread.start()

    def __enter__(self) -> Upstream:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def seen(self) -> list[UpstreamRequest]:
        with self._lock:
            return list(self.requests)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        conn.settimeout(3)
        buf = b""
        received = 0
        with conn:
            while received < _MAX_CONNECTION and not self._stop.is_set():
                head_end = buf.find(b"\r\n\r\n")
                if head_end < 0:
                    try:
                        data = conn.recv(4096)
                    except OSError:
                        return
                    if not data:
                        return
                    received += len(data)
                    buf += data
                    continue
                head, buf = buf[:head_end].decode("latin-1"), buf[head_end + 4:]
                lines = head.split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in
                           (line.partition(":") for line in lines[1:])}
                with self._lock:
                    if len(self.requests) < _MAX_RECORDS:
                        self.requests.append(UpstreamRequest(lines[0][:200],
                                                             headers.get("host", "")[:200]))
                try:
                    length = min(int(headers.get("content-length", "0") or 0),
                                 _MAX_CONNECTION)
                except ValueError:
                    length = 0
                while len(buf) < length and received < _MAX_CONNECTION:
                    try:
                        data = conn.recv(4096)
                    except OSError:
                        return
                    if not data:
                        break
                    received += len(data)
                    buf += data
                buf = buf[length:]
                with contextlib.suppress(OSError):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self._sock.close()
