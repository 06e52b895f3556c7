"""A new user's first hour, on a real host (issue 38): a Dockerfile's WORKDIR is made as Docker
makes it, and a cleanly stopped ``corral serve`` leaves none of its spare workspaces mounted."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from corral import Sandbox
from corral._backends._linux.storage import mounts_under
from corral._images.build import build_dockerfile
from corral._settings import Settings
from tests.conftest import managed, private_settings
from tests.images.oci import busybox_root, layer_from_dir, push, write_layout
from tests.images.registry import LocalRegistry, registry_fixture, require_tools  # noqa: F401

pytestmark = pytest.mark.needs_root

# Bounds on waits for events (never a fixed sleep): generous for a loaded 2-core machine.
_START_S = 60.0
_STOP_S = 60.0


@pytest.fixture(scope="module")
def base_image(registry: LocalRegistry, settings: Settings) -> Iterator[tuple[Settings, str]]:
    require_tools("skopeo", "busybox")
    work = Path(tempfile.mkdtemp(prefix="corral-test-first-hour-"))
    try:
        os.chmod(work, 0o711)
        own = Settings(home=work / "home", uid_start=settings.uid_start + 7000, uid_count=300,
                       registries=registry.host)
        image = write_layout(work / "base", [layer_from_dir(busybox_root(work / "root"))],
                             config={"Env": ["PATH=/bin"]})
        push(image, registry.host, "firsthour/busybox", "1")
        yield own, f"{registry.host}/firsthour/busybox:1"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _dockerfile(tmp_path: Path, text: str) -> Path:
    (tmp_path / "Dockerfile").write_text(text)
    (tmp_path / "f.txt").write_text("from the context\n")
    return tmp_path / "Dockerfile"


@pytest.mark.parametrize("workdir", ["/workspace", "/srv/app/deep", "/opt/tool"])
def test_a_run_in_a_workdir_that_does_not_exist_yet_runs_there(
        base_image: tuple[Settings, str], tmp_path: Path, workdir: str) -> None:
    own, base = base_image
    # The RUN's text names the directory: its layer is not another case's cached one.
    dockerfile = _dockerfile(tmp_path, f"FROM {base}\nWORKDIR {workdir}\n"
                                       f"RUN pwd > here.txt && echo {workdir}\n")
    with managed(own) as manager:
        built = build_dockerfile(manager, dockerfile, name="firsthour-" + workdir.strip("/")
                                 .replace("/", "-"))
        root = built.template.root
        made = root / workdir.lstrip("/")
        assert (made / "here.txt").read_text() == f"{workdir}\n"
        assert made.is_dir() and os.stat(made).st_uid == 0  # root's, as any image file


def test_every_workdir_is_in_the_image_and_a_run_is_cached_per_workdir(
        base_image: tuple[Settings, str], tmp_path: Path) -> None:
    own, base = base_image
    with managed(own) as manager:
        # The same RUN under another WORKDIR is another step (Docker: the working directory is
        # part of what a step is), never the first one's cached layer.
        for where in ("/srv/one", "/srv/two"):
            ctx = tmp_path / where.rsplit("/", 1)[1]
            ctx.mkdir()
            dockerfile = _dockerfile(ctx, f"FROM {base}\nWORKDIR {where}\nRUN pwd > here\n")
            built = build_dockerfile(manager, dockerfile, name="firsthour-cache")
            assert (built.template.root / where.lstrip("/") / "here").read_text() == \
                f"{where}\n"
        # A WORKDIR no step writes in is in the image too, though the last one is another.
        ctx = tmp_path / "unwritten"
        ctx.mkdir()
        dockerfile = _dockerfile(ctx, f"FROM {base}\nWORKDIR /srv/unwritten\n"
                                      "WORKDIR /srv/last\nRUN true\nWORKDIR /srv/trailing\n")
        build_dockerfile(manager, dockerfile, name="firsthour-workdirs")
        with Sandbox.create(template="firsthour-workdirs", home=str(own.home)) as sb:
            assert sb.commands.run(["pwd"]).stdout == "/srv/trailing\n"
            assert sb.commands.run(["ls", "/srv"]).stdout.split() == [
                "last", "trailing", "unwritten"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + _START_S
    while time.monotonic() < deadline:
        assert process.poll() is None, "corral serve exited at start-up"
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # polling an event (the listener), bounded by the deadline
    raise AssertionError(f"corral serve did not answer within {_START_S:.0f} s")


def _wait_for_spares(home: Path) -> list[Path]:
    """The spare workspaces' mounts, once the service has made one (after its second create)."""
    deadline = time.monotonic() + _START_S
    while time.monotonic() < deadline:
        spares = [p for p in mounts_under(home) if ".ready." in str(p)]
        if spares:
            return spares
        time.sleep(0.1)
    raise AssertionError("the service made no spare workspace after two creates")


@pytest.mark.parametrize(("signum", "e2b"), [(signal.SIGTERM, False), (signal.SIGINT, False),
                                             (signal.SIGTERM, True)],
                         ids=["sigterm", "ctrl-c", "sigterm-with-e2b"])
def test_a_cleanly_stopped_service_leaves_nothing_mounted(signum: int, e2b: bool) -> None:
    with private_settings("corral-test-serve-stop-") as own:
        port = _free_port()
        env = {**os.environ, "CORRAL_HOME": str(own.home),
               "CORRAL_UID_START": str(own.uid_start), "CORRAL_UID_COUNT": str(own.uid_count)}
        env.pop("CORRAL_URL", None)
        process = subprocess.Popen(
            [sys.executable, "-m", "corral", "serve", "--host", "127.0.0.1", "--port",
             str(port), *(["--e2b-port", str(_free_port())] if e2b else [])],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, process)
            for _ in range(2):  # the second plain create starts the refill
                with Sandbox.create(url=url) as sb:
                    assert sb.commands.run("true").exit_code == 0
            assert _wait_for_spares(own.home)
            # As a terminal sends it: to the whole process group (helpers included).
            os.killpg(process.pid, signum)
            _, stderr = process.communicate(timeout=_STOP_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=_STOP_S)
        left = mounts_under(own.home) + [
            p for p in mounts_under(own.run_dir) if own.instance in p.name]
        # Swept by hand if the service left them, so the home can be removed.
        for point in left:
            subprocess.run(["umount", "-l", str(point)], check=False)
        assert left == [], (left, stderr.decode(errors="replace")[-2000:])
        assert not [p.name for p in (own.home / "sandboxes").glob(".ready.*")] \
            if (own.home / "sandboxes").exists() else True


_NO_NETWORK_COMMAND = """
import sys
from corral import Sandbox
with Sandbox.create(home=sys.argv[1]) as sb:
    assert sb.commands.run("true").exit_code == 0
loaded = sorted(m for m in sys.modules if m.startswith(("cryptography", "corral._egress.ca")))
print(",".join(loaded))
"""


def test_a_sandbox_without_network_loads_no_cryptography(settings: Settings) -> None:
    """Its commands get a refusing listener, which intercepts nothing: the CA (cryptography)
    and the upstream trust store are left for the first secret-bound connection (start-up)."""
    env = {**os.environ, "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    env.pop("CORRAL_URL", None)
    for _ in range(2):  # a new home makes its CA at once (templates bundle it); then it is kept
        done = subprocess.run([sys.executable, "-c", _NO_NETWORK_COMMAND, str(settings.home)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", done.stdout
