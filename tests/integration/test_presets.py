"""Package-index presets (issue 15): pip through the ``pypi`` preset against a real PEP 503
simple index on loopback, the lock requirement enforced by pip, the presets' rules in the
policy, the ceiling seeing them, and the npm and apt client config.

The index is a directory served by the standard library's HTTP file server on 127.0.0.1; the
gateway reaches it only because the operator lists 127.0.0.1/32 and pins ``mirror.test`` to it
(an index URL must be a name: the gateway refuses IP literals)."""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from corral import Sandbox, UsageError
from corral._control.manager import Manager
from corral._control.tenants import Ceiling, local_tenant
from corral._settings import Settings
from corral.errors import CeilingExceeded

from ..conftest import managed

pytestmark = pytest.mark.needs_root

MIRROR = "mirror.test"
WHEEL = "tinypkg-1.0-py3-none-any.whl"


@dataclass
class Index:
    port: int
    sha256: str
    requests: list[str]

    @property
    def host(self) -> str:
        return f"{MIRROR}:{self.port}"


def _wheel() -> bytes:
    """A pure-Python wheel built by hand (a wheel is a zip with its metadata and a RECORD)."""
    files = {
        "tinypkg/__init__.py": b"VALUE = 'tiny from the mirror'\n",
        "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": (b"Wheel-Version: 1.0\nGenerator: test\n"
                                        b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("tinypkg-1.0.dist-info/RECORD,,")
    files["tinypkg-1.0.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return out.getvalue()


def _index_tree(root: Path) -> str:
    """``root/simple/`` as a PEP 503 index for one project; returns the wheel's sha256."""
    wheel = _wheel()
    sha256 = hashlib.sha256(wheel).hexdigest()
    (root / "files").mkdir(parents=True)
    (root / "files" / WHEEL).write_bytes(wheel)
    project = root / "simple" / "tinypkg"
    project.mkdir(parents=True)
    (root / "simple" / "index.html").write_text(
        '<!DOCTYPE html><html><body><a href="tinypkg/">tinypkg</a></body></html>\n')
    (project / "index.html").write_text(
        f'<!DOCTYPE html><html><body><a href="../../files/{WHEEL}#sha256={sha256}">{WHEEL}</a>'
        "</body></html>\n")
    return sha256


@pytest.fixture(scope="module")
def index() -> Iterator[Index]:
    root = Path(tempfile.mkdtemp(prefix="corral-test-index-"))
    requests: list[str] = []

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            requests.append(self.path)  # what the mirror served, instead of stderr noise

    try:
        sha256 = _index_tree(root)
        server = ThreadingHTTPServer(("127.0.0.1", 0),
                                     functools.partial(Handler, directory=str(root)))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield Index(port=server.server_address[1], sha256=sha256, requests=requests)
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def preset_manager(settings: Settings, index: Index) -> Iterator[Manager]:
    home = Path(tempfile.mkdtemp(prefix="corral-test-presets-"))
    home.chmod(0o711)
    base = f"http://{index.host}"
    own = Settings(home=home, uid_start=settings.uid_start + 7000, uid_count=500,
                   egress_allow_cidrs="127.0.0.1/32", egress_hosts={MIRROR: ["127.0.0.1"]},
                   index_pypi=f"{base}/simple", index_npm=f"{base}/npm",
                   index_debian=f"{base}/debian")
    try:
        with managed(own) as mgr:
            yield mgr
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def preset_home(preset_manager: Manager) -> str:
    return str(preset_manager.settings.home)


def pip(args: str) -> str:
    # No retries: a refused host answers at once, and the test need not wait out backoff.
    return f"python3 -m pip --retries 0 --timeout 20 --no-cache-dir {args}"


def test_pip_installs_through_the_preset_from_the_mirror_only(preset_home: str,
                                                              index: Index) -> None:
    with Sandbox.create(home=preset_home, network={"presets": ["pypi"]}) as sb:
        assert sb.get_info().network == {"mode": "allowlist", "allow": [index.host],
                                         "deny": [], "presets": ["pypi"],
                                         "require_lock": False}
        run = sb.commands.run(pip("install --target /workspace/t tinypkg"), timeout=60)
        assert run.exit_code == 0, (run.stdout, run.stderr)
        assert f"/files/{WHEEL}" in index.requests
        check = sb.commands.run("python3 -c 'import tinypkg; print(tinypkg.VALUE)'",
                                envs={"PYTHONPATH": "/workspace/t"})
        assert check.stdout == "tiny from the mirror\n"
        # The preset opens the mirror, not the public index: the gateway refuses pypi.org.
        public = sb.commands.run(pip("download --no-deps -d /workspace/d "
                                     "--index-url https://pypi.org/simple tinypkg"),
                                 timeout=60)
        assert public.exit_code != 0
        decisions = [e.data for e in sb.audit.events(types=["egress.decision"])]
        assert {(d["host"], d["verdict"]) for d in decisions} == {
            (MIRROR, "allowed"), ("pypi.org", "denied")}


def test_require_lock_makes_pip_refuse_unhashed_installs(preset_home: str,
                                                         index: Index) -> None:
    network = {"presets": ["pypi"], "require_lock": True}
    with Sandbox.create(home=preset_home, network=network) as sb:  # type: ignore[arg-type]
        assert sb.get_info().network["require_lock"] is True
        plain = sb.commands.run(pip("install --target /workspace/t tinypkg"), timeout=60)
        assert plain.exit_code != 0
        assert "hashes" in plain.stderr.lower(), plain.stderr
        # Even with the environment overridden for the command, the preset's setting wins.
        again = sb.commands.run(pip("install --target /workspace/t tinypkg"), timeout=60,
                                envs={"PIP_REQUIRE_HASHES": "0"})
        assert again.exit_code != 0 and "hashes" in again.stderr.lower(), again.stderr
        sb.files.write("bad.txt", f"tinypkg==1.0 --hash=sha256:{'0' * 64}\n")
        bad = sb.commands.run(pip("install --target /workspace/t -r bad.txt"), timeout=60)
        assert bad.exit_code != 0 and "DO NOT MATCH THE HASHES" in bad.stderr, bad.stderr
        sb.files.write("req.txt", f"tinypkg==1.0 --hash=sha256:{index.sha256}\n")
        locked = sb.commands.run(pip("install --require-hashes --target /workspace/t "
                                     "-r req.txt"), timeout=60)
        assert locked.exit_code == 0, (locked.stdout, locked.stderr)
        check = sb.commands.run("python3 -c 'import tinypkg; print(tinypkg.VALUE)'",
                                envs={"PYTHONPATH": "/workspace/t"})
        assert check.stdout == "tiny from the mirror\n"


def test_bad_preset_specs_are_refused_by_name(preset_home: str) -> None:
    with pytest.raises(UsageError, match=r"unknown network preset 'cargo'; valid presets: "
                                         r"debian, npm, pypi"):
        Sandbox.create(home=preset_home, network={"presets": ["cargo"]})
    with pytest.raises(UsageError, match="require_lock is enforced only for the pypi preset"):
        Sandbox.create(home=preset_home,
                       network={"presets": ["pypi", "npm"], "require_lock": True})  # type: ignore[dict-item]
    with pytest.raises(UsageError, match="require_lock needs a preset"):
        Sandbox.create(home=preset_home, network={"require_lock": True})  # type: ignore[dict-item]


def test_the_ceiling_sees_the_expanded_hosts(preset_manager: Manager, index: Index) -> None:
    public_only = local_tenant(Ceiling(hosts=("pypi.org", "files.pythonhosted.org")))
    with pytest.raises(CeilingExceeded, match=f"allow rule '{index.host}'"):
        preset_manager.create(network={"presets": ["pypi"]}, caller=public_only)
    mirror_ok = local_tenant(Ceiling(hosts=(index.host, "example.com")))
    info = preset_manager.create(network={"presets": ["pypi"], "allow": ["example.com"]},
                                 caller=mirror_ok)
    try:
        assert info.network["allow"] == ["example.com", index.host]
    finally:
        preset_manager.destroy(info.id)


def test_npm_and_apt_are_pointed_at_the_mirror(preset_home: str, index: Index) -> None:
    with Sandbox.create(home=preset_home, network={"presets": ["npm", "debian"]}) as sb:
        assert sb.get_info().network["allow"] == [index.host]
        sb.files.write(".npmrc", "registry=https://registry.npmjs.org/\n")  # the user's own
        registry = sb.commands.run("npm config get registry", timeout=60)
        assert registry.stdout.strip() == f"http://{index.host}/npm/", registry.stderr
        # apt reads the sources written for it, and goes to the mirror through the gateway
        # (which serves no Debian archive here: a missing Release file is the proof).
        update = sb.commands.run("apt-get update", timeout=60)
        assert f"http://{index.host}/debian bookworm" in update.stdout + update.stderr, (
            update.stdout, update.stderr)
        assert "/debian/dists/bookworm/InRelease" in index.requests
        assert "Permission denied" not in update.stderr and "lock" not in update.stderr.lower()
        hosts = {e.data["host"] for e in sb.audit.events(types=["egress.decision"])}
        assert hosts == {MIRROR}
    assert not os.environ.get("APT_CONFIG")  # nothing leaked onto the host


def test_the_cli_takes_index_presets(preset_home: str, index: Index) -> None:
    corral = [sys.executable, "-m", "corral", "--home", preset_home]
    ok = subprocess.run([*corral, "run", "--index", "pypi", "--",
                         pip("install --target t tinypkg") + " && ls t"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "tinypkg" in ok.stdout, (ok.stdout, ok.stderr)
    bad = subprocess.run([*corral, "create", "--index", "cargo"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "valid presets: debian, npm, pypi" in bad.stderr
