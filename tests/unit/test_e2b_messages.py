"""The process service's Connect messages as models: each rule's refusal in this surface's own
words (the SDKs show them), proto3 JSON's leniencies (unknown fields ignored, a uint32 as its
decimal string, an empty ``pty`` is none), and the typed values the handlers get."""

from __future__ import annotations

from typing import Any

import pytest

from corral._e2b.connect import ConnectError
from corral._e2b.messages import (
    ConnectProcess,
    ListDir,
    Move,
    PathRequest,
    SendInput,
    SendSignal,
    Start,
    StreamInputMessage,
    Update,
    WatchDir,
    WatcherRequest,
)

REFUSED: list[tuple[Any, dict[str, Any], str]] = [
    (Start, {}, "the request needs 'process'"),
    (Start, {"process": 3}, "'process' must be an object"),
    (Start, {"process": {}}, "process.cmd must be a non-empty string"),
    (Start, {"process": {"cmd": "a", "args": [1]}}, "process.args must be a list of strings"),
    (Start, {"process": {"cmd": "a", "envs": {"A": 1}}}, "process.envs must map strings"),
    (Start, {"process": {"cmd": "a", "cwd": 7}}, "process.cwd must be a string"),
    (Start, {"process": {"cmd": "a"}, "pty": {"size": {"rows": 0, "cols": 3}}},
     "pty.size rows and cols must be 1..1000, got 0x3"),
    (Start, {"process": {"cmd": "a"}, "pty": {"size": {"rows": True, "cols": 3}}},
     "pty.size.rows must be a uint32, got True"),
    (Start, {"process": {"cmd": "a"}, "pty": {"other": 1}}, "the request needs 'size'"),
    (Start, {"process": {"cmd": "a"}, "tag": "x" * 257}, "tag must be a string of at most 256"),
    (Start, {"process": {"cmd": "a"}, "stdin": "yes"}, "stdin must be true or false"),
    (ConnectProcess, {"process": {}}, "process must select a pid or a tag"),
    (ConnectProcess, {"process": {"pid": -1}}, "process.pid must be a uint32, got -1"),
    (SendSignal, {"process": {"pid": 1}},
     "signal 'SIGNAL_UNSPECIFIED' is not supported; send SIGNAL_SIGKILL or SIGNAL_SIGTERM"),
    # The signal is judged before the process is: as envd, which reads it first.
    (SendSignal, {"process": {}, "signal": 3}, "signal 3 is not supported"),
    (SendInput, {"process": {"pid": 1}}, "the request needs 'input'"),
    (SendInput, {"process": {"pid": 1}, "input": {"pty": 3}}, "input.pty must be base64 text"),
    (SendInput, {"process": {"pid": 1}, "input": {}}, 'input must hold "stdin" or "pty"'),
    (StreamInputMessage, {}, "a StreamInput message is start, data or keepalive"),
    (StreamInputMessage, {"data": {}}, "the request needs 'input'"),
    (PathRequest, {}, "path is required (absolute, or relative to /home/user)"),
    (ListDir, {"path": "x", "depth": -1}, "depth must be a non-negative integer"),
    (ListDir, {"path": "x", "depth": 65}, "depth is at most 64"),
    (Move, {"source": "a"}, "destination is required"),
    (WatchDir, {"path": "a", "recursive": "yes"}, "recursive must be true or false"),
    (WatcherRequest, {"watcherId": ""}, "watcherId is required (from CreateWatcher)"),
]


@pytest.mark.parametrize(("model", "message", "words"), REFUSED,
                         ids=[f"{m.__name__}-{i}" for i, (m, _, _) in enumerate(REFUSED)])
def test_a_refusal_is_invalid_argument_in_the_surface_words(
        model: Any, message: dict[str, Any], words: str) -> None:
    with pytest.raises(ConnectError) as refused:
        model.read(message)
    assert refused.value.code == "invalid_argument"
    assert words in refused.value.message


def test_a_start_is_typed_and_proto3_lenient() -> None:
    start = Start.read({"process": {"cmd": "/bin/bash", "args": ["-c", "true"],
                                    "envs": {"A": "b"}, "cwd": "/home/user"},
                        "pty": {"size": {"rows": "24", "cols": 80}}, "tag": "t",
                        "stdin": False, "unknownField": 1})
    assert start.process.argv == ["/bin/bash", "-c", "true"]
    assert start.process.envs == {"A": "b"} and start.process.cwd == "/home/user"
    assert start.pty is not None and start.pty.pair == (24, 80)
    assert (start.tag, start.stdin) == ("t", False)
    bare = Start.read({"process": {"cmd": "ls", "args": None, "cwd": ""}, "pty": {}})
    assert (bare.process.argv, bare.process.cwd, bare.pty, bare.stdin) == (["ls"], None, None,
                                                                           None)


def test_selectors_inputs_and_signals() -> None:
    assert ConnectProcess.read({"process": {"pid": "12"}}).process.pid == 12
    assert ConnectProcess.read({"process": {"tag": "web"}}).process.tag == "web"
    assert SendSignal.read({"process": {"pid": 1}, "signal": "SIGNAL_SIGTERM"}).signal == 15
    assert SendSignal.read({"process": {"pid": 1}, "signal": 9}).signal == 9
    sent = SendInput.read({"process": {"pid": 1}, "input": {"stdin": "aGk="}}).input
    assert (sent.kind, sent.data) == ("stdin", b"hi")
    assert StreamInputMessage.read({"keepalive": {}}).keepalive
    part = StreamInputMessage.read({"start": {"process": {"pid": 2}}})
    assert part.start is not None and part.start.process.pid == 2 and not part.keepalive
    data = StreamInputMessage.read({"data": {"input": {"pty": "AQ=="}}}).data
    assert data is not None and (data.kind, data.data) == ("pty", b"\x01")
    assert Update.read({"process": {"pid": 1}}).pty is None
    resized = Update.read({"process": {"pid": 1}, "pty": {"size": {"rows": 5, "cols": 6}}})
    assert resized.pty is not None and resized.pty.pair == (5, 6)


def test_a_path_leaving_the_workspace_is_permission_denied() -> None:
    with pytest.raises(ConnectError) as refused:
        PathRequest.read({"path": "/etc/passwd"})
    assert refused.value.code == "permission_denied"
    assert "outside /home/user" in refused.value.message


def test_filesystem_messages_are_typed_with_proto3_defaults() -> None:
    assert PathRequest.read({"path": "notes.txt"}).path == "/workspace/notes.txt"
    assert ListDir.read({"path": "/home/user"}).depth == 1
    assert ListDir.read({"path": "/home/user", "depth": 0}).depth == 1
    assert ListDir.read({"path": "/home/user", "depth": "3"}).depth == 3
    watch = WatchDir.read({"path": "d", "include_entry": True})  # older SDKs' spelling
    assert (watch.path, watch.recursive, watch.include_entry) == ("/workspace/d", False, True)
    assert WatchDir.read({"path": "d", "includeEntry": True}).include_entry
    assert WatcherRequest.read({"watcher_id": "w1"}).watcher_id == "w1"
    assert WatcherRequest.read({"watcherId": "w2"}).watcher_id == "w2"
