"""A command's parts are validated alone (the request models' field rules) with the same rule,
and the same words, as the whole command."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from corral._control import validate
from corral.errors import CorralError


def _refusal(check: Callable[[], object]) -> tuple[type[CorralError], str]:
    with pytest.raises(CorralError) as caught:
        check()
    return type(caught.value), str(caught.value)


@pytest.mark.parametrize(("part", "value", "whole"), [
    (validate.command_argv, "  ", lambda v: validate.command(v, None, None, None)),
    (validate.command_argv, ["a", 1], lambda v: validate.command(v, None, None, None)),
    (validate.command_env, {"1A": "x"}, lambda v: validate.command("true", None, v, None)),
    (validate.command_env, {"A": "x\x00"}, lambda v: validate.command("true", None, v, None)),
    (validate.command_cwd, "../out", lambda v: validate.command("true", v, None, None)),
    (validate.command_cwd, "/a\x00", lambda v: validate.command("true", v, None, None)),
    (validate.command_stdin, 5, lambda v: validate.command("true", None, None, v)),
])
def test_a_part_refuses_as_the_whole_command_does(
        part: Callable[[Any], object], value: Any, whole: Callable[[Any], object]) -> None:
    assert _refusal(lambda: part(value)) == _refusal(lambda: whole(value))


def test_the_whole_command_is_its_parts() -> None:
    cmd = validate.command("ls", "sub", {"A": "1"}, "in")
    assert (cmd.argv, cmd.cwd, cmd.env, cmd.stdin) == (
        validate.command_argv("ls"), validate.command_cwd("sub"),
        validate.command_env({"A": "1"}), validate.command_stdin("in"))
