"""A long-lived gVisor sandbox with the in-sandbox helper (``inside``): issue 14's design.

Used by ``GvisorBackend.exec`` only behind the experimental opt-in (see the backend's
docstring for what is left); the bench (``bench/bench_gvisor.py``, series
``resident_command``) and ``tests/integration/test_gvisor_resident.py`` drive it directly, to
measure the design and to hold the per-command guarantees it keeps (filter, identity, own
``/tmp`` and PID namespace, tree killed on return and on timeout, idle stop).

One ``runsc run`` per resident sandbox, attached, with the helper as the container's init and
runsc's stdin/stdout as the helper's channel (``runsc create`` cannot be given pipes: the
sandbox inherits them and ``create`` waits for their EOF). ``setpriv --pdeathsig KILL`` ties
runsc to the thread that spawned it (the spawner thread lives as long as Corral), and the
Sentry dies with runsc, so a resident sandbox never outlives its Corral process.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import errno
import json
import logging
import subprocess
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..._core.fsafe import remove_tree
from ...errors import BackendError
from .._linux import ondemand
from .._linux.static_helper import build_static_helper
from .bundle import write_config
from .runsc import Runsc

__all__ = ["OnDemand", "Resident", "ResidentDied", "ResidentIO", "ResidentResult",
           "ensure_launcher", "helper_config"]

_HELPER_SOURCE = (Path(__file__).with_name("inside.py")).read_text()
_LAUNCHER_SOURCE = Path(__file__).with_name("run.c")
# Inside gVisor's kernel only (the Sentry is the runtime uid on the host): enough to give each
# command its own mount and PID namespace and to drop to 1000 (SETPCAP: to empty the bounding set).
_HELPER_CAPS = ["CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_SYS_ADMIN"]
_START_TIMEOUT_S = 20.0
# How long a close waits for runsc to end on its own, and again after SIGKILL.
_STOP_WAIT_S = 5.0
# The longest line the helper may send: its longest is a 64 KiB output chunk in base64
# (~87 KiB). The helper lives in the sandbox: a longer line, or one that is not its protocol,
# ends the resident rather than fill the host's memory or stop the reader.
_MAX_LINE = 1 << 20

logger = logging.getLogger(__name__)


def ensure_launcher(parent: Path) -> Path:
    """The directory bound read-only at ``/.corral``: the launcher (``run.c``) and the
    namespace tier's seccomp program (``filter``); see ``build_static_helper``."""
    return build_static_helper(parent, _LAUNCHER_SOURCE, "run", "the gVisor launcher")


def helper_config(command_config: Mapping[str, Any], launcher: Path,
                  python: str = "python3") -> dict[str, Any]:
    """The resident sandbox's spec: a command's spec (``bundle.build_config``) whose process is
    the helper, as root inside with ``_HELPER_CAPS``, and ``launcher`` (``ensure_launcher``)
    at ``/.corral``. The OCI seccomp profile is dropped: it would forbid the launcher's
    ``unshare`` and ``mount``; the launcher installs the namespace tier's filter into every
    command itself, as its last step before exec."""
    config = copy.deepcopy(dict(command_config))
    config["mounts"].append({"destination": "/.corral", "type": "bind", "source": str(launcher),
                             "options": ["bind", "ro", "nosuid", "nodev"]})
    process = config["process"]
    process["args"] = [python, "-I", "-S", "-c", _HELPER_SOURCE]
    process["env"] = ["PATH=/usr/bin:/bin"]
    process["cwd"] = "/"
    process["user"] = {"uid": 0, "gid": 0}
    process["terminal"] = False
    process["capabilities"] = {kind: list(_HELPER_CAPS) for kind in (
        "bounding", "effective", "permitted")} | {"inheritable": [], "ambient": []}
    process["rlimits"] = [r for r in process["rlimits"] if r["type"] != "RLIMIT_NPROC"]
    config["linux"].pop("seccomp", None)
    return config


@dataclass(slots=True)
class ResidentResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    cpu_s: float
    peak_rss_bytes: int
    timed_out: bool = False
    killed: bool = False
    #: execve failed with this errno (the program cannot be run); ``exit_code`` is then 127/126.
    exec_errno: int | None = None
    #: the cgroup of the resident it ran in (``Resident.group``)
    group: str = ""


OutputSink = Callable[[str, bytes], None]


class ResidentIO:
    """An interactive command's stdin (``ProcessIO`` without a terminal), from any thread."""

    def __init__(self, resident: Resident, command_id: int) -> None:
        self._resident = resident
        self._command_id = command_id

    def write(self, data: bytes) -> None:
        if data:
            self._resident.send_stdin(self._command_id, data, close=False)

    def close_stdin(self) -> None:
        self._resident.send_stdin(self._command_id, b"", close=True)

    def resize(self, rows: int, cols: int) -> None:
        """Not a terminal: nothing to resize (a terminal takes the per-command path)."""


@dataclass(slots=True)
class _Pending:
    key: str
    on_output: OutputSink | None
    done: threading.Event = field(default_factory=threading.Event)
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    reply: dict[str, Any] | None = None
    killed: bool = False


class ResidentDied(BackendError):
    """The resident sandbox ended under a command (its Sentry killed, gVisor crashed).
    ``group`` names the cgroup it ran in, for the caller to ask why (the OOM killer?)."""

    def __init__(self, message: str, group: str) -> None:
        super().__init__(message)
        self.group = group


class Resident:
    """One running helper sandbox. Thread-safe: commands may run concurrently. ``group`` is
    only a label: the cgroup its owner placed it in."""

    def __init__(self, runsc: Runsc, bundle: Path, container_id: str,
                 config: Mapping[str, Any], launcher: Path,
                 spawn: Callable[[list[str]], subprocess.Popen[bytes]],
                 on_close: Callable[[], None] | None = None, group: str = "",
                 python: str = "python3") -> None:
        self.group = group
        self._on_close = on_close
        self._runsc = runsc
        self._bundle = bundle
        self._container_id = container_id
        write_config(bundle, helper_config(config, launcher, python))
        argv = ["setpriv", "--pdeathsig", "KILL", "--",
                *runsc.run_argv(bundle=bundle, container_id=container_id)]
        self._proc = spawn(argv)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin: IO[bytes] = self._proc.stdin
        self._stdout: IO[bytes] = self._proc.stdout
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._next = 1
        self._ready = threading.Event()
        self._closed = False
        self._up = False
        self._broken: str | None = None  # how the helper broke its protocol, if it did
        self._reader = threading.Thread(target=self._read, name="corral-resident", daemon=True)
        self._reader.start()
        if not self._ready.wait(_START_TIMEOUT_S) or not self._up:
            self.close()
            raise BackendError("the resident gVisor sandbox did not start: "
                               f"{runsc.error_of(bundle) or 'no answer from its helper'}")

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _send(self, message: Mapping[str, Any]) -> None:
        with self._lock:
            self._stdin.write(json.dumps(message).encode() + b"\n")
            self._stdin.flush()

    def _read(self) -> None:
        try:
            # Bounded: a line is read whole only up to _MAX_LINE bytes.
            while line := self._stdout.readline(_MAX_LINE + 1):
                if len(line) > _MAX_LINE:
                    raise ValueError(f"a line longer than {_MAX_LINE} bytes")
                self._dispatch(json.loads(line))
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            self._broken = f"its helper broke the protocol ({exc!s:.200})"
            logger.warning("resident gVisor sandbox %s: %s; stopping it", self._container_id,
                           self._broken)
            self._proc.kill()  # the Sentry goes with runsc
        self._ready.set()  # runsc exited: a start still waiting fails now, not at its deadline
        for pending in list(self._pending.values()):  # the sandbox died: nobody will answer
            pending.done.set()

    def _dispatch(self, message: dict[str, Any]) -> None:
        if message.get("ready"):
            self._up = True
            self._ready.set()
            return
        pending = self._pending.get(message.get("id", -1))
        if pending is None:
            return
        if "out" in message:
            data = base64.b64decode(message["data"])
            if pending.on_output is not None:
                pending.on_output(message["out"], data)
            else:
                target = pending.stdout if message["out"] == "stdout" else pending.stderr
                target += data
        else:
            pending.reply = message
            pending.done.set()

    @property
    def busy(self) -> int:
        """How many commands are running."""
        return len(self._pending)

    def send_stdin(self, command_id: int, data: bytes, *, close: bool) -> None:
        """More input for a running interactive command (dropped once it has ended)."""
        if command_id not in self._pending:
            return
        with contextlib.suppress(OSError, ValueError):  # the sandbox is gone: run() reports it
            self._send({"id": 0, "op": "close_stdin" if close else "stdin",
                        "target": command_id, "data": base64.b64encode(data).decode()})

    def kill(self, key: str) -> bool:
        """Kill the running command started with ``key`` (its whole PID namespace)."""
        for command_id, pending in list(self._pending.items()):
            if pending.key == key and not pending.done.is_set():
                pending.killed = True
                with contextlib.suppress(OSError, ValueError):
                    self._send({"id": -command_id, "op": "kill", "target": command_id})
                return True
        return False

    def run(self, argv: list[str], *, env: Mapping[str, str], cwd: str = "/workspace",
            tmp_bytes: int = 64 << 20, nproc: int = 128, timeout: float = 30.0,
            key: str = "", on_output: OutputSink | None = None, stdin: bytes | None = None,
            on_start: Callable[[ResidentIO], None] | None = None) -> ResidentResult:
        """Run one command to its end. ``on_output(stream, data)`` (from the reader thread)
        gets the output instead of the result; ``key`` names it for ``kill``. ``stdin`` is
        its input, then EOF; with ``on_start`` it is interactive instead: ``on_start`` gets a
        ``ResidentIO`` for more input once the command is on its way, and EOF comes from
        ``close_stdin`` (or the command's end)."""
        with self._lock:
            command_id = self._next
            self._next += 1
        pending = self._pending[command_id] = _Pending(key, on_output)
        timed_out = False
        try:
            request: dict[str, Any] = {"id": command_id, "op": "exec", "argv": argv,
                                       "env": dict(env), "cwd": cwd, "tmp_bytes": tmp_bytes,
                                       "nproc": nproc}
            if stdin:
                request["stdin"] = base64.b64encode(stdin).decode()
            if on_start is not None:
                request["interactive"] = True
            try:
                self._send(request)
            except (OSError, ValueError):
                pass  # the sandbox is gone: the reader has ended, reply stays None
            else:
                if on_start is not None:
                    try:
                        on_start(ResidentIO(self, command_id))
                    except BaseException:  # nobody will feed or wait for it: it ends now
                        with contextlib.suppress(OSError, ValueError):
                            self._send({"id": -command_id, "op": "kill", "target": command_id})
                        pending.done.wait(_START_TIMEOUT_S)
                        raise
            if not pending.done.wait(timeout) and not self._closed:
                timed_out = True
                with contextlib.suppress(OSError, ValueError):
                    self._send({"id": -command_id, "op": "kill", "target": command_id})
                pending.done.wait(_START_TIMEOUT_S)
            reply = pending.reply
        finally:
            del self._pending[command_id]
        if reply is None:
            why = self._broken or self._runsc.error_of(self._bundle) or "no reason logged"
            raise ResidentDied(f"the resident gVisor sandbox died: {why}", self.group)
        if "error" in reply:
            raise BackendError(f"the command could not start: {reply['error']['error']}")
        result = reply["exit"]
        if "exec_errno" in result:
            failed = int(result["exec_errno"])
            return ResidentResult(exit_code=127 if failed == errno.ENOENT else 126,
                                  stdout=b"", stderr=b"", cpu_s=0.0, peak_rss_bytes=0,
                                  exec_errno=failed, group=self.group)
        return ResidentResult(exit_code=int(result["code"]), stdout=bytes(pending.stdout),
                              stderr=bytes(pending.stderr), cpu_s=float(result["cpu_s"]),
                              peak_rss_bytes=int(result["peak_rss_bytes"]),
                              timed_out=timed_out, killed=pending.killed or timed_out,
                              group=self.group)

    def close(self) -> None:
        """Stop the sandbox: EOF to the helper (it kills its commands and exits), then runsc
        is killed if it lingers; its state and bundle are removed. Idempotent."""
        if self._closed:
            return  # and never again: the next resident may reuse the bundle path
        self._closed = True
        with contextlib.suppress(OSError, ValueError):
            self._stdin.close()
        self._stop()
        self._reader.join(timeout=_STOP_WAIT_S)
        self._stdout.close()
        self._runsc.remove_state(self._container_id)
        remove_tree(self._bundle)
        if self._on_close is not None:
            self._on_close()

    def _stop(self) -> None:
        """Wait for runsc to end on the helper's EOF, kill it if it lingers, and give up on
        it after that, bounded either way: a frozen runsc (its sandbox paused) cannot die
        before it thaws. Its group's kill (``on_close``) and the sandbox's destroy, which
        thaws first, end it; a ``TimeoutExpired`` from here was a destroy's 500."""
        try:
            self._proc.wait(timeout=_STOP_WAIT_S)
            return
        except subprocess.TimeoutExpired:
            self._proc.kill()
        try:
            self._proc.wait(timeout=_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("resident gVisor sandbox %s did not end %.0f s after SIGKILL (its "
                           "sandbox is paused, or runsc is stuck in the kernel); left to its "
                           "cgroup's kill", self._container_id, _STOP_WAIT_S)

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None and self._reader.is_alive()


class OnDemand(ondemand.OnDemand[Resident]):
    """A resident gVisor sandbox started on demand (``_linux.ondemand``)."""

    def kill(self, key: str) -> bool:
        resident = self.current
        return resident is not None and resident.kill(key)

    def run(self, argv: list[str], **kwargs: Any) -> ResidentResult:
        with self.use() as resident:
            return resident.run(argv, **kwargs)
