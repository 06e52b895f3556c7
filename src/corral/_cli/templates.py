"""``corral templates build|ls|rm``: sandbox root filesystems built from Debian packages.

They act on the local data directory (``--home`` / ``CORRAL_HOME``) and need root to build.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import click

from .. import errors
from .common import emit_json, handle_errors, json_option, when

if TYPE_CHECKING:  # imported by the commands that run: `corral --help` loads this module
    from rich.console import Console

    from .._templates import BuiltTemplate, TemplateSpec

__all__ = ["templates"]

EXIT_INTERRUPTED = 130


@click.group()
def templates() -> None:
    """Build, list and remove sandbox templates.

    \b
    base     the host's own system, read-only (always there)
    python   python3, pip, venv, git, curl, build-essential
    node     nodejs, npm
    go       golang-go, git, gcc
    Others from a spec file: corral templates build --file spec.toml

    \b
    A spec file (TOML or JSON):
      name = "tools"
      packages = ["python3", "jq"]
      setup = ["python3 -m compileall -q /usr/lib/python3"]
      [[files]]
      path = "/etc/pip.conf"
      content = "[global]\\nno-index = true\\n"
    """


def _spec_from(name: str | None, spec_file: Path | None) -> TemplateSpec:
    from .._templates import BUILTIN_SPECS, check_name, load_spec_file

    if spec_file is not None:
        return load_spec_file(spec_file, name=name)
    if name is None:
        raise errors.UsageError("name a template to build (built-in: "
                                f"{', '.join(BUILTIN_SPECS)}) or pass --file SPEC.toml")
    if name in BUILTIN_SPECS:
        return BUILTIN_SPECS[name]
    check_name(name)
    raise errors.UsageError(f"there is no built-in template {name!r} (built-in: "
                            f"{', '.join(BUILTIN_SPECS)}); describe it in a spec file and run "
                            f"`corral templates build {name} --file SPEC.toml`")


@contextlib.contextmanager
def _interruptible(message: str, *, as_json: bool) -> Iterator[None]:
    """Ctrl-C or SIGTERM inside: ``message`` said (JSON on stderr with --json), exit 130."""
    try:
        with _terminate_as_interrupt():
            yield
    except KeyboardInterrupt:
        if as_json:  # like every other error: JSON on stderr
            click.echo(json.dumps({"code": "interrupted", "message": message}), err=True)
        else:
            click.secho(f"corral: {message}", err=True, fg="red")
        sys.exit(EXIT_INTERRUPTED)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the builder stops mmdebstrap and removes its files."""
    def raise_interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Progress:
    """mmdebstrap's phase lines (``I:``, ``W:``) printed as they come; on a terminal, every
    other line (apt downloads, dpkg unpacking, setup output) as a one-line live status."""

    def __init__(self, console: Console, *, live: bool) -> None:
        self._console = console
        self._status = console.status("starting") if live and console.is_terminal else None

    def __enter__(self) -> _Progress:
        if self._status is not None:
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.stop()

    def __call__(self, line: str) -> None:
        if line.startswith(("I: ", "W: ", "E: ")):
            self._console.print(line, markup=False, highlight=False, soft_wrap=True)
        elif self._status is not None and line.strip():
            self._status.update(line.strip()[: max(20, self._console.width - 4)])


def _mib(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"


def _when(ts: float) -> str:
    return when(ts)


@templates.command(name="build")
@click.argument("name", required=False)
@click.option("--file", "-f", "spec_file", type=click.Path(path_type=Path, dir_okay=False),
              default=None, help="Build from a spec file (.toml or .json); NAME overrides its "
                                 "name.")
@click.option("--dockerfile", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              default=None, help="Build NAME from a Dockerfile instead (one stage; every RUN "
                                 "runs in a Corral sandbox).")
@click.option("--context", "context_dir",
              type=click.Path(path_type=Path, file_okay=False, exists=True), default=None,
              help="COPY/ADD sources come from here (default: the Dockerfile's directory).")
@click.option("--build-arg", "build_args", multiple=True, metavar="NAME=VALUE",
              help="Set an ARG (repeatable).")
@click.option("--allow", "allow", multiple=True, metavar="HOST",
              help="Hosts RUN steps may reach through the egress gateway (default: none).")
@json_option
@click.pass_context
@handle_errors
def build(ctx: click.Context, name: str | None, spec_file: Path | None,
          dockerfile: Path | None, context_dir: Path | None, build_args: tuple[str, ...],
          allow: tuple[str, ...], as_json: bool) -> None:
    """Build template NAME (python, node, go) or one from --file or --dockerfile; reuses an
    existing build of the same input (each Dockerfile step is cached)."""
    if dockerfile is not None:
        _build_dockerfile(ctx, name, dockerfile, context_dir, build_args, allow, as_json)
        return
    if context_dir or build_args or allow:
        raise errors.UsageError("--context, --build-arg and --allow go with --dockerfile")
    spec = _spec_from(name, spec_file)
    if spec.image is not None:  # a spec naming an image: the image, pulled as NAME
        ctx.invoke(pull, reference=spec.image, name=spec.name, as_json=as_json)
        return
    from rich.console import Console

    from .._templates import build_template

    templates_dir: Path = ctx.obj["settings"].home / "templates"
    console = Console(stderr=True)
    with _interruptible(f"building template {spec.name!r} was interrupted; nothing was kept",
                        as_json=as_json), _Progress(console, live=not as_json) as progress:
        result = build_template(spec, templates_dir, on_progress=None if as_json else progress)
    built = result.template
    if as_json:
        emit_json({**built.to_dict(), "cached": result.cached,
                   "duration_s": round(result.duration_s, 3)})
    elif result.cached:
        click.echo(f"{built.name}: already built as {built.path.name} on "
                   f"{_when(built.built_at)} ({_mib(built.size_bytes)}); cached, nothing run")
    else:
        click.echo(f"{built.name}: built {built.path.name} in {result.duration_s:.1f} s "
                   f"({_mib(built.size_bytes)}, {built.installed_packages} packages)")


def _build_dockerfile(ctx: click.Context, name: str | None, dockerfile: Path,
                      context_dir: Path | None, build_args: tuple[str, ...],
                      allow: tuple[str, ...], as_json: bool) -> None:
    from rich.console import Console

    from .._control.plane import get_manager
    from .._images.build import build_dockerfile
    from .common import parse_pairs

    if name is None:
        raise errors.UsageError("name the template to build: `corral templates build NAME "
                                "--dockerfile PATH`")
    network = {"allow": list(allow)} if allow else "none"
    console = Console(stderr=True)
    message = f"building template {name!r} was interrupted; finished steps stay cached"
    with _interruptible(message, as_json=as_json), \
            _Progress(console, live=not as_json) as progress:
        result = build_dockerfile(
            get_manager(ctx.obj["settings"]), dockerfile, name=name, context=context_dir,
            build_args=parse_pairs(build_args, "--build-arg"), network=network,
            on_progress=None if as_json else (lambda line: progress(f"I: {line}")))
    built = result.template
    if as_json:
        emit_json({**_row(built), "digest": result.digest, "steps_run": result.steps_run,
                   "steps_cached": result.steps_cached,
                   "duration_s": round(result.duration_s, 3)})
    else:
        click.echo(f"{built.name}: built {built.path.name} in {result.duration_s:.1f} s "
                   f"({result.steps_run} steps run, {result.steps_cached} cached)")


@templates.command(name="prune")
@json_option
@click.pass_context
@handle_errors
def prune(ctx: click.Context, as_json: bool) -> None:
    """Remove unpacked image layers and downloaded blobs that no template uses any more (after
    `corral templates rm`); a later pull fetches again what it needs."""
    from .._images.pull import prune_images

    removed, freed = prune_images(ctx.obj["settings"])
    if as_json:
        emit_json({"removed": removed, "freed_bytes": freed})
    else:
        click.echo(f"removed {removed} unused layers and blobs ({_mib(freed)})")


def _row(build: BuiltTemplate) -> dict[str, Any]:
    return {"kind": "image" if build.image is not None else "built", **build.to_dict()}


@templates.command(name="pull")
@click.argument("reference")
@click.option("--name", "-n", default=None, metavar="NAME[:TAG]",
              help="Make it template NAME (default: img-<digest>, which never moves); a later "
                   "pull of another image with the same NAME makes that one current, while "
                   "NAME:TAG keeps naming this one.")
@json_option
@click.pass_context
@handle_errors
def pull(ctx: click.Context, reference: str, name: str | None, as_json: bool) -> None:
    """Pull an image and make it a template.

    \b
    REFERENCE is one of
      [host[:port]/]path[:tag][@sha256:...]   from a registry on CORRAL_REGISTRIES
      oci:/path/to/layout[:tag]               an OCI image layout on this host
      docker-archive:/path/to/image.tar       a `docker save` tarball on this host

    Layers are unpacked once and shared between images; nothing of an image is trusted:
    paths that leave the root, device nodes, setuid bits and file owners are refused or
    cleared. Sandboxes of the template get the image's Env and WorkingDir.
    """
    from rich.console import Console

    from .._images.pull import pull_image

    settings = ctx.obj["settings"]
    console = Console(stderr=True)
    with _interruptible(f"pulling {reference[:80]!r} was interrupted; nothing was kept",
                        as_json=as_json), _Progress(console, live=not as_json) as progress:
        result = pull_image(reference, settings, name=name, allow_local=True,
                            on_progress=None if as_json else
                            (lambda line: progress(f"I: {line}")))
    built = result.template
    if as_json:
        emit_json({**_row(built), "reference": result.reference, "digest": result.digest,
                   "cached": result.cached, "layers_reused": result.layers_reused,
                   "layers_unpacked": result.layers_unpacked,
                   "duration_s": round(result.duration_s, 3)})
    elif result.cached:
        click.echo(f"{built.name}: already {result.reference}; nothing fetched")
    else:
        click.echo(f"{built.name}: {result.reference} in {result.duration_s:.1f} s "
                   f"({result.layers_unpacked} layers unpacked, {result.layers_reused} "
                   f"reused, {_mib(built.size_bytes)})")


@templates.command(name="ls")
@json_option
@click.pass_context
@handle_errors
def ls(ctx: click.Context, as_json: bool) -> None:
    """List templates: base and every build, newest first (the current one of each name is
    marked *, tags in brackets: `--template NAME:TAG` picks that build)."""
    from .._templates import BUILTIN_SPECS, list_builds

    builds = list_builds(ctx.obj["settings"].home / "templates")
    if as_json:
        base: dict[str, Any] = {
            "kind": "host", "name": "base", "hash": None, "path": "/", "built_at": None,
            "build_s": None, "size_bytes": None, "packages": [], "installed_packages": None,
            "current": True}
        emit_json([base, *(_row(b) for b in builds)])
        return
    width = max([12, *(len(b.name) for b in builds)])
    click.echo(f"{'NAME':<{width}} {'VERSION':<17} {'SIZE':>9}  {'BUILT':<19}  CONTENT")
    click.echo(f"{'base':<{width}} {'-':<17} {'-':>9}  {'-':<19}  (the host's system)")
    for b in builds:
        mark = "*" if b.current else " "
        content = (f"image {b.image.get('reference')}" if b.image is not None
                   else " ".join(b.packages))
        if b.tags:
            content = f"[{', '.join(b.tags)}] {content}"
        click.echo(f"{b.name:<{width}} {b.hash + mark:<17} {_mib(b.size_bytes):>9}  "
                   f"{_when(b.built_at):<19}  {content}")
    missing = [n for n in BUILTIN_SPECS if not any(b.name == n for b in builds)]
    if missing:
        click.echo(f"not built yet: {', '.join(missing)} "
                   f"(corral templates build {missing[0]})", err=True)


def _sandboxes_using(home: Path, name: str) -> list[str]:
    db = home / "corral.db"
    if not db.exists():
        return []
    from .._control.plane import Store

    store = Store(db)
    try:
        return [info.id for info in store.list() if info.template == name]
    finally:
        store.close()


@templates.command(name="rm")
@click.argument("name")
@json_option
@click.pass_context
@handle_errors
def rm(ctx: click.Context, name: str, as_json: bool) -> None:
    """Remove every build of template NAME (refused while a sandbox uses it)."""
    if name == "base":
        raise errors.UsageError("template 'base' is the host's own system and cannot be removed")
    from .._templates import check_name, remove_builds

    check_name(name)
    home: Path = ctx.obj["settings"].home
    users = _sandboxes_using(home, name)
    if users:
        shown = ", ".join(users[:5]) + (", ..." if len(users) > 5 else "")
        raise errors.UsageError(
            f"template {name!r} is used by {len(users)} sandbox(es) ({shown}); destroy them "
            "first (`corral rm ID`)")
    removed = remove_builds(home / "templates", name)
    if not removed:
        raise errors.UsageError(f"template {name!r} is not built here; nothing to remove "
                                "(`corral templates ls` lists what is)")
    if as_json:
        emit_json({"removed": [b.to_dict() for b in removed]})
    else:
        for b in removed:
            click.echo(f"removed {b.path.name} ({_mib(b.size_bytes)})")
