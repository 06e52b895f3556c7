"""A normal Linux view with the same guarantees (issue 37): a command may start in any directory
that exists in the sandbox, and ``/tmp`` lives as long as the sandbox, size-limited and counted
against the sandbox's own memory, never the host's disk. Real sandboxes on every tier; the
attacks are bounded (the largest write is the tier's /tmp limit plus 16 MiB)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import CommandError, Sandbox
from corral._core.resources import get_tier

from . import conftest as integration

pytestmark = pytest.mark.needs_root

isolation = integration.isolation_all


@pytest.fixture
def sandbox(home: str, isolation: str) -> Iterator[Sandbox]:
    sb = Sandbox.create(home=home, isolation=isolation)
    yield sb
    sb.kill()


@pytest.mark.parametrize("cwd", ["/", "/tmp", "/workspace", "/home/user", "/usr/bin"])
def test_a_command_starts_in_any_directory_that_exists(sandbox: Sandbox, cwd: str) -> None:
    r = sandbox.commands.run("pwd", cwd=cwd)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == cwd


def test_a_missing_working_directory_is_refused_inside_the_sandbox(sandbox: Sandbox) -> None:
    # /etc/corral-nope does not exist in the sandbox; whether the host has one is beside the
    # point (the check is the sandbox's chdir, not a look at the host).
    for cwd in ("/nope-corral", "/tmp/not-made", "/workspace/not-made"):
        with pytest.raises(CommandError, match="working directory"):
            sandbox.commands.run("pwd", cwd=cwd)


def test_a_refused_cwd_streams_nothing_and_a_command_saying_the_same_keeps_its_words(
        sandbox: Sandbox) -> None:
    streamed: list[str] = []
    with pytest.raises(CommandError, match="cannot enter the working directory /nope"):
        sandbox.commands.run("true", cwd="/nope", on_stderr=streamed.append)
    assert streamed == []  # nothing of the runtime's own on the command's stream
    # A command that prints the runtime's words itself ran: they are its output.
    for _ in range(2):  # the first command and the later ones may take different paths
        said = "bwrap: Can't chdir to /tmp: not really"
        r = sandbox.commands.run(f"echo \"{said}\" >&2; echo ran", cwd="/tmp")
        assert (r.exit_code, r.stdout, r.stderr) == (0, "ran\n", said + "\n")


def test_outside_the_two_places_nothing_is_writable_from_any_cwd(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("touch here 2>&1; mkdir -p -- /workspace && echo ok", cwd="/")
    assert "Read-only file system" in r.stdout or "Permission denied" in r.stdout, r.stdout
    assert r.stdout.strip().endswith("ok")  # OpenAI Agents' session start: `mkdir -p -- /workspace`
    assert not os.path.exists("/here")


def test_a_file_left_in_tmp_is_read_by_the_next_commands(sandbox: Sandbox) -> None:
    # Tools installed by one command and run by the next (OpenAI Agents' apply_patch helpers).
    r = sandbox.commands.run("mkdir -p /tmp/tools/bin && printf '#!/bin/sh\\necho helper $1\\n' "
                             "> /tmp/tools/bin/h && chmod +x /tmp/tools/bin/h")
    assert r.exit_code == 0, r.stderr
    for n in range(3):  # the first command and the later ones may take different paths
        r = sandbox.commands.run(f"/tmp/tools/bin/h {n}", cwd="/tmp/tools")
        assert (r.exit_code, r.stdout.strip()) == (0, f"helper {n}"), r.stderr


def test_tmp_over_its_limit_is_enospc_inside_and_nothing_outside(sandbox: Sandbox,
                                                                  isolation: str,
                                                                  home: str) -> None:
    limit_mib = get_tier(sandbox.get_info().resources).tmp_bytes >> 20
    r = sandbox.commands.run(
        f"dd if=/dev/zero of=/tmp/fill bs=1M count={limit_mib + 16} 2>&1; "
        "echo still-running; ls -s --block-size=1M /tmp/fill", timeout=60)
    assert "No space left on device" in r.stdout, r.stdout
    assert "still-running" in r.stdout
    held_mib = int(r.stdout.strip().splitlines()[-1].split()[0])
    assert limit_mib - 2 <= held_mib <= limit_mib, r.stdout
    # The sandbox's own tmpfs holds it (memory, its limit), not the data disk or the host's /tmp.
    if isolation != "microvm":  # there, the guest's own tmpfs in the VM's memory
        scratch = os.statvfs(Path(home) / "sandboxes" / sandbox.id / "scratch" / "tmp")
        assert scratch.f_blocks * scratch.f_frsize == limit_mib << 20
        assert (scratch.f_blocks - scratch.f_bfree) * scratch.f_frsize >= (limit_mib - 2) << 20
    assert not os.path.exists("/tmp/fill")
    # Still the sandbox's to free: the next command removes it and writes again.
    r = sandbox.commands.run("rm /tmp/fill && echo x > /tmp/small && cat /tmp/small")
    assert r.stdout.strip() == "x", r.stderr


def test_tmp_is_emptied_by_a_restore_and_is_not_another_sandboxs(sandbox: Sandbox,
                                                                   home: str,
                                                                   isolation: str) -> None:
    sandbox.commands.run("echo before > /tmp/a && echo w > /workspace/w")
    snap = sandbox.snapshot()
    sandbox.commands.run("echo after > /tmp/b")
    other = Sandbox.create(home=home, isolation=isolation)
    try:
        r = other.commands.run("ls -A /tmp")
        assert r.stdout.split() == [], r.stdout
    finally:
        other.kill()
    if isolation != "microvm":  # a microVM's disk snapshot restarts its VM, /tmp with it
        r = sandbox.commands.run("cat /tmp/a /tmp/b")
        assert r.stdout.split() == ["before", "after"], r.stderr
    sandbox.restore(snap)
    r = sandbox.commands.run("ls -A /tmp; cat /workspace/w")
    assert r.stdout.split() == ["w"], r.stdout


def test_tmp_goes_with_its_sandbox(home: str, isolation: str) -> None:
    sb = Sandbox.create(home=home, isolation=isolation)
    sb.commands.run("echo x > /tmp/x")
    scratch = Path(home) / "sandboxes" / sb.id / "scratch"
    sb.kill()
    assert not scratch.exists()
    with open("/proc/self/mountinfo") as f:
        assert sb.id not in f.read()
