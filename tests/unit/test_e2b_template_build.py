"""The Template SDK's template made a Dockerfile, its COPY archives checked, its log paged
(corral._e2b.template_build): no server, no sandboxes."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from corral._control.presets import ceiling_network
from corral._e2b.template_build import (
    BuildLog,
    PlanError,
    TarRefused,
    check_archive,
    plan_build,
    unpack_archive,
)
from corral._settings import Settings

HASH = "ab" * 32


def _step(kind: str, *args: str, **extra: Any) -> dict[str, Any]:
    return {"type": kind, "args": list(args), "force": False, **extra}


def test_steps_become_one_dockerfile_line_each() -> None:
    plan = plan_build({"fromImage": "127.0.0.1:5000/team/tools:1", "force": False, "steps": [
        _step("ENV", "A", "it's $HOME", "B", "2"),
        _step("WORKDIR", "/opt/app"),
        _step("COPY", "src/app.py", "/opt/app/", "", "", filesHash=HASH),
        _step("RUN", "echo 'a\nb' && exit 0", "root"),
        _step("USER", "user"),
    ]}, nonce="n1")
    lines = plan.dockerfile.splitlines()
    assert lines[0] == "FROM 127.0.0.1:5000/team/tools:1"
    assert lines[1] == "ENV A='it'\"'\"'s \\$HOME' B='2'"
    assert lines[2] == "WORKDIR /opt/app"
    assert json.loads(lines[3].removeprefix("COPY ")) == ["s3/src/app.py", "/opt/app/"]
    assert json.loads(lines[4].removeprefix("RUN ")) == ["/bin/sh", "-c", "echo 'a\nb' && exit 0"]
    assert lines[5] == "USER user"
    assert plan.copies == {3: HASH} and plan.notes == ()
    assert plan.step_of("Dockerfile:5: RUN ...: exited with 3") == "4"
    assert plan.step_of("Dockerfile:1: FROM x") == "base" and plan.step_of("other") is None


def test_skip_cache_puts_a_build_unique_arg_before_the_first_forced_step() -> None:
    steps = [_step("RUN", "a"), _step("RUN", "b", force=True), _step("RUN", "c", force=True)]
    plan = plan_build({"fromImage": "a/b", "steps": steps}, nonce="b42")
    lines = plan.dockerfile.splitlines()
    assert lines[2] == "ARG CORRAL_SKIP_CACHE=b42" and len(lines) == 5
    assert plan.steps == {1: "base", 2: "1", 3: "2", 4: "2", 5: "3"}
    assert plan.step_of("Dockerfile:4: RUN b: exited with 1") == "2"
    whole = plan_build({"fromImage": "a/b", "force": True, "steps": steps}, nonce="b43")
    assert whole.dockerfile.splitlines()[1] == "ARG CORRAL_SKIP_CACHE=b43"
    assert whole.dockerfile.count("ARG") == 1


def test_a_run_as_another_user_and_copy_modes_are_noted_not_hidden() -> None:
    plan = plan_build({"fromImage": "a/b", "steps": [
        _step("RUN", "true", "user"), _step("COPY", ".", "/x", "user", "0755", filesHash=HASH)]},
        nonce="n1")
    assert "run as 'user'" in plan.notes[0] and "mode" in plan.notes[1]
    assert json.loads(plan.dockerfile.splitlines()[2].removeprefix("COPY ")) == ["s2", "/x"]


@pytest.mark.parametrize(("body", "says"), [
    ({"fromTemplate": "base"}, "images only"),
    ({"fromImage": "a/b", "fromImageRegistry": {"type": "registry"}}, "CORRAL_REGISTRY_AUTH"),
    ({"fromImage": "a/b", "startCmd": "x"}, "background=True"),
    ({"fromImage": "a/b", "readyCmd": "x"}, "readyCmd"),
    ({"fromImage": "oci:/srv/layout"}, "not a registry image"),
    ({"fromImage": "docker-archive:/x.tar"}, "not a registry image"),
    ({"fromImage": "a/b\nRUN evil"}, "line breaks"),
    ({"fromImage": "a/b", "steps": [_step("ADD", "x", "y")]}, "unknown step type"),
    ({"fromImage": "a/b", "steps": [_step("ENV", "1BAD", "x")]}, "not a variable name"),
    ({"fromImage": "a/b", "steps": [_step("ENV", "A")]}, "pairs"),
    ({"fromImage": "a/b", "steps": [_step("WORKDIR", "/a\nRUN x")]}, "line breaks"),
    ({"fromImage": "a/b", "steps": [_step("WORKDIR", "$HOME")]}, "without '$'"),
    ({"fromImage": "a/b", "steps": [_step("USER", "root; rm")]}, "user name"),
    ({"fromImage": "a/b", "steps": [_step("COPY", "../x", "/y", filesHash=HASH)]},
     "inside the template"),
    ({"fromImage": "a/b", "steps": [_step("COPY", "/etc", "/y", filesHash=HASH)]},
     "inside the template"),
    ({"fromImage": "a/b", "steps": [_step("COPY", "x", "/y", filesHash="nothex")]}, "filesHash"),
    ({"fromImage": "a/b", "steps": [_step("RUN", "true", "bad user")]}, "user name"),
    ({"fromImage": "a/b", "steps": [{"type": "RUN", "args": ["x"], "extra": 1}]},
     "unknown field"),
    ({"fromImage": "a/b", "steps": [_step("RUN", "x")] * 401}, "at most"),
    ({"fromImage": "a/b", "bogus": 1}, "unknown field"),
])
def test_what_the_builder_cannot_do_is_refused_saying_why(body: dict[str, Any],
                                                          says: str) -> None:
    with pytest.raises(PlanError, match=None) as caught:
        plan_build(body, nonce="n1")
    assert says in caught.value.message


def _tar(members: list[tuple[str, bytes, str]], *, compress: bool = True) -> io.BytesIO:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, kind, target in members:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            data = b"data" if kind == tarfile.REGTYPE else b""
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    data = gzip.compress(raw.getvalue()) if compress else raw.getvalue()
    return io.BytesIO(data)


def test_a_plain_context_archive_is_kept_and_unpacked(tmp_path: Path) -> None:
    archive = _tar([("app", tarfile.DIRTYPE, ""), ("app/main.py", tarfile.REGTYPE, ""),
                    ("app/link", tarfile.SYMTYPE, "main.py"),
                    ("app/hard", tarfile.LNKTYPE, "app/main.py")])
    assert check_archive(archive) == 4
    path = tmp_path / "a.tar"
    path.write_bytes(archive.getvalue())
    unpack_archive(path, tmp_path / "out")
    assert (tmp_path / "out/app/main.py").read_bytes() == b"data"
    assert (tmp_path / "out/app/link").is_symlink()


@pytest.mark.parametrize(("members", "says"), [
    ([("../x", tarfile.REGTYPE, "")], "'..'"),
    ([("a/../../x", tarfile.REGTYPE, "")], "'..'"),
    ([("/etc/x", tarfile.REGTYPE, "")], "absolute"),
    ([("l", tarfile.SYMTYPE, "/etc")], "outside the archive"),
    ([("a/l", tarfile.SYMTYPE, "../../etc")], "outside the archive"),
    ([("l", tarfile.SYMTYPE, "sub"), ("l/x", tarfile.REGTYPE, "")], "goes through"),
    ([("h", tarfile.LNKTYPE, "../x")], "outside the archive"),
    ([("d/l", tarfile.SYMTYPE, ".."), ("e", tarfile.SYMTYPE, "d/l/..")], "through the link"),
    ([("dev", tarfile.CHRTYPE, "")], "special file"),
    ([("fifo", tarfile.FIFOTYPE, "")], "special file"),
])
def test_a_hostile_archive_is_refused_whole(members: list[tuple[str, bytes, str]],
                                            says: str) -> None:
    with pytest.raises(TarRefused) as caught:
        check_archive(_tar(members, compress=False))
    assert says in str(caught.value)


def test_what_is_not_a_tar_is_refused() -> None:
    with pytest.raises(TarRefused, match="not a readable tar"):
        check_archive(io.BytesIO(b"\x1f\x8b" + b"garbage" * 100))


def test_the_log_pages_by_offset_with_steps() -> None:
    log = BuildLog()
    plan = plan_build({"fromImage": "a/b", "steps": [_step("ENV", "A", "1"),
                                                     _step("RUN", "x")]}, nonce="n1")
    on_progress = log.progress(plan)
    on_progress("resolving a/b")
    on_progress("Dockerfile:3: RUN x")
    on_progress("  | output")
    log.add("broke", "error", "2")
    assert [e.step for e in log.page(0, 100, None)] == ["base", "2", "2", "2"]
    assert [e.message for e in log.page(1, 2, None)] == ["Dockerfile:3: RUN x", "  | output"]
    assert [e.message for e in log.page(0, 100, "error")] == ["broke"]
    assert log.page(4, 100, None) == []
    entry = log.page(0, 1, None)[0].to_e2b()
    assert set(entry) == {"timestamp", "level", "message", "step"}
    assert entry["timestamp"].endswith("+00:00")


def test_a_build_reaches_what_the_tenants_ceiling_allows_with_its_index_presets(
        tmp_path: Path) -> None:
    public = Settings(home=tmp_path)
    assert ceiling_network(public, None) is None and ceiling_network(public, ()) is None
    assert ceiling_network(public, ["pypi.org", "*.pythonhosted.org", "registry.npmjs.org"]) == {
        "allow": ["*.pythonhosted.org", "pypi.org", "registry.npmjs.org"],
        "presets": ["pypi", "npm"]}
    # pypi.org alone: pip would need files.pythonhosted.org too, so pip is not pointed at it.
    assert ceiling_network(public, ["pypi.org"]) == {"allow": ["pypi.org"]}
    mirror = Settings(home=tmp_path, index_pypi="http://mirror.test:8080/simple")
    assert ceiling_network(mirror, ["mirror.test:8080"]) == {"allow": ["mirror.test:8080"],
                                                            "presets": ["pypi"]}
