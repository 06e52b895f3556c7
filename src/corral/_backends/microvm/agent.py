"""The guest agent: runs inside the microVM (as ``python3 -I -S /corral/agent.py``), never on the
host. Standard library only: it runs on the template's python3, not Corral's virtualenv.

Protocol on the virtio-serial port ``corral.agent``: one JSON object per line each way.
Host to guest::

    {"op": "exec", "id": N, "argv": [...], "cwd": "/workspace", "env": {...}, "timeout": S}
    {"op": "ping", "id": N}

Guest to host: ``{"ready": true, "release": ...}`` once, then for each request either
``{"id": N, "stream": "stdout"|"stderr", "data": BASE64}`` frames followed by
``{"id": N, "exit": CODE}`` (a negative code is the killing signal, as in ``subprocess``), or
``{"id": N, "error": MESSAGE}``, or ``{"id": N, "pong": true}``. One request runs at a time in
this first slice; the command's whole process group is killed when it returns or times out.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import threading
import time
from typing import IO, Any

PORT_NAME = "corral.agent"
_CHUNK = 64 * 1024


def _find_port() -> str:
    root = "/sys/class/virtio-ports"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for entry in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            try:
                with open(os.path.join(root, entry, "name")) as f:
                    if f.read().strip() == PORT_NAME:
                        return f"/dev/{entry}"
            except OSError:
                continue
        time.sleep(0.01)
    raise SystemExit(f"corral-agent: no virtio-serial port named {PORT_NAME}")


class Channel:
    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        self._reader = os.fdopen(fd, "rb", buffering=0)
        self._writer = os.fdopen(os.dup(fd), "wb", buffering=0)
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            self._writer.write(data)

    def lines(self) -> Any:
        buffer = b""
        while True:
            chunk = self._reader.read(_CHUNK)
            if not chunk:
                # The host end is not connected yet (or went away): virtio-serial reads EOF.
                time.sleep(0.01)
                continue
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if line.strip():
                    yield line


def _pump(channel: Channel, rid: int, name: str, stream: IO[bytes]) -> None:
    while True:
        data = stream.read1(_CHUNK) if hasattr(stream, "read1") else stream.read(_CHUNK)
        if not data:
            return
        channel.send({"id": rid, "stream": name, "data": base64.b64encode(data).decode()})


def _exec(channel: Channel, rid: int, request: dict[str, Any]) -> None:
    argv = request.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        channel.send({"id": rid, "error": "argv must be a non-empty list of strings"})
        return
    env = request.get("env") or {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/workspace"}
    timeout = float(request.get("timeout") or 60)
    try:
        proc = subprocess.Popen(argv, cwd=request.get("cwd") or "/workspace", env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        channel.send({"id": rid, "error": f"cannot start {argv[0]!r}: {exc.strerror}"})
        return
    assert proc.stdout is not None and proc.stderr is not None
    pumps = [threading.Thread(target=_pump, args=(channel, rid, name, stream), daemon=True)
             for name, stream in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for pump in pumps:
        pump.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = -signal.SIGKILL
    # Whatever the command left behind in its group dies with it.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for pump in pumps:
        pump.join(timeout=5)
    channel.send({"id": rid, "exit": code})


def main() -> None:
    channel = Channel(_find_port())
    channel.send({"ready": True, "release": os.uname().release})
    for line in channel.lines():
        try:
            request = json.loads(line)
            rid = int(request["id"])
            op = request["op"]
        except (ValueError, KeyError, TypeError):
            channel.send({"id": None, "error": "bad request line"})
            continue
        if op == "ping":
            channel.send({"id": rid, "pong": True})
        elif op == "exec":
            _exec(channel, rid, request)
        else:
            channel.send({"id": rid, "error": f"unknown op {op!r}"})


if __name__ == "__main__":
    main()
