"""Which accelerator a microVM gets on this host: hardware KVM, or TCG only when a test allows it.

``/dev/kvm`` is not enough to tell: on PVM hosts (``kvm_pvm``, pagetable-based nested
virtualization) a stock guest kernel falls into KVM's instruction emulator, runs 10^3-10^4 times
slower and dies with ``KVM internal error ... emulation failure``, and QEMU then pauses and looks
hung. So PVM counts as "no usable KVM" and, like a host without KVM, is refused unless the
loudly named test setting ``CORRAL_MICROVM_ALLOW_TCG=1`` allows software emulation, which runs
the tier's code paths but is no isolation boundary worth the name.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ...errors import BackendUnavailable

__all__ = ["Accel", "KvmKind", "choose_accel", "kvm_kind"]

log = logging.getLogger(__name__)

KvmKind = Literal["hardware", "pvm", "none"]


@dataclass(frozen=True, slots=True)
class Accel:
    name: Literal["kvm", "tcg"]
    cpu: str  # QEMU's -cpu value
    kvm: KvmKind  # what the host has, for messages and `corral doctor`


def kvm_kind(sys_module: Path = Path("/sys/module"), dev: Path = Path("/dev/kvm")) -> KvmKind:
    """``hardware`` (kvm_intel/kvm_amd), ``pvm`` (kvm_pvm) or ``none``."""
    if not dev.exists():
        return "none"
    if (sys_module / "kvm_pvm").exists():
        return "pvm"
    if (sys_module / "kvm_intel").exists() or (sys_module / "kvm_amd").exists():
        return "hardware"
    return "none"


def choose_accel(*, allow_tcg: bool, kind: KvmKind | None = None) -> Accel:
    """The accelerator to run guests with.

    Raises:
        BackendUnavailable: no hardware KVM and TCG not allowed; the message says why and what
            the test setting does.
    """
    kind = kvm_kind() if kind is None else kind
    if kind == "hardware":
        if not os.access("/dev/kvm", os.R_OK | os.W_OK):
            raise BackendUnavailable("the microVM tier needs read-write access to /dev/kvm")
        # arch-capabilities is refused by some nested KVMs; the guest does not need it.
        return Accel("kvm", "host,-arch-capabilities", kind)
    if not allow_tcg:
        why = ("this host's /dev/kvm is PVM (kvm_pvm), which runs only PVM-enabled guest "
               "kernels: a standard guest dies in KVM's instruction emulator"
               if kind == "pvm" else "this host has no hardware KVM (/dev/kvm with kvm_intel "
               "or kvm_amd)")
        raise BackendUnavailable(
            f"the microVM tier refuses to run: {why}. Run it on a host with hardware KVM. Only "
            "for tests, CORRAL_MICROVM_ALLOW_TCG=1 runs guests under QEMU's TCG software "
            "emulation, which is slow and is not an isolation boundary")
    log.warning("microVM guests run under QEMU TCG emulation (CORRAL_MICROVM_ALLOW_TCG=1): "
                "a TEST MODE, not an isolation boundary (host KVM: %s)", kind)
    return Accel("tcg", "max", kind)
