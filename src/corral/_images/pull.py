"""Pulling an image into a template: skopeo fetches, Corral unpacks.

Why skopeo: it is the daemonless reference client for registries (token auth, manifest lists,
Docker and OCI manifests, ``docker save`` archives, OCI layouts), it verifies every blob against
its digest as it streams, and into an ``oci:`` layout it skips blobs the layout already holds,
so images sharing base layers download them once. Why not umoci for unpacking: run as root it
recreates what the image says (device nodes, setuid bits, owners), and it hashes every file into
an mtree manifest we have no use for; ``unpack`` does less, on purpose (see there).

Layout of ``$CORRAL_HOME/images``::

    oci/                     skopeo's OCI layout: every pulled blob, once
    layers/<hex>/tree/       one layer unpacked (hex of its diff_id)
    layers/<hex>/layer.json  its whiteouts, opaque directories and counts
    policy.json              skopeo's signature policy (Corral's own allowlist comes first)
    .locks/                  one flock for the layout, one per layer

An image becomes the template build ``templates/<name>-<digest[:16]>`` (its root stacked from
the layers with hard links), so every tier uses it exactly like a template built from Debian
packages.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .._core.privileged import privileged_env
from .._settings import Settings
from .._templates.catalog import (
    METADATA,
    BuiltTemplate,
    build_dir,
    list_builds,
    locked,
    name_lock,
    read_build,
    set_current,
    split_reference,
)
from .._templates.roots import executable_in_root
from .._templates.spec import check_reference
from ..errors import BackendUnavailable, ImageError, UsageError
from .config import ImageConfig, parse_config
from .reference import ImagePolicy, ImageRef, parse_reference
from .unpack import LayerContent, LayerLimits, compose_root, unpack_layer

__all__ = ["LayerCache", "PullResult", "image_template_name", "images_dir", "make_build",
           "prune_images", "pull_image"]

Progress = Callable[[str], None]

_MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                   "application/vnd.docker.distribution.manifest.v2+json")
_MAX_MANIFEST = 4 * 2**20
_MAX_LAYERS = 256
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_POLICY = {"default": [{"type": "insecureAcceptAnything"}]}


@dataclass(frozen=True, slots=True)
class PullResult:
    template: BuiltTemplate
    reference: str  # the reference as normalised (host/path:tag@digest)
    digest: str  # the manifest digest the sandbox runs on
    cached: bool  # nothing was fetched or unpacked
    layers_reused: int
    layers_unpacked: int
    duration_s: float


def image_template_name(digest: str) -> str:
    """The template an image reference without ``name`` becomes: named by its digest, so it
    never moves (a ``name`` others use is moved only by an explicit pull)."""
    return f"img-{digest.removeprefix('sha256:')[:16]}"


def images_dir(settings: Settings) -> Path:
    return settings.home / "images"


def _skopeo() -> str:
    path = shutil.which("skopeo")
    if path is None:
        raise BackendUnavailable("skopeo is not installed, and Corral pulls images with it; "
                                 "`apt-get install skopeo` (`corral setup` does it)")
    return path


class _Skopeo:
    """skopeo with Corral's settings: no host configuration but the operator's auth file."""

    def __init__(self, settings: Settings, images: Path, progress: Progress) -> None:
        self._settings = settings
        self._images = images
        self._progress = progress
        self._policy = images / "policy.json"
        if not self._policy.exists():
            tmp = images / f".policy.{os.getpid()}"
            tmp.write_text(json.dumps(_POLICY))
            os.replace(tmp, self._policy)

    def _argv(self, command: str, ref: ImageRef) -> list[str]:
        # --override-*: a multi-platform image resolves to this host's platform.
        argv = [_skopeo(), "--policy", str(self._policy), "--override-os", "linux",
                "--override-arch", "amd64", command]
        if not ref.local:
            argv.append(f"--src-tls-verify={'false' if ref.plain_http else 'true'}"
                        if command == "copy" else
                        f"--tls-verify={'false' if ref.plain_http else 'true'}")
            auth = self._settings.registry_auth_file
            if auth is not None:
                argv.append(f"--{'src-' if command == 'copy' else ''}authfile={auth}")
            else:
                argv.append("--src-no-creds" if command == "copy" else "--no-creds")
        return argv

    def run(self, argv: list[str], what: str, *, timeout: float) -> str:
        # A home of Corral's own: no ~/.docker or ~/.config/containers of the service's user.
        env = {**privileged_env(inherit=("http_proxy", "https_proxy", "no_proxy",
                                         "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")),
               "HOME": str(self._images), "LC_ALL": "C.UTF-8"}
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, errors="replace", env=env)
        except OSError as exc:
            raise BackendUnavailable(f"cannot run skopeo: {exc}") from None
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise ImageError(f"{what}: took longer than {timeout:g} s "
                             "(Settings.image_pull_timeout_s)") from None
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if proc.returncode != 0:
            raise ImageError(f"{what}: {_skopeo_error(err)}")
        return out

    def inspect_raw(self, ref: ImageRef) -> bytes:
        out = self.run([*self._argv("inspect", ref), "--raw", ref.source],
                       f"cannot read {ref.canonical}", timeout=120)
        return out.encode()

    def copy(self, ref: ImageRef, source: str, layout: Path, name: str) -> str:
        digest_file = layout.parent / f".digest-{os.getpid()}-{time.monotonic_ns()}"
        try:
            self._progress(f"fetching {ref.canonical}")
            argv = [*self._argv("copy", ref), "--digestfile", str(digest_file),
                    source, f"oci:{layout}:{name}"]
            self.run(argv, f"cannot pull {ref.canonical}",
                     timeout=self._settings.image_pull_timeout_s)
            digest = digest_file.read_text().strip()
        finally:
            digest_file.unlink(missing_ok=True)
        if not _DIGEST.fullmatch(digest):
            raise ImageError(f"cannot pull {ref.canonical}: skopeo reported no manifest digest")
        return digest


def _skopeo_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else "skopeo failed"
    # skopeo's logrus form: time="..." level=fatal msg="..."
    match = re.search(r'msg="(.*)"\s*$', text)
    text = match.group(1).replace('\\"', '"') if match else text
    if "Digest did not match" in text or "digest did not match" in text.lower():
        text = f"a blob does not match its digest (damaged or tampered with): {text}"
    return text[:800]


def _blob(layout: Path, digest: str) -> Path:
    if not _DIGEST.fullmatch(digest):
        raise ImageError(f"the image names an invalid digest {digest[:80]!r}")
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def _read_json_blob(layout: Path, digest: str, what: str) -> dict[str, Any]:
    path = _blob(layout, digest)
    data = path.read_bytes()
    if len(data) > _MAX_MANIFEST:
        raise ImageError(f"the image's {what} is over {_MAX_MANIFEST} bytes")
    if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
        raise ImageError(f"the image's {what} does not match its digest {digest}")
    try:
        value = json.loads(data)
    except ValueError:
        raise ImageError(f"the image's {what} is not JSON") from None
    if not isinstance(value, dict):
        raise ImageError(f"the image's {what} is not a JSON object")
    return value


@dataclass(frozen=True, slots=True)
class _Layer:
    digest: str
    media_type: str
    diff_id: str


def _manifest_layers(manifest: dict[str, Any], config: dict[str, Any]) -> list[_Layer]:
    if manifest.get("mediaType", _MANIFEST_TYPES[0]) not in _MANIFEST_TYPES:
        raise ImageError(f"unsupported manifest type {str(manifest.get('mediaType'))[:80]!r}")
    layers = manifest.get("layers")
    rootfs = config.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(layers, list) or not isinstance(diff_ids, list):
        raise ImageError("the image's manifest or config lists no layers")
    if len(layers) != len(diff_ids):
        raise ImageError(f"the manifest lists {len(layers)} layers and the config "
                         f"{len(diff_ids)}; the image is malformed")
    if len(layers) > _MAX_LAYERS:
        raise ImageError(f"the image has more than {_MAX_LAYERS} layers")
    out = []
    for entry, diff_id in zip(layers, diff_ids, strict=True):
        if not isinstance(entry, dict) or not isinstance(diff_id, str) \
                or not _DIGEST.fullmatch(diff_id):
            raise ImageError("the image lists a layer without a valid digest")
        digest, media_type = entry.get("digest"), entry.get("mediaType")
        if not isinstance(digest, str) or not isinstance(media_type, str):
            raise ImageError("the image lists a layer without a digest or media type")
        _blob(Path("/"), digest)  # validates the digest's form
        out.append(_Layer(digest=digest, media_type=media_type, diff_id=diff_id))
    return out


class LayerCache:
    """Unpacked layers by ``diff_id`` (pulled) or by build-step key (built), each unpacked or
    made once under its own lock."""

    def __init__(self, images: Path, limits: LayerLimits, progress: Progress) -> None:
        self.dir = images / "layers"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o711)
        self._locks = images / ".locks"
        self._limits = limits
        self._progress = progress

    def path(self, diff_id: str) -> Path:
        return self.dir / diff_id.removeprefix("sha256:")

    def get(self, diff_id: str) -> LayerContent | None:
        try:
            return LayerContent.from_dict(json.loads((self.path(diff_id) / "layer.json")
                                                     .read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def ensure(self, layer: _Layer, blob: Path, used: int, index: int,
               count: int) -> tuple[LayerContent, bool]:
        """The unpacked layer, unpacked now unless it already was; True when it was reused."""
        short = layer.diff_id.removeprefix("sha256:")[:12]
        with locked(self._locks / f"layer-{short}.lock"):
            found = self.get(layer.diff_id)
            if found is not None:
                self._progress(f"layer {index}/{count} {short}: already unpacked")
                return found, True
            final = self.path(layer.diff_id)
            shutil.rmtree(final, ignore_errors=True)  # a damaged one (no layer.json)
            work = Path(tempfile.mkdtemp(prefix=f".unpack-{short}-", dir=self.dir))
            try:
                os.chmod(work, 0o755)
                (work / "tree").mkdir(mode=0o755)
                size = blob.stat().st_size
                self._progress(f"layer {index}/{count} {short}: unpacking "
                               f"{size / 2**20:.1f} MiB")
                last = [time.monotonic()]

                def unpacked(total: int) -> None:
                    # At most one line a second: a big layer shows it moves, a small one is quiet.
                    if time.monotonic() - last[0] >= 1.0:
                        last[0] = time.monotonic()
                        self._progress(f"layer {index}/{count} {short}: "
                                       f"{(total - used) / 2**20:.0f} MiB written")

                with open(blob, "rb") as stream:
                    content = unpack_layer(stream, layer.media_type, work / "tree",
                                           diff_id=layer.diff_id, limits=self._limits,
                                           used_bytes=used, what=f"layer {index} ({short})",
                                           on_progress=unpacked)
                (work / "layer.json").write_text(json.dumps(content.to_dict()))
                os.rename(work, final)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
            skipped = ", ".join(f"{n} {k}" for k, n in sorted(content.skipped.items()))
            self._progress(f"layer {index}/{count} {short}: {content.entries} entries, "
                           f"{content.bytes / 2**20:.1f} MiB"
                           + (f" (left out or cleared: {skipped})" if skipped else ""))
            return content, False


def _existing(templates_dir: Path, name: str, digest: str) -> BuiltTemplate | None:
    return read_build(build_dir(templates_dir, name, digest.removeprefix("sha256:")[:16]))


def pull_image(reference: str, settings: Settings, *, name: str | None = None,
               allow_local: bool = False, on_progress: Progress | None = None) -> PullResult:
    """Pull ``reference`` and make it template ``name`` (default ``img-<digest>``).

    A registry reference already pulled by digest is not fetched again; a tag is resolved with
    the registry (tags move) and then fetched by the digest it names, so what is unpacked is
    what was resolved. ``allow_local``: the caller is the host's operator (see ``reference``).

    Raises:
        UsageError: a malformed reference or name.
        ImageRefused: the operator's policy refuses it.
        ImageError: it cannot be fetched, or its content is refused.
        BackendUnavailable: skopeo is missing.
    """
    # Shared: pulls run side by side; `prune` waits for them all (it removes what is unused).
    with locked(images_dir(settings) / ".locks" / "pulls.lock", shared=True):
        return _pull(reference, settings, name=name, allow_local=allow_local,
                     on_progress=on_progress)


def prune_images(settings: Settings) -> tuple[int, int]:
    """Remove unpacked layers and downloaded blobs no template build uses any more; returns
    (entries removed, bytes freed). Waits for pulls under way."""
    images = images_dir(settings)
    if not images.is_dir():
        return 0, 0
    with locked(images / ".locks" / "pulls.lock"):
        used_layers: set[str] = set()
        used_blobs: set[str] = set()
        for build in list_builds(settings.home / "templates"):
            if build.image is not None:
                used_layers.update(str(d).removeprefix("sha256:")
                                   for d in build.image.get("layers", ()))
                used_blobs.update(str(d).removeprefix("sha256:")
                                  for d in build.image.get("blobs", ()))
        removed = freed = 0
        layers = images / "layers"
        for entry in (list(layers.iterdir()) if layers.is_dir() else []):
            if entry.name not in used_layers:
                freed += _size_of(entry)
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
        blobs = images / "oci" / "blobs" / "sha256"
        for entry in (list(blobs.iterdir()) if blobs.is_dir() else []):
            if entry.name not in used_blobs:
                freed += entry.lstat().st_size
                entry.unlink(missing_ok=True)
                removed += 1
    return removed, freed


def _size_of(path: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in (*dirnames, *filenames):
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def _pull(reference: str, settings: Settings, *, name: str | None,
          allow_local: bool, on_progress: Progress | None) -> PullResult:
    progress = on_progress or (lambda line: None)
    started = time.monotonic()
    ref = parse_reference(reference)
    ImagePolicy.from_setting(settings.registries,
                             require_digest=settings.registries_require_digest
                             ).check(ref, allow_local=allow_local)
    tag = None
    if name is not None:
        name, tag = split_reference(check_reference(name))
        if name.startswith("img-"):
            raise UsageError(f"template names starting with 'img-' are Corral's own (an image "
                             f"by digest); choose another name than {name!r}")
    templates_dir = settings.home / "templates"
    if ref.digest is not None:
        existing = _existing(templates_dir, name or image_template_name(ref.digest), ref.digest)
        if existing is not None:
            return _done(existing, templates_dir, ref, ref.digest, cached=True, reused=0,
                         unpacked=0, started=started, progress=progress, tag=tag)
    images = images_dir(settings)
    images.mkdir(parents=True, exist_ok=True, mode=0o711)
    skopeo = _Skopeo(settings, images, progress)
    digest, source = ref.digest, ref.source
    if not ref.local and digest is None:
        progress(f"resolving {ref.canonical}")
        digest = "sha256:" + hashlib.sha256(skopeo.inspect_raw(ref)).hexdigest()
        ref = replace(ref, digest=digest)
        source = f"docker://{ref.registry}/{ref.repository}@{digest}"
        existing = _existing(templates_dir, name or image_template_name(digest), digest)
        if existing is not None:
            return _done(existing, templates_dir, ref, digest, cached=True, reused=0,
                         unpacked=0, started=started, progress=progress, tag=tag)
    layout = images / "oci"
    # One skopeo at a time writes the layout's index; blobs are shared, so it stays one layout.
    with locked(images / ".locks" / "layout.lock",
                on_wait=lambda: progress("waiting for another pull to finish")):
        local_digest = skopeo.copy(ref, source, layout, f"pull-{os.getpid()}")
        _untag(layout, f"pull-{os.getpid()}")
    if digest is None:  # a local image: its identity is the manifest as stored
        digest = local_digest
    manifest = _read_json_blob(layout, local_digest, "manifest")
    config_entry = manifest.get("config")
    if not isinstance(config_entry, dict) or not isinstance(config_entry.get("digest"), str):
        raise ImageError("the image's manifest names no config")
    config_blob = _read_json_blob(layout, config_entry["digest"], "config")
    image_config = parse_config(config_blob)
    layers = _manifest_layers(manifest, config_blob)
    cache = LayerCache(images, LayerLimits(max_bytes=settings.image_max_bytes), progress)
    contents: list[tuple[Path, LayerContent]] = []
    used = reused = 0
    for index, layer in enumerate(layers, 1):
        content, was_cached = cache.ensure(layer, _blob(layout, layer.digest), used, index,
                                           len(layers))
        used += content.bytes
        reused += was_cached
        contents.append((cache.path(layer.diff_id) / "tree", content))
    chosen = name or image_template_name(digest)
    blobs = [local_digest, config_entry["digest"], *(layer.digest for layer in layers)]
    built = make_build(templates_dir, chosen, digest, ref.canonical, image_config, contents,
                       used, time.monotonic() - started, progress, extra={"blobs": blobs})
    return _done(built, templates_dir, ref, digest, cached=False, reused=reused,
                 unpacked=len(layers) - reused, started=started, progress=progress,
                 tag=tag)


def _untag(layout: Path, tag: str) -> None:
    """Drop the pull's own name from the layout's index (its blobs stay, shared)."""
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text())
    index["manifests"] = [
        m for m in index.get("manifests", [])
        if m.get("annotations", {}).get("org.opencontainers.image.ref.name") != tag]
    tmp = layout / f".index.{os.getpid()}"
    tmp.write_text(json.dumps(index))
    os.replace(tmp, index_path)


def _done(built: BuiltTemplate, templates_dir: Path, ref: ImageRef, digest: str, *,
          cached: bool, reused: int, unpacked: int, started: float,
          progress: Progress, tag: str | None = None) -> PullResult:
    with name_lock(templates_dir, built.name):
        set_current(templates_dir, built.name, built.hash)
        if tag is not None:
            set_current(templates_dir, built.name, built.hash, tag=tag)
    if cached:
        progress(f"{ref.canonical} is already template {built.name}; nothing fetched")
    return PullResult(template=replace(built, current=True), reference=ref.canonical,
                      digest=digest, cached=cached, layers_reused=reused,
                      layers_unpacked=unpacked, duration_s=time.monotonic() - started)


def make_build(templates_dir: Path, name: str, digest: str, reference: str,
               image_config: ImageConfig, contents: list[tuple[Path, LayerContent]],
               size: int, pull_s: float, progress: Progress,
               extra: dict[str, Any] | None = None) -> BuiltTemplate:
    """Template build ``name`` for an image: its root stacked from ``contents``, and its
    metadata (reference, digest, layers, config, and ``extra``)."""
    templates_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
    short = digest.removeprefix("sha256:")[:16]
    final = build_dir(templates_dir, name, short)
    with locked(templates_dir / ".locks" / f"{name}-{short}.lock"):
        existing = read_build(final)
        if existing is not None:
            return existing
        work = Path(tempfile.mkdtemp(prefix=f".build-{name}-{short}-", dir=templates_dir))
        try:
            os.chmod(work, 0o755)
            root = work / "root"
            root.mkdir(mode=0o755)
            progress(f"stacking {len(contents)} layers into template {name}")
            compose_root(contents, root, workdir=image_config.working_dir)
            if not executable_in_root(root, "/bin/bash"):
                image_config = replace(image_config, shell="/bin/sh")
            meta = {
                "name": name, "hash": short, "built_at": time.time(), "build_s": pull_s,
                "size_bytes": size, "installed_packages": 0,
                "spec": {"packages": [], "image": reference},
                "image": {"reference": reference, "digest": digest,
                          "layers": [c.diff_id for _, c in contents],
                          "config": image_config.to_dict(), **(extra or {})},
            }
            (work / METADATA).write_text(json.dumps(meta, indent=2) + "\n")
            os.chmod(work / METADATA, 0o644)
            with name_lock(templates_dir, name):
                if os.path.lexists(final):
                    shutil.rmtree(final, ignore_errors=True)
                os.rename(work, final)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    built = read_build(final)
    if built is None:
        raise ImageError(f"template {name} was removed while it was being made; pull again")
    progress(f"template {name} is {reference}")
    return built
