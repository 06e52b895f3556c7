"""Hostile image layers against the real unpacker, as root on this host: every trick is refused
or neutralised, and the host is untouched (its files, their owners and link counts)."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import secrets
import stat
from pathlib import Path

import pytest

from corral._images.unpack import LayerContent, LayerLimits, compose_root, unpack_layer
from corral.errors import ImageError
from tests.images.oci import Member, layer_from_members

pytestmark = pytest.mark.needs_root

_LIMITS = LayerLimits(max_bytes=64 * 2**20)


def _diff_id(blob: bytes) -> str:
    return "sha256:" + hashlib.sha256(gzip.decompress(blob)).hexdigest()


def _unpack(members: list[Member], dest: Path, *, limits: LayerLimits = _LIMITS,
            diff_id: str | None = None) -> LayerContent:
    blob = layer_from_members(members)
    dest.mkdir(parents=True, exist_ok=True)
    return unpack_layer(io.BytesIO(blob), "application/vnd.oci.image.layer.v1.tar+gzip", dest,
                        diff_id=diff_id or _diff_id(blob), limits=limits)


@pytest.fixture
def victim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A host directory outside the layer, which no layer may write into."""
    return tmp_path_factory.mktemp("host-victim")


def test_dot_dot_is_refused_and_nothing_lands_outside(tmp_path: Path, victim: Path) -> None:
    name = f"escape-{secrets.token_hex(4)}"
    up = os.path.relpath(victim, tmp_path / "tree")
    with pytest.raises(ImageError, match=r"climbs out of the root"):
        _unpack([Member(f"{up}/{name}", data=b"pwned")], tmp_path / "tree")
    with pytest.raises(ImageError, match=r"climbs out"):
        _unpack([Member(f"usr/../../{name}", data=b"pwned")], tmp_path / "tree2")
    assert not (victim / name).exists() and not (tmp_path / name).exists()


def test_absolute_paths_stay_inside(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    _unpack([Member("/etc/corral-abs-test", data=b"inside")], tree)
    assert (tree / "etc" / "corral-abs-test").read_bytes() == b"inside"
    assert not Path("/etc/corral-abs-test").exists()


def test_a_file_through_an_absolute_symlink_is_refused(tmp_path: Path, victim: Path) -> None:
    tree = tmp_path / "tree"
    with pytest.raises(ImageError, match=r"symlink or a file"):
        _unpack([Member("evil", kind="symlink", target=str(victim)),
                 Member("evil/pwned", data=b"pwned")], tree)
    assert list(victim.iterdir()) == []
    # The symlink itself may exist in the tree; it is never followed on the host.
    assert os.readlink(tree / "evil") == str(victim)


def test_a_file_through_a_relative_symlink_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match=r"symlink or a file"):
        _unpack([Member("a", kind="dir", mode=0o755),
                 Member("a/up", kind="symlink", target="../../../../../../tmp"),
                 Member("a/up/corral-rel-test", data=b"pwned")], tmp_path / "tree")
    assert not Path("/tmp/corral-rel-test").exists()


def test_hard_links_resolve_inside_the_layer_only(tmp_path: Path) -> None:
    before = os.stat("/etc/passwd")
    with pytest.raises(ImageError, match=r"not in the layer"):
        _unpack([Member("pw", kind="hardlink", target="/etc/passwd")], tmp_path / "t1")
    with pytest.raises(ImageError, match=r"climbs out"):
        _unpack([Member("pw", kind="hardlink", target="../../../../etc/passwd")],
                tmp_path / "t2")
    after = os.stat("/etc/passwd")
    assert (after.st_nlink, after.st_ino) == (before.st_nlink, before.st_ino)
    # Within the layer they work, also when written with a leading slash.
    tree = tmp_path / "t3"
    _unpack([Member("bin/a", data=b"same", mode=0o755),
             Member("bin/b", kind="hardlink", target="/bin/a")], tree)
    assert os.stat(tree / "bin" / "a").st_ino == os.stat(tree / "bin" / "b").st_ino


def test_a_hard_link_through_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match=r"symlink or a file"):
        _unpack([Member("etcdir", kind="symlink", target="/etc"),
                 Member("pw", kind="hardlink", target="etcdir/passwd")], tmp_path / "tree")
    assert os.stat("/etc/passwd").st_nlink == 1


def test_devices_fifos_setuid_owners_and_xattrs_are_cleared(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    content = _unpack([
        Member("dev/sda", kind="blockdev", devmajor=8, devminor=0),
        Member("dev/mem", kind="chardev", devmajor=1, devminor=1),
        Member("run/pipe", kind="fifo"),
        Member("usr/bin/su", data=b"#!/bin/sh\n", mode=0o4755, uid=0),
        Member("usr/bin/sg", data=b"#!/bin/sh\n", mode=0o2755, uid=0),
        Member("srv/owned", data=b"x", mode=0o640, uid=4321, gid=4321),
        Member("usr/bin/ping", data=b"x", mode=0o755,
               xattrs={"security.capability": "\x01\x00\x00\x02"}),
    ], tree)
    assert not (tree / "dev" / "sda").exists() and not (tree / "dev" / "mem").exists()
    assert not (tree / "run" / "pipe").exists()
    assert content.skipped == {"device": 2, "fifo": 1, "setuid": 2, "xattr": 1}
    for name in ("su", "sg"):
        assert stat.S_IMODE(os.stat(tree / "usr" / "bin" / name).st_mode) == 0o755
    owned = os.stat(tree / "srv" / "owned")
    # Root's on the host whatever the archive says; its owner's read bit given to others.
    assert (owned.st_uid, owned.st_gid) == (0, 0)
    assert stat.S_IMODE(owned.st_mode) == 0o644
    assert os.listxattr(tree / "usr" / "bin" / "ping") == []
    for path in tree.rglob("*"):
        st = path.lstat()
        assert st.st_uid == 0 and not st.st_mode & 0o6000, path


def test_whiteouts_and_opaque_directories_stack_like_overlayfs(tmp_path: Path) -> None:
    low, high, root = tmp_path / "low", tmp_path / "high", tmp_path / "root"
    lower = _unpack([Member("etc/passwd", data=b"root:x:0:0::/:/bin/sh\n"),
                     Member("etc/motd", data=b"hello"),
                     Member("opt/keep/a", data=b"a"), Member("opt/keep/b", data=b"b"),
                     Member("lib", kind="symlink", target="usr/lib")], low)
    upper = _unpack([Member(".wh.etc"), Member("opt/keep/.wh..wh..opq"),
                     Member("opt/keep/c", data=b"c"),
                     Member("lib/own", data=b"dir over symlink")], high)
    assert upper.whiteouts == ["etc"] and upper.opaque == ["opt/keep"]
    root.mkdir()
    etc_before = os.stat("/etc")
    compose_root([(low, lower), (high, upper)], root, workdir="/app/work")
    # /etc whited out: an empty directory of the image's own, the host's untouched.
    assert (root / "etc").is_dir() and not (root / "etc").is_symlink()
    assert list((root / "etc").iterdir()) == []
    assert os.stat("/etc").st_mtime_ns == etc_before.st_mtime_ns
    assert Path("/etc/passwd").exists()
    assert sorted(p.name for p in (root / "opt" / "keep").iterdir()) == ["c"]
    assert (root / "lib").is_dir() and not (root / "lib").is_symlink()
    assert (root / "lib" / "own").read_bytes() == b"dir over symlink"
    assert (root / "app" / "work").is_dir()
    # Files are shared with the layer, not copied.
    assert os.stat(root / "opt" / "keep" / "c").st_ino == os.stat(high / "opt/keep/c").st_ino


def test_a_symlinked_etc_becomes_an_empty_directory(tmp_path: Path) -> None:
    layer, root = tmp_path / "layer", tmp_path / "root"
    content = _unpack([Member("etc", kind="symlink", target="/etc")], layer)
    root.mkdir()
    compose_root([(layer, content)], root)
    assert (root / "etc").is_dir() and not (root / "etc").is_symlink()
    assert list((root / "etc").iterdir()) == []


def test_a_digest_mismatch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match=r"tampered"):
        _unpack([Member("a", data=b"a")], tmp_path / "tree", diff_id="sha256:" + "0" * 64)


def test_size_and_entry_limits_hold_while_unpacking(tmp_path: Path) -> None:
    # 8 MiB of zeros compresses to a few KiB: the cap is on what is written, not the blob.
    with pytest.raises(ImageError, match=r"more than 1048576 bytes"):
        _unpack([Member("big", data=bytes(8 * 2**20))], tmp_path / "t1",
                limits=LayerLimits(max_bytes=2**20))
    assert not (tmp_path / "t1" / "big").exists() or \
        (tmp_path / "t1" / "big").stat().st_size <= 2 * 2**20
    with pytest.raises(ImageError, match=r"more than 10 entries"):
        _unpack([Member(f"f{i}", data=b"") for i in range(20)], tmp_path / "t2",
                limits=LayerLimits(max_bytes=2**20, max_entries=10))


def test_garbage_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tree").mkdir()
    with pytest.raises(ImageError, match=r"not a readable layer"):
        unpack_layer(io.BytesIO(b"\x1f\x8bnot really gzip" * 100),
                     "application/vnd.oci.image.layer.v1.tar+gzip", tmp_path / "tree",
                     diff_id="sha256:" + "0" * 64, limits=_LIMITS)
    with pytest.raises(ImageError, match=r"zstd"):
        unpack_layer(io.BytesIO(b""), "application/vnd.oci.image.layer.v1.tar+zstd",
                     tmp_path / "tree", diff_id="sha256:" + "0" * 64, limits=_LIMITS)
