"""A real distribution registry (Debian's ``docker-registry``) on loopback, for image tests.

A test module gets the session's registry by importing the fixture::

    from tests.images.registry import registry_fixture  # noqa: F401

and asking for ``registry`` (a ``LocalRegistry``) as an argument. Nothing listens beyond
127.0.0.1, there is no auth and no TLS, and the storage is a temp dir the test can reach into
(``tamper_blob``)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import httpx
import pytest

__all__ = ["LocalRegistry", "blob_data_path", "registry_fixture", "require_tools"]

REGISTRY_BIN = "docker-registry"
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0
# A port picked free can be taken before the registry binds it; that, and only that, is retried.
BIND_ATTEMPTS = 3


def require_tools(*names: str) -> None:
    """Skip the calling test when a tool it needs is not installed, saying which."""
    missing = [name for name in names if shutil.which(name) is None]
    if missing:
        pytest.skip("needs " + ", ".join(missing) + " (Debian: docker-registry, skopeo, "
                    "busybox-static)")


def blob_data_path(storage: Path, digest: str) -> Path:
    """Where the filesystem driver keeps a blob's bytes (distribution's storage layout)."""
    algorithm, _, hex_ = digest.partition(":")
    if algorithm != "sha256" or len(hex_) != 64:
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return storage / "docker/registry/v2/blobs/sha256" / hex_[:2] / hex_ / "data"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(storage: Path, port: int) -> str:
    # A JSON string is a YAML scalar: quoting keeps odd characters of a path intact.
    # No storage.cache section: blob descriptors are then looked up on disk every time.
    return "\n".join([
        "version: 0.1",
        "log:",
        "  level: info",
        "  formatter: text",
        "storage:",
        "  filesystem:",
        f"    rootdirectory: {json.dumps(str(storage))}",
        "  delete:",
        "    enabled: true",
        "http:",
        f"  addr: '127.0.0.1:{port}'",
        "",
    ])


class LocalRegistry:
    """``docker-registry serve`` on 127.0.0.1 with filesystem storage in a fresh temp dir.

    A context manager: entering starts it and waits until ``/v2/`` answers; leaving stops the
    process and removes the temp dir (storage, config and log)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="corral-test-registry-"))
        self.storage = self.root / "storage"
        self.log = self.root / "registry.log"
        self.host = ""
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LocalRegistry:
        try:
            self._start()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def tamper_blob(self, digest: str) -> None:
        """Flip every byte of a stored blob: same length (so the size the registry recorded still
        matches) but different content, so a client that verifies digests refuses it."""
        path = blob_data_path(self.storage, digest)
        data = path.read_bytes()
        path.write_bytes(bytes(b ^ 0xFF for b in data))

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def _start(self) -> None:
        self.storage.mkdir()
        for _ in range(BIND_ATTEMPTS):
            port = _free_port()
            self._spawn(port)
            if self._wait_ready(port):
                self.host = f"127.0.0.1:{port}"
                return
            if "address already in use" not in self.log_tail():
                break
        raise RuntimeError(f"docker-registry did not start; log tail:\n{self.log_tail()}")

    def _spawn(self, port: int) -> None:
        self._reap()
        config = self.root / "config.yml"
        config.write_text(_config(self.storage, port))
        # A minimal environment: REGISTRY_* variables of the host would override the config.
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.root)}
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], env=env,
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                          cwd=self.root)

    def _wait_ready(self, port: int) -> bool:
        assert self._proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        # trust_env=False: a host proxy setting must not route loopback requests elsewhere.
        with httpx.Client(trust_env=False, timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    return False
                try:
                    if client.get(f"http://127.0.0.1:{port}/v2/").status_code == 200:
                        return True
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        return False

    def _reap(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _stop(self) -> None:
        self._reap()
        shutil.rmtree(self.root, ignore_errors=True)


# name=: the function's own name differs from the fixture's, so a test's ``registry`` argument
# does not shadow the import (pyflakes F811).
@pytest.fixture(scope="session", name="registry")
def registry_fixture() -> Iterator[LocalRegistry]:
    """The session's local registry. Tests keep to repositories of their own names: it is
    shared, and ``tamper_blob`` damages a blob for every repository that holds it."""
    require_tools(REGISTRY_BIN, "skopeo")
    with LocalRegistry() as reg:
        yield reg
