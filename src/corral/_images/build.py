"""``corral templates build --dockerfile``: a Dockerfile built into a template, daemonless, with
every ``RUN`` inside a Corral sandbox.

How a step runs. The build keeps a *stage*: the root so far, copied (not linked) into a
directory owned by the build sandbox's own host uid. ``RUN`` executes in that sandbox (namespace
tier, its egress policy, its cgroup limits, the seccomp filter) with the stage as its whole
root, writable, as root *inside its user namespace* only — on the host it is the sandbox's
unprivileged uid, without capabilities; never root on the host. ``COPY``/``ADD`` write into the
stage from the context directory, never following a symlink on the host. After each step the
stage is compared with what it was, and the difference (files, directories and symlinks made or
changed; whiteouts for what went) becomes a layer like a pulled one, normalised the same way
(owned by root, no setuid bits, no devices).

Caching. Each step's layer is keyed by the key of the step before it, the instruction as
expanded, and for ``COPY``/``ADD`` the content of what it copies; a step whose key is cached is
not run, and the stage is made only when a step has to run. A rebuild with nothing changed
therefore runs nothing and makes no stage.

What is not supported, refused with the line: multi-stage builds (a second ``FROM``,
``COPY --from``), ``ADD`` of a URL, ``ONBUILD``, ``SHELL``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import posixpath
import re
import shlex
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from .._settings import Settings
from .._templates.catalog import BuiltTemplate, locked, read_build, split_reference
from .._templates.spec import check_reference
from ..errors import ImageError, UsageError
from ..models import CommandResult, SandboxInfo
from .config import ImageConfig
from .pull import LayerCache, images_dir, make_build, pull_image
from .unpack import LayerContent, LayerLimits, SafeTree, compose_root, path_components

__all__ = ["BuildHost", "BuildResult", "build_dockerfile"]

Progress = Callable[[str], None]


class _Record(Protocol):
    @property
    def uid(self) -> int: ...


class _Records(Protocol):
    def get(self, sandbox_id: str) -> _Record: ...


class _Commands(Protocol):
    def run(self, sandbox_id: str, cmd: Sequence[str], *, timeout: float | None = None,
            envs: Mapping[str, str] | None = None, cwd: str | None = None,
            on_stdout: Callable[[str], None] | None = None,
            on_stderr: Callable[[str], None] | None = None,
            build_root: str | None = None) -> CommandResult: ...


class BuildHost(Protocol):
    """What a Dockerfile build asks of the control plane (the Manager is one): a sandbox to run
    the ``RUN`` steps in, its uid, a command in it over a build root, and its destroy."""

    @property
    def settings(self) -> Settings: ...

    @property
    def sandboxes(self) -> _Records: ...

    @property
    def commands(self) -> _Commands: ...

    def create(self, *, template: str | None = None, resources: str = "small",
               timeout: float | None = None, network: Any = None) -> SandboxInfo: ...

    def destroy(self, sandbox_id: str) -> bool: ...

_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_IGNORED = frozenset({"LABEL", "EXPOSE", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK", "VOLUME"})
_REFUSED = {
    "ONBUILD": "ONBUILD is not supported",
    "SHELL": "SHELL is not supported; RUN uses /bin/sh -c (use the JSON form for another)",
}
_VARIABLE = re.compile(r"\\\$|\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)"
                       r"(?::(?P<op>[-+])(?P<word>[^}]*))?\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
_MAX_DOCKERFILE = 1024 * 1024
_TOP_LEVEL = ("etc", "home", "media", "mnt", "opt", "root", "srv", "usr", "var")
_MAX_STEPS = 500


@dataclass(frozen=True, slots=True)
class BuildResult:
    template: BuiltTemplate
    digest: str  # names the build: the last step's key
    steps_run: int
    steps_cached: int
    duration_s: float


@dataclass(frozen=True, slots=True)
class _Instruction:
    line: int  # 1-based, for messages
    keyword: str
    value: str

    def where(self, path: Path) -> str:
        return f"{path.name}:{self.line}: {self.keyword} {self.value[:80]}"


def _parse(dockerfile: Path) -> list[_Instruction]:
    from dockerfile_parse import DockerfileParser

    try:
        raw = dockerfile.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {dockerfile}: {exc.strerror}") from None
    if len(raw) > _MAX_DOCKERFILE:
        raise UsageError(f"{dockerfile} is over {_MAX_DOCKERFILE} bytes")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{dockerfile} is not UTF-8 text") from None
    import io

    parser = DockerfileParser(fileobj=io.BytesIO(raw))
    steps = [_Instruction(line=int(s["startline"]) + 1, keyword=str(s["instruction"]).upper(),
                          value=str(s["value"]).strip())
             for s in parser.structure if s["instruction"] != "COMMENT"]
    if not steps:
        raise UsageError(f"{dockerfile} has no instructions")
    if len(steps) > _MAX_STEPS:
        raise UsageError(f"{dockerfile} has more than {_MAX_STEPS} instructions")
    froms = [s for s in steps if s.keyword == "FROM"]
    if not froms:
        raise UsageError(f"{dockerfile}: no FROM; a build starts from an image")
    if len(froms) > 1:
        raise UsageError(f"{froms[1].where(dockerfile)}: multi-stage builds are not supported "
                         "yet; build the stages as separate templates")
    for step in steps:
        if step.keyword in _REFUSED:
            raise UsageError(f"{step.where(dockerfile)}: {_REFUSED[step.keyword]}")
        if steps.index(step) < steps.index(froms[0]) and step.keyword != "ARG":
            raise UsageError(f"{step.where(dockerfile)}: only ARG may come before FROM")
    return steps


def _expand(text: str, variables: Mapping[str, str]) -> str:
    """Docker's substitution: ``$V``, ``${V}``, ``${V:-word}``, ``${V:+word}``, ``\\$``."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "\\$":
            return "$"
        name = match.group("braced") or match.group("plain")
        value = variables.get(name, "")
        op = match.group("op")
        if op == "-":
            return value or match.group("word")
        if op == "+":
            return match.group("word") if value else ""
        return value

    return _VARIABLE.sub(one, text)


def _json_or_words(value: str) -> tuple[list[str], bool]:
    """An instruction's arguments: the JSON array form, or shell-like words."""
    if value.startswith("["):
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if isinstance(parsed, list) and all(isinstance(v, str) for v in parsed):
            return parsed, True
    return shlex.split(value), False


def _pairs(value: str, where: str) -> dict[str, str]:
    """``ENV``/``ARG``-style ``K=V K2="v w"``, or the legacy ``ENV K value with spaces``."""
    words = shlex.split(value)
    if words and "=" not in words[0]:
        return {words[0]: value.split(None, 1)[1] if len(words) > 1 else ""}
    out = {}
    for word in words:
        name, sep, val = word.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UsageError(f"{where}: {word[:80]!r} is not NAME=VALUE")
        out[name] = val
    return out


# -- the stage and its differences ------------------------------------------------------------


_Entry = tuple[int, int, int, int, int, str]  # mode, size, mtime_ns, ctime_ns, inode, target


def _scan(root: Path) -> dict[str, _Entry]:
    found: dict[str, _Entry] = {}

    def walk(directory: Path, rel: str) -> None:
        with os.scandir(directory) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                path = f"{rel}{entry.name}"
                target = os.readlink(entry.path) if stat.S_ISLNK(st.st_mode) else ""
                found[path] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                               st.st_ino, target)
                if stat.S_ISDIR(st.st_mode):
                    walk(Path(entry.path), path + "/")

    walk(root, "")
    return found


def _diff_layer(stage: Path, before: dict[str, _Entry], tree: Path,
                key: str) -> LayerContent:
    """What changed in ``stage`` since ``before``, written into ``tree`` as a layer."""
    after = _scan(stage)
    content = LayerContent(diff_id=f"sha256:{key}")
    gone = sorted(p for p in before if p not in after)
    for path in gone:
        parent = posixpath.dirname(path)
        if parent and parent in before and parent not in after:
            continue  # inside a directory that went as a whole
        content.whiteouts.append(path)
    for path in sorted(after):
        mode, size, mtime, ctime, ino, target = after[path]
        old = before.get(path)
        kind = stat.S_IFMT(mode)
        if old is not None and stat.S_IFMT(old[0]) == kind:
            if kind == stat.S_IFDIR and old[0] == mode:
                continue
            if kind != stat.S_IFDIR and old == after[path]:
                continue
        if kind not in (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK):
            content.skipped["special"] = content.skipped.get("special", 0) + 1
            continue
        if old is not None and stat.S_IFMT(old[0]) == stat.S_IFDIR and kind != stat.S_IFDIR:
            content.whiteouts.append(path)  # a directory replaced by a file: the old goes
        dest = tree / path
        for ancestor in reversed(Path(path).parents[:-1]):
            made = tree / ancestor
            if not made.is_dir():
                made.mkdir()
                os.chmod(made, stat.S_IMODE(after[str(ancestor)][0]) & 0o1777)
        if kind == stat.S_IFDIR:
            dest.mkdir(exist_ok=True)
            os.chmod(dest, stat.S_IMODE(mode) & 0o1777)
        elif kind == stat.S_IFLNK:
            os.symlink(target, dest)
        else:
            if mode & 0o6000:
                content.skipped["setuid"] = content.skipped.get("setuid", 0) + 1
            _copy_out(stage / path, dest, mode, mtime)
            content.bytes += size
        content.entries += 1
    return content


def _copy_out(source: Path, dest: Path, mode: int, mtime_ns: int) -> None:
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        dst = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600)
        try:
            while os.copy_file_range(src, dst, 1 << 24):
                pass
            os.fchmod(dst, stat.S_IMODE(mode) & 0o777)  # never setuid/setgid out of a build
            os.utime(dst, ns=(mtime_ns, mtime_ns))
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _chown_tree(root: Path, uid: int) -> None:
    os.chown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            os.chown(os.path.join(dirpath, name), uid, uid, follow_symlinks=False)


# -- the context --------------------------------------------------------------------------------


def _context_sources(context: Path, patterns: list[str], where: str) -> list[Path]:
    """The context paths ``patterns`` name (globs allowed), each inside ``context``."""
    found: list[Path] = []
    for pattern in patterns:
        if pattern.startswith(("http://", "https://", "git@")):
            raise UsageError(f"{where}: sources from URLs are not supported; RUN curl (under "
                             "the build's --allow policy) instead")
        rel = posixpath.normpath(pattern.lstrip("/"))
        if rel == ".." or rel.startswith("../"):
            raise UsageError(f"{where}: {pattern!r} is outside the build context")
        if any(c in rel for c in "*?["):
            matches = sorted(p for p in _walk_names(context)
                             if fnmatch.fnmatchcase(p, rel))
            if not matches:
                raise UsageError(f"{where}: nothing in the context matches {pattern!r}")
            found += [context / m for m in matches]
        else:
            path = context / rel if rel != "." else context
            if not os.path.lexists(path):
                raise UsageError(f"{where}: {pattern!r} is not in the build context {context}")
            _inside(context, path, where)
            found.append(path)
    return found


def _walk_names(context: Path) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(context):
        for name in (*dirnames, *filenames):
            yield os.path.relpath(os.path.join(dirpath, name), context)


def _inside(context: Path, path: Path, where: str) -> None:
    # Every component but the last must be a real directory inside the context: a symlinked
    # directory would copy what it points at on the host.
    current = context
    for part in path.relative_to(context).parts[:-1]:
        current = current / part
        if current.is_symlink() or not current.is_dir():
            raise UsageError(f"{where}: {path.relative_to(context)} goes through "
                             f"{current.relative_to(context)}, which is not a directory of "
                             "the context")


def _hash_sources(sources: list[Path]) -> str:
    digest = hashlib.sha256()
    for source in sources:
        for path in [source, *sorted(_tree_of(source))]:
            st = path.lstat()
            digest.update(f"{path}\0{stat.S_IMODE(st.st_mode):o}\0{stat.S_IFMT(st.st_mode)}\0"
                          .encode())
            if path.is_symlink():
                digest.update(os.readlink(path).encode())
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 20):
                        digest.update(chunk)
    return digest.hexdigest()


def _tree_of(source: Path) -> Iterator[Path]:
    if source.is_dir() and not source.is_symlink():
        for dirpath, dirnames, filenames in os.walk(source):
            for name in (*dirnames, *filenames):
                yield Path(dirpath) / name


def _copy_in(sources: list[Path], dest: str, stage: Path, where: str) -> None:
    """``COPY`` semantics: a directory's content goes into ``dest``; files into ``dest/`` when
    it ends in ``/`` or there are several, else they become ``dest``."""
    into_dir = dest.endswith("/") or len(sources) > 1
    parts = path_components(dest, where)
    tree = SafeTree(stage, where)
    try:
        for source in sources:
            if source.is_dir() and not source.is_symlink():
                _copy_dir(source, tree, parts)
            else:
                target = parts + [source.name] if into_dir else parts
                if not target:
                    raise UsageError(f"{where}: cannot copy a file onto /")
                _copy_file(source, tree, target[:-1], target[-1])
    finally:
        tree.close()


def _copy_dir(source: Path, tree: SafeTree, parts: list[str]) -> None:
    tree.directory(parts, create=True)
    for entry in sorted(os.scandir(source), key=lambda e: e.name):
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            fd = tree.directory([*parts, entry.name], create=True)
            assert fd is not None
            os.fchmod(fd, stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode) & 0o1777)
            _copy_dir(path, tree, [*parts, entry.name])
        else:
            _copy_file(path, tree, parts, entry.name)


def _copy_file(source: Path, tree: SafeTree, parent_parts: list[str], name: str) -> None:
    st = source.lstat()
    tree.directory(parent_parts, create=True)
    tree.remove(parent_parts, name)
    parent = tree.directory(parent_parts, create=True)
    assert parent is not None
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(source), name, dir_fd=parent)  # copied, never followed
        return
    if not stat.S_ISREG(st.st_mode):
        return  # sockets, FIFOs and devices in a context are not copied
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600, dir_fd=parent)
        try:
            while os.copy_file_range(src, dst, 1 << 24):
                pass
            os.fchmod(dst, stat.S_IMODE(st.st_mode) & 0o777)
            os.utime(dst, ns=(st.st_mtime_ns, st.st_mtime_ns))
        finally:
            os.close(dst)
    finally:
        os.close(src)


# -- the build ------------------------------------------------------------------------------------


@dataclass
class _State:
    layers: list[tuple[Path, LayerContent]]
    config: ImageConfig
    key: str
    variables: dict[str, str] = field(default_factory=dict)  # ARG values in scope
    stage: Path | None = None  # made when a step has to run
    # WORKDIRs since the last filesystem step: Docker makes each in the image, so the next
    # step's layer holds them (made in the stage after its "before" scan).
    workdirs: list[str] = field(default_factory=list)
    steps_run: int = 0
    steps_cached: int = 0


class _Builder:
    def __init__(self, manager: BuildHost, dockerfile: Path, context: Path,
                 network: Any, progress: Progress, work: Path) -> None:
        self._manager = manager
        self._settings = manager.settings
        self._dockerfile = dockerfile
        self._context = context
        self._network = network
        self._progress = progress
        self._work = work
        images = self._settings.home / "images"
        self._cache = LayerCache(images, LayerLimits(max_bytes=self._settings.image_max_bytes),
                                 progress)
        self._sandbox: str | None = None
        self._uid = 0

    def close(self) -> None:
        if self._sandbox is not None:
            with contextlib.suppress(Exception):
                self._manager.destroy(self._sandbox)

    def _sandbox_uid(self) -> tuple[str, int]:
        if self._sandbox is None:
            info = self._manager.create(template="base", resources="large",
                                        network=self._network, timeout=3600)
            self._sandbox = info.id
            self._uid = self._manager.sandboxes.get(info.id).uid
            self._progress(f"build steps run in sandbox {info.id}")
        return self._sandbox, self._uid

    def _stage(self, state: _State) -> Path:
        if state.stage is None:
            _, uid = self._sandbox_uid()
            stage = self._work / "stage"
            shutil.rmtree(stage, ignore_errors=True)
            stage.mkdir(mode=0o755)
            # No workdir here: made before the step's scan it would be in no layer
            # (``_make_workdirs`` makes it after).
            compose_root(state.layers, stage, link=False)
            # A step's root is bound directory by directory into a read-only one, so it cannot
            # make a new top-level directory: the usual ones are there (in a layer if new).
            for top in _TOP_LEVEL:
                if not os.path.lexists(stage / top):
                    (stage / top).mkdir(mode=0o755)
            _chown_tree(stage, uid)
            state.stage = stage
        return state.stage

    def from_image(self, step: _Instruction, variables: dict[str, str]) -> _State:
        reference = _expand(step.value.split()[0] if step.value else "", variables)
        if not reference:
            raise UsageError(f"{step.where(self._dockerfile)}: FROM names no image")
        pulled = pull_image(reference, self._settings, allow_local=True,
                            on_progress=self._progress)
        image = pulled.template.image or {}
        layers = []
        for diff_id in image.get("layers", []):
            content = self._cache.get(diff_id)
            if content is None:
                raise ImageError(f"{step.where(self._dockerfile)}: layer {diff_id} of "
                                 f"{reference} is gone from the cache; pull it again")
            layers.append((self._cache.path(diff_id) / "tree", content))
        config = ImageConfig.from_dict(image.get("config") or {})
        key = hashlib.sha256(f"from\0{pulled.digest}".encode()).hexdigest()
        return _State(layers=layers, config=config, key=key)

    def filesystem_step(self, state: _State, step: _Instruction, key_input: str,
                        apply: Callable[[Path], None]) -> None:
        # The directories the step makes first are part of what it is (and of its layer).
        workdirs = self._workdirs(state)
        if workdirs:
            key_input += "\0" + json.dumps(workdirs)
        key = hashlib.sha256(f"{state.key}\0{key_input}".encode()).hexdigest()
        layer_id = f"sha256:{key}"
        where = step.where(self._dockerfile)
        cached = self._cache.get(layer_id)
        if cached is not None:
            self._progress(f"{where} (cached)")
            state.steps_cached += 1
            if state.stage is not None:
                # Later steps run on top of it: bring the stage up to this layer's state.
                state.stage = None
        else:
            self._progress(where)
            stage = self._stage(state)
            before = _scan(stage)
            self._make_workdirs(stage, workdirs, where)
            apply(stage)
            cached = self._store_layer(stage, before, key)
            state.steps_run += 1
        state.layers.append((self._cache.path(layer_id) / "tree", cached))
        state.key = key
        state.workdirs = []

    def _store_layer(self, stage: Path, before: dict[str, _Entry], key: str) -> LayerContent:
        final = self._cache.path(f"sha256:{key}")
        with locked(self._settings.home / "images" / ".locks" / f"layer-{key[:12]}.lock"):
            existing = self._cache.get(f"sha256:{key}")
            if existing is not None:
                return existing
            work = Path(tempfile.mkdtemp(prefix=f".step-{key[:12]}-", dir=self._cache.dir))
            try:
                os.chmod(work, 0o755)
                (work / "tree").mkdir(mode=0o755)
                content = _diff_layer(stage, before, work / "tree", key)
                (work / "layer.json").write_text(json.dumps(content.to_dict()))
                shutil.rmtree(final, ignore_errors=True)
                os.rename(work, final)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
        return content

    def run(self, state: _State, step: _Instruction) -> None:
        words, is_json = _json_or_words(step.value)
        argv = words if is_json else ["/bin/sh", "-c", step.value]
        if not argv:
            raise UsageError(f"{step.where(self._dockerfile)}: RUN names no command")
        env = {"PATH": _DEFAULT_PATH, **state.config.env, **state.variables,
               "HOME": "/root", "USER": "root", "LOGNAME": "root"}

        def execute(stage: Path) -> None:
            sandbox, _ = self._sandbox_uid()
            where = step.where(self._dockerfile)
            result = self._manager.commands.run(
                sandbox, argv, envs=env, cwd=state.config.working_dir or "/",
                build_root=str(stage), timeout=600,
                on_stdout=lambda text: self._relay(text),
                on_stderr=lambda text: self._relay(text))
            if result.timed_out:
                raise ImageError(f"{where}: timed out after {result.duration_s:.0f} s")
            if result.exit_code != 0:
                tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
                raise ImageError(f"{where}: exited with {result.exit_code}"
                                 + (": " + " | ".join(tail) if tail else ""))

        key_input = json.dumps(["RUN", argv, sorted(env.items())])
        self.filesystem_step(state, step, key_input, execute)

    def _relay(self, text: str) -> None:
        for line in text.splitlines():
            self._progress(f"  | {line}")

    def copy(self, state: _State, step: _Instruction) -> None:
        where = step.where(self._dockerfile)
        value = _expand(step.value, {**state.config.env, **state.variables})
        words, _ = _json_or_words(value)
        flags = [w for w in words if w.startswith("--")]
        args = [w for w in words if not w.startswith("--")]
        for flag in flags:
            if flag.startswith("--from"):
                raise UsageError(f"{where}: COPY --from (multi-stage) is not supported yet")
            if not flag.startswith(("--chown", "--chmod", "--link")):
                raise UsageError(f"{where}: unknown flag {flag[:40]!r}")
        if len(args) < 2:
            raise UsageError(f"{where}: give one or more sources and a destination")
        *patterns, dest = args
        sources = _context_sources(self._context, patterns, where)
        if not dest.startswith("/"):
            dest = posixpath.join(state.config.working_dir or "/", dest) + (
                "/" if dest.endswith("/") else "")
        key_input = json.dumps([step.keyword, patterns, dest, _hash_sources(sources)])
        self.filesystem_step(state, step, key_input,
                             lambda stage: self._copy_as_owner(sources, dest, stage, where))

    @staticmethod
    def _workdirs(state: _State) -> list[str]:
        """The WORKDIRs a step makes before it runs: those since the last step, and the one
        it runs in (the base image's may be missing too; Docker makes it)."""
        current = state.config.working_dir
        return [*state.workdirs, *([current] if current and current not in state.workdirs
                                   else [])]

    def _make_workdirs(self, stage: Path, workdirs: list[str], where: str) -> None:
        """Make ``workdirs`` in the stage, as Docker does: root's (the build's uid here, root's
        in the image), 0755, each missing parent too; one reached through a symlink of the
        image's is left for the step's command to resolve in its root (never followed)."""
        if not workdirs:
            return
        made = False
        tree = SafeTree(stage, where)
        try:
            for workdir in workdirs:
                parts = path_components(workdir, where)
                with contextlib.suppress(ImageError):
                    if tree.directory(parts, create=False) is None:
                        tree.directory(parts, create=True)
                        made = True
        finally:
            tree.close()
        if made:  # the step's command (the build's uid) writes in them
            _chown_tree(stage, self._uid)

    def _copy_as_owner(self, sources: list[Path], dest: str, stage: Path, where: str) -> None:
        _copy_in(sources, dest, stage, where)
        _chown_tree(stage, self._uid)


def build_dockerfile(manager: BuildHost, dockerfile: Path, *, name: str,
                     context: Path | None = None, build_args: Mapping[str, str] | None = None,
                     network: Any = None, on_progress: Progress | None = None) -> BuildResult:
    """Build ``dockerfile`` into template ``name`` (see the module doc).

    ``network``: the egress policy of the build's ``RUN`` steps (default: none).

    Raises:
        UsageError: a malformed or unsupported Dockerfile (naming its line), a bad context path.
        ImageError: a step failed (naming its line), or the base image cannot be pulled.
        ImageRefused: the base image's registry is not allowed.
    """
    started = time.monotonic()
    progress = on_progress or (lambda line: None)
    name, tag = split_reference(check_reference(name))
    dockerfile = dockerfile.absolute()
    context = (context or dockerfile.parent).absolute()
    if not context.is_dir():
        raise UsageError(f"the build context {context} is not a directory")
    steps = _parse(dockerfile)
    # Shared with pulls: `corral templates prune` waits, so the layers this build makes
    # before its template refers to them are not taken away under it.
    with locked(images_dir(manager.settings) / ".locks" / "pulls.lock", shared=True):
        return _build(manager, dockerfile, context, steps, name, tag, dict(build_args or {}),
                      network, progress, started)


def _build(manager: BuildHost, dockerfile: Path, context: Path, steps: list[_Instruction],
           name: str, tag: str | None, given: dict[str, str], network: Any,
           progress: Progress, started: float) -> BuildResult:
    variables: dict[str, str] = {}
    state: _State | None = None
    last_workdir: _Instruction | None = None
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=manager.settings.home))
    os.chmod(work, 0o711)  # the build sandbox's uid reaches its stage inside
    builder = _Builder(manager, dockerfile, context, network, progress, work)
    try:
        for step in steps:
            where = step.where(dockerfile)
            if step.keyword == "ARG":
                # Before FROM, for FROM only; after it, for the steps that follow (and RUN's
                # environment), not kept in the image (Docker's scoping).
                scope_vars = variables if state is None else state.variables
                for arg_name, default in _pairs(step.value, where).items():
                    scope_vars[arg_name] = given.get(arg_name, _expand(default, scope_vars))
                continue
            if step.keyword == "FROM":
                state = builder.from_image(step, variables)
                state.variables = {}
                continue
            assert state is not None  # _parse: only ARG before FROM
            scope = {**state.config.env, **state.variables}
            if step.keyword == "ENV":
                pairs = {k: _expand(v, scope) for k, v in _pairs(step.value, where).items()}
                state.config = replace(state.config, env={**state.config.env, **pairs})
            elif step.keyword == "WORKDIR":
                path = _expand(step.value, scope)
                workdir = posixpath.normpath(posixpath.join(state.config.working_dir or "/",
                                                            path))
                state.config = replace(state.config, working_dir=workdir)
                if workdir not in state.workdirs:  # made by the next step, in its layer
                    state.workdirs.append(workdir)
            elif step.keyword == "USER":
                state.config = replace(state.config, user=_expand(step.value, scope) or None)
            elif step.keyword in ("CMD", "ENTRYPOINT"):
                words, is_json = _json_or_words(step.value)
                argv = tuple(words) if is_json else ("/bin/sh", "-c", step.value)
                state.config = (replace(state.config, cmd=argv) if step.keyword == "CMD"
                                else replace(state.config, entrypoint=argv))
            elif step.keyword == "RUN":
                builder.run(state, step)
            elif step.keyword in ("COPY", "ADD"):
                builder.copy(state, step)
            elif step.keyword in _IGNORED:
                progress(f"{where} (recorded only)")
            else:
                raise UsageError(f"{where}: unknown instruction {step.keyword}")
            if step.keyword == "WORKDIR":
                last_workdir = step
        assert state is not None
        if [w for w in state.workdirs if w != state.config.working_dir]:
            # WORKDIRs no step followed: Docker has them in the image, so a layer of their
            # own (the last one is made at start anyway, as for any image).
            assert last_workdir is not None
            builder.filesystem_step(state, last_workdir, "WORKDIR", lambda stage: None)
        config_key = hashlib.sha256(
            f"{state.key}\0{json.dumps(state.config.to_dict(), sort_keys=True)}".encode()
        ).hexdigest()
        digest = f"sha256:{config_key}"
        templates_dir = manager.settings.home / "templates"
        built = make_build(templates_dir, name, digest, f"dockerfile:{dockerfile}",
                           state.config, state.layers,
                           sum(c.bytes for _, c in state.layers), time.monotonic() - started,
                           progress, extra={"dockerfile": str(dockerfile),
                                            "context": str(context)})
        from .._templates.catalog import name_lock, set_current

        with name_lock(templates_dir, name):
            set_current(templates_dir, name, built.hash)
            if tag is not None:
                set_current(templates_dir, name, built.hash, tag=tag)
        existing = read_build(built.path)
        assert existing is not None
        return BuildResult(template=replace(existing, current=True), digest=digest,
                           steps_run=state.steps_run, steps_cached=state.steps_cached,
                           duration_s=time.monotonic() - started)
    finally:
        builder.close()
        shutil.rmtree(work, ignore_errors=True)
