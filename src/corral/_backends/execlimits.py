"""The kernel's limits on what one ``execve`` may carry, checked before a command starts.

Two limits, and an error must name the one that was hit:

* ``MAX_ARG_STRLEN``: one argument or one environment entry (``NAME=value``), NUL included, is
  at most 32 pages (128 KiB);
* ``ARG_MAX``: all argument and environment strings together, plus one pointer for each, fit in
  a quarter of the stack limit (``RLIMIT_STACK``; 2 MiB with the usual 8 MiB), capped at 6 MiB.

Checked here rather than learnt from ``E2BIG``: in the namespace tier the command's environment
is applied by bwrap inside the sandbox, so the kernel's refusal comes from bwrap's own
``execvp`` there, as a bwrap message on the command's stderr.
"""

from __future__ import annotations

import resource
from collections.abc import Mapping, Sequence

from ..errors import CommandError

__all__ = ["MAX_ARG_STRLEN", "arg_max", "check_exec_size"]

MAX_ARG_STRLEN = 32 * 4096
_STK_LIM = 8 * 1024 * 1024
_POINTER = 8
_HINT = "; pass data through files or stdin"


def arg_max() -> int:
    """ARG_MAX as the kernel computes it for a process with our stack limit (commands inherit
    it)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    limit = _STK_LIM // 4 * 3
    if soft != resource.RLIM_INFINITY:
        limit = min(limit, soft // 4)
    return max(limit, MAX_ARG_STRLEN)


def check_exec_size(argv: Sequence[str], env: Mapping[str, str], *,
                    limit: int | None = None) -> None:
    """Raise ``CommandError`` naming the limit that ``argv`` and ``env`` would exceed."""
    total = 0
    for i, arg in enumerate(argv):
        size = len(arg.encode(errors="surrogateescape")) + 1
        if size > MAX_ARG_STRLEN:
            raise CommandError(
                f"argv[{i}] is {size} bytes; the kernel limits one argument to 128 KiB "
                f"(MAX_ARG_STRLEN){_HINT}")
        total += size + _POINTER
    for name, value in env.items():
        size = len(name.encode()) + 1 + len(value.encode(errors="surrogateescape")) + 1
        if size > MAX_ARG_STRLEN:
            raise CommandError(
                f"environment variable {name} is {size} bytes; the kernel limits one "
                f"environment entry (NAME=value) to 128 KiB (MAX_ARG_STRLEN){_HINT}")
        total += size + _POINTER
    # The program's path is copied too; execvp may find a longer one on PATH, hence a page.
    total += len(argv[0].encode(errors="surrogateescape")) + 1 + 4096 if argv else 0
    ceiling = arg_max() if limit is None else limit
    if total > ceiling:
        raise CommandError(
            f"the command's {len(argv)} arguments and {len(env)} environment entries take "
            f"{total} bytes (with the kernel's pointer for each), over ARG_MAX, {ceiling} bytes "
            f"here (a quarter of the stack limit){_HINT}")
