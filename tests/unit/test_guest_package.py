"""The guest package (``corral._guest``) runs inside the microVM on the template's python3: every
module imports only the standard library and its own package, and the zipapp the root image
carries is the same bytes for the same sources (the image key hashes it)."""

from __future__ import annotations

import ast
import socket
import subprocess
import sys
import zipfile
from io import BytesIO
from pathlib import Path

import corral._guest
from corral._backends.microvm import rootimage
from corral._guest.protocol import AGENT_VERSION, encode, read_one

GUEST = Path(corral._guest.__file__).parent


def _imports(path: Path) -> list[tuple[int, str, int]]:
    """(line, module, level) of every import in ``path``, ``TYPE_CHECKING`` blocks included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.module or "", node.level))
    return found


def test_the_guest_package_imports_only_the_standard_library_and_itself() -> None:
    modules = sorted(GUEST.glob("*.py"))
    assert len(modules) > 10
    own = {path.stem for path in modules}
    offenders = []
    for path in modules:
        for line, module, level in _imports(path):
            where = f"{path.name}:{line}"
            if level > 1:
                offenders.append(f"{where} climbs out of the package ({'.' * level}{module})")
            elif level == 1:
                # In the zipapp the package is ``_guest``: only its own modules are there.
                if module and module.split(".")[0] not in own:
                    offenders.append(f"{where} imports .{module}, not a module of the package")
            elif module.split(".")[0] not in sys.stdlib_module_names:
                # Absolute corral imports too: corral itself is not in the guest.
                offenders.append(f"{where} imports {module}, not the standard library")
    assert offenders == []


def test_the_agent_zipapp_is_the_same_bytes_each_build() -> None:
    first, second = rootimage.agent_zipapp(), rootimage.agent_zipapp()
    assert first == second
    names = zipfile.ZipFile(BytesIO(first)).namelist()
    assert names[0] == "__main__.py"
    assert sorted(names[1:]) == names[1:]
    assert set(names[1:]) == {f"_guest/{path.name}" for path in GUEST.glob("*.py")}


def test_the_agent_zipapp_runs_on_a_bare_python(tmp_path: Path) -> None:
    """The guest's command line, ``python3 -I -S agent.pyz`` (no site-packages, so no corral
    to fall back on): it starts, says ``ready``, answers a ``ping`` and ends with its channel
    (a socket in the agent's test mode)."""
    app = tmp_path / rootimage.AGENT
    app.write_bytes(rootimage.agent_zipapp())
    ours, theirs = socket.socketpair()
    env = {"CORRAL_AGENT_CHANNEL": f"fd:{theirs.fileno()}",
           "CORRAL_AGENT_WORKSPACE": str(tmp_path), "CORRAL_AGENT_CGROUP": str(tmp_path / "cg"),
           "CORRAL_AGENT_RUN": "/nonexistent"}
    proc = subprocess.Popen([sys.executable, "-I", "-S", str(app)], env=env,
                            pass_fds=(theirs.fileno(),), stderr=subprocess.PIPE)
    theirs.close()
    try:
        ours.settimeout(30)
        ready = read_one(ours)
        ours.sendall(encode({"id": 1, "op": "ping"}))
        assert read_one(ours) == {"id": 1, "ok": True}
    finally:
        ours.close()
        _, stderr = proc.communicate(timeout=30)
    assert ready is not None and ready["ready"]["agent"] == AGENT_VERSION, stderr
    assert proc.returncode == 0, stderr


def test_the_image_key_covers_the_guest_package() -> None:
    assert rootimage.skeleton_sources()[rootimage.AGENT] == GUEST
