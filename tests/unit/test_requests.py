"""The request models: each refusal is the control plane rule's own error and words, and a
request of the wrong shape is one ``InvalidRequestError`` naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from corral._control import requests
from corral._control.requests import (
    CreateSandbox,
    Fork,
    Restore,
    RunCommand,
    SetTimeout,
    StartProcess,
    TakeSnapshot,
)
from corral.errors import CommandError, CorralError, InvalidRequestError, PathRefused, UsageError

REFUSED: list[tuple[type[requests.Request], dict[str, Any], type[CorralError], str]] = [
    (SetTimeout, {"timeout": "5"}, UsageError,
     "timeout must be a positive number of seconds, got '5'"),
    (SetTimeout, {"timeout": True}, UsageError, "positive number of seconds, got True"),
    (SetTimeout, {"timeout": -1}, UsageError, "positive number of seconds, got -1"),
    (SetTimeout, {}, InvalidRequestError, "timeout: required"),
    (Restore, {"snapshot": ""}, UsageError, "a snapshot is named by its id or name"),
    (Restore, {"snapshot": 7}, UsageError, "a snapshot is named by its id or name, not 7"),
    (TakeSnapshot, {"name": "snap_0123456789ab"}, UsageError, "not shaped like a snapshot id"),
    (Fork, {"count": 0}, UsageError, "count must be an integer from 1 to 64, not 0"),
    (Fork, {"count": 2, "memory": "yes"}, InvalidRequestError, "memory: Input should be a valid"),
    (RunCommand, {"cmd": ""}, CommandError, "the command is empty"),
    (RunCommand, {"cmd": ["ls", 3]}, CommandError, "argv[1] is int, not str"),
    (RunCommand, {"cmd": "ls", "cwd": "../.."}, PathRefused, ""),
    (RunCommand, {"cmd": "ls", "envs": {"1A": "x"}}, CommandError,
     "invalid environment variable name '1A'"),
    (RunCommand, {"command": "ls"}, InvalidRequestError, "did you mean 'cmd'?"),
    (StartProcess, {"cmd": "ls", "workdir": "/tmp"}, InvalidRequestError, "did you mean 'cwd'?"),
    (CreateSandbox, {"resources": "huge"}, UsageError, "unknown resource tier 'huge'"),
    (CreateSandbox, {"isolation": "docker"}, UsageError, "unknown isolation tier 'docker'"),
    (CreateSandbox, {"labels": {"a b": "x"}}, UsageError, "invalid label name 'a b'"),
    (CreateSandbox, {"secrets": "TOKEN"}, UsageError, "not a single string"),
    (CreateSandbox, {"idle_timeout": 0}, UsageError, "idle_timeout must be a positive"),
]


@pytest.mark.parametrize(("model", "data", "error", "words"), REFUSED,
                         ids=[f"{m.__name__}-{sorted(d)}" for m, d, _, _ in REFUSED])
def test_a_refusal_is_the_control_plane_s_own_error(
        model: type[requests.Request], data: dict[str, Any], error: type[CorralError],
        words: str) -> None:
    with pytest.raises(CorralError) as refused:
        model.parse(data)
    assert type(refused.value) is error
    assert words in refused.value.message


def test_what_passes_is_kept_as_given() -> None:
    run = RunCommand.parse({"cmd": "echo hi", "envs": {"A": "1"}, "cwd": "sub", "timeout": 5})
    assert (run.cmd, run.envs, run.cwd, run.timeout) == ("echo hi", {"A": "1"}, "sub", 5)
    assert CreateSandbox.parse({}).resources == "small"
    assert Fork.parse({}).count == 1
    with pytest.raises(ValidationError, match="frozen"):
        run.cmd = "other"  # type: ignore[misc]


def test_a_non_object_is_refused_clearly() -> None:
    with pytest.raises(InvalidRequestError, match="must be a JSON object, not list"):
        SetTimeout.parse([600])


def test_the_schema_shows_the_types_the_rules_accept() -> None:
    props = RunCommand.model_json_schema()["properties"]
    assert {"type": "string", "minLength": 1} in props["cmd"]["anyOf"]
    assert SetTimeout.model_json_schema()["properties"]["timeout"]["type"] == "number"
    assert Fork.model_json_schema()["properties"]["count"]["maximum"] == 64
    assert {"cmd", "timeout", "snapshot", "count"} <= requests.request_fields()


@pytest.mark.parametrize(("model", "data", "words"), [
    (CreateSandbox, {"labels": ["a"]}, "labels: Input should be a valid dictionary"),
    (CreateSandbox, {"secrets": ["A", 3]}, "secrets.1: Input should be a valid string"),
    (RunCommand, {"cmd": "ls", "envs": ["A=1"]}, "envs: Input should be a valid dictionary"),
    (RunCommand, {"cmd": "ls", "context": "run-7"}, "context must be a mapping, not str"),
    (CreateSandbox, {"template": 7}, "template must be a string, not int"),
])
def test_a_value_of_a_type_no_rule_expected_is_refused_by_its_type(
        model: type[requests.Request], data: dict[str, Any], words: str) -> None:
    with pytest.raises(CorralError) as refused:
        model.parse(data)
    assert words in refused.value.message, refused.value.message
