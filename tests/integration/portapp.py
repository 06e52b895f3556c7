"""A small web app run *inside* sandboxes by the port tests (stdlib only: the sandbox's Python
has no third-party packages): a page whose script opens a WebSocket back to the app, a large
download, an upload that answers its hash, the request headers as seen, and a WebSocket echo.

Usage inside a sandbox: ``python3 portapp.py PORT [HOST]``.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import socket
import struct
import sys
import time

PAGE = b"""<!doctype html><html lang=en><meta charset=utf-8><title>port app</title>
<body><h1>hello from the sandbox</h1><p id=state>connecting</p><script>
const url = new URL("ws", location.href); url.protocol = url.protocol.replace("http", "ws");
const ws = new WebSocket(url);
ws.onopen = () => ws.send("ping from the page");
ws.onmessage = (m) => { document.getElementById("state").textContent = m.data; };
ws.onerror = () => { document.getElementById("state").textContent = "websocket error"; };
</script></body></html>"""
_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
STREAMS = {"open": 0, "ended": 0}  # /stream answers being written, and ended by the client


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def _send_frame(conn: socket.socket, opcode: int, payload: bytes) -> None:
    head = bytes([0x80 | opcode])
    if len(payload) < 126:
        head += bytes([len(payload)])
    elif len(payload) < 65536:
        head += bytes([126]) + struct.pack("!H", len(payload))
    else:
        head += bytes([127]) + struct.pack("!Q", len(payload))
    conn.sendall(head + payload)


def _echo(conn: socket.socket) -> None:
    """RFC 6455 server side, unfragmented messages: text comes back as ``echo: <text>``,
    binary as it was; a close is answered with the same code."""
    while True:
        b0, b1 = _recv_exact(conn, 2)
        opcode, length = b0 & 0x0F, b1 & 0x7F
        if length == 126:
            length = struct.unpack("!H", _recv_exact(conn, 2))[0]
        elif length == 127:
            length = struct.unpack("!Q", _recv_exact(conn, 8))[0]
        mask = _recv_exact(conn, 4) if b1 & 0x80 else b"\0\0\0\0"
        data = bytes(c ^ mask[i % 4] for i, c in enumerate(_recv_exact(conn, length)))
        if opcode == 0x8:
            _send_frame(conn, 0x8, data[:2])
            return
        if opcode == 0x9:
            _send_frame(conn, 0xA, data)
        elif opcode == 0x1:
            _send_frame(conn, 0x1, b"echo: " + data)
        elif opcode == 0x2:
            _send_frame(conn, 0x2, data)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, body: bytes, kind: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/ws" and self.headers.get("Upgrade", "").lower() == "websocket":
            accept = base64.b64encode(hashlib.sha1(
                (self.headers["Sec-WebSocket-Key"] + _GUID).encode()).digest()).decode()
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", accept)
            self.end_headers()
            self.wfile.flush()
            try:
                _echo(self.connection)
            except (ConnectionError, OSError):
                pass
            self.close_connection = True
        elif path == "/stream":  # server-sent events that never end, as a dev server's
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            STREAMS["open"] += 1
            try:
                for n in range(1200):  # a minute at most, whatever happens
                    event = f"data: tick {n}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                STREAMS["ended"] += 1
            finally:
                STREAMS["open"] -= 1
            self.close_connection = True
        elif path == "/streams":
            self._reply(json.dumps(STREAMS).encode())
        elif path == "/headers":
            self._reply(json.dumps({"path": self.path, "headers": dict(self.headers)}).encode())
        elif path == "/big":
            size = int(self.path.split("n=", 1)[1]) if "n=" in self.path else 1 << 20
            block = bytes(range(256)) * 1024
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            sent = 0
            while sent < size:
                piece = block[:size - sent]
                self.wfile.write(piece)
                sent += len(piece)
        else:
            self._reply(PAGE, "text/html; charset=utf-8")

    def do_POST(self) -> None:
        digest, total = hashlib.sha256(), 0
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunk = self.rfile.read(size)
                self.rfile.readline()
                digest.update(chunk)
                total += len(chunk)
        else:
            left = int(self.headers.get("Content-Length", "0"))
            while left:
                chunk = self.rfile.read(min(left, 1 << 20))
                digest.update(chunk)
                total += len(chunk)
                left -= len(chunk)
        self._reply(json.dumps({"sha256": digest.hexdigest(), "bytes": total}).encode())


if __name__ == "__main__":
    port = int(sys.argv[1])
    host = sys.argv[2] if len(sys.argv) > 2 else "0.0.0.0"
    http.server.ThreadingHTTPServer((host, port), Handler).serve_forever()
