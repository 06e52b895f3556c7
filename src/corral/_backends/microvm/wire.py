"""The host half of the agent protocol's framing: one JSON object per line (contract in
``agent.py``'s docstring). Shared by the keeper (which talks to the guest and to clients) and the
client; the guest agent has its own copy of the few lines it needs, being standard-library only
and on the other side of the boundary.

Everything read here comes from an untrusted peer (the guest, whose code may be hostile): lines
are bounded, and a line that is not a JSON object is a protocol error, never a crash.
"""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import Iterator
from typing import Any

__all__ = ["MAX_LINE", "ProtocolError", "b64", "encode", "read_lines", "read_one", "unb64"]

MAX_LINE = 4 << 20
_CHUNK = 256 * 1024


class ProtocolError(Exception):
    """The peer broke the framing (an oversized line, or one that is not a JSON object)."""


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: object) -> bytes:
    if not isinstance(text, str):
        raise ProtocolError("data must be a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise ProtocolError(f"bad base64 data: {exc}") from None


def read_lines(sock: socket.socket) -> Iterator[dict[str, Any]]:
    """The messages ``sock`` sends until it closes (then the iterator ends)."""
    buffer = bytearray()
    searched = 0  # the bytes of an unfinished line already searched for its newline
    while True:
        try:
            chunk = sock.recv(_CHUNK)
        except OSError:
            return
        if not chunk:
            return
        buffer += chunk
        while True:
            end = buffer.find(b"\n", searched)
            if end < 0:
                if len(buffer) > MAX_LINE:
                    raise ProtocolError(f"a line longer than {MAX_LINE} bytes")
                searched = len(buffer)
                break
            line = bytes(buffer[:end])
            del buffer[:end + 1]
            searched = 0
            if not line.strip():
                continue
            yield _decode(line)


def _decode(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError:
        raise ProtocolError(f"not JSON: {line[:120]!r}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"not a JSON object: {line[:120]!r}")
    return message


def read_one(sock: socket.socket, limit: int = MAX_LINE) -> dict[str, Any] | None:
    """The first message ``sock`` sends, taking not one byte past its newline: what follows
    may be the next reader's (a port connection's raw stream). None when it closes first;
    ``OSError`` (a timeout among them) when reading fails."""
    line = bytearray()
    while True:
        # Peek, then take only up to the newline; bytes before it are this line's either way.
        peeked = sock.recv(_CHUNK, socket.MSG_PEEK)
        if not peeked:
            return None
        end = peeked.find(b"\n")
        want = len(peeked) if end < 0 else end + 1
        while want:
            taken = sock.recv(want)
            if not taken:
                return None
            line += taken
            want -= len(taken)
        if len(line) > limit:
            raise ProtocolError(f"a line longer than {limit} bytes")
        if end >= 0:
            break
    return _decode(bytes(line))
