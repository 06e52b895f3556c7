from __future__ import annotations

import pytest

from corral import CommandError, PathRefused, UsageError
from corral._control import validate
from corral._control.validate import command as _validate_command
from corral._core.resources import TIERS, get_tier


def test_shell_string_runs_under_bash() -> None:
    cmd = _validate_command("echo hi | wc -c", None, None, None)
    assert cmd.argv == ["/bin/bash", "-c", "echo hi | wc -c"]
    assert cmd.cwd == "/workspace"


def test_argv_is_kept_as_is() -> None:
    cmd = _validate_command(["python3", "-c", "print(1)"], "sub/dir", {"A": "1"}, "in")
    assert cmd.argv == ["python3", "-c", "print(1)"]
    assert cmd.cwd == "/workspace/sub/dir"
    assert cmd.env == {"A": "1"}
    assert cmd.stdin == b"in"


@pytest.mark.parametrize("bad", ["", "   ", [], [""], ["ok", 3], b"echo", 42, ["a\x00b"]])
def test_malformed_commands_are_refused(bad: object) -> None:
    with pytest.raises(CommandError):
        _validate_command(bad, None, None, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("env", [{"1X": "a"}, {"A B": "a"}, {"A": 1}, {"A": "x\x00"}, {"": "a"}])
def test_bad_environment_is_refused(env: dict[str, object]) -> None:
    with pytest.raises(CommandError):
        _validate_command("true", None, env, None)  # type: ignore[arg-type]


def test_huge_environment_is_refused_with_a_clear_message() -> None:
    with pytest.raises(CommandError, match="environment is .* bytes"):
        _validate_command("true", None, {"BIG": "x" * 300_000}, None)


@pytest.mark.parametrize(("given", "kept"), [
    ("/etc", "/etc"), ("/", "/"), ("//tmp/./x/..", "/tmp"), ("/home/user/a", "/home/user/a"),
    ("a/b", "/workspace/a/b"), (None, "/workspace")])
def test_an_absolute_cwd_is_the_sandboxs_to_judge_a_relative_one_is_in_the_workspace(
        given: str | None, kept: str) -> None:
    assert _validate_command("true", given, None, None).cwd == kept


@pytest.mark.parametrize("cwd", ["../x", "/tmp\x00", "/" + "a" * 4100, "/\udcff"])
def test_a_cwd_that_is_no_path_or_leaves_the_workspace_is_refused(cwd: str) -> None:
    with pytest.raises(PathRefused):
        _validate_command("true", cwd, None, None)


def test_unknown_tier_names_the_known_ones() -> None:
    with pytest.raises(UsageError, match="large, small"):
        get_tier("huge")


def test_tiers_are_ordered_and_sane() -> None:
    small, large = TIERS["small"], TIERS["large"]
    for field in ("cpus", "memory_bytes", "pids", "disk_bytes", "tmp_bytes", "command_timeout_s"):
        assert getattr(small, field) < getattr(large, field)
    for tier in TIERS.values():
        assert tier.tmp_bytes < tier.memory_bytes
        assert tier.ttl_s <= tier.max_ttl_s


def test_uid_range_must_fit_a_signed_int() -> None:
    from pydantic import ValidationError

    from corral._settings import Settings

    with pytest.raises(ValidationError, match="goes past"):
        Settings(home="/tmp/x", uid_start=2_147_000_000, uid_count=1_000_000)
    assert Settings(home="/tmp/x", uid_start=2_000_000_000, uid_count=1000).uid_count == 1000


def test_a_cwd_under_home_user_stays_there() -> None:
    # /home/user is the workspace's second mount (E2B's home): `pwd` must say so.
    assert validate.command("pwd", "/home/user", None, None).cwd == "/home/user"
    assert validate.command("pwd", "/home/user/a/./b", None, None).cwd == "/home/user/a/b"
    assert validate.command("pwd", "/home/user/../etc", None, None).cwd == "/home/etc"
