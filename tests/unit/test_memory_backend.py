"""The in-memory backend of ``corral.testing``: the backend protocol without root, and the
workspace code (archives) running over its ``WorkspaceFS``."""

from __future__ import annotations

import io

import pytest

from corral._workspace.archive import create_tar, extract_tar
from corral.backends import ExecRequest
from corral.errors import FileError, FileNotFound, PathRefused
from corral.testing.backend import MemoryBackend, spec_for


@pytest.fixture
def backend() -> MemoryBackend:
    return MemoryBackend()


def run(backend: MemoryBackend, spec_id: str, command: str, **kw: object) -> object:
    request = ExecRequest(argv=["/bin/bash", "-c", command], cwd="/workspace", env={},
                          timeout_s=float(kw.pop("timeout", 5.0)), **kw)  # type: ignore[arg-type]
    return backend.exec(spec_for(spec_id), request)


def test_commands_stream_exit_and_refuse_unknown_programs(backend: MemoryBackend) -> None:
    spec = spec_for("sbx_a")
    backend.create(spec)
    live: list[str] = []
    out = run(backend, spec.id, "echo hi; echo $CORRAL_SANDBOX_ID; exit 3", on_stdout=live.append)
    assert (out.exit_code, out.stdout) == (3, f"hi\n{spec.id}\n")  # type: ignore[attr-defined]
    assert "".join(live) == out.stdout  # type: ignore[attr-defined]
    missing = run(backend, spec.id, "nosuchprog")
    assert missing.exit_code == 127  # type: ignore[attr-defined]
    assert missing.stderr == "corral: command not found: nosuchprog\n"  # type: ignore[attr-defined]
    slow = run(backend, spec.id, "sleep 5", timeout=0.05)
    assert slow.timed_out and slow.exit_code == 124  # type: ignore[attr-defined]


def test_output_is_capped_with_the_host_tiers_marker(backend: MemoryBackend) -> None:
    spec = spec_for("sbx_b")
    backend.create(spec)
    live: list[str] = []
    out = run(backend, spec.id, "echo 0123456789", output_limit_bytes=4, on_stdout=live.append)
    marker = "[corral: stdout truncated after 4 bytes; the rest is dropped]\n"
    assert out.stdout == "".join(live) == "0123\n" + marker  # type: ignore[attr-defined]
    assert out.stdout_truncated == 7  # type: ignore[attr-defined]


def test_files_keep_the_workspace_rules(backend: MemoryBackend) -> None:
    spec = spec_for("sbx_c")
    backend.create(spec)
    fs = backend.files(spec)
    assert fs.write("a/b.txt", b"data").path == "/workspace/a/b.txt"
    assert fs.read("/workspace/a/b.txt") == b"data"
    assert [e.name for e in fs.list("a")] == ["b.txt"]
    assert fs.make_dir("a") is False and fs.make_dir("c/d") is True
    fs.rename("a/b.txt", "c/d/e.txt")
    assert not fs.exists("a/b.txt") and fs.stat("c/d/e.txt").size == 4
    with pytest.raises(PathRefused):
        fs.read("../etc/passwd")
    with pytest.raises(PathRefused):
        fs.read("/etc/shadow")
    with pytest.raises(FileNotFound):
        fs.read("nope")
    with pytest.raises(FileError):
        fs.read("c")
    fs.remove("c")
    assert not fs.exists("c/d/e.txt")
    # Commands and files see one workspace.
    run(backend, spec.id, "echo from-a-command > out.txt")
    assert fs.read("out.txt") == b"from-a-command\n"
    assert run(backend, spec.id, "cat out.txt").stdout == "from-a-command\n"  # type: ignore[attr-defined]


def test_archives_round_trip_over_the_protocol(backend: MemoryBackend) -> None:
    src, dst = spec_for("sbx_d"), spec_for("sbx_e")
    backend.create(src)
    backend.create(dst)
    fs = backend.files(src)
    fs.write("tree/x.bin", bytes(range(256)) * 300)
    fs.write("tree/sub/y.txt", b"y")
    fs.symlink("tree/link", "x.bin")
    archive = b"".join(create_tar(fs, "tree", max_bytes=1 << 20))
    report = extract_tar(backend.files(dst), "copy", io.BytesIO(archive), max_bytes=1 << 20)
    other = backend.files(dst)
    assert other.read("copy/x.bin") == bytes(range(256)) * 300
    assert other.read("copy/sub/y.txt") == b"y"
    assert other.stat("copy/link").type == "symlink"
    assert (report.files, report.symlinks) == (2, 1)


def test_seal_reset_and_sweep(backend: MemoryBackend) -> None:
    spec = spec_for("sbx_f")
    backend.create(spec)
    backend.files(spec).write("kept", b"1")
    sealed = backend.seal_workspace(spec, "lyr_1")
    assert sealed.layers == ("lyr_1",) and backend.layer_ids() == ["lyr_1"]
    backend.files(spec).write("later", b"2")
    on_layer = spec_for(spec.id, layers=sealed.layers)
    backend.reset_workspace(on_layer)
    assert backend.files(on_layer).exists("kept") and not backend.files(on_layer).exists("later")
    gone = backend.sweep(set())
    assert [str(item) for item in gone] == [f"workspace {spec.id}"]
    assert backend.sweep({"other"}) == []
    backend.destroy(spec)  # idempotent on a swept sandbox
    assert backend.allocate_uid({100_000, 100_001}) == 100_002
