"""The host's readers of the microVM guest's lines (``wire.read_lines``, ``Vm.read_line``): the
guest is untrusted, so a line is bounded and whole messages come out however the bytes are
cut."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from corral._backends.microvm.vm import Vm
from corral._backends.microvm.wire import MAX_LINE, ProtocolError, read_lines
from corral.errors import BackendError

_senders: list[threading.Thread] = []


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    yield ours, theirs
    # The reader's end first: a sender still writing (a test stopped reading on purpose) gets
    # EPIPE and ends; only then is its socket closed, so it never writes to a number reused.
    ours.close()
    while _senders:
        _senders.pop().join(timeout=60)
    theirs.close()


def send_cut(sock: socket.socket, data: bytes, size: int) -> None:
    """``data`` in pieces of ``size`` bytes, from another thread (a pipe's buffer is small);
    it stops when the reader's end is closed."""
    def run() -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for start in range(0, len(data), size):
                sock.sendall(data[start:start + size])
            sock.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=run, daemon=True)
    _senders.append(sender)
    sender.start()


def test_read_lines_are_whole_however_cut(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    big = "y" * (MAX_LINE - 20)
    stream = b'{"a": 1}\n\n{"b": "' + big.encode() + b'"}\n{"c": 3}\n'
    send_cut(theirs, stream, 7001)
    assert list(read_lines(ours)) == [{"a": 1}, {"b": big}, {"c": 3}]


def test_read_lines_refuses_a_line_past_the_limit(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    send_cut(theirs, b'{"a": 1}\n' + b"x" * (MAX_LINE + 2), 65536)
    lines = read_lines(ours)
    assert next(lines) == {"a": 1}
    with pytest.raises(ProtocolError, match="longer than"):
        next(lines)


class _Guest:
    """What ``Vm.read_line`` asks of its VM: a live guest, and errors in its words."""

    def _check(self, deadline: float, waiting_for: str) -> None:
        if time.monotonic() > deadline:
            raise BackendError(f"deadline passed waiting for {waiting_for}")

    def _error(self, what: str) -> BackendError:
        return BackendError(what)


def test_vm_read_line_keeps_what_follows_and_bounds_a_line(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    guest, buffer = _Guest(), bytearray()
    send_cut(theirs, b'{"ready": 1}\n{"next": 2}\n' + b"z" * (MAX_LINE + 2), 4097)
    deadline = time.monotonic() + 60
    assert Vm.read_line(guest, ours, buffer, deadline, "ready") == {"ready": 1}  # type: ignore[arg-type]
    assert Vm.read_line(guest, ours, buffer, deadline, "next") == {"next": 2}  # type: ignore[arg-type]
    with pytest.raises(BackendError, match="longer than"):
        Vm.read_line(guest, ours, buffer, deadline, "more")  # type: ignore[arg-type]


def test_a_command_whose_time_ran_out_before_it_started_is_a_timeout_not_a_failure() -> None:
    """On a busy host the guest may see a command's deadline pass before its program starts:
    that is the caller's timeout (exit 124), as on the other tiers, not the VM failing."""
    import time

    from corral._backends._linux.process_io import OutputStream
    from corral._backends.microvm.backend import MicrovmBackend
    from corral.backends import ExecRequest

    request = ExecRequest(argv=["sleep", "10"], cwd="/workspace", env={}, timeout_s=0.5)
    outcome = MicrovmBackend._failed(
        request, {"kind": "timeout", "message": "the command did not start before its timeout"},
        OutputStream("stdout", 1024, None), OutputStream("stderr", 1024, None),
        time.monotonic())
    assert outcome.timed_out and outcome.exit_code == 124
