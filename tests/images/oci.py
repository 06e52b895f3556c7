"""OCI image layouts built by hand, so tests can craft normal images and hostile ones alike.

Layers are tars written member by member (names exactly as given: ``../x``, ``/abs``,
whiteouts), the config and manifest are JSON written here, and ``skopeo`` moves the result into
a registry or a docker archive. Everything is deterministic: same input, same digests."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "CONFIG_MEDIA_TYPE", "INDEX_MEDIA_TYPE", "LAYER_MEDIA_TYPE", "LAYER_GZIP_MEDIA_TYPE",
    "MANIFEST_MEDIA_TYPE", "REF_NAME", "Image", "Kind", "Member", "blob_path", "busybox_root",
    "docker_archive", "layer_from_dir", "layer_from_members", "push", "skopeo", "write_layout",
]

MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"
LAYER_GZIP_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
REF_NAME = "org.opencontainers.image.ref.name"

MTIME = 1700000000
CREATED = "2023-11-14T22:13:20Z"  # MTIME as RFC 3339
BUSYBOX = Path("/usr/bin/busybox")
# The applets the image tests run; a busybox without one of them is no base for them.
REQUIRED_APPLETS = ("sh", "ls", "cat", "env", "id", "pwd", "echo", "sleep", "touch", "mkdir",
                    "stat", "wc", "head")
SKOPEO_TIMEOUT_S = 60

Kind = Literal["file", "dir", "symlink", "hardlink", "chardev", "blockdev", "fifo"]

_TAR_TYPES: dict[str, bytes] = {
    "file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE, "chardev": tarfile.CHRTYPE, "blockdev": tarfile.BLKTYPE,
    "fifo": tarfile.FIFOTYPE,
}


@dataclass
class Member:
    """One tar member, every header field explicit. ``name`` goes into the tar as given (tarfile
    only appends "/" to a directory's name); ``target`` is a link's linkname; ``xattrs`` become
    PAX ``SCHILY.xattr.*`` records."""

    name: str
    kind: Kind = "file"
    data: bytes = b""
    mode: int = 0o644
    target: str = ""
    uid: int = 0
    gid: int = 0
    mtime: int = MTIME
    devmajor: int = 0
    devminor: int = 0
    xattrs: dict[str, str] = field(default_factory=dict)


@dataclass
class Image:
    """An image written into an OCI layout under ``tag``; digests are "sha256:<hex>"."""

    layout: Path
    tag: str
    manifest_digest: str
    config_digest: str
    layer_digests: list[str]  # of the blobs as stored (compressed or not)
    diff_ids: list[str]  # of the uncompressed tars


# --- layers -----------------------------------------------------------------------------------


def _tarinfo(member: Member) -> tarfile.TarInfo:
    info = tarfile.TarInfo(member.name)
    info.type = _TAR_TYPES[member.kind]
    info.mode = member.mode
    info.uid, info.gid = member.uid, member.gid
    # Empty names: a reader that maps names to ids must not find a host's "root" here.
    info.uname = info.gname = ""
    info.mtime = member.mtime
    info.linkname = member.target
    info.devmajor, info.devminor = member.devmajor, member.devminor
    info.size = len(member.data) if member.kind == "file" else 0
    info.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in member.xattrs.items()}
    return info


def _finish(tar_bytes: bytes, compress: bool) -> bytes:
    # mtime=0 and no file name in the gzip header: the same tar always gives the same blob.
    return gzip.compress(tar_bytes, compresslevel=6, mtime=0) if compress else tar_bytes


def layer_from_members(members: list[Member], *, compress: bool = True) -> bytes:
    """A layer tar (PAX format) of exactly these members in this order, gzipped if
    ``compress``. Data is written for files only; duplicates and odd names are kept."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for member in members:
            data = io.BytesIO(member.data) if member.kind == "file" else None
            tar.addfile(_tarinfo(member), data)
    return _finish(buf.getvalue(), compress)


def _walk(root: Path) -> Iterator[Path]:
    # Sorted, parents before children: the tar's order must not depend on the filesystem's.
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        yield entry
        if entry.is_dir() and not entry.is_symlink():
            yield from _walk(entry)


def layer_from_dir(root: Path, *, compress: bool = True) -> bytes:
    """A layer tar of the tree under ``root`` (paths relative, "usr/bin/x"): symlinks stay
    symlinks, a second path to an inode becomes a hard link, owners are 0:0, mtimes fixed.
    Sockets are left out (a tar cannot hold them)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _walk(root):
            # gettarinfo on this TarFile: it remembers inodes and so emits hard links.
            info = tar.gettarinfo(str(path), arcname=path.relative_to(root).as_posix())
            if info is None:
                continue
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = MTIME
            if info.isreg():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return _finish(buf.getvalue(), compress)


def _applets() -> list[str]:
    out = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True)
    return sorted({name for name in out.stdout.split() if name and "/" not in name})


def busybox_root(dest: Path) -> Path:
    """A minimal root filesystem at ``dest``: the static busybox, a ``bin/<applet>`` symlink
    for each of its applets, the usual directories and users root and app (1000)."""
    applets = _applets()
    missing = [a for a in REQUIRED_APPLETS if a not in applets]
    if missing:
        raise RuntimeError(f"{BUSYBOX} lacks applets {missing}")
    for name in ("bin", "etc", "tmp", "usr/bin", "root", "home"):
        (dest / name).mkdir(parents=True, exist_ok=True)
    # chmod, not mkdir's mode: the umask would take the sticky and world bits away.
    os.chmod(dest / "tmp", 0o1777)
    os.chmod(dest / "root", 0o700)
    shutil.copyfile(BUSYBOX, dest / "bin/busybox")
    os.chmod(dest / "bin/busybox", 0o755)
    for applet in applets:
        if applet != "busybox":
            os.symlink("busybox", dest / "bin" / applet)
    (dest / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                     "app:x:1000:1000:app:/home:/bin/sh\n")
    (dest / "etc/group").write_text("root:x:0:\napp:x:1000:\n")
    return dest


# --- layouts ----------------------------------------------------------------------------------


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def blob_path(layout: Path, digest: str) -> Path:
    """Where a layout keeps a blob (so a test can read or damage it)."""
    algorithm, _, hex_ = digest.partition(":")
    return layout / "blobs" / algorithm / hex_


def _write_blob(layout: Path, data: bytes) -> dict[str, Any]:
    digest = _digest(data)
    path = blob_path(layout, digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"digest": digest, "size": len(data)}


def _diff_id(blob: bytes) -> str:
    # From the bytes, not from the media type: a test may label a layer wrongly on purpose.
    return _digest(gzip.decompress(blob) if blob[:2] == b"\x1f\x8b" else blob)


def _image_config(diff_ids: list[str], config: dict[str, Any] | None) -> dict[str, Any]:
    runtime = config if config is not None else {"Env": ["PATH=/usr/bin:/bin"],
                                                 "Cmd": ["/bin/sh"]}
    return {
        "created": CREATED,
        "architecture": "amd64",
        "os": "linux",
        "config": runtime,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created": CREATED, "created_by": f"tests.images.oci layer {i}"}
                    for i in range(len(diff_ids))],
    }


def _add_to_index(layout: Path, manifest: dict[str, Any], tag: str) -> None:
    path = layout / "index.json"
    index: dict[str, Any] = (json.loads(path.read_text()) if path.exists() else
                             {"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE, "manifests": []})
    # A tag names one manifest: writing it again moves it, as a registry push would.
    index["manifests"] = [m for m in index["manifests"]
                          if m.get("annotations", {}).get(REF_NAME) != tag]
    index["manifests"].append({"mediaType": MANIFEST_MEDIA_TYPE, **manifest,
                               "annotations": {REF_NAME: tag}})
    path.write_bytes(_canonical(index))


def write_layout(layout: Path, layers: list[bytes], *, config: dict[str, Any] | None = None,
                 tag: str = "latest", media_compressed: list[bool] | None = None) -> Image:
    """Write an image of ``layers`` (bottom first) into the OCI layout at ``layout``, creating
    it or adding to it (blobs are shared, ``tag`` is added to index.json or moved).

    ``config`` is the image config's runtime section as is (Env, WorkingDir, User, Entrypoint,
    Cmd, ...; default: a PATH and /bin/sh). ``media_compressed[i]`` says which media type layer
    i is labelled with; by default, whether it is gzip."""
    if media_compressed is None:
        media_compressed = [layer[:2] == b"\x1f\x8b" for layer in layers]
    if len(media_compressed) != len(layers):
        raise ValueError("media_compressed needs one entry per layer")
    layout.mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_bytes(_canonical({"imageLayoutVersion": "1.0.0"}))
    descriptors = [{"mediaType": LAYER_GZIP_MEDIA_TYPE if gz else LAYER_MEDIA_TYPE,
                    **_write_blob(layout, layer)}
                   for layer, gz in zip(layers, media_compressed, strict=True)]
    diff_ids = [_diff_id(layer) for layer in layers]
    config_desc = {"mediaType": CONFIG_MEDIA_TYPE,
                   **_write_blob(layout, _canonical(_image_config(diff_ids, config)))}
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE, "config": config_desc,
                "layers": descriptors}
    manifest_desc = _write_blob(layout, _canonical(manifest))
    _add_to_index(layout, manifest_desc, tag)
    return Image(layout=layout, tag=tag, manifest_digest=manifest_desc["digest"],
                 config_digest=config_desc["digest"],
                 layer_digests=[d["digest"] for d in descriptors], diff_ids=diff_ids)


# --- skopeo -----------------------------------------------------------------------------------


def _skopeo_home(home: Path) -> tuple[dict[str, str], list[str]]:
    """An environment and global flags under which skopeo reads nothing of the host's: no
    credentials, no registry mirrors or rewrites, no signature policy or lookaside."""
    (home / "auth.json").write_text('{"auths": {}}')
    (home / "registries.conf").write_text("")
    (home / "registries.d").mkdir()
    (home / "policy.json").write_text('{"default": [{"type": "insecureAcceptAnything"}]}')
    (home / "tmp").mkdir()
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
           "TMPDIR": str(home / "tmp"), "XDG_RUNTIME_DIR": str(home),
           "REGISTRY_AUTH_FILE": str(home / "auth.json"),
           "CONTAINERS_REGISTRIES_CONF": str(home / "registries.conf")}
    flags = ["--policy", str(home / "policy.json"), "--registries.d", str(home / "registries.d"),
             "--tmpdir", str(home / "tmp")]
    return env, flags


def skopeo(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``skopeo ARGS`` isolated from the host's configuration. With ``check``, a failure
    raises RuntimeError carrying skopeo's stderr."""
    with tempfile.TemporaryDirectory(prefix="corral-test-skopeo-") as home:
        env, flags = _skopeo_home(Path(home))
        proc = subprocess.run(["skopeo", *flags, *args], env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=SKOPEO_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise RuntimeError(f"skopeo {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def push(image: Image, registry_host: str, repo: str, tag: str, *,
         preserve_digests: bool = True) -> str:
    """Copy ``image`` to ``registry_host/repo:tag`` and return the manifest digest the registry
    stored. With ``preserve_digests`` skopeo pushes the bytes as built (or fails); without it,
    skopeo may rewrite the manifest (it gzips uncompressed layers for a registry)."""
    with tempfile.TemporaryDirectory(prefix="corral-test-push-") as tmp:
        digestfile = Path(tmp) / "digest"
        skopeo("copy", "--quiet", "--dest-tls-verify=false", "--dest-no-creds",
               *(["--preserve-digests"] if preserve_digests else []),
               "--digestfile", str(digestfile),
               f"oci:{image.layout}:{image.tag}", f"docker://{registry_host}/{repo}:{tag}")
        return digestfile.read_text().strip()


def docker_archive(image: Image, dest: Path, ref: str) -> Path:
    """Write ``image`` as a ``docker save``-style archive at ``dest`` naming it ``ref``
    ("repo:tag"). skopeo stores the layers uncompressed there, so the manifest differs."""
    skopeo("copy", "--quiet", f"oci:{image.layout}:{image.tag}", f"docker-archive:{dest}:{ref}")
    return dest
