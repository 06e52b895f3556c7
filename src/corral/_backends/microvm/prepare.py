"""Build what the microVM tier needs once per host, ahead of its first sandbox: the guest kernel
(minutes) and the tier's base root (the ``microvm-base`` Debian template, a minute).

    python -m corral._backends.microvm.prepare [--background] [--wait SECONDS]

``--background`` returns at once and builds in a detached process (``scripts/bootstrap --test``
uses it, so the build overlaps the rest of the set-up and the first test suites); ``--wait``
waits for a build in progress. While a build runs it holds ``prepare.lock`` in the cache, which
is how ``wait_for_prepare`` (the tests, the tier's host check) knows to wait rather than refuse.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ..._core.privileged import privileged_env

__all__ = ["main", "preparing", "wait_for_prepare"]

log = logging.getLogger(__name__)

_LOCK = "prepare.lock"
_LOG = "prepare.log"
# Not __name__: run with -m, this module is __main__.
_MODULE = "corral._backends.microvm.prepare"


@contextlib.contextmanager
def _locked(cache: Path, *, block: bool) -> Iterator[bool]:
    cache.mkdir(parents=True, exist_ok=True, mode=0o755)
    fd = os.open(cache / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def preparing(cache: Path) -> bool:
    """True while a build holds the lock."""
    if not (cache / _LOCK).exists():
        return False
    with _locked(cache, block=False) as got:
        return not got


def wait_for_prepare(cache: Path, timeout_s: float) -> bool:
    """Wait (at most ``timeout_s``) for a build in progress; True when none runs any more."""
    deadline = time.monotonic() + timeout_s
    while preparing(cache):
        if time.monotonic() > deadline:
            return False
        time.sleep(2)
    return True


def _build(cache: Path) -> None:
    from ..._templates import BUILTIN_SPECS, build_template
    from .kernel import build_kernel
    from .rootimage import BASE_SPEC

    started = time.monotonic()
    kernel = build_kernel(cache)
    log.info("guest kernel %s ready (%.0f s)", kernel.key, time.monotonic() - started)
    started = time.monotonic()
    build_template(BUILTIN_SPECS[BASE_SPEC], cache / "templates",
                   on_progress=lambda line: log.debug("%s", line))
    log.info("%s ready (%.0f s)", BASE_SPEC, time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    from ..._settings import Settings

    parser = argparse.ArgumentParser(prog="python -m corral._backends.microvm.prepare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--background", action="store_true",
                        help="build in a detached process and return at once")
    parser.add_argument("--wait", type=float, metavar="SECONDS",
                        help="only wait for a build in progress")
    parser.add_argument("--cache", type=Path, help="the microVM cache (default: settings')")
    args = parser.parse_args(argv)
    cache = args.cache or Settings().microvm_cache
    if args.wait is not None:
        return 0 if wait_for_prepare(cache, args.wait) else 1
    if args.background:
        cache.mkdir(parents=True, exist_ok=True, mode=0o755)
        with (cache / _LOG).open("ab") as out:
            # Niced: it overlaps the first test suites, which should not wait for it.
            subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", _MODULE,
                              "--cache", str(cache)],
                             stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd="/",
                             env=privileged_env(), start_new_session=True, close_fds=True)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with _locked(cache, block=True):
        _build(cache)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
