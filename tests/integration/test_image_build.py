"""Dockerfile builds: FROM an image in a real loopback registry, every RUN inside a Corral
sandbox, every step cached by its inputs, refusals naming the line."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from corral import Sandbox
from corral._cli.main import cli
from corral._control.manager import Manager
from corral._images.build import build_dockerfile
from corral._settings import Settings
from corral.errors import ImageError, UsageError
from tests.conftest import managed
from tests.images.oci import busybox_root, layer_from_dir, push, write_layout
from tests.images.registry import LocalRegistry, registry_fixture, require_tools  # noqa: F401

pytestmark = pytest.mark.needs_root


@dataclass
class Build:
    registry: LocalRegistry
    settings: Settings
    manager: Manager
    work: Path
    base: str  # the base image's reference

    def context(self, name: str, dockerfile: str, files: dict[str, str] | None = None) -> Path:
        ctx = self.work / name
        ctx.mkdir()
        (ctx / "Dockerfile").write_text(dockerfile.replace("{BASE}", self.base))
        for rel, text in (files or {}).items():
            (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
            (ctx / rel).write_text(text)
        return ctx


@pytest.fixture(scope="module")
def build(registry: LocalRegistry, settings: Settings) -> Iterator[Build]:
    require_tools("skopeo", "busybox")
    work = Path(tempfile.mkdtemp(prefix="corral-test-build-"))
    try:
        os.chmod(work, 0o711)
        own = Settings(home=work / "home", uid_start=settings.uid_start + 8000, uid_count=500,
                       registries=registry.host)
        image = write_layout(work / "base", [layer_from_dir(busybox_root(work / "root"))],
                             config={"Env": ["PATH=/bin"]})
        push(image, registry.host, "build/busybox", "1")
        with managed(own) as manager:
            yield Build(registry=registry, settings=own, manager=manager, work=work,
                        base=f"{registry.host}/build/busybox:1")
    finally:
        shutil.rmtree(work, ignore_errors=True)


_DOCKERFILE = """\
# a comment, and an ARG used by FROM
ARG BASE={BASE}
FROM $BASE
ARG FLAVOUR=plain
ENV GREETING="hello from the build" \\
    MODE=$FLAVOUR
WORKDIR /opt/app
COPY hello.txt ./
COPY conf/ /etc/app/
RUN echo "ran as $(id -u) in $(pwd) with $FLAVOUR" > built.txt && \\
    mkdir -p /var/lib/app && echo "$GREETING" > /var/lib/app/state && rm /etc/passwd
CMD ["cat", "built.txt"]
"""


def test_a_dockerfile_builds_and_a_rebuild_runs_no_step(build: Build) -> None:
    ctx = build.context("main", _DOCKERFILE, {"hello.txt": "from the context\n",
                                              "conf/app.ini": "[app]\n"})
    first = build_dockerfile(build.manager, ctx / "Dockerfile", name="built",
                             build_args={"FLAVOUR": "spicy"})
    assert (first.steps_run, first.steps_cached) == (3, 0)
    root = first.template.root
    # Written by the build sandbox's uid, kept as root's on the host like any image file.
    assert os.stat(root / "opt" / "app" / "built.txt").st_uid == 0
    assert not (root / "etc" / "passwd").exists()  # the RUN's deletion is a whiteout
    again = build_dockerfile(build.manager, ctx / "Dockerfile", name="built",
                             build_args={"FLAVOUR": "spicy"})
    assert (again.steps_run, again.steps_cached) == (0, 3)
    assert again.digest == first.digest
    # A changed input reruns its own step and the ones after it, not those before.
    (ctx / "conf" / "app.ini").write_text("[app]\nchanged = 1\n")
    changed = build_dockerfile(build.manager, ctx / "Dockerfile", name="built",
                               build_args={"FLAVOUR": "spicy"})
    assert (changed.steps_run, changed.steps_cached) == (2, 1)
    with Sandbox.create(template="built", home=str(build.settings.home)) as sb:
        assert sb.commands.run(["pwd"]).stdout == "/opt/app\n"
        assert sb.commands.run(["cat", "built.txt"]).stdout == \
            "ran as 0 in /opt/app with spicy\n"
        assert sb.commands.run(["cat", "hello.txt", "/etc/app/app.ini"]).stdout == \
            "from the context\n[app]\nchanged = 1\n"
        assert sb.commands.run(["cat", "/var/lib/app/state"]).stdout == \
            "hello from the build\n"
        env = sb.commands.run(["env"]).stdout
        assert "GREETING=hello from the build" in env and "MODE=spicy" in env
        assert "FLAVOUR" not in env  # an ARG is the build's, not the image's
        assert sb.commands.run(["id", "-u"]).stdout == "1000\n"
        assert sb.get_info().template_version == changed.digest


def test_a_run_is_contained_like_any_sandbox_command(build: Build) -> None:
    # Bounded by construction: one mount attempt on the step's own /mnt, one unshare.
    ctx = build.context("contained", """\
FROM {BASE}
RUN (mount -t tmpfs none /mnt 2>/dev/null && echo MOUNTED || echo mount-refused) > /srv/probe; \\
    (unshare -U true 2>/dev/null && echo USERNS || echo userns-refused) >> /srv/probe; \\
    (cat /proc/1/cmdline | tr '\\0' ' '; echo) >> /srv/probe; \\
    (ls /workspace 2>/dev/null && echo WORKSPACE || echo no-workspace) >> /srv/probe
""")
    result = build_dockerfile(build.manager, ctx / "Dockerfile", name="contained")
    probe = (result.template.root / "srv" / "probe").read_text().splitlines()
    assert probe[0] == "mount-refused" and probe[1] == "userns-refused"
    assert str(build.settings.home) not in probe[2]  # no host path shows inside
    assert probe[3] == "no-workspace"
    assert not Path("/srv/probe").exists()


def test_run_reaches_only_what_the_build_policy_allows(build: Build) -> None:
    ctx = build.context("egress", """\
FROM {BASE}
RUN wget -q -O /srv/page http://blocked.example/
""")
    with pytest.raises(ImageError, match=r"Dockerfile:2: RUN wget.*exited with") as caught:
        build_dockerfile(build.manager, ctx / "Dockerfile", name="egress",
                         network={"allow": ["allowed.example"]})
    assert "403" in str(caught.value) or "Forbidden" in str(caught.value)
    decisions = []
    for log in (build.settings.home / "audit").glob("*.jsonl"):
        for line in log.read_text().splitlines():
            event = json.loads(line)
            if event["type"].startswith("egress") and "blocked.example" in line:
                decisions.append(event)
    assert decisions, "the gateway's refusal is in the build sandbox's audit trail"


def test_a_failing_step_names_its_line_and_keeps_nothing(build: Build) -> None:
    ctx = build.context("failing", "FROM {BASE}\nRUN echo ok\n\nRUN echo oops >&2; exit 3\n")
    with pytest.raises(ImageError, match=r"Dockerfile:4: RUN echo oops.*exited with 3: oops"):
        build_dockerfile(build.manager, ctx / "Dockerfile", name="failing")
    assert not list((build.settings.home / "templates").glob("failing*"))
    assert not [p for p in build.settings.home.iterdir() if p.name.startswith(".build-")]


@pytest.mark.parametrize(("dockerfile", "files", "message"), [
    ("FROM {BASE}\nFROM {BASE}\n", {}, r"Dockerfile:2: FROM .*multi-stage"),
    ("FROM {BASE}\nCOPY --from=x /a /b\n", {}, r"Dockerfile:2: COPY .*--from"),
    ("FROM {BASE}\nCOPY ../outside /x\n", {}, r"outside the build context"),
    ("FROM {BASE}\nADD https://example.com/x /x\n", {}, r"URLs are not supported"),
    ("FROM {BASE}\nCOPY link/passwd /x\n", {"link": "symlink"}, r"goes through link"),
    ("FROM {BASE}\nSHELL [\"/bin/bash\", \"-c\"]\n", {}, r"Dockerfile:2: SHELL"),
    ("RUN true\n", {}, r"no FROM"),
    ("FROM {BASE}\nCOPY missing.txt /x\n", {}, r"'missing.txt' is not in the build context"),
])
def test_unsupported_or_unsafe_instructions_are_refused_with_the_line(
        build: Build, dockerfile: str, files: dict[str, str], message: str) -> None:
    ctx = build.context(f"refused-{abs(hash(dockerfile))}", dockerfile)
    if files.get("link") == "symlink":
        os.symlink("/etc", ctx / "link")
    with pytest.raises(UsageError, match=message):
        build_dockerfile(build.manager, ctx / "Dockerfile", name="refused")


def test_a_context_symlink_is_copied_as_a_symlink(build: Build) -> None:
    ctx = build.context("symlinked", "FROM {BASE}\nCOPY etc-link /srv/etc-link\n")
    os.symlink("/etc", ctx / "etc-link")
    result = build_dockerfile(build.manager, ctx / "Dockerfile", name="symlinked")
    link = result.template.root / "srv" / "etc-link"
    assert link.is_symlink() and os.readlink(link) == "/etc"


def test_the_cli_builds_with_progress_and_json(build: Build) -> None:
    ctx = build.context("cli", "FROM {BASE}\nRUN echo cli > /srv/cli\nCMD [\"cat\", "
                               "\"/srv/cli\"]\n")
    runner = CliRunner()
    env = {"CORRAL_REGISTRIES": build.registry.host}
    result = runner.invoke(cli, ["--home", str(build.settings.home), "templates", "build",
                                 "from-cli", "--dockerfile", str(ctx / "Dockerfile"), "--json"],
                           env=env)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["name"] == "from-cli" and out["steps_run"] == 1
    ran = runner.invoke(cli, ["--home", str(build.settings.home), "run", "--template",
                              "from-cli", "--json", "--", "cat", "/srv/cli"], env=env)
    assert json.loads(ran.stdout)["stdout"] == "cli\n"
    text = runner.invoke(cli, ["--home", str(build.settings.home), "templates", "build",
                               "from-cli", "--dockerfile", str(ctx / "Dockerfile")], env=env)
    assert text.exit_code == 0 and "0 steps run, 1 cached" in text.output
