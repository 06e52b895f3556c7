"""`corral ports` and `corral volumes`, and `--volume` / `--data` on `create` and `run`, driven as
a user would: a separate process per command, exit codes, --json, embedded on the session's data
directory. The port URLs the CLI prints are reached through a real proxy (the API server of the
same data directory) to show they are the right ones."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral import Sandbox
from corral._settings import Settings

from .servers import Server

pytestmark = pytest.mark.needs_root

Run = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture
def corral(settings: Settings, home: str) -> Iterator[Run]:
    env = {**os.environ, "CORRAL_HOME": str(settings.home),
           "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    # Embedded, the CLI cannot know where `corral serve` answers unless told.
    env.pop("CORRAL_PORTS_URL", None)
    env.pop("CORRAL_URL", None)

    def run(*args: str, extra_env: dict[str, str] | None = None,
            stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "corral", *args],
                              env={**env, **(extra_env or {})}, input=stdin,
                              capture_output=True, text=True, timeout=120)

    return run


@pytest.fixture
def volume(corral: Run) -> Iterator[str]:
    """A fresh volume's name, deleted after the test (the session's cleanup keeps volumes)."""
    name = f"cli-{secrets.token_hex(4)}"
    made = corral("volumes", "create", name, "--size", "32M")
    assert made.returncode == 0, made.stderr
    yield name
    corral("volumes", "rm", name)


def _sandbox(corral: Run, *args: str) -> dict[str, Any]:
    made = corral("create", "--json", "--ttl", "600", *args)
    assert made.returncode == 0, made.stderr
    return dict(json.loads(made.stdout))


# -- volumes ---------------------------------------------------------------------------------


def test_volume_lifecycle_with_json_and_tables(corral: Run) -> None:
    name = f"cli-{secrets.token_hex(4)}"
    made = corral("volumes", "create", name, "--size", "32M", "--json")
    assert made.returncode == 0, made.stderr
    info = json.loads(made.stdout)
    try:
        assert info["name"] == name and info["id"].startswith("vol_")
        assert info["size_bytes"] == 32 * 2**20
        assert info["mounted_by"] == [] and info["writer"] is None
        assert set(info) == {"id", "name", "size_bytes", "used_bytes", "created_at",
                             "mounted_by", "writer"}

        listed = corral("volumes", "ls", "--json")
        assert listed.returncode == 0, listed.stderr
        assert info["id"] in {v["id"] for v in json.loads(listed.stdout)}
        table = corral("volumes", "ls")
        assert table.returncode == 0, table.stderr
        header, *rows = table.stdout.splitlines()
        assert header.split()[:4] == ["NAME", "ID", "SIZE", "USED"]
        (row,) = [r for r in rows if r.split()[0] == name]
        assert info["id"] in row and "32.0 MiB" in row

        by_name = json.loads(corral("volumes", "info", name, "--json").stdout)
        by_id = json.loads(corral("volumes", "info", info["id"], "--json").stdout)
        assert by_name["id"] == by_id["id"] == info["id"]
        shown = corral("volumes", "info", name)
        assert shown.returncode == 0, shown.stderr
        lines = dict(line.split(None, 1) for line in shown.stdout.splitlines()
                     if not line.startswith("mounted"))
        assert lines["name"] == name and lines["size"] == "32.0 MiB"

        # A second volume of the same name is refused.
        again = corral("volumes", "create", name, "--json")
        assert again.returncode == 2, again.stderr
        assert "Traceback" not in again.stderr
    finally:
        removed = corral("volumes", "rm", name, "--json")
    assert removed.returncode == 0, removed.stderr
    assert json.loads(removed.stdout) == {"removed": [name]}
    gone = corral("volumes", "info", name, "--json")
    assert gone.returncode == 4
    assert json.loads(gone.stderr)["code"] == "volume_not_found"
    twice = corral("volumes", "rm", name)
    assert twice.returncode == 4 and "no volume" in twice.stderr


def test_volumes_create_prints_the_id(corral: Run) -> None:
    name = f"cli-{secrets.token_hex(4)}"
    made = corral("volumes", "create", name)  # the default size
    try:
        assert made.returncode == 0, made.stderr
        volume_id = made.stdout.strip()
        assert volume_id.startswith("vol_")
        info = json.loads(corral("volumes", "info", volume_id, "--json").stdout)
        assert info["name"] == name and info["size_bytes"] == 2**30
    finally:
        corral("volumes", "rm", name)


@pytest.mark.parametrize(("args", "needle"), [
    (("Not A Name",), "invalid volume name"),
    (("vol_000000000000",), "invalid volume name"),
    (("ok-name", "--size", "lots"), "a volume size is bytes"),
    (("ok-name", "--size", "1K"), "size must be from 16M"),
])
def test_bad_volumes_are_refused_clearly(corral: Run, args: tuple[str, ...],
                                         needle: str) -> None:
    done = corral("volumes", "create", *args)
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr and "Traceback" not in done.stderr
    assert "ok-name" not in corral("volumes", "ls").stdout


def test_a_mounted_volume_keeps_its_files_and_refuses_rm(corral: Run, volume: str) -> None:
    info = _sandbox(corral, "--volume", f"{volume}:/mnt/data")
    sandbox_id = info["id"]
    try:
        (mount,) = info["mounts"]
        assert mount["kind"] == "volume" and mount["target"] == "/mnt/data"
        assert mount["read_only"] is False
        wrote = corral("exec", sandbox_id, "--", "echo kept > /mnt/data/note")
        assert wrote.returncode == 0, wrote.stderr

        held = json.loads(corral("volumes", "info", volume, "--json").stdout)
        assert held["mounted_by"] == [sandbox_id] and held["writer"] == sandbox_id
        assert held["used_bytes"] is not None and held["used_bytes"] > 0
        assert f"{sandbox_id} (rw)" in corral("volumes", "ls").stdout

        refused = corral("volumes", "rm", volume)
        assert refused.returncode == 1
        assert "mounted by sandbox" in refused.stderr and sandbox_id in refused.stderr
        assert "Traceback" not in refused.stderr
        refused_json = corral("volumes", "rm", volume, "--json")
        assert refused_json.returncode == 1
        assert json.loads(refused_json.stderr)["code"] == "volume_in_use"

        # One writer or many readers: a second writer, or a reader beside it, is refused.
        for spec in (f"{volume}:/mnt/data", f"{volume}:/mnt/data:ro"):
            second = corral("create", "--json", "--volume", spec)
            assert second.returncode == 1, second.stderr
            error = json.loads(second.stderr)
            assert error["code"] == "volume_in_use" and sandbox_id in error["message"]
            assert "one writer" in error["message"]
    finally:
        assert corral("rm", sandbox_id).returncode == 0

    # The files outlived the sandbox; read-only, the next one sees them and cannot write.
    read = corral("run", "--json", "--volume", f"{volume}:/mnt/data:ro", "--",
                  "cat /mnt/data/note; echo x > /mnt/data/other")
    result = json.loads(read.stdout)
    assert result["stdout"] == "kept\n"
    assert "Read-only file system" in result["stderr"] and result["exit_code"] != 0
    free = json.loads(corral("volumes", "info", volume, "--json").stdout)
    assert free["mounted_by"] == [] and free["writer"] is None


def test_many_readers_share_a_volume(corral: Run, volume: str) -> None:
    wrote = corral("run", "--volume", f"{volume}:/mnt/v", "--", "echo shared > /mnt/v/f")
    assert wrote.returncode == 0, wrote.stderr
    readers = [_sandbox(corral, "--volume", f"{volume}:/workspace/v:ro")["id"]
               for _ in range(2)]
    try:
        for sandbox_id in readers:
            seen = corral("exec", sandbox_id, "--", "cat v/f")
            assert seen.stdout == "shared\n", seen.stderr
        held = json.loads(corral("volumes", "info", volume, "--json").stdout)
        assert sorted(held["mounted_by"]) == sorted(readers) and held["writer"] is None
        writer = corral("create", "--volume", f"{volume}:/mnt/v")
        assert writer.returncode == 1 and "one writer" in writer.stderr
    finally:
        corral("rm", *readers)


@pytest.mark.parametrize(("option", "value", "needle"), [
    ("--volume", "cache", "'cache' is not NAME:/mnt/PATH[:ro]"),
    ("--volume", ":/mnt/x", "names no volume"),
    ("--volume", "cache:mnt/x", "must be an absolute path"),
    ("--volume", "cache:/mnt/x:rx", "ro (read-only) or rw"),
    ("--volume", "cache:/mnt/x:ro:more", "too many ':'"),
    ("--data", "refs", "'refs' is not NAME:/mnt/PATH"),
    ("--data", "refs:/mnt/refs:rw", "data mounts are always read-only"),
])
@pytest.mark.parametrize("command", ["create", "run"])
def test_bad_mount_syntax_is_a_usage_error_before_any_sandbox(
        corral: Run, home: str, command: str, option: str, value: str, needle: str) -> None:
    before = {i.id for i in Sandbox.list(home=home)}
    done = corral(command, option, value, *(("--", "true") if command == "run" else ()))
    assert done.returncode == 2, done.stderr
    assert f"Invalid value for '{option}'" in done.stderr and needle in done.stderr
    assert {i.id for i in Sandbox.list(home=home)} == before


def test_a_volume_given_twice_is_refused(corral: Run) -> None:
    done = corral("create", "--volume", "a:/mnt/a", "--volume", "a:/mnt/b")
    assert done.returncode == 2 and "given twice" in done.stderr


@pytest.mark.parametrize(("spec", "code", "needle"), [
    ("no-such-volume:/mnt/x", 4, "no volume 'no-such-volume'"),
    ("{volume}:/etc/x", 2, "under /mnt/ or /workspace/"),
    ("{volume}:/mnt/../etc", 2, "mount point"),
])
def test_mount_refusals_from_the_control_plane(corral: Run, volume: str, spec: str, code: int,
                                               needle: str) -> None:
    done = corral("create", "--volume", spec.format(volume=volume))
    assert done.returncode == code, done.stderr
    assert needle in done.stderr and "Traceback" not in done.stderr


def test_data_mounts_are_the_operators_and_read_only(corral: Run) -> None:
    data = Path(tempfile.mkdtemp(prefix="corral-test-data-"))
    try:
        data.chmod(0o755)  # the sandbox's uid reads it as "other"
        (data / "ref.txt").write_text("reference\n")
        (data / "ref.txt").chmod(0o644)
        approved = {"CORRAL_DATA_MOUNTS": f"refs={data}"}
        read = corral("run", "--json", "--data", "refs:/mnt/refs", "--",
                      "cat /mnt/refs/ref.txt; touch /mnt/refs/new", extra_env=approved)
        result = json.loads(read.stdout)
        assert result["stdout"] == "reference\n", read.stderr
        assert result["exit_code"] != 0 and "Read-only file system" in result["stderr"]
        assert not (data / "new").exists()
        unknown = corral("run", "--data", "other:/mnt/o", "--", "true", extra_env=approved)
        assert unknown.returncode == 1
        assert "not a data mount the operator approved" in unknown.stderr
    finally:
        shutil.rmtree(data, ignore_errors=True)


# -- ports -----------------------------------------------------------------------------------


def _lines(text: str) -> dict[str, str]:
    """`ports expose`'s aligned ``key  value`` lines."""
    return dict(line.split(None, 1) for line in text.splitlines() if line.strip())


def _wait_served(url: str, token: str) -> httpx.Response:
    deadline = time.monotonic() + 20
    while True:
        answer = httpx.get(url, headers={"X-Corral-Port-Token": token})
        if answer.status_code != 502:  # 502: the server in the sandbox is not listening yet
            return answer
        assert time.monotonic() < deadline, "the server in the sandbox never listened"
        time.sleep(0.1)


def test_ports_expose_ls_rm_and_the_printed_url_works(corral: Run, home: str,
                                                      server: Server) -> None:
    sandbox_id = _sandbox(corral)["id"]
    served = {"CORRAL_PORTS_URL": server.url}
    try:
        sb = Sandbox.connect(sandbox_id, home=home)
        sb.files.write("index.html", "hello through the proxy\n")
        sb.processes.start(["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1"])

        shown = corral("ports", "expose", sandbox_id, "8000", extra_env=served)
        assert shown.returncode == 0, shown.stderr
        lines = _lines(shown.stdout)
        url = f"{server.url}/ports/{sandbox_id}/8000/"
        assert lines["url"] == url
        assert lines["token"].startswith("cpt_")
        assert lines["signed_url"].startswith(url + "?corral_expires=")
        assert lines["access"].startswith("private")
        keys = [line.split()[0] for line in shown.stdout.splitlines()]
        assert keys[:3] == ["port", "access", "url"] and "token" in keys
        widths = {len(line) - len(line[len(line.split()[0]):].lstrip())
                  for line in shown.stdout.splitlines()}
        assert len(widths) == 1  # aligned: every value starts in the same column

        answer = _wait_served(url + "index.html", lines["token"])
        assert answer.status_code == 200 and answer.text == "hello through the proxy\n"
        assert httpx.get(url + "index.html").status_code == 401  # private: no token, no entry

        # --json, again: the same token; --public lets anyone in; the link TTL is honoured.
        before = time.time()
        again = corral("ports", "expose", sandbox_id, "8000", "--public", "--link-ttl", "60",
                       "--json", extra_env=served)
        assert again.returncode == 0, again.stderr
        port = json.loads(again.stdout)
        assert set(port) == {"sandbox_id", "port", "public", "url", "host_url", "token",
                             "signed_url", "signed_expires_at"}
        assert port["token"] == lines["token"] and port["public"] is True
        assert port["url"] == url and port["sandbox_id"] == sandbox_id and port["port"] == 8000
        assert before + 55 <= port["signed_expires_at"] <= time.time() + 61
        assert httpx.get(url + "index.html").status_code == 200

        corral("ports", "expose", sandbox_id, "9000", extra_env=served)
        listed = corral("ports", "ls", sandbox_id, "--json", extra_env=served)
        assert listed.returncode == 0, listed.stderr
        assert [(p["port"], p["public"]) for p in json.loads(listed.stdout)] == [
            (8000, True), (9000, False)]
        table = corral("ports", "ls", sandbox_id, extra_env=served)
        header, *rows = table.stdout.splitlines()
        assert header.split() == ["PORT", "ACCESS", "URL", "TOKEN"]
        assert [r.split()[:2] for r in rows] == [["8000", "public"], ["9000", "private"]]

        removed = corral("ports", "rm", sandbox_id, "8000", "--json")
        assert removed.returncode == 0, removed.stderr
        assert json.loads(removed.stdout) == {"sandbox_id": sandbox_id, "unexposed": [8000]}
        assert httpx.get(url + "index.html",
                         headers={"X-Corral-Port-Token": lines["token"]}).status_code == 404
        alias = corral("ports", "unexpose", sandbox_id, "9000")
        assert alias.returncode == 0, alias.stderr
        empty = corral("ports", "ls", sandbox_id)
        assert empty.returncode == 0 and empty.stdout == "" and "no exposed ports" in empty.stderr
        assert corral("ports", "rm", sandbox_id, "9000").returncode == 0  # idempotent
    finally:
        corral("rm", sandbox_id)


def test_ports_expose_embedded_without_a_service_url(corral: Run) -> None:
    sandbox_id = _sandbox(corral)["id"]
    try:
        shown = corral("ports", "expose", sandbox_id, "8080")
        assert shown.returncode == 0, shown.stderr
        lines = _lines(shown.stdout)
        assert lines["token"].startswith("cpt_")
        assert "CORRAL_PORTS_URL" in lines["url"]  # says how to get one
        assert "signed_url" not in lines
        port = json.loads(corral("ports", "expose", sandbox_id, "8080", "--json").stdout)
        assert port["url"] is None and port["token"] == lines["token"]
    finally:
        corral("rm", sandbox_id)


@pytest.mark.parametrize(("args", "code", "needle"), [
    (("expose", "{id}", "0"), 2, "0 is not in the range 1<=x<=65535"),
    (("expose", "{id}", "http"), 2, "'http' is not a valid integer"),
    (("expose", "{id}", "80", "--link-ttl", "0"), 2, "--link-ttl"),
    (("expose", "{id}", "80", "--link-ttl", "9999999"), 2, "link_ttl must be more than 0"),
    (("expose", "sbx_000000000000", "80"), 4, "does not exist"),
    (("ls", "sbx_000000000000"), 4, "does not exist"),
    (("rm", "{id}"), 2, "Missing argument 'PORT...'"),
])
def test_bad_port_input_gives_a_clear_error(corral: Run, args: tuple[str, ...], code: int,
                                            needle: str) -> None:
    sandbox_id = _sandbox(corral)["id"]
    try:
        done = corral("ports", *(a.format(id=sandbox_id) for a in args))
        assert done.returncode == code, done.stderr
        assert needle in done.stderr and "Traceback" not in done.stderr
    finally:
        corral("rm", sandbox_id)


@pytest.mark.parametrize("command", [["ports"], ["ports", "expose"], ["ports", "ls"],
                                     ["ports", "rm"], ["volumes"], ["volumes", "create"],
                                     ["volumes", "ls"], ["volumes", "info"], ["volumes", "rm"]])
def test_help_is_available(corral: Run, command: list[str]) -> None:
    done = corral(*command, "--help")
    assert done.returncode == 0 and "Usage:" in done.stdout


def test_help_says_what_matters() -> None:
    from click.testing import CliRunner

    from corral._cli.main import cli

    def help_of(*command: str) -> str:
        done = CliRunner().invoke(cli, [*command, "--help"])
        assert done.exit_code == 0, done.output
        return " ".join(done.output.split())

    ports = help_of("ports")
    assert "private by default" in ports and "X-Corral-Port-Token" in ports
    assert "--public" in help_of("ports", "expose")
    assert "one writer or any number of readers" in help_of("volumes")
    create = help_of("create")
    assert "--volume NAME:/mnt/PATH[:ro]" in create and "--data NAME:/mnt/PATH" in create
    assert "one writer or any number of readers" in create
