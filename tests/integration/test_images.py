"""Images as templates, end to end: a real registry on loopback (Debian's docker-registry), images
this test builds itself and pushes with skopeo, pulled by Corral and run on the namespace and
gVisor tiers."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from corral import Sandbox
from corral._cli.main import cli
from corral._control.manager import Manager
from corral._images.pull import pull_image
from corral._settings import Settings
from corral.errors import ImageError, ImageRefused
from tests.conftest import managed
from tests.images.oci import (
    Image,
    Member,
    busybox_root,
    docker_archive,
    layer_from_dir,
    layer_from_members,
    push,
    write_layout,
)
from tests.images.registry import LocalRegistry, registry_fixture, require_tools  # noqa: F401

pytestmark = pytest.mark.needs_root

_CONFIG = {"Env": ["PATH=/bin:/usr/bin", "GREETING=hello from the image", "HOME=/root"],
           "WorkingDir": "/app", "User": "app",
           "Cmd": ["/bin/sh", "-c", "echo cmd says $GREETING"]}


@dataclass
class Images:
    registry: LocalRegistry
    settings: Settings
    manager: Manager
    base_layer: bytes
    bb: Image
    bb_digest: str
    bb2_digest: str
    work: Path

    @property
    def home(self) -> str:
        return str(self.settings.home)

    def ref(self, repo: str, tag: str = "v1") -> str:
        return f"{self.registry.host}/{repo}:{tag}"


@pytest.fixture(scope="module")
def images(registry: LocalRegistry, settings: Settings) -> Iterator[Images]:
    require_tools("skopeo", "busybox")
    work = Path(tempfile.mkdtemp(prefix="corral-test-images-"))
    try:
        os.chmod(work, 0o711)  # sandbox uids reach the home inside
        own = Settings(home=work / "home", uid_start=settings.uid_start + 6000,
                       uid_count=1000, registries=registry.host)
        base = layer_from_dir(busybox_root(work / "busybox"))
        app = layer_from_members([Member("app", kind="dir", mode=0o755),
                                  Member("app/hello.txt", data=b"hello\n")])
        bb = write_layout(work / "bb", [base, app], config=_CONFIG)
        other = layer_from_members([Member("srv/other.txt", data=b"other\n")])
        bb2 = write_layout(work / "bb2", [base, other], config={"Cmd": ["/bin/sh"]})
        with managed(own) as manager:
            yield Images(registry=registry, settings=own, manager=manager, base_layer=base,
                         bb=bb, bb_digest=push(bb, registry.host, "test/bb", "v1"),
                         bb2_digest=push(bb2, registry.host, "test/bb2", "v1"), work=work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _cli(images: Images, *args: str) -> Any:
    result = CliRunner().invoke(cli, ["--home", images.home, *args],
                                env={"CORRAL_REGISTRIES": images.registry.host})
    return result


def _json(images: Images, *args: str) -> Any:
    result = _cli(images, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_pull_by_tag_then_by_digest_from_the_cache(images: Images) -> None:
    first = _json(images, "templates", "pull", images.ref("test/bb"))
    assert first["digest"] == images.bb_digest
    assert first["name"] == "img-" + images.bb_digest[7:23]
    assert (first["cached"], first["layers_unpacked"]) == (False, 2)
    assert first["image"]["config"]["working_dir"] == "/app"
    again = _json(images, "templates", "pull",
                  f"{images.registry.host}/test/bb@{images.bb_digest}")
    assert again["cached"] is True and again["name"] == first["name"]
    listed = {t["name"]: t for t in _json(images, "templates", "ls")}
    assert listed[first["name"]]["kind"] == "image"
    assert listed[first["name"]]["version"] == images.bb_digest


def test_a_second_image_reuses_the_shared_base_layer(images: Images) -> None:
    one = pull_image(images.ref("test/bb"), images.settings)
    two = pull_image(images.ref("test/bb2"), images.settings, name="bb-two")
    assert (two.layers_reused, two.layers_unpacked) == (1, 1)
    assert two.digest == images.bb2_digest
    # The base layer's files are one inode on disk, shared by both roots.
    assert os.stat(one.template.root / "bin" / "busybox").st_ino == \
        os.stat(two.template.root / "bin" / "busybox").st_ino
    assert (two.template.root / "srv" / "other.txt").read_text() == "other\n"


def test_registries_off_the_allowlist_and_unpinned_tags_are_refused(images: Images) -> None:
    elsewhere = Settings(home=images.settings.home, registries="docker.io")
    with pytest.raises(ImageRefused, match=r"not on the operator's allowlist.*CORRAL_REGISTRIES"):
        pull_image(images.ref("test/bb"), elsewhere)
    pinned_only = Settings(home=images.settings.home, registries=images.registry.host,
                           registries_require_digest=True)
    with pytest.raises(ImageRefused, match=r"CORRAL_REGISTRIES_REQUIRE_DIGEST"):
        pull_image(images.ref("test/bb2"), pinned_only)
    # Host paths only for the host's operator, never for an API caller.
    with pytest.raises(ImageRefused, match=r"only its operator"):
        pull_image(f"oci:{images.bb.layout}:latest", images.settings, allow_local=False)
    result = _cli(images, "templates", "pull", "docker.io/library/python:3.12", "--json")
    assert result.exit_code != 0
    assert json.loads(result.stderr)["code"] == "image_refused"


def test_a_tampered_blob_is_refused_and_nothing_is_kept(images: Images) -> None:
    marker = secrets.token_hex(8).encode()
    own = layer_from_members([Member("tampered.txt", data=marker * 64)])
    image = write_layout(images.work / f"t-{marker.decode()}", [images.base_layer, own])
    push(image, images.registry.host, "test/tampered", "v1")
    images.registry.tamper_blob(image.layer_digests[1])
    with pytest.raises(ImageError, match=r"(?i)digest"):
        pull_image(images.ref("test/tampered"), images.settings)
    layers = images.settings.home / "images" / "layers"
    assert not (layers / image.diff_ids[1].removeprefix("sha256:")).exists()
    # No template of it either (nor the folder, when this test runs alone).
    templates = images.settings.home / "templates"
    kept = templates.iterdir() if templates.exists() else iter(())
    assert not [p for p in kept if image.manifest_digest[7:23] in p.name]


def test_a_hostile_image_is_neutralised_or_refused_whole(images: Images) -> None:
    etc_before = {p: os.lstat(p) for p in ("/etc", "/etc/passwd", "/etc/shadow")}
    hostile = layer_from_members([
        Member("dev/sda", kind="blockdev", devmajor=8, devminor=0),
        Member("bin/su", data=b"#!/bin/sh\necho root\n", mode=0o4755),
        Member("root/owned", data=b"x", uid=0, mode=0o600),
        Member("srv/app", data=b"x", uid=1234, mode=0o750),
        Member(".wh.etc"),
    ])
    image = write_layout(images.work / "hostile", [images.base_layer, hostile],
                         config={"Env": ["PATH=/bin"]})
    pulled = pull_image(f"oci:{image.layout}:latest", images.settings, name="hostile",
                        allow_local=True)
    root = pulled.template.root
    assert not (root / "dev" / "sda").exists()
    assert os.stat(root / "bin" / "su").st_mode & 0o7777 == 0o755
    assert (root / "etc").is_dir() and list((root / "etc").iterdir()) == []
    for path in root.rglob("*"):
        assert path.lstat().st_uid == 0, path
    with Sandbox.create(template="hostile", home=images.home) as sb:
        r = sb.commands.run(["/bin/sh", "-c", "cat /srv/app; ls /dev; id -u; cat /root/owned"])
        assert r.stdout.startswith("x") and "sda" not in r.stdout
        assert "1000" in r.stdout and "Permission denied" in r.stderr
    assert {p: os.lstat(p) for p in etc_before} == etc_before

    escaping = layer_from_members([Member("../../../../tmp/corral-escaped", data=b"pwned")])
    bad = write_layout(images.work / "escaping", [images.base_layer, escaping])
    with pytest.raises(ImageError, match=r"climbs out"):
        pull_image(f"oci:{bad.layout}:latest", images.settings, name="escaping",
                   allow_local=True)
    assert not Path("/tmp/corral-escaped").exists()
    assert not list((images.settings.home / "templates").glob("escaping*"))


def test_the_image_config_is_honoured(images: Images, isolation: str) -> None:
    with Sandbox.create(image=images.ref("test/bb"), isolation=isolation,
                        home=images.home) as sb:
        env = dict(line.split("=", 1) for line in
                   sb.commands.run(["env"]).stdout.splitlines() if "=" in line)
        assert env["GREETING"] == "hello from the image"
        assert env["PATH"] == "/bin:/usr/bin"
        assert env["HOME"] == "/workspace"  # the sandbox user's, not the image's /root
        assert sb.commands.run(["pwd"]).stdout == "/app\n"
        assert sb.commands.run(["id", "-u"]).stdout == "1000\n"  # User "app" is the sandbox user
        # A string command runs with sh: the image has no bash.
        assert sb.commands.run("echo $GREETING; cat hello.txt").stdout == \
            "hello from the image\nhello\n"
        assert sb.commands.run(["pwd"], cwd="/workspace").stdout == "/workspace\n"
        denied = sb.commands.run(["touch", "/app/new"])
        assert denied.exit_code != 0
        sb.files.write("/workspace/ok.txt", "fine")
        assert sb.files.read("/workspace/ok.txt") == "fine"
        info = sb.get_info()
        assert info.template_version == images.bb_digest
        created = sb.audit.events(types=["sandbox.created"])[0].data
        assert created["image"].endswith(f"test/bb:v1@{images.bb_digest}")
        assert created["template_version"] == images.bb_digest


def test_corral_run_image_runs_its_command_and_info_shows_the_digest(images: Images) -> None:
    result = _cli(images, "run", "--image", images.ref("test/bb"), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stdout"] == "cmd says hello from the image\n"
    created = _cli(images, "create", "--image", images.ref("test/bb"))
    assert created.exit_code == 0, created.output
    sandbox_id = created.stdout.strip()
    try:
        info = _json(images, "info", sandbox_id)
        assert info["template_version"] == images.bb_digest
    finally:
        _cli(images, "rm", sandbox_id)


def test_a_docker_save_archive_becomes_a_template(images: Images) -> None:
    archive = docker_archive(images.bb, images.work / "bb.tar", "test/bb:v1")
    pulled = _json(images, "templates", "pull", f"docker-archive:{archive}", "--name",
                   "from-archive")
    assert pulled["name"] == "from-archive" and pulled["kind"] == "image"
    with Sandbox.create(template="from-archive", home=images.home) as sb:
        assert sb.commands.run(["cat", "/app/hello.txt"]).stdout == "hello\n"
        assert sb.commands.run(["pwd"]).stdout == "/app\n"


def test_tags_name_versions_of_a_template(images: Images) -> None:
    one = _json(images, "templates", "pull", images.ref("test/bb"), "--name", "versioned:one")
    two = _json(images, "templates", "pull", images.ref("test/bb2"), "--name", "versioned:two")
    assert one["version"] != two["version"]
    listed = [t for t in _json(images, "templates", "ls") if t["name"] == "versioned"]
    assert sorted(tag for t in listed for tag in t["tags"]) == ["one", "two"]
    assert [t["version"] for t in listed if t["current"]] == [images.bb2_digest]
    with Sandbox.create(template="versioned:one", home=images.home) as sb:
        assert sb.get_info().template_version == images.bb_digest
        assert sb.commands.run(["cat", "/app/hello.txt"]).stdout == "hello\n"
    with Sandbox.create(template="versioned", home=images.home) as sb:
        assert sb.get_info().template_version == images.bb2_digest
    bad = _cli(images, "templates", "pull", images.ref("test/bb"), "--name", "versioned:.bad")
    assert bad.exit_code != 0 and "invalid tag" in bad.output
    text = _cli(images, "templates", "ls")
    assert "[one]" in text.output and "[two]" in text.output


def test_the_http_api_creates_from_registry_images_only(images: Images) -> None:
    from tests.integration.servers import Server

    with Server(images.manager) as server:
        with Sandbox.create(image=images.ref("test/bb"), url=server.url) as sb:
            assert sb.commands.run(["cat", "hello.txt"]).stdout == "hello\n"
            assert sb.get_info().template_version == images.bb_digest
        # A host path is the operator's to name, never an API caller's.
        with pytest.raises(ImageRefused, match=r"only its operator"):
            Sandbox.create(image=f"oci:{images.bb.layout}:latest", url=server.url)
        with pytest.raises(ImageRefused, match=r"CORRAL_REGISTRIES"):
            Sandbox.create(image="quay.io/acme/tool:1", url=server.url)


def test_prune_removes_what_no_template_uses(images: Images) -> None:
    marker = secrets.token_hex(8).encode()
    own = layer_from_members([Member("pruned.txt", data=marker)])
    image = write_layout(images.work / f"p-{marker.decode()}", [images.base_layer, own])
    pulled = pull_image(f"oci:{image.layout}:latest", images.settings, name="to-prune",
                        allow_local=True)
    layers = images.settings.home / "images" / "layers"
    top = layers / image.diff_ids[1].removeprefix("sha256:")
    base = layers / image.diff_ids[0].removeprefix("sha256:")
    assert top.is_dir() and base.is_dir()
    assert _cli(images, "templates", "rm", "to-prune").exit_code == 0
    pruned = _json(images, "templates", "prune")
    assert pruned["removed"] >= 1 and pruned["freed_bytes"] > 0
    assert not top.exists()  # only to-prune used it
    assert base.is_dir()  # the other images still use the base layer
    assert not pulled.template.path.exists()
    with Sandbox.create(image=images.ref("test/bb"), home=images.home) as sb:
        assert sb.commands.run(["cat", "/app/hello.txt"]).stdout == "hello\n"


def test_a_template_spec_can_name_an_image(images: Images) -> None:
    spec = images.work / "from-spec.toml"
    spec.write_text(f'name = "from-spec"\nimage = "{images.ref("test/bb")}"\n')
    built = _json(images, "templates", "build", "--file", str(spec))
    assert built["name"] == "from-spec" and built["digest"] == images.bb_digest
    both = images.work / "both.toml"
    both.write_text(f'name = "both"\nimage = "{images.ref("test/bb")}"\npackages = ["jq"]\n')
    refused = _cli(images, "templates", "build", "--file", str(both))
    assert refused.exit_code != 0 and "takes no packages" in refused.output
