"""The microVM tier: every sandbox is a small QEMU ``-M microvm`` guest with a kernel of its own.

What it shares with the host tiers (``HostBackedBackend``): the sandbox's network namespace
(only ``lo``; QEMU runs in it and the guest has no network device at all), its cgroup (QEMU's
memory, CPU and host tasks), its host uid (QEMU's), the egress gateway's per-command listener
(bound in the namespace; the keeper connects guest tunnels to it) and the sweep of crash
leftovers. What is its own:

* **The workspace is a qcow2 chain** (``disk``): a writable top per sandbox over read-only
  layers. Snapshots seal the top into a layer (O(1)); quota is the ext4 size inside, so a full
  workspace is ENOSPC in the guest. The host never mounts it; files go through the agent
  (``files``).
* **A keeper process per running VM** (``keeper``) owns QEMU, its QMP socket and the agent
  channel, and serves every Corral process on the host. The VM starts at ``create`` (restored
  from the template's warm snapshot, or resumed from a memory image) and stops at ``destroy``,
  or when its workspace is sealed or reset (nothing runs then, so nothing is lost; the next use
  restores it again).
* **Commands run in the guest** (``agent``): each in its own PID and mount namespace with a
  fresh ``/tmp``, in its own guest cgroup (pids, memory, usage, kill), as uid 1000, killed with
  its whole tree on return and on timeout.
* **Ports are reached through the agent** (``open_port``): the guest has no network device, so
  a port connection is a unix socket to the keeper, relayed to a TCP connection the agent makes
  to ``127.0.0.1:<port>`` inside the guest. Nothing of it connects on the host.
* **No volumes or data mounts yet**: the guest's devices are fixed by the warm snapshot it
  restores from, so a spec with ``mounts`` is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._core import flocks
from ..._core.fsafe import read_regular, remove_tree
from ..._core.owner import owner_alive
from ..._core.privileged import privileged_env
from ..._settings import Settings
from ...backends import (
    BackendName,
    ExecOutcome,
    ExecRequest,
    Hibernated,
    HostCheck,
    Leftover,
    SandboxSpec,
    SealResult,
    WorkspaceFS,
)
from ...errors import BackendError, BackendUnavailable, CommandError
from ...models import ResourceTier, Usage
from .._linux import netns
from .._linux.cgroups import detect_cgroups
from .._linux.host import HostBackedBackend
from .._linux.notfound import NOT_FOUND_EXIT_CODE
from .._linux.process_io import OutputStream
from .._linux.supervise import TIMEOUT_EXIT_CODE
from .._linux.tmparchive import digest_of
from ..execlimits import check_exec_size
from .client import KeeperClient, open_port
from .files import VmFiles
from .keeper import CONFIG, ERROR, PIDFILE, SOCKET, KeeperConfig
from .sleeps import Sleep
from .wire import b64, unb64

__all__ = ["MicrovmBackend"]

log = logging.getLogger(__name__)

# QEMU's own memory next to the guest's RAM (TCG's translation cache, device state, the
# process): the sandbox cgroup allows RAM + this, so a guest can use all its RAM and a runaway
# QEMU still cannot take the host.
_QEMU_OVERHEAD_BYTES = 160 << 20
_HOST_TASKS = 128
# How long a command may run past its own timeout before the VM counts as hung: the agent
# kills on time; this is for a guest that stopped answering.
_GRACE_S = 20.0
# Saving a guest's memory writes its RAM (a few hundred MiB) to disk; emulated, slowly.
_HIBERNATE_TIMEOUT_S = 300.0
_START_DEADLINE_S = 90.0
_PROXY = re.compile(r"^http://127\.0\.0\.1:(\d+)$")
RUN_ROOT = Path("/run/corral-microvm")
# The child group of the sandbox's cgroup QEMU runs in (commands run inside the guest).
_VM_GROUP = "vm"
# The one QEMU that boots a template's warm snapshot runs as nobody: it touches no sandbox's
# files, and the snapshot it writes is re-owned by root before any sandbox uses it.
_WARM_UID = 65534


class _VmProcess:
    """The ``ProcessIO`` of one command running in the guest."""

    def __init__(self, client: KeeperClient, exec_id: int) -> None:
        self._client, self._id = client, exec_id

    def rebind(self, client: KeeperClient, exec_id: int) -> None:
        """The command goes on in a VM woken from hibernation, under a new id."""
        self._client, self._id = client, exec_id

    def write(self, data: bytes) -> None:
        for start in range(0, len(data), 1 << 20):
            self._client.notify("stdin", target=self._id, data=b64(data[start:start + (1 << 20)]))

    def close_stdin(self) -> None:
        self._client.notify("stdin_close", target=self._id)

    def resize(self, rows: int, cols: int) -> None:
        self._client.notify("resize", target=self._id, rows=rows, cols=cols)


class _Spawner:
    """What ``HostBackedBackend`` wants from ``_ready``: the thread entering namespaces."""

    def __init__(self) -> None:
        self.spawner = netns.Spawner()


class MicrovmBackend(HostBackedBackend):
    """See the module docstring. One instance per process and data directory."""

    name: BackendName = "microvm"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._dir = settings.home / "microvm"
        self._launcher: _Spawner | None = None
        self._lock = threading.Lock()
        self._clients: dict[str, KeeperClient] = {}
        self._keepers: dict[str, subprocess.Popen[bytes]] = {}
        # Commands this process runs, by command id: (sandbox, keeper client, exec id), for
        # kill_command and for a hibernate to give back.
        self._running: dict[str, tuple[str, KeeperClient, int]] = {}
        # The last hibernate with memory of each sandbox (``sleeps``), by sandbox id.
        self._sleeps: dict[str, Sleep] = {}
        self._kernel: Any = None
        self._accel: Any = None

    # -- set-up ----------------------------------------------------------------------------

    def check_host(self) -> list[HostCheck]:
        from .hostcheck import host_checks

        return host_checks(self._settings).fresh()

    def _ready(self) -> _Spawner:
        if self._launcher is None:
            with self._lock:
                if self._launcher is None:
                    from .hostcheck import host_checks

                    # Remembered for this boot (see hostcache): each CLI call is a process.
                    failed = [c for c in host_checks(self._settings).cached() if not c.ok]
                    if failed:
                        lines = "; ".join(f"{c.name}: {c.detail} (fix: {c.fix})"
                                          for c in failed)
                        raise BackendUnavailable(
                            f"this host cannot run microVM sandboxes: {lines}. Run `corral "
                            "doctor` for details.")
                    from .accel import choose_accel
                    from .kernel import find_kernel

                    self._accel = choose_accel(allow_tcg=self._settings.microvm_allow_tcg)
                    self._kernel = find_kernel(self._settings.microvm_cache)
                    if self._kernel is None:
                        raise BackendUnavailable(
                            "the microVM guest kernel is not built; build it once with "
                            "`python -m corral._backends.microvm.kernel` (about 5 minutes)")
                    self._attach_cgroups(detect_cgroups(self._instance))
                    self._launcher = _Spawner()
        return self._launcher

    def _limits(self, tier: ResourceTier) -> ResourceTier:
        return dataclasses.replace(tier, memory_bytes=tier.memory_bytes + _QEMU_OVERHEAD_BYTES,
                                   pids=_HOST_TASKS)

    # -- paths ------------------------------------------------------------------------------

    def _run_path(self, sandbox_id: str) -> Path:
        # Sockets live here: a short path under /run (sun_path holds 107 bytes), gone on reboot
        # with the VMs themselves.
        return RUN_ROOT / f"{self._settings.instance}-{sandbox_id}"

    def _disk_dir(self, sandbox_id: str) -> Path:
        return self._dir / "sandboxes" / sandbox_id

    def _top(self, sandbox_id: str) -> Path:
        """The sandbox's writable disk. Its name changes at each live seal (QEMU knows its
        disks by name and reopens them by name, so a disk in use is never renamed); ``top``,
        a symlink beside it, names the current one."""
        pointer = self._disk_dir(sandbox_id) / "top"
        try:
            return pointer.parent / os.readlink(pointer)
        except OSError:
            return pointer.parent / "top-0.qcow2"

    def _point_top(self, sandbox_id: str, name: str) -> None:
        pointer = self._disk_dir(sandbox_id) / "top"
        tmp = pointer.with_name(".top.tmp")
        tmp.unlink(missing_ok=True)
        os.symlink(name, tmp)
        os.replace(tmp, pointer)

    def _fresh_top_name(self, sandbox_id: str) -> Path:
        return self._disk_dir(sandbox_id) / f"top-{secrets.token_hex(4)}.qcow2"

    def _layers_dir(self) -> Path:
        return self._dir / "layers"

    def _layer_path(self, layer_id: str) -> Path:
        return self._layers_dir() / f"{layer_id}.qcow2"

    # -- lifecycle --------------------------------------------------------------------------

    def create(self, spec: SandboxSpec) -> None:
        _refuse_mounts(spec)
        self._ready()
        try:
            self.cgroups.create_sandbox(spec.id, self._limits(spec.tier))
            self._ensured.add(spec.id)
            netns.create_netns(self._netns_path(spec.id))
            self._new_top(spec)
            # The VM runs from now on (create -> first command is one hop). Only here does a
            # memory image apply: a VM restarted later boots from its disk like any other.
            self._client(spec, memory_image=spec.memory_image)
        except BaseException:
            with contextlib.suppress(BackendError, OSError):
                self.destroy(spec)
            raise

    def _new_top(self, spec: SandboxSpec) -> None:
        from . import disk

        top = self._fresh_top_name(spec.id)
        # QEMU (the sandbox's uid) makes live-sealed tops and memory saves in this directory.
        top.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chown(top.parent, spec.uid, spec.uid)
        backing = (self._layer_path(spec.layers[0]) if spec.layers
                   else disk.base_disk(spec.tier.disk_bytes,
                                       self._settings.microvm_cache / "disks"))
        old = self._top(spec.id)
        disk.create_top(top, backing, uid=spec.uid, gid=spec.uid)
        self._point_top(spec.id, top.name)
        if old != top:
            old.unlink(missing_ok=True)

    def _root(self, name: str) -> Any:
        """The read-only root image of template ``name`` (built and cached on first use)."""
        from . import rootimage

        template = self._template(name)
        if template.root is None:
            # A host-backed template (``base``: the host's own /usr on the other tiers) cannot
            # be a VM's disk; this tier's base is a small Debian root of its own.
            template = self._vm_base_template()
        image = rootimage.root_image(template, self._settings.microvm_cache / "roots")
        if image.build_s > 0:
            from .cachesweep import sweep

            sweep(self._settings.microvm_cache,
                  max_bytes=self._settings.microvm_cache_max_bytes)
        return image

    def _vm_base_template(self) -> Any:
        from ..._templates import BUILTIN_SPECS, build_template, current_build
        from .._linux.template import load_template
        from .rootimage import BASE_SPEC

        templates = self._settings.microvm_cache / "templates"
        if current_build(templates, BASE_SPEC) is None:
            log.warning("building the microVM tier's base root (%s, Debian packages; once "
                        "per host, about a minute)", BASE_SPEC)
            build_template(BUILTIN_SPECS[BASE_SPEC], templates,
                           on_progress=lambda line: log.info("%s", line))
        ca = self._settings.home / "egress" / "ca.pem"
        return load_template(BASE_SPEC, templates,
                             extra_ca=ca.read_bytes() if ca.exists() else None)

    def destroy(self, spec: SandboxSpec) -> None:
        self._ready()
        self._ensured.discard(spec.id)
        with self._lock:
            client = self._clients.pop(spec.id, None)
            sleep = self._sleeps.pop(spec.id, None)
        if sleep is not None:
            sleep.lose("the sandbox was destroyed")
        if client is not None:
            client.close()
        with contextlib.suppress(BackendError, OSError):
            self.cgroups.freeze(spec.id, False)
        self.cgroups.kill(spec.id)  # QEMU is in it: the guest is gone at once
        self._stop_keeper(spec.id)
        self.cgroups.remove(spec.id)
        netns.remove_netns(self._netns_path(spec.id))
        remove_tree(self._disk_dir(spec.id))

    def _stop_keeper(self, sandbox_id: str) -> None:
        run = self._run_path(sandbox_id)
        _kill_keeper(run)
        proc = self._keepers.pop(sandbox_id, None)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        remove_tree(run)

    def _stop_vm(self, spec: SandboxSpec) -> None:
        """Stop the VM cleanly (the agent unmounts the workspace first)."""
        with self._lock:
            client = self._clients.pop(spec.id, None)
        if client is None and (self._run_path(spec.id) / SOCKET).exists():
            with contextlib.suppress(OSError):
                client = KeeperClient(self._run_path(spec.id) / SOCKET)
        if client is not None:
            with contextlib.suppress(BackendError):
                client.call("vm.quit", timeout=30)
            client.close()
        self._stop_keeper(spec.id)

    # -- the keeper -------------------------------------------------------------------------

    def _client(self, spec: SandboxSpec, *, memory_image: str | None = None,
                memory: Path | None = None, keep_commands: bool = False) -> KeeperClient:
        """The keeper's client, the VM started first if it is not running: booted (from the
        warm snapshot or cold), or restored from memory image ``memory_image`` (a memory
        snapshot's), or from ``memory`` (its own hibernated state; ``keep_commands``: its
        commands kept for ``attach``, else they run on as orphans)."""
        with self._lock:
            client = self._clients.get(spec.id)
            if client is not None and not client.closed:
                return client
        run = self._run_path(spec.id)
        with _start_lock(run):
            sock = run / SOCKET
            client = None
            if sock.exists():
                with contextlib.suppress(OSError):
                    client = KeeperClient(sock)
            if client is None:
                if memory_image:
                    memory = self._memory_state(memory_image)
                self._start_keeper(spec, memory=memory, keep_commands=keep_commands)
                client = KeeperClient(sock)
        with self._lock:
            old = self._clients.get(spec.id)
            if old is not None and not old.closed:
                client.close()
                return old
            self._clients[spec.id] = client
        return client

    def _start_keeper(self, spec: SandboxSpec, *, memory: Path | None = None,
                      keep_commands: bool = False) -> None:
        from . import disk, warm

        _refuse_mounts(spec)
        self._ready()
        self._ensure_host_pieces(spec)
        run = self._run_path(spec.id)
        _kill_keeper(run)
        for name in (SOCKET, ERROR, PIDFILE):
            (run / name).unlink(missing_ok=True)
        memory_mib = max(128, spec.tier.memory_bytes >> 20)
        image = self._root(spec.template)
        image_path = str(memory) if memory is not None else ""
        if image_path:
            mode, snapshot = "memory", None
        elif not self._settings.microvm_warm:
            mode, snapshot = "cold", None
        else:
            snapshot = warm.warm_snapshot(
                self._kernel, image, memory_mib, self._settings.microvm_cache / "warm",
                accel=self._accel, uid=_WARM_UID, gid=_WARM_UID,
                disks=self._settings.microvm_cache / "disks", disk_bytes=spec.tier.disk_bytes)
            mode = "warm"
        group = f"{spec.id}/{_VM_GROUP}"
        # Each hierarchy's group on its own (cgroup v1 has one per controller): a start again
        # after one whose clean-up removed the group from some hierarchies and not others
        # (a QEMU slow to die) found it "existing" in the first and made none of the rest,
        # and QEMU's placement then failed on a missing cgroup.procs.
        for procs in self.cgroups.procs_files(group):
            procs.parent.mkdir(exist_ok=True)
        config = KeeperConfig(
            cgroup_procs=tuple(str(p) for p in self.cgroups.procs_files(group)),
            sandbox_id=spec.id, instance=self._instance, uid=spec.uid,
            kernel=str(self._kernel.vmlinux), root_image=str(image.path),
            top=str(self._top(spec.id)), memory_mib=memory_mib,
            cpus=max(1, math.ceil(spec.tier.cpus)), accel=self._accel.name,
            cpu_model=self._accel.cpu, mode=mode,
            warm_ram=str(snapshot.ram) if snapshot else "",
            warm_state=str(snapshot.state) if snapshot else "",
            memory_image=image_path, keep_commands=bool(image_path) and keep_commands,
            netns=str(self._netns_path(spec.id)),
            backing=tuple(str(entry["filename"])
                          for entry in disk.chain(self._top(spec.id))[1:]))
        config.dump(run / CONFIG)
        stderr = (run / "keeper.stderr").open("wb")

        def spawn() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                [sys.executable, "-m", "corral._backends.microvm.keeper", str(run)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                env=privileged_env(inherit=("PYTHONPATH",)), cwd="/",
                start_new_session=True, close_fds=True)

        try:
            proc = self._spawner().run(self._netns_path(spec.id), spawn)
        finally:
            stderr.close()
        self._keepers[spec.id] = proc
        deadline = time.monotonic() + _START_DEADLINE_S
        while not (run / SOCKET).exists():
            failure = _read(run / ERROR)
            if failure or proc.poll() is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
                why = failure or _read(run / "keeper.stderr")[-2000:] or (
                    f"the keeper exited with status {proc.returncode}")
                raise BackendError(f"the microVM of sandbox {spec.id} did not start: {why}")
            if time.monotonic() > deadline:
                _kill_keeper(run)
                raise BackendError(f"the microVM of sandbox {spec.id} did not start within "
                                   f"{_START_DEADLINE_S:.0f} s")
            time.sleep(0.002)

    def _ensure_runtime(self, spec: SandboxSpec) -> Path:
        # The host tiers' version mounts a host workspace; this tier's workspace is a disk.
        self._ensure_host_pieces(spec)
        return self._disk_dir(spec.id)

    def _ensure_host_pieces(self, spec: SandboxSpec) -> None:
        """Rebuild what a reboot or crash removed (netns pin, cgroup, run dir, disk top)."""
        self._ensure_netns_and_cgroup(spec)
        RUN_ROOT.mkdir(mode=0o700, exist_ok=True)
        self._run_path(spec.id).mkdir(mode=0o700, exist_ok=True)
        if not self._top(spec.id).exists():
            self._new_top(spec)

    # -- commands ---------------------------------------------------------------------------

    def exec(self, spec: SandboxSpec, request: ExecRequest) -> ExecOutcome:
        if request.build_root is not None:
            raise BackendUnavailable("image builds run their steps on the namespace tier")
        env = self._command_env(spec, request)
        check_exec_size(request.argv, env)
        client = self._client(spec)
        proxy = _PROXY.match(env.get("HTTP_PROXY", ""))
        fields: dict[str, Any] = {
            "argv": list(request.argv), "cwd": request.cwd, "env": env,
            "timeout": request.timeout_s,
            "stdin": "pipe" if request.interactive or request.stdin else "null",
            "pty": list(request.pty) if request.pty else None,
            "tmp_bytes": spec.tier.tmp_bytes, "pids": spec.tier.pids,
            "memory_bytes": spec.tier.memory_bytes,
            "egress_port": int(proxy.group(1)) if proxy else None,
            "tag": request.command_id or None,
            # The other tiers' syscall filter, installed by the guest's launcher before execve.
            "seccomp": _seccomp_program(),
        }
        started = time.monotonic()
        exec_id, events = client.start_exec(fields)
        process = _VmProcess(client, exec_id)
        if request.command_id:
            self._running[request.command_id] = (spec.id, client, exec_id)
        try:
            return self._follow(spec.id, request, client, exec_id, events, process, started)
        finally:
            if request.command_id:
                self._running.pop(request.command_id, None)

    def _follow(self, sandbox_id: str, request: ExecRequest, client: KeeperClient,
                exec_id: int, events: queue.Queue[dict[str, Any]], process: _VmProcess,
                started: float) -> ExecOutcome:
        out = OutputStream.for_request("stdout", request)
        err = OutputStream.for_request("stderr", request)
        deadline = started + request.timeout_s + _GRACE_S
        killed_at: float | None = None
        attached_again = False
        while True:
            wait = deadline - time.monotonic()
            try:
                message = events.get(timeout=max(0.0, wait))
            except queue.Empty:
                if killed_at is None:
                    client.notify("kill", target=exec_id)
                    killed_at = time.monotonic()
                    deadline = killed_at + 10.0
                    continue
                raise BackendError("the microVM stopped answering while a command ran; "
                                   "its sandbox may need to be destroyed") from None
            if "out" in message:
                data = unb64(message.get("data", ""))
                (err if message["out"] == "stderr" else out).feed(data)
            elif "started" in message and attached_again:
                pass  # its start was handled before the sandbox slept
            elif "started" in message:
                if request.stdin and not request.interactive:
                    process.write(request.stdin)
                    process.close_stdin()
                if request.on_start is not None and (request.interactive or request.pty):
                    try:
                        request.on_start(process)
                    except BaseException:
                        client.notify("kill", target=exec_id)
                        raise
            elif "exit" in message:
                return self._outcome(message["exit"], out, err, started)
            elif "error" in message:
                sleep = self._sleeps.get(sandbox_id)
                if sleep is None or not sleep.holds(request.command_id):
                    return self._failed(request, message["error"], out, err, started)
                # Its VM went to sleep with it: woken, it goes on where it was.
                assert request.command_id is not None
                disk = self._disk_dir(sandbox_id)
                back = sleep.take(request.command_id, still=disk.exists)
                client, exec_id, events = back.client, back.exec_id, back.events
                process.rebind(client, exec_id)
                self._running[request.command_id] = (sandbox_id, client, exec_id)
                deadline += back.slept_s
                attached_again = True

    @staticmethod
    def _outcome(exit_: Any, out: OutputStream, err: OutputStream,
                 started: float) -> ExecOutcome:
        if not isinstance(exit_, dict):
            raise BackendError("the microVM agent sent a malformed exit")
        timed_out = bool(exit_.get("timed_out"))
        code = TIMEOUT_EXIT_CODE if timed_out else int(exit_.get("code", 1))
        usage = Usage(wall_s=float(exit_.get("wall_s", time.monotonic() - started)),
                      cpu_s=float(exit_.get("cpu_s", 0.0)),
                      peak_memory_bytes=int(exit_.get("peak_memory_bytes", 0)),
                      oom_killed=bool(exit_.get("oom_killed")))
        return ExecOutcome(
            exit_code=code, stdout=out.finish(), stderr=err.finish(), timed_out=timed_out,
            usage=usage, stdout_truncated=out.dropped, stderr_truncated=err.dropped,
            stdout_bytes=bytes(out.raw), stderr_bytes=bytes(err.raw))

    @staticmethod
    def _failed(request: ExecRequest, error: Any, out: OutputStream, err: OutputStream,
                started: float) -> ExecOutcome:
        kind = error.get("kind") if isinstance(error, dict) else None
        message = str(error.get("message", "")) if isinstance(error, dict) else str(error)
        if kind == "not_found":
            err.feed(f"corral: command not found: {request.argv[0]}\n".encode())
            return MicrovmBackend._outcome(
                {"code": NOT_FOUND_EXIT_CODE, "wall_s": time.monotonic() - started},
                out, err, started)
        if kind == "timeout":  # its time ran out before it could start (a busy host)
            return MicrovmBackend._outcome(
                {"code": TIMEOUT_EXIT_CODE, "timed_out": True,
                 "wall_s": time.monotonic() - started}, out, err, started)
        if kind == "cwd":
            raise CommandError(message)
        if kind == "e2big":
            raise CommandError("the kernel refused the command's argv and environment as too "
                               "large (ARG_MAX or MAX_ARG_STRLEN, 128 KiB per entry); pass data "
                               "through files or stdin")
        raise BackendError(f"the microVM could not run the command: {message}")

    def kill_command(self, spec: SandboxSpec, command_id: str) -> bool:
        running = self._running.get(command_id)
        if running is not None and not running[1].closed:
            _, client, exec_id = running
            client.notify("kill", target=exec_id)
            return True
        if not (self._run_path(spec.id) / SOCKET).exists():
            return False
        return bool(self._client(spec).call("kill", tag=command_id))

    def busy(self, spec: SandboxSpec) -> bool:
        if not (self._run_path(spec.id) / SOCKET).exists():
            return False
        procs = self._client(spec).call("procs")
        return bool(procs.get("commands")) or bool(procs.get("orphans"))

    def pause(self, spec: SandboxSpec, paused: bool) -> None:
        # The agent freezes every command group, not the VM: files stay reachable.
        self._client(spec).call("freeze", frozen=paused)

    # -- hibernation (backends.Hibernation) ---------------------------------------------------

    keeps_processes = True

    def _memory_path(self, sandbox_id: str) -> Path:
        """A hibernated VM's RAM and device state, beside its disk (the sandbox's uid's
        directory: its QEMU writes the save and reads it back)."""
        return self._disk_dir(sandbox_id) / "hibernated.mem"

    def hibernate(self, spec: SandboxSpec) -> Hibernated:
        """With no command running: stop the VM (its agent unmounts the workspace first) and
        release its keeper, cgroup and network namespace; the qcow2 chain stays, and the wake
        boots it again. With commands running (the sandbox is paused: they are frozen): save
        the guest's memory and devices too, and stop it where it is; the wake restores it,
        and the commands this process follows go on (``sleeps``). Each command has a fresh
        ``/tmp`` in the guest, so there is no ``/tmp`` of the sandbox's to keep."""
        self._ready()
        if not self.busy(spec):
            return self.recover_hibernate(spec)
        memory = self._memory_path(spec.id)
        memory.unlink(missing_ok=True)
        tags = [tag for tag, (sandbox_id, _, _) in list(self._running.items())
                if sandbox_id == spec.id]
        sleep = Sleep(spec.id, tags)
        with self._lock:
            old = self._sleeps.get(spec.id)
            self._sleeps[spec.id] = sleep
        if old is not None:
            old.lose("the sandbox went to sleep again before they were taken back")
        try:
            self._client(spec).call("vm.hibernate", timeout=_HIBERNATE_TIMEOUT_S,
                                    memory_path=str(memory))
        except BaseException as exc:
            # Settled by recover_hibernate (without the memory, unless it was saved whole).
            sleep.lose(f"its memory could not be saved ({exc})")
            raise
        return self.recover_hibernate(spec)

    def recover_hibernate(self, spec: SandboxSpec) -> Hibernated:
        """Each step may be taken again (a stopped VM stays stopped): finished, always. A
        memory save that completed is kept (the save renames it into place whole), and the
        VM was then never run on: the wake restores it."""
        self._ready()
        memory = self._memory_path(spec.id)
        saved = memory.is_file()
        if saved:  # its keeper stopped the guest where the state was taken: nothing to quit
            with self._lock:
                client = self._clients.pop(spec.id, None)
            if client is not None:
                client.close()
            self._stop_keeper(spec.id)
        else:
            self._stop_vm(spec)
            with self._lock:
                sleep = self._sleeps.get(spec.id)
            if sleep is not None:
                sleep.lose("its VM was stopped without its memory")
        with contextlib.suppress(OSError):  # the keeper's socket and files, in /run (memory)
            remove_tree(self._run_path(spec.id))
        self._release_host_pieces(spec)
        if not saved:
            return Hibernated(tmp_bytes=0, digest="")
        return Hibernated(tmp_bytes=0, digest=digest_of(memory),
                          memory_bytes=memory.stat().st_size)

    def wake(self, spec: SandboxSpec, image: Hibernated) -> None:
        """Start the VM again: restored from its memory (thawed once the commands this
        process follows are attached again), or booted from its disk (the template's warm
        snapshot, as after any stop), so the call that woke it finds it running."""
        memory = self._memory_path(spec.id)
        with self._lock:
            sleep = self._sleeps.get(spec.id)
        if not image.memory_bytes:
            self._client(spec)
            if sleep is not None:
                sleep.lose("its VM was booted again from its disk")
            return
        if not memory.is_file():
            raise BackendError(f"the hibernated memory of sandbox {spec.id} is missing "
                               f"({memory}); its disk is intact: `corral rm` it, or ask the "
                               "operator")
        if image.digest and digest_of(memory) != image.digest:
            raise BackendError(f"the hibernated image of sandbox {spec.id} was changed on "
                               f"disk since it hibernated ({memory} no longer matches "
                               f"{image.digest}); it is not woken and left as it is")
        # Commands only this process could take back; another's (one that has ended since)
        # run on as orphans, as after a memory snapshot's restore.
        client = self._client(spec, memory=memory, keep_commands=sleep is not None)
        memory.unlink(missing_ok=True)  # loaded whole by the restore
        if sleep is not None:
            sleep.woke(lambda tag: (client, *client.start_exec({"tag": tag}, op="attach")))
        client.call("freeze", frozen=False)  # it slept paused: awake, it runs

    # -- ports ------------------------------------------------------------------------------

    def open_port(self, spec: SandboxSpec, port: int, timeout_s: float) -> socket.socket:
        """A unix socket to the VM's keeper, relayed to a TCP connection the guest agent made
        to ``127.0.0.1:port`` in the guest. The host tiers' version would connect in the
        sandbox's network namespace, where only QEMU runs: the guest's loopback is its own."""
        self._client(spec)  # the VM runs (a stopped one starts, as for any other use)
        return open_port(self._run_path(spec.id) / SOCKET, spec.id, port, timeout_s)

    # -- files and layers -------------------------------------------------------------------

    def files(self, spec: SandboxSpec) -> WorkspaceFS:
        return VmFiles(lambda: self._client(spec))

    def seal_workspace(self, spec: SandboxSpec, layer_id: str) -> SealResult:
        from . import disk

        self._ready()
        self._stop_vm(spec)
        self._layers_dir().mkdir(parents=True, exist_ok=True)
        layer = self._layer_path(layer_id)
        disk.seal(self._top(spec.id), layer, uid=spec.uid, gid=spec.uid)
        return SealResult(layers=(layer_id, *spec.layers), bytes_used=layer.stat().st_size,
                          squashed=False)

    def recover_seal(self, spec: SandboxSpec, layer_id: str) -> SealResult | None:
        from . import disk

        self._ready()
        self._stop_vm(spec)
        layer = self._layer_path(layer_id)
        layer.with_name(f".{layer.name}.tmp").unlink(missing_ok=True)  # a squash's, unpublished
        if not layer.exists():  # neither the rename nor a squash's publish happened
            return None
        sealed = (layer_id, *spec.layers)
        top = self._top(spec.id)
        backing = disk.chain(top)[1:2] if top.exists() else []
        if not backing or backing[0].get("filename") != str(layer):
            # The top was renamed into the layer, or a squash copied it there: a fresh top.
            self._new_top(dataclasses.replace(spec, layers=sealed))
        return SealResult(layers=sealed, bytes_used=layer.stat().st_size, squashed=False)

    def reset_workspace(self, spec: SandboxSpec) -> None:
        _refuse_mounts(spec)
        self._ready()
        self._stop_vm(spec)
        self._new_top(spec)
        if spec.memory_image:  # a restore to a memory snapshot: resume it now
            self._client(spec, memory_image=spec.memory_image)

    def remove_layer(self, layer_id: str) -> None:
        self._layer_path(layer_id).unlink(missing_ok=True)

    def layer_age(self, layer_id: str) -> float:
        """Seconds since the layer's file was made (the control plane's sweep spares young
        ones: a seal in another process records its layer a moment after making it)."""
        try:
            return time.time() - self._layer_path(layer_id).stat().st_ctime
        except OSError:
            return 0.0

    def layer_ids(self) -> list[str]:
        if not self._layers_dir().is_dir():
            return []
        return sorted(p.stem for p in self._layers_dir().glob("*.qcow2"))

    # -- memory snapshots -------------------------------------------------------------------

    def _images_dir(self) -> Path:
        return self._dir / "memory"

    def snapshot_memory(self, spec: SandboxSpec, layer_id: str, image_id: str) -> SealResult:
        """Pause the VM, seal its top disk into ``layer_id`` (a new top goes on live), save
        its memory and device state, and let it run on: one instant for disk and memory."""
        self._ready()
        client = self._client(spec)
        self._layers_dir().mkdir(parents=True, exist_ok=True)
        image = self._images_dir() / image_id
        image.mkdir(parents=True, exist_ok=True, mode=0o755)
        layer = self._layer_path(layer_id)
        new_top = self._fresh_top_name(spec.id)
        try:
            client.call("vm.snapshot_memory", timeout=300, layer_path=str(layer),
                        top_path=str(self._top(spec.id)), new_top_path=str(new_top),
                        memory_path=str(image / "state"))
        except BaseException:
            shutil.rmtree(image, ignore_errors=True)
            layer.unlink(missing_ok=True)
            raise
        self._point_top(spec.id, new_top.name)
        (image / "image.json").write_text(json.dumps({
            "layer": layer_id, "memory_mib": max(128, spec.tier.memory_bytes >> 20),
            "template": spec.template, "sandbox": spec.id}))
        return SealResult(layers=(layer_id, *spec.layers), bytes_used=layer.stat().st_size,
                          squashed=False)

    def remove_memory_image(self, image_id: str) -> None:
        shutil.rmtree(self._images_dir() / image_id, ignore_errors=True)

    def memory_image_ids(self) -> list[str]:
        if not self._images_dir().is_dir():
            return []
        return sorted(p.name for p in self._images_dir().iterdir()
                      if (p / "image.json").is_file())

    def _memory_state(self, image_id: str) -> Path:
        state = self._images_dir() / image_id / "state"
        if not state.is_file():
            raise BackendError(f"memory image {image_id} is gone; create the sandbox from its "
                               "snapshot's workspace only, or take a new memory snapshot")
        return state

    # -- crash leftovers --------------------------------------------------------------------

    def _keep_group(self, sandbox_id: str, name: str) -> bool:
        if name != _VM_GROUP:
            return False
        owner = _read(self._run_path(sandbox_id) / PIDFILE).split(".")
        if len(owner) >= 2 and owner_alive(owner[0], owner[1]):
            return True
        # A start under way: its group is made before its keeper writes the pid file, and a
        # reaper's sweep in between removed it (QEMU's placement then failed).
        try:
            made = self.cgroups.procs_files(f"{sandbox_id}/{name}")[0].parent.stat().st_ctime
        except (OSError, IndexError):
            return False
        return time.time() - made < _START_DEADLINE_S + 30

    def _sweep_extra(self, is_live: Callable[[str], bool]) -> list[Leftover]:
        removed: list[Leftover] = []
        prefix = f"{self._settings.instance}-"
        if RUN_ROOT.is_dir():
            for run in RUN_ROOT.iterdir():
                sandbox_id = run.name[len(prefix):]
                if run.name.startswith(prefix) and not is_live(sandbox_id):
                    _kill_keeper(run)
                    remove_tree(run)
                    removed.append(Leftover("microvm", sandbox_id, run.name))
        disks = self._dir / "sandboxes"
        if disks.is_dir():
            for entry in disks.iterdir():
                if not is_live(entry.name):
                    remove_tree(entry)
                    removed.append(Leftover("disk", entry.name, entry.name))
        return removed

    def close(self) -> None:
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for client in clients:
            client.close()
        super().close()


def _refuse_mounts(spec: SandboxSpec) -> None:
    if spec.mounts:
        raise BackendUnavailable(
            "volumes and data mounts are not available on the microvm tier yet: a microVM's "
            "devices are fixed by the warm snapshot it restores from, so it cannot be given a "
            "directory of the host; use the namespace or gvisor tier for a sandbox with "
            "mounts")


@functools.cache
def _seccomp_program() -> str:
    from .._linux.seccomp import compile_filter

    return b64(compile_filter())


def _read(path: Path) -> str:
    # Never a blocking open: a sweep reads the pid file of every run directory it finds.
    data = read_regular(path)
    return "" if data is None else data.decode(errors="replace").strip()


def _kill_keeper(run: Path) -> None:
    """Kill the keeper recorded in ``run`` (if it is still that process), and so its QEMU."""
    owner = _read(run / PIDFILE).split(".")
    if len(owner) >= 2 and owner_alive(owner[0], owner[1]):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(owner[0]), signal.SIGKILL)
        deadline = time.monotonic() + 5
        while owner_alive(owner[0], owner[1]) and time.monotonic() < deadline:
            time.sleep(0.002)


@contextlib.contextmanager
def _start_lock(run: Path) -> Iterator[None]:
    """One keeper per VM, even when several processes want it at once."""
    RUN_ROOT.mkdir(mode=0o700, exist_ok=True)
    run.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(run / "start.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        # Held for one keeper's start, itself bounded by _START_DEADLINE_S.
        flocks.acquire(fd, timeout_s=_START_DEADLINE_S + 30, busy=(
            f"the microVM of {run.name} has been starting for over {_START_DEADLINE_S:.0f} s "
            "in another process (stopped or stuck?); retry in a moment"))
        yield
    finally:
        os.close(fd)


if TYPE_CHECKING:  # the protocol, checked by mypy
    from ...backends import IsolationBackend

    _conforms: type[IsolationBackend] = MicrovmBackend
