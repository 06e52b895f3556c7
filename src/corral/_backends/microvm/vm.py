"""One QEMU ``-M microvm`` guest: its command line, its confined launch, and the waits on it.

QEMU is the most exposed host process of the tier (it parses everything the guest does), so it
runs with as little as it can: the sandbox's uid and gid (``setpriv``, no capabilities, no new
privileges), inside ``bwrap`` (a mount namespace holding only the kernel, the disks, the memory
files and its run directory, of which only the run directory and the writable top disk can be
written; its own PID, IPC, UTS and cgroup namespaces; the network namespace it was started in,
which for a sandbox holds only ``lo``, and the guest has no NIC anyway), QEMU's own seccomp
filter (``-sandbox on`` denying obsolete calls, privilege changes, spawning and resource
control), and it dies with its parent. The caller's ``attach`` puts its pid into the sandbox's
cgroup before the guest runs one instruction: QEMU starts stopped (``-S``) or waiting for its
state (``-incoming defer``), and only after ``attach`` returns is it continued.

A QEMU that hits an emulation error pauses the guest and stays alive, which looks like a hang.
Every wait here therefore also watches QMP (a ``STOP`` nobody asked for, ``GUEST_PANICKED``,
``SHUTDOWN``) and the process itself, and fails at once with the serial log's tail.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..._core.privileged import privileged_env
from ...errors import BackendError, BackendUnavailable, UsageError
from .accel import Accel
from .qmp import Qmp
from .wire import MAX_LINE

__all__ = ["QEMU", "Vm", "VmConfig", "VmState", "WarmFiles", "kernel_cmdline", "tsc_khz"]

log = logging.getLogger(__name__)

QEMU = "qemu-system-x86_64"
_CHANNEL = "corral.agent"
_SERIAL_TAIL = 25
_TCG_TB_MIB = 32
_QMP_DEFAULT_S = 30.0  # for QMP commands that take no time of their own
_SUN_PATH_MAX = 108  # sockaddr_un.sun_path, with its terminating NUL
_HZ = 100  # the guest kernel's CONFIG_HZ (guest.config)
# Library and firmware directories QEMU reads from (bound read-only; /usr/share/qemu has the
# microvm firmware). Merged-/usr hosts have /lib etc. as symlinks, recreated as such.
_SYSTEM = ("usr", "lib", "lib64", "bin", "sbin")


def tsc_khz(cpuinfo: Path = Path("/proc/cpuinfo")) -> int:
    """The host TSC rate in kHz, which is the guest's too (TCG's rdtsc reads the host's TSC;
    KVM passes it through).

    The kernel's ``cpu MHz`` is its own TSC calibration on hosts with an invariant TSC
    (``constant_tsc`` and ``nonstop_tsc``: the rate never changes with frequency or sleep
    states); measured on this host (2026-12-01) it agrees with an rdtsc-over-clock_gettime
    measurement to 0.02 %. Without an invariant TSC there is no single right value.

    Raises:
        BackendUnavailable: the host has no invariant TSC (the guest could not keep time).
    """
    mhz: float | None = None
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in cpuinfo.read_text().splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if name == "cpu MHz" and mhz is None:
                with contextlib.suppress(ValueError):
                    mhz = float(value)
            elif name == "flags" and not flags:
                flags = set(value.split())
    if mhz is None or not {"constant_tsc", "nonstop_tsc"} <= flags:
        raise BackendUnavailable(
            "the microVM tier needs a host with an invariant TSC (constant_tsc and nonstop_tsc "
            "in /proc/cpuinfo) to give the guest kernel its clock rate")
    return round(mhz * 1000)


def kernel_cmdline(khz: int, extra: str = "") -> str:
    """The guest kernel's command line.

    Under TCG the kernel's own calibrations (the PIT against the TSC, then the delay loop
    against jiffies) run against an emulated timer whose ticks come late when the host is busy:
    in 10-50 % of boots they spin on a jiffy for seconds or mark the TSC unstable. So the rate is
    given (``tsc_early_khz``), the delay loop preset from it (``lpj`` = TSC cycles per jiffy,
    the guest uses the TSC for delays) and the TSC trusted (``tsc=reliable``: no watchdog
    against the late jiffies). ``reboot=t`` triple-faults at once (no ACPI or keyboard
    controller to try first), which ``-no-reboot`` turns into QEMU's exit; ``panic=-1`` reboots
    on a panic.
    """
    parts = ["root=/dev/vda", "ro", "rootfstype=ext4", "init=/corral/init", "console=ttyS0",
             "panic=-1", "reboot=t", "quiet", f"tsc_early_khz={khz}",
             f"lpj={khz * 1000 // _HZ}", "tsc=reliable"]
    return " ".join(parts + ([extra] if extra else []))


@dataclass(frozen=True, slots=True)
class VmConfig:
    """What one QEMU gets.

    ``attach`` is called with QEMU's host pid before the guest runs (to move it into the
    sandbox's cgroup); ``netns`` is the network namespace QEMU runs in (None: the caller's).
    ``backing`` lists the read-only files the top disk's qcow2 chain refers to.
    """

    kernel: Path
    root_image: Path
    run_dir: Path
    accel: Accel
    memory_mib: int = 256
    vcpus: int = 1
    top_disk: Path | None = None
    backing: tuple[Path, ...] = ()
    uid: int = 0
    gid: int = 0
    netns: Path | None = None
    attach: Callable[[int], None] | None = None
    cmdline_extra: str = ""
    # A directory QEMU may write besides its run dir, on the disks' filesystem: live-sealed
    # tops and memory saves are made there and renamed into place (the run dir is on tmpfs).
    work_dir: Path | None = None


class WarmFiles(Protocol):
    """What a restore needs of a warm snapshot (``warm.WarmSnapshot``)."""

    @property
    def ram(self) -> Path: ...
    @property
    def state(self) -> Path: ...


class VmState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    CLOSED = "closed"


@dataclass(slots=True)
class _Files:
    qmp: Path
    channel: Path
    serial: Path


@dataclass(slots=True)
class _Memory:
    """How guest RAM is backed: anonymous, a shared file (making a warm snapshot) or a
    read-only file mapped private (restoring one)."""

    path: Path | None = None
    mode: str = "anon"  # "anon" | "share" | "template"
    extra_ro: list[Path] = field(default_factory=list)


def _files(run_dir: Path) -> _Files:
    return _Files(qmp=run_dir / "qmp.sock", channel=run_dir / "agent.sock",
                  serial=run_dir / "serial.log")


def _opt(path: Path) -> str:
    # QEMU's option syntax splits on commas; a literal comma is written twice.
    return str(path).replace(",", ",,")


def _qemu_argv(config: VmConfig, files: _Files, memory: _Memory, incoming: bool) -> list[str]:
    machine = "microvm,acpi=off,x-option-roms=off"
    argv = [QEMU, "-nodefaults", "-no-user-config", "-nic", "none", "-display", "none",
            "-no-reboot", "-accel", _accel_opt(config.accel), "-cpu", config.accel.cpu,
            "-smp", str(config.vcpus), "-m", f"{config.memory_mib}M"]
    # Always a named backend: the migration stream names RAM blocks, so a memory image of a VM
    # restored from a warm snapshot (a file backend) must load into a block of the same name.
    if memory.mode == "anon":
        argv += ["-object", f"memory-backend-ram,id=ram,size={config.memory_mib}M"]
    else:
        assert memory.path is not None
        opts = {"share": "share=on", "template": "readonly=on,rom=off,share=off"}[memory.mode]
        argv += ["-object", f"memory-backend-file,id=ram,size={config.memory_mib}M,"
                            f"mem-path={_opt(memory.path)},{opts}"]
    machine += ",memory-backend=ram"
    argv += [
        "-M", machine,
        "-kernel", str(config.kernel),
        "-append", kernel_cmdline(tsc_khz(), config.cmdline_extra),
        "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
        "-chardev", f"file,id=serial,path={_opt(files.serial)}", "-serial", "chardev:serial",
        "-qmp", f"unix:{_opt(files.qmp)},server=on,wait=off",
        # No pvpanic device (it needs ACPI to be found): a guest panic reboots (panic=-1) and
        # -no-reboot turns that into QEMU's exit, which every wait sees at once.
        "-device", "virtio-rng-device",
        "-device", "virtio-serial-device",
        "-chardev", f"socket,id=agent,path={_opt(files.channel)},server=on,wait=off",
        "-device", f"virtserialport,chardev=agent,name={_CHANNEL}",
        # vda: the template root, never written by anyone.
        "-drive", f"file={_opt(config.root_image)},if=none,id=root,format=raw,readonly=on",
        "-device", "virtio-blk-device,drive=root",
    ]
    if config.top_disk is not None:
        argv += ["-drive", f"file={_opt(config.top_disk)},if=none,id=ws,format=qcow2,discard=unmap",
                 "-device", "virtio-blk-device,drive=ws"]
    argv += ["-incoming", "defer"] if incoming else ["-S"]
    return argv


def _bwrap_argv(config: VmConfig, memory: _Memory, info_fd: int) -> list[str]:
    bwrap, setpriv = shutil.which("bwrap"), shutil.which("setpriv")
    if bwrap is None or setpriv is None:
        raise BackendUnavailable("the microVM tier confines QEMU with bwrap and setpriv; "
                                 "apt-get install bubblewrap util-linux")
    # No user namespace (QEMU's uid must be the sandbox's real uid for the cgroup and the
    # files), no network namespace (the caller's is kept).
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--info-fd", str(info_fd),
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for name in _SYSTEM:
        path = Path("/") / name
        if path.is_symlink():
            argv += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            argv += ["--ro-bind", str(path), str(path)]
    if Path("/etc/ld.so.cache").exists():
        argv += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    if config.accel.name == "kvm":
        argv += ["--dev-bind", "/dev/kvm", "/dev/kvm"]
    read_only = [config.kernel, config.root_image, *config.backing, *memory.extra_ro]
    if memory.mode == "template" and memory.path is not None:
        read_only.append(memory.path)
    writable = [config.run_dir]
    if memory.mode == "share" and memory.path is not None:
        writable.append(memory.path)
    if config.work_dir is not None:
        writable.append(config.work_dir)
    if config.top_disk is not None and config.top_disk.parent != config.work_dir:
        writable.append(config.top_disk)
    # bwrap makes missing parents with the modes of the host's (0700 for a temp dir), which
    # QEMU's uid could not pass: make them searchable first. They hold nothing but the binds.
    parents: list[str] = []
    for path in [*writable, *read_only]:
        for parent in reversed(path.parents):
            name = str(parent)
            if parent != Path("/") and parent.parts[1] not in _SYSTEM and name not in parents:
                parents.append(name)
    for name in parents:
        argv += ["--perms", "0755", "--dir", name]
    argv += ["--bind", str(config.run_dir), str(config.run_dir)]
    for path in writable[1:]:
        argv += ["--bind", str(path), str(path)]
    for path in read_only:
        argv += ["--ro-bind", str(path), str(path)]
    argv += ["--chdir", str(config.run_dir)]
    # /dev/kvm is usually root:kvm 0660: with hardware KVM the one supplementary group QEMU
    # keeps is the device's, so it can open it and nothing else that group could.
    groups = (["--groups", str(os.stat("/dev/kvm").st_gid)] if config.accel.name == "kvm"
              else ["--clear-groups"])
    argv += ["--", setpriv, f"--reuid={config.uid}", f"--regid={config.gid}", *groups,
             "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    return argv


def _in_netns(path: Path | None) -> list[str]:
    # nsenter execs what follows in the same process (no fork for a network namespace only),
    # so bwrap stays our child and --die-with-parent refers to us.
    if path is None:
        return []
    nsenter = shutil.which("nsenter")
    if nsenter is None:
        raise BackendUnavailable("the microVM tier needs nsenter (util-linux)")
    return [nsenter, f"--net={path}", "--"]


class Vm:
    """A running QEMU. Use ``boot``, ``restore_warm`` or ``restore_memory`` to make one; it is a
    context manager that kills QEMU on exit."""

    def __init__(self, config: VmConfig, memory: _Memory) -> None:
        self.config = config
        self._memory = memory
        self._files = _files(config.run_dir)
        self._proc: subprocess.Popen[bytes] | None = None
        self._qmp: Qmp | None = None
        self.pid = 0  # QEMU's host pid
        self._init_pid = 0  # bwrap's reaper, pid 1 of QEMU's PID namespace
        self.state = VmState.STARTING

    # -- making one ---------------------------------------------------------------------------

    @classmethod
    def boot(cls, config: VmConfig, deadline: float, *, memory_file: Path | None = None) -> Vm:
        """Cold boot (RAM on ``memory_file`` shared, when given: how a warm snapshot is made).

        Returns once the guest runs; the caller connects to ``channel_path`` for the agent.
        """
        memory = _Memory(memory_file, "share") if memory_file else _Memory()
        vm = cls(config, memory)
        with vm._cleanup_on_error():
            vm._launch(incoming=False, deadline=deadline)
            vm._qmp_cmd("cont", deadline)
            vm.state = VmState.RUNNING
        return vm

    @classmethod
    def restore_warm(cls, config: VmConfig, warm: WarmFiles, deadline: float) -> Vm:
        """Start from a warm snapshot (``warm.WarmSnapshot``): its RAM file mapped read-only and
        private (pages shared with every other VM restored from it until written), its device
        state saved with ``x-ignore-shared``."""
        vm = cls(config, _Memory(warm.ram, "template", [warm.state]))
        with vm._cleanup_on_error():
            vm._launch(incoming=True, deadline=deadline)
            vm._incoming(warm.state, deadline, ignore_shared=True)
            if config.top_disk is not None:
                vm._announce_disk_size(deadline)
        return vm

    @classmethod
    def restore_memory(cls, config: VmConfig, memory_file: Path, deadline: float) -> Vm:
        """Start from a memory image ``save_memory`` wrote (RAM and devices in one file)."""
        vm = cls(config, _Memory(None, "anon", [memory_file]))
        with vm._cleanup_on_error():
            vm._launch(incoming=True, deadline=deadline)
            vm._incoming(memory_file, deadline, ignore_shared=False)
        return vm

    def _launch(self, *, incoming: bool, deadline: float) -> None:
        config = self.config
        if config.memory_mib < 64 or config.vcpus < 1:
            raise UsageError(f"a microVM needs at least 64 MiB and 1 vCPU "
                             f"(got {config.memory_mib} MiB, {config.vcpus})")
        longest = max(len(str(self._files.qmp)), len(str(self._files.channel)))
        if longest >= _SUN_PATH_MAX:
            raise UsageError(f"the microVM run directory {config.run_dir} is too long for its "
                             f"unix sockets ({longest} of at most {_SUN_PATH_MAX - 1} bytes); "
                             "use a shorter path")
        for path in (config.kernel, config.root_image, *config.backing,
                     *self._memory.extra_ro):
            if not path.is_file():
                raise BackendError(f"the microVM file {path} is missing")
        config.run_dir.mkdir(parents=True, exist_ok=True)
        os.chown(config.run_dir, config.uid, config.gid)
        os.chmod(config.run_dir, 0o700)
        for path in (self._files.qmp, self._files.channel, self._files.serial):
            path.unlink(missing_ok=True)
        read_info, write_info = os.pipe()
        argv = (_in_netns(config.netns) + _bwrap_argv(config, self._memory, write_info)
                + _qemu_argv(config, self._files, self._memory, incoming))
        log.debug("starting QEMU: %s", " ".join(argv))
        stderr = (config.run_dir / "qemu.stderr").open("wb")
        try:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                pass_fds=(write_info,), env=privileged_env())
        except OSError as exc:
            os.close(read_info)
            raise BackendUnavailable(f"cannot start QEMU under bwrap: {exc}") from exc
        finally:
            os.close(write_info)
            stderr.close()
        self._init_pid = self._read_child_pid(read_info, deadline)
        self.pid = self._find_qemu(self._init_pid, deadline)
        proc = self._proc
        try:
            self._qmp = Qmp(self._files.qmp, deadline=deadline,
                            alive=lambda: proc.poll() is None)
        except BackendError as exc:
            raise self._error(str(exc)) from exc
        if config.attach is not None:
            config.attach(self.pid)

    def _read_child_pid(self, fd: int, deadline: float) -> int:
        # bwrap writes {"child-pid": N} (the host pid of setpriv, which execs QEMU) once its
        # namespaces exist.
        data = b""
        os.set_blocking(fd, False)
        try:
            while b"}" not in data:
                self._check(deadline, "bwrap to start QEMU")
                try:
                    chunk = os.read(fd, 4096)
                except BlockingIOError:
                    time.sleep(0.002)
                    continue
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(fd)
        try:
            return int(json.loads(data)["child-pid"])
        except (ValueError, KeyError) as exc:
            raise self._error(f"bwrap gave no child pid ({data[:200]!r})") from exc

    def _find_qemu(self, init_pid: int, deadline: float) -> int:
        # With its own PID namespace bwrap runs a reaper as the namespace's pid 1 and the
        # command as its child: QEMU is that child once setpriv has exec'd it.
        children = Path(f"/proc/{init_pid}/task/{init_pid}/children")
        while True:
            self._check(deadline, "QEMU to start")
            with contextlib.suppress(OSError, ValueError):
                for pid in children.read_text().split():
                    if Path(f"/proc/{pid}/comm").read_text().startswith("qemu-system"):
                        return int(pid)
            time.sleep(0.002)

    def _incoming(self, path: Path, deadline: float, *, ignore_shared: bool) -> None:
        if ignore_shared:
            self._qmp_cmd("migrate-set-capabilities", deadline, capabilities=[
                {"capability": "x-ignore-shared", "state": True}])
        self._qmp_cmd("migrate-incoming", deadline, uri=f"file:{path}")
        self._wait_migration(deadline, "restore")
        # The state was saved from a stopped guest, so QEMU keeps it stopped after the load
        # (it restores the saved run state); it runs when we say so.
        status = self._status(deadline)
        if status in ("paused", "postmigrate", "prelaunch", "inmigrate"):
            self._qmp_cmd("cont", deadline)
        elif status != "running":
            raise self._error(f"the restored guest is {status!r} after its state loaded")
        self.state = VmState.RUNNING

    # -- waits --------------------------------------------------------------------------------

    @property
    def channel_path(self) -> Path:
        """The agent channel's unix socket (QEMU listens; connect to talk to the agent)."""
        return self._files.channel

    @property
    def alive(self) -> bool:
        """QEMU's process exists and is not a zombie."""
        return bool(self.pid) and _alive(self.pid)

    @property
    def fatal(self) -> str | None:
        """Why the guest will not answer any more (a QMP event, or QEMU's exit), or None."""
        if self._proc is not None and self._proc.poll() is not None:
            return f"QEMU exited with status {self._proc.returncode}"
        return self._qmp.fatal if self._qmp is not None else None

    def serial_tail(self, lines: int = _SERIAL_TAIL) -> str:
        try:
            text = self._files.serial.read_text(errors="replace")
        except OSError:
            text = ""
        with contextlib.suppress(OSError):
            err = (self.config.run_dir / "qemu.stderr").read_text(errors="replace").strip()
            if err:
                text += "\n[qemu stderr] " + err
        return "\n".join(text.splitlines()[-lines:])

    def _error(self, what: str) -> BackendError:
        return BackendError(f"microVM (QEMU pid {self.pid or '?'}): {what}; serial log tail:\n"
                            f"{self.serial_tail()}")

    def _check(self, deadline: float, waiting_for: str) -> None:
        fatal = self.fatal
        if fatal is not None:
            raise self._error(f"the guest stopped while waiting for {waiting_for}: {fatal}")
        if time.monotonic() > deadline:
            raise self._error(f"deadline passed waiting for {waiting_for}")

    def check(self) -> None:
        """Raise BackendError now if the guest will not answer any more."""
        self._check(float("inf"), "the guest")

    def _qmp_cmd(self, name: str, deadline: float, **arguments: Any) -> dict[str, Any]:
        if self._qmp is None:
            raise UsageError("this VM is not started")
        try:
            return self._qmp.command(name, deadline=deadline, **arguments)
        except BackendError as exc:
            raise self._error(str(exc)) from exc

    def _wait_migration(self, deadline: float, what: str) -> None:
        while True:
            info = self._qmp_cmd("query-migrate", deadline)
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise self._error(f"{what} failed: {info.get('error-desc', status)}")
            # Our own stop is not fatal; QEMU's exit is.
            if self._proc is not None and self._proc.poll() is not None:
                raise self._error(f"QEMU exited during {what}")
            if time.monotonic() > deadline:
                raise self._error(f"deadline passed during {what} (status {status})")
            time.sleep(0.005)

    def connect(self, deadline: float) -> socket.socket:
        """A connection to the agent channel (QEMU accepts one at a time)."""
        while True:
            self._check(deadline, "the agent channel")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                sock.connect(str(self._files.channel))
                return sock
            except OSError:
                sock.close()
                time.sleep(0.005)

    def read_line(self, sock: socket.socket, buffer: bytearray, deadline: float,
                  waiting_for: str) -> dict[str, Any]:
        """The next JSON line from the agent, watching the guest while waiting. The guest is
        untrusted: only new bytes are searched for the newline, and a line is at most
        ``wire.MAX_LINE`` bytes."""
        searched = 0
        while (end := buffer.find(b"\n", searched)) < 0:
            if len(buffer) > MAX_LINE:
                raise self._error(f"the agent sent a line longer than {MAX_LINE} bytes while "
                                  f"waiting for {waiting_for}")
            searched = len(buffer)
            self._check(deadline, waiting_for)
            sock.settimeout(0.05)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                raise self._error(f"the agent channel closed while waiting for {waiting_for}")
            buffer += chunk
        line = bytes(buffer[:end])
        del buffer[:end + 1]
        try:
            message: dict[str, Any] = json.loads(line)
        except ValueError as exc:
            raise self._error(f"the agent sent a bad line {line[:200]!r}") from exc
        return message

    # -- while it runs ------------------------------------------------------------------------

    def pause(self, deadline: float | None = None) -> None:
        """Stop the guest's vCPUs (a no-op when stopped)."""
        deadline = _default(deadline)
        if self._status(deadline) == "running":
            self._qmp_cmd("stop", deadline)
        self.state = VmState.PAUSED

    def cont(self, deadline: float | None = None) -> None:
        """Run the guest's vCPUs again (a no-op when running)."""
        deadline = _default(deadline)
        if self._status(deadline) != "running":
            self._qmp_cmd("cont", deadline)
        self.state = VmState.RUNNING

    def _status(self, deadline: float) -> str:
        return str(self._qmp_cmd("query-status", deadline).get("status"))

    def save_memory(self, path: Path, deadline: float, *, ignore_shared: bool = False) -> None:
        """Stop the guest and write its RAM and device state to ``path`` (a ``file:``
        migration). The guest stays paused; ``cont`` resumes it. With ``ignore_shared`` the RAM
        of a ``share=on`` memory file is left out (it is the warm snapshot's RAM file)."""
        self.pause(deadline)
        self._qmp_cmd("migrate-set-capabilities", deadline, capabilities=[
            {"capability": "x-ignore-shared", "state": ignore_shared}])
        path.unlink(missing_ok=True)
        # QEMU (the sandbox's uid) writes into its run dir; the caller moves the file.
        target = (self.config.work_dir or self.config.run_dir) / f".save-{path.name}"
        target.unlink(missing_ok=True)
        self._qmp_cmd("migrate", deadline, uri=f"file:{target}")
        self._wait_migration(deadline, "memory save")
        # Root's from here on, readable by the unprivileged QEMUs that restore from it and
        # writable by none of them.
        os.chown(target, 0, 0)
        os.chmod(target, 0o644)
        shutil.move(target, path)  # the run dir may be on another filesystem

    def seal_live(self, new_top: Path, layer_path: Path, deadline: float) -> None:
        """Make ``new_top`` the writable disk over the current top, live; the current top
        becomes read-only backing and ``new_top``'s backing string names ``layer_path`` (where
        the caller will move the old top). ``new_top`` must be a path QEMU can create: in its
        run dir. Pause the guest first for a consistent instant."""
        self._qmp_cmd("blockdev-snapshot-sync", deadline, device="ws",
                      **{"snapshot-file": str(new_top), "format": "qcow2",
                         "mode": "absolute-paths"})
        self._qmp_cmd("change-backing-file", deadline, device="ws",
                      **{"image-node-name": self._top_node(deadline),
                         "backing-file": str(layer_path)})

    def _announce_disk_size(self, deadline: float) -> None:
        # The guest probed the warm snapshot's placeholder disk; the sandbox's disk may be
        # bigger. A resize to its own size changes nothing on disk but makes QEMU send the
        # config-change interrupt on which the guest re-reads the capacity.
        for block in self._qmp_cmd_list("query-block", deadline):
            if block.get("device") == "ws":
                size = int((block.get("inserted") or {}).get("image", {}).get("virtual-size", 0))
                if size:
                    self._qmp_cmd("block_resize", deadline, device="ws", size=size)

    def _top_node(self, deadline: float) -> str:
        for block in self._qmp_cmd_list("query-block", deadline):
            if block.get("device") == "ws":
                inserted = block.get("inserted") or {}
                return str(inserted.get("node-name"))
        raise self._error("no workspace disk to seal")

    def _qmp_cmd_list(self, name: str, deadline: float) -> list[dict[str, Any]]:
        if self._qmp is None:
            raise UsageError("this VM is not started")
        try:
            result: Any = self._qmp.command(name, deadline=deadline)
        except BackendError as exc:
            raise self._error(str(exc)) from exc
        return list(result) if isinstance(result, list) else []

    def rss_bytes(self) -> int:
        """QEMU's resident memory (RSS), from /proc."""
        return _proc_status(self.pid, "VmRSS")

    def pss_bytes(self) -> int:
        """QEMU's proportional share of resident memory: pages shared with other VMs restored
        from one warm snapshot count once across them."""
        try:
            for line in Path(f"/proc/{self.pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return 0

    # -- ending -------------------------------------------------------------------------------

    def quit(self, deadline: float | None = None) -> None:
        """Ask QEMU to exit; kill it if it does not by the deadline."""
        deadline = _default(deadline)
        if self._proc is not None and self._proc.poll() is None and self._qmp is not None:
            with contextlib.suppress(BackendError):
                self._qmp.command("quit", deadline=deadline)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill QEMU (and bwrap) now and remove the run dir's sockets. Idempotent."""
        if self._proc is not None:
            if self._proc.poll() is None:
                # bwrap is the child; QEMU is bwrap's child (pid namespace init dies → all die).
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._proc.pid, signal.SIGKILL)
                # Killing the namespace's pid 1 kills everything in it.
                for pid in (self._init_pid, self.pid):
                    if pid:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)
            # QEMU is bwrap's reaper's child: once that dies, the host's init reaps QEMU. Wait
            # for that, so "killed" means gone (its files closed, its memory freed).
            gone_by = time.monotonic() + 10
            while self.pid and _alive(self.pid) and time.monotonic() < gone_by:
                time.sleep(0.01)
        if self._qmp is not None:
            self._qmp.close()
            self._qmp = None
        for path in (self._files.qmp, self._files.channel):
            path.unlink(missing_ok=True)
        self.state = VmState.CLOSED

    @contextlib.contextmanager
    def _cleanup_on_error(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.kill()
            raise

    def __enter__(self) -> Vm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def _default(deadline: float | None) -> float:
    return time.monotonic() + _QMP_DEFAULT_S if deadline is None else deadline


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _proc_status(pid: int, field_name: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _accel_opt(accel: Accel) -> str:
    # TCG's translated-code cache defaults to 1 GiB and fills as the guest runs new code; an
    # idle agent's working set fits in a few MiB, so a small cache keeps idle RSS down.
    return f"tcg,tb-size={_TCG_TB_MIB}" if accel.name == "tcg" else accel.name
