"""E2B's Template SDK (``e2b`` 2.63.0, the ``latest`` set) builds a template through Corral's
template-build API (``POST /v3/templates`` ... ``/status``) from an image in a loopback registry
the server's policy allows; a sandbox is then created from it by name, only by its own tenant.
Refusals (a bad name, a registry off the allowlist, a start command, a failing step) and hostile
COPY archives come back as the SDK's exceptions with Corral's messages."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.images.oci import busybox_root, layer_from_dir, push, write_layout
from tests.images.registry import LocalRegistry, registry_fixture, require_tools  # noqa: F401

from .conftest import ClientRun, Served, corral_serve, run_client

pytestmark = [pytest.mark.e2b, pytest.mark.needs_root, pytest.mark.timeout(900)]


MIRROR = "mirror.test"  # the operator's pypi index, pinned to 127.0.0.1
INDEX_PAGE = "<a href='corraltiny/'>corraltiny</a>\n"


@pytest.fixture(scope="module")
def index() -> Iterator[int]:
    """A PEP 503 ``/simple/`` page on 127.0.0.1 (its port)."""
    root = Path(tempfile.mkdtemp(prefix="corral-test-e2b-index-"))
    (root / "simple").mkdir()
    (root / "simple" / "index.html").write_text(INDEX_PAGE)

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def image_served(registry: LocalRegistry, index: int) -> Iterator[tuple[Served, str]]:
    """A ``corral serve`` of its own whose registry policy allows the loopback registry, with
    a busybox image pushed there, and whose tenants' ceiling allows the operator's (loopback)
    pypi index."""
    if os.geteuid() != 0:
        pytest.skip("needs root: corral serve runs real sandboxes")
    require_tools("skopeo", "busybox")
    work = Path(tempfile.mkdtemp(prefix="corral-test-e2b-templates-"))
    settings = {"CORRAL_REGISTRIES": registry.host,
                "CORRAL_INDEX_PYPI": f"http://{MIRROR}:{index}/simple",
                "CORRAL_EGRESS_HOSTS": json.dumps({MIRROR: ["127.0.0.1"]}),
                "CORRAL_EGRESS_ALLOW_CIDRS": "127.0.0.1/32",
                "CORRAL_CEILING_HOSTS": f"{MIRROR}:{index}"}
    patch = pytest.MonkeyPatch()
    try:
        image = write_layout(work / "base", [layer_from_dir(busybox_root(work / "root"))],
                             config={"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"]})
        push(image, registry.host, "e2b/busybox", "1")
        for name, value in settings.items():
            patch.setenv(name, value)  # read once, as the server starts
        with corral_serve() as served:
            patch.undo()
            yield served, f"{registry.host}/e2b/busybox:1"
    finally:
        patch.undo()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def client(image_served: tuple[Served, str]) -> ClientRun:
    served, base = image_served
    return run_client(served, "latest", "templates.py", base,
                      env={"BETA_KEY": served.keys["beta"]}, timeout=800)


def test_the_template_sdk_builds_with_logs_in_its_own_format(client: ClientRun) -> None:
    got = client.value("build")
    assert got["template_id"] == "busy-env" and got["name"] == "busy-env:v1"
    assert got["tags"] == ["v1"]
    messages = [entry["message"] for entry in got["logs"]]
    # The server's entries, streamed by offset: each step named by its Dockerfile line, the
    # RUN's own output, then the last line.
    assert any(m.startswith("Dockerfile:4: COPY") for m in messages), messages
    assert any("RUN" in m for m in messages) and any("built in" in m for m in messages)
    # Polled by offset: no server entry comes twice.
    assert sum(m.startswith("Dockerfile:4: COPY") for m in messages) == 1, messages
    print(f"template build (cold): {got['seconds']} s")


def test_a_rebuild_runs_no_step(client: ClientRun) -> None:
    got = client.value("rebuild")
    messages = [entry["message"] for entry in got["logs"]]
    assert any("(cached)" in m for m in messages), messages
    assert any("0 steps run" in m for m in messages), messages
    print(f"template build (cached): {got['seconds']} s")
    # skip_cache: the RUN steps run again (the COPY steps' content is the same: still cached).
    forced = [entry["message"] for entry in client.value("skip_cache")["logs"]]
    assert any("(2 steps run, 2 cached)" in m for m in forced), forced


def test_sandboxes_are_created_from_the_template_by_name_and_tag(client: ClientRun) -> None:
    assert client.value("exists") == [True, False, True, False]
    assert "has no tag 'v9'" in client.error("no_such_tag")["message"]
    for name, step in (("busy-env", "sandbox"), ("busy-env:v1", "sandbox_tag")):
        got = client.value(step)
        assert got["template_id"] == name
        assert got["stdout"].splitlines() == [
            "hello from an uploaded file", "hello 'quoted' $HOME", "line one", "line two",
            "tool ran"], got


def test_tags_are_assigned_listed_and_removed(client: ClientRun) -> None:
    got = client.value("tags")
    assert got["assigned"] == ["prod", "stable"] and got["same_build"] is True
    assert got["listed"] == ["prod", "stable", "v1"] and got["after"] == ["prod", "v1"]
    assert got["prod_exists"] is True and got["stable_exists"] is False
    assert client.value("prod_sandbox")["template_id"] == "busy-env:prod"


def test_build_steps_reach_the_tenants_index_with_pip_pointed_at_it(
        client: ClientRun, index: int) -> None:
    got = client.value("network")
    assert got["stdout"].splitlines() == [INDEX_PAGE.strip(), f"http://{MIRROR}:{index}/simple/"]


def test_another_tenant_does_not_see_the_template(client: ClientRun) -> None:
    assert client.value("beta_exists") is False
    assert client.error("beta_tags")["error"] in ("NotFoundException", "TemplateException")
    assert client.error("beta_create")["error"] in ("NotFoundException", "SandboxException",
                                                    "TemplateException")


def test_a_failing_step_is_the_sdks_build_exception_naming_it(client: ClientRun) -> None:
    err = client.error("failing")
    assert err["error"] == "BuildException"
    assert "exited with 3" in err["message"] and "about to fail" in err["message"]


def test_bad_input_is_refused_with_what_to_do(client: ClientRun) -> None:
    bad = client.error("bad_name")
    assert "invalid template name" in bad["message"]
    refused = client.error("refused_registry")
    assert "CORRAL_REGISTRIES" in refused["message"], refused
    start = client.error("start_cmd")
    assert "startCmd" in start["message"] and "background=True" in start["message"]


@pytest.mark.parametrize("step", ["hostile_dotdot", "hostile_link"])
def test_a_hostile_archive_is_refused_whole(client: ClientRun, step: str,
                                            image_served: tuple[Served, str]) -> None:
    got = client.value(step)
    assert got["upload"] == 400, got
    assert "refused" in got["message"]
    assert ("'..'" in got["message"]) if step == "hostile_dotdot" else (
        "outside the archive" in got["message"])
    # Nothing of it was kept: the build that names it is refused.
    assert got["trigger"] == 400 and "were not uploaded" in got["trigger_message"]
    served, _ = image_served
    assert not list(served.home.rglob("escaped-by-tar.txt"))
    assert not Path("/etc/escaped-by-tar.txt").exists()


def test_the_js_template_sdk_builds_too(image_served: tuple[Served, str]) -> None:
    """The JS SDK (2.51.0, what @mastra/e2b builds with): same API, same results."""
    served, base = image_served
    js = run_client(served, "js", "templates.cjs", base, timeout=400)
    got = js.value("build")
    assert got["templateId"] == "js-env" and got["name"] == "js-env"
    assert any(entry["message"].startswith("Dockerfile:") for entry in got["logs"])
    assert js.value("exists") == [True, False]
    assert js.value("sandbox").splitlines() == ["hello from the JS SDK", "yes"]
    assert "CORRAL_REGISTRIES" in js.error("refused")["message"]
    print(f"template build (JS, cold): {got['seconds']} s")


def test_an_upload_link_is_its_tenants_and_used_once(client: ClientRun) -> None:
    got = client.value("stolen_link")
    assert (got["beta"], got["own"], got["again"]) == (403, 200, 403)
    assert got["present"] == {"present": True}
