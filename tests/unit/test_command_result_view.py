"""A command's result has one JSON form: the REST API answers it, the CLI's ``--json`` prints
it, and the SDK's reader turns it back into the same ``CommandResult``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from corral._sdk._wire import command_result
from corral.models import CommandResult, Usage

_RESULT = CommandResult(
    exit_code=3, stdout="out\n", stderr="err\n", timed_out=False, duration_s=0.25,
    usage=Usage(wall_s=0.25, cpu_s=0.01, peak_memory_bytes=4096, oom_killed=False),
    stdout_truncated=7, stderr_truncated=0, command_id="cmd_0123456789ab",
    stdout_bytes=b"out\n", stderr_bytes=b"err\n")


def test_its_keys_are_the_documented_ones() -> None:
    assert list(_RESULT.to_dict()) == [
        "exit_code", "stdout", "stderr", "timed_out", "duration_s", "usage",
        "stdout_truncated", "stderr_truncated", "command_id"]
    assert list(_RESULT.to_dict(exact_bytes=True))[-2:] == ["stdout_b64", "stderr_b64"]


@pytest.mark.parametrize("exact_bytes", [False, True])
def test_the_sdk_reads_back_what_was_written(exact_bytes: bool) -> None:
    wire = json.loads(json.dumps(_RESULT.to_dict(exact_bytes=exact_bytes)))
    expected = _RESULT if exact_bytes else dataclasses.replace(
        _RESULT, stdout_bytes=None, stderr_bytes=None)
    assert command_result(wire) == expected


def test_duration_is_kept_to_the_microsecond() -> None:
    result = CommandResult(exit_code=0, stdout="", stderr="", timed_out=False,
                           duration_s=0.1234567891, usage=_RESULT.usage)
    assert result.to_dict()["duration_s"] == 0.123457


def test_bytes_not_captured_are_sent_empty() -> None:
    result = CommandResult(exit_code=0, stdout="", stderr="", timed_out=False,
                           duration_s=1.0, usage=_RESULT.usage)
    data = result.to_dict(exact_bytes=True)
    assert (data["stdout_b64"], data["stderr_b64"]) == ("", "")
