"""A small static C program of Corral's (the gVisor tier's launcher, the namespace tier's
zygote) beside the namespace tier's seccomp program, built once with the host's gcc into a
directory named after both contents and bound read-only into sandboxes at ``/.corral``."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..._core.privileged import privileged_env
from ...errors import BackendError
from .seccomp import compile_filter

__all__ = ["FILTER_NAME", "build_static_helper"]

#: The seccomp program's file in the directory (``seccomp.compile_filter``).
FILTER_NAME = "filter"


def build_static_helper(parent: Path, source: Path, program: str, what: str) -> Path:
    """The directory under ``parent`` holding ``program`` (``source`` built static) and
    ``filter``, world-readable (a sandbox's own uid runs the program). ``what`` names the
    program in errors."""
    code = source.read_bytes()
    bpf = compile_filter()
    digest = hashlib.sha256(code + b"\0" + bpf).hexdigest()[:16]
    dest = parent / f"{source.stem}.{digest}"
    if (dest / program).is_file():
        return dest
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise BackendError(f"{what} is built with gcc on the host: install it "
                           "(apt-get install gcc libc6-dev)")
    parent.mkdir(parents=True, exist_ok=True, mode=0o711)
    tmp = Path(tempfile.mkdtemp(prefix=f".{source.stem}-", dir=parent))
    try:
        built = subprocess.run(
            [gcc, "-O2", "-static", "-Wall", "-Werror", "-o", str(tmp / program), str(source)],
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
            env=privileged_env())
        if built.returncode != 0:
            raise BackendError(f"cannot build {what}: {built.stderr.strip()}")
        (tmp / FILTER_NAME).write_bytes(bpf)
        os.chmod(tmp / program, 0o755)
        os.chmod(tmp / FILTER_NAME, 0o644)
        os.chmod(tmp, 0o755)
        try:
            tmp.rename(dest)
        except OSError:  # another process built it first
            if not (dest / program).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
