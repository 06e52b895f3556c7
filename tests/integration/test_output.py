"""Command output as a user sees it live and at the end: a cut is announced while it happens,
the NDJSON stream carries each byte of output once, and binary output can be had byte-exact."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest

from corral import Sandbox

from .servers import Server

pytestmark = pytest.mark.needs_root

# Just over the small tier's 1 MiB per-stream cap.
FLOOD = "head -c 1100000 /dev/zero | tr '\\0' a; echo done >&2"


def test_a_cut_is_said_live_not_only_in_the_result(where: dict[str, str]) -> None:
    seen: list[str] = []
    with Sandbox.create(**where) as sb:
        result = sb.commands.run(FLOOD, on_stdout=seen.append)
    live = "".join(seen)
    assert result.stdout_truncated > 0
    assert "[corral: stdout truncated" in live, live[-300:]
    # The live note comes after the kept output, and the kept output is all there.
    assert live.index("[corral: stdout truncated") >= 1024 * 1024
    assert result.stdout.startswith("a" * 1024 * 1024)
    assert "[corral: stdout truncated" in result.stdout  # the result still says it too


def _ndjson(server: Server, sandbox_id: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.Client(base_url=server.url, timeout=60) as client, client.stream(
            "POST", f"/v1/sandboxes/{sandbox_id}/commands", json=body) as response:
        assert response.status_code == 200
        return [json.loads(line) for line in response.iter_lines() if line.strip()]


def test_the_stream_announces_a_cut_and_does_not_resend_the_output(
        home: str, server: Server) -> None:
    with Sandbox.create(home=home) as sb:
        events = _ndjson(server, sb.id, {"cmd": FLOOD, "stream": True})
    kinds = [e["type"] for e in events]
    cut = [e for e in events if e["type"] == "truncated"]
    assert cut and cut[0]["stream"] == "stdout", kinds[-5:]
    # Announced when it happened: before the end of the run, not with the result.
    assert kinds.index("truncated") < kinds.index("result")
    result = events[-1]
    assert result["type"] == "result" and result["stdout_truncated"] > 0
    streamed = sum(len(e["data"]) for e in events if e["type"] == "stdout")
    assert streamed >= 1024 * 1024
    # The whole kept output is not sent a second time in the result line.
    assert len(json.dumps(result)) < 4096, len(json.dumps(result))


def test_the_sdk_still_gets_the_whole_result_over_a_stream(home: str, server: Server) -> None:
    seen: list[str] = []
    with Sandbox.create(url=server.url) as sb:
        result = sb.commands.run("printf 'a\\nb'; printf e >&2", on_stdout=seen.append)
        flood = sb.commands.run(FLOOD, on_stdout=lambda _: None)
    assert (result.stdout, result.stderr, "".join(seen)) == ("a\nb", "e", "a\nb")
    assert flood.stdout.startswith("a" * 1024 * 1024) and flood.stdout_truncated > 0
    assert flood.stdout.endswith("the rest is dropped]\n") and flood.stderr == "done\n"


def test_binary_output_is_byte_exact(where: dict[str, str]) -> None:
    blob = os.urandom(1000)
    with Sandbox.create(**where) as sb:
        sb.files.write("r.bin", blob)
        result = sb.commands.run("cat r.bin", output="bytes")
        streamed = sb.commands.run("cat r.bin; printf x >&2", output="bytes",
                                   on_stdout=lambda _: None)
        text = sb.commands.run("cat r.bin")
    assert result.stdout_bytes == blob
    assert streamed.stdout_bytes == blob and streamed.stderr_bytes == b"x"
    assert text.stdout_bytes is None  # only when asked for: text stays the default
    assert "\ufffd" in text.stdout
