"""An image as the root of the microVM tier: the tier's own Debian base root packed as an OCI
image (as a user's image would come), pulled, booted, its config honoured inside the guest."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Sandbox
from corral._settings import Settings
from tests.images.oci import Member, layer_from_dir, layer_from_members, write_layout

pytestmark = [pytest.mark.needs_root, pytest.mark.microvm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def layout(settings: Settings, microvm_problems: list[str]) -> Iterator[Path]:
    if microvm_problems:
        pytest.skip("the microVM tier cannot run here: " + "; ".join(microvm_problems))
    from corral._backends.microvm.backend import MicrovmBackend

    # The tier's own base root (built once per host), so the image has the python3 the guest
    # agent runs on.
    base = MicrovmBackend(settings)._vm_base_template()
    assert base.root is not None
    work = Path(tempfile.mkdtemp(prefix="corral-test-microvm-image-"))
    try:
        app = layer_from_members([Member("app", kind="dir", mode=0o755),
                                  Member("app/hello.txt", data=b"hello from the image\n")])
        write_layout(work / "layout", [layer_from_dir(base.root, compress=False), app],
                     config={"Env": ["PATH=/usr/bin:/bin", "GREETING=guest"],
                             "WorkingDir": "/app"})
        yield work / "layout"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_an_image_boots_as_a_microvm_with_its_config(layout: Path, home: str) -> None:
    with Sandbox.create(image=f"oci:{layout}:latest", isolation="microvm", home=home) as sb:
        r = sb.commands.run(["sh", "-c", "pwd; cat hello.txt; echo $GREETING; id -u"])
        assert r.exit_code == 0, r.stderr
        assert r.stdout == "/app\nhello from the image\nguest\n1000\n"
        assert sb.get_info().template_version is not None
        assert sb.get_info().isolation == "microvm"
