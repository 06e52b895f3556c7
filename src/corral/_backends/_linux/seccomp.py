"""The seccomp filter every sandboxed process runs under, compiled once to BPF by libseccomp.

Denied calls fail with EPERM (ENOSYS for clone3, so libc falls back to clone, whose flags we can
inspect). Any architecture but the host's native one (32-bit x86 via ``int 0x80``, x32) kills the
process: those ABIs have other syscall numbers and would dodge every rule.
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile

from ...errors import BackendUnavailable

__all__ = ["DENIED_SYSCALLS", "compile_filter"]

# Kernel attack surface and host-changing calls an agent's code never needs.
DENIED_SYSCALLS: tuple[str, ...] = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr",
    "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "unshare", "setns",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog", "vhangup",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "fanotify_init",
)

_CLONE_NEWUSER = 0x10000000
_TIOCSTI = 0x5412
_TIOCLINUX = 0x541C
_AF_NETLINK = 16
_AF_PACKET = 17
_SOCK_RAW = 3
_SOCK_TYPE_MASK = 0xF


@functools.cache
def compile_filter() -> bytes:
    """Return the BPF program (for ``bwrap --seccomp FD``).

    Raises:
        BackendUnavailable: libseccomp (Debian package ``libseccomp2``) cannot be loaded.
    """
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:  # pyseccomp raises OSError when libseccomp.so is absent
        raise BackendUnavailable(
            f"cannot load libseccomp ({exc}); install it with `apt-get install libseccomp2`"
        ) from exc

    eperm = sc.ERRNO(errno.EPERM)
    filt = sc.SyscallFilter(sc.ALLOW)
    filt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    for name in DENIED_SYSCALLS:
        try:
            filt.add_rule(eperm, name)
        except (ValueError, RuntimeError, OSError):
            continue  # not a syscall on this architecture
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    filt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_NEWUSER, _CLONE_NEWUSER))
    filt.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, _TIOCSTI))
    filt.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, _TIOCLINUX))
    # Masked to 32 bits: the kernel reads an int, so a plain 64-bit EQ would let
    # AF_NETLINK | 1 << 32 through.
    for family in (_AF_NETLINK, _AF_PACKET):
        filt.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket",
                      sc.Arg(0, sc.MASKED_EQ, 0xFFFFFFFF, family))
    filt.add_rule(eperm, "socket", sc.Arg(1, sc.MASKED_EQ, _SOCK_TYPE_MASK, _SOCK_RAW))

    with tempfile.TemporaryFile() as out:
        filt.export_bpf(out)
        out.seek(0)
        program = out.read()
    if not program or len(program) % 8:
        raise BackendUnavailable("libseccomp produced an invalid BPF program")
    return program


def filter_fd() -> int:
    """A readable fd holding the program, for one bwrap invocation (bwrap closes it)."""
    program = compile_filter()
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, program)  # < 64 KiB: fits the pipe buffer, never blocks
    finally:
        os.close(write_end)
    return read_end
