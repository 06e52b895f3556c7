"""The image test tooling itself: hand-built OCI layouts go into a real local registry and come
back out through skopeo as built, and a damaged blob is caught on the way out."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from tests.images.oci import (
    Member,
    busybox_root,
    docker_archive,
    layer_from_dir,
    layer_from_members,
    push,
    skopeo,
    write_layout,
)
from tests.images.registry import LocalRegistry, registry_fixture, require_tools  # noqa: F401


@pytest.fixture(autouse=True)
def _tools() -> None:
    require_tools("skopeo", "busybox")


def _inspect(ref: str) -> dict[str, object]:
    out = skopeo("inspect", "--tls-verify=false", "--no-creds", ref).stdout
    result: dict[str, object] = json.loads(out)
    return result


def test_layout_pushes_and_inspects_by_tag_and_digest(registry: LocalRegistry,
                                                      tmp_path: Path) -> None:
    base = layer_from_dir(busybox_root(tmp_path / "root"))
    extra = layer_from_members([Member("etc/motd", data=b"hi\n"),
                                Member("etc/os", kind="symlink", target="motd")], compress=False)
    image = write_layout(tmp_path / "layout", [base, extra],
                         config={"Env": ["PATH=/bin"], "User": "app", "Cmd": ["sh"]})
    second = write_layout(tmp_path / "layout", [base], tag="base")

    digest = push(image, registry.host, "selfcheck/busybox", "v1")
    push(second, registry.host, "selfcheck/busybox", "base")

    # --preserve-digests: the registry holds the manifest byte for byte, uncompressed layer too.
    assert digest == image.manifest_digest
    by_tag = _inspect(f"docker://{registry.host}/selfcheck/busybox:v1")
    by_digest = _inspect(f"docker://{registry.host}/selfcheck/busybox@{digest}")
    for seen in (by_tag, by_digest):
        assert seen["Digest"] == digest
        assert seen["Layers"] == image.layer_digests
        assert seen["Architecture"] == "amd64" and seen["Os"] == "linux"
        assert seen["Env"] == ["PATH=/bin"]
    config = json.loads(skopeo("inspect", "--tls-verify=false", "--no-creds", "--config",
                               "--raw", f"docker://{registry.host}/selfcheck/busybox:v1").stdout)
    assert config["rootfs"]["diff_ids"] == image.diff_ids
    assert second.layer_digests == image.layer_digests[:1]  # the layout shares the base blob


HOSTILE_NAMES = ["../escape", "/abs/path", "./x", "d/.wh.gone", "d/.wh..wh..opq"]


def _hostile_members() -> list[Member]:
    return [Member(n) for n in HOSTILE_NAMES] + [
        Member("dev/null", kind="chardev", mode=0o666, devmajor=1, devminor=3),
        Member("link", kind="hardlink", target="../escape"),
        Member("f", data=b"x", xattrs={"user.k": "v"}),
    ]


def test_hostile_members_are_written_as_given() -> None:
    layer = layer_from_members(_hostile_members())
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        members = tar.getmembers()
    assert [m.name for m in members[:5]] == HOSTILE_NAMES
    assert members[5].ischr() and (members[5].devmajor, members[5].devminor) == (1, 3)
    assert members[6].islnk() and members[6].linkname == "../escape"
    assert members[7].pax_headers["SCHILY.xattr.user.k"] == "v"
    assert layer == layer_from_members(_hostile_members())  # deterministic, gzip header too


def test_tampered_blob_fails_the_pull(registry: LocalRegistry, tmp_path: Path) -> None:
    layer = layer_from_members([Member("tampered", data=b"original content\n")])
    image = write_layout(tmp_path / "layout", [layer])
    push(image, registry.host, "selfcheck/tampered", "v1")
    registry.tamper_blob(image.layer_digests[0])

    proc = skopeo("copy", "--src-tls-verify=false", "--src-no-creds",
                  f"docker://{registry.host}/selfcheck/tampered:v1",
                  f"oci:{tmp_path / 'pulled'}:v1", check=False)
    assert proc.returncode != 0
    assert "digest" in proc.stderr.lower(), proc.stderr


def test_docker_archive_round_trips(tmp_path: Path) -> None:
    layer = layer_from_members([Member("hello", data=b"hello\n", mode=0o755)])
    image = write_layout(tmp_path / "layout", [layer], tag="v1")
    archive = docker_archive(image, tmp_path / "image.tar", "corral/selfcheck:v1")

    skopeo("copy", "--quiet", f"docker-archive:{archive}", f"oci:{tmp_path / 'back'}:v1")
    back = _inspect(f"oci:{tmp_path / 'back'}:v1")
    # The archive holds the layer uncompressed, so only the uncompressed digest survives.
    config = json.loads(skopeo("inspect", "--config", "--raw",
                               f"oci:{tmp_path / 'back'}:v1").stdout)
    assert config["rootfs"]["diff_ids"] == image.diff_ids
    assert len(back["Layers"]) == 1  # type: ignore[arg-type]
