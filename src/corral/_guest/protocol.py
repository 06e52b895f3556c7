"""The agent protocol's pieces both sides use: framing, limits and the error a request ends with.

One JSON object per line each way, on the virtio-serial port ``corral.agent`` (the whole
protocol is in ``docs/design/guest-agent.md``). The host's keeper and client import this module
(through ``corral._backends.microvm.wire``), and the guest agent runs it: standard library only.

Everything read here comes from an untrusted peer (the guest, whose code may be hostile, or a
host-side client): lines are bounded, and a line that is not a JSON object is a protocol error,
never a crash.
"""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import Iterator
from typing import Any

__all__ = ["AGENT_VERSION", "CHUNK", "MAX_LINE", "PORT_NAME", "AgentError", "Message",
           "ProtocolError", "b64", "encode", "read_lines", "read_one", "unb64"]

AGENT_VERSION = 1  # sent in ``ready``; bump when the host must tell agents apart
PORT_NAME = "corral.agent"  # the virtio-serial port's name
MAX_LINE = 4 << 20
CHUNK = 64 << 10  # the most bytes one "out" or "data" message carries
_CHUNK = 256 * 1024

Message = dict[str, Any]


class ProtocolError(Exception):
    """The peer broke the framing (an oversized line, or one that is not a JSON object)."""


class AgentError(Exception):
    """A request failed in the guest; ``kind`` is one of the protocol's error kinds
    (``docs/design/guest-agent.md``), sent as ``{"id", "error": {"kind", "message"}}``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def encode(message: Message) -> bytes:
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


def read_lines(sock: socket.socket) -> Iterator[Message]:
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


def _decode(line: bytes) -> Message:
    try:
        message = json.loads(line)
    except ValueError:
        raise ProtocolError(f"not JSON: {line[:120]!r}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"not a JSON object: {line[:120]!r}")
    return message


def read_one(sock: socket.socket, limit: int = MAX_LINE) -> Message | None:
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
