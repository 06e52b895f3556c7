"""``AsyncSandbox``: one async behavioural suite, run embedded and against a real server (uvicorn
on loopback). Each test drives its coroutine with ``asyncio.run`` (no pytest plugin)."""

from __future__ import annotations

import asyncio
import io
import tarfile
import threading
import time
from typing import Any

import pytest

from corral import (
    AsyncSandbox,
    CommandError,
    PathRefused,
    SandboxNotFound,
    UsageError,
)

pytestmark = pytest.mark.needs_root


def test_commands(where: dict[str, str]) -> None:
    async def scenario() -> None:
        async with await AsyncSandbox.create(**where) as sb:
            result = await sb.commands.run("echo out; echo err >&2; exit 3")
            assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
            assert result.command_id.startswith("cmd_")

            loop_thread = threading.get_ident()
            seen: list[str] = []
            errs: list[str] = []
            threads: set[int] = set()

            def on_out(text: str) -> None:
                threads.add(threading.get_ident())
                seen.append(text)

            async def on_err(text: str) -> None:  # async callbacks are awaited
                await asyncio.sleep(0)
                errs.append(text)

            streamed = await sb.commands.run(
                "for i in 1 2 3; do echo $i; echo e$i >&2; sleep 0.1; done",
                on_stdout=on_out, on_stderr=on_err)
            assert "".join(seen) == streamed.stdout == "1\n2\n3\n"
            assert "".join(errs) == streamed.stderr == "e1\ne2\ne3\n"
            assert threads == {loop_thread}, "callbacks must run on the event loop's thread"

            assert (await sb.commands.run(["wc", "-c"], stdin="12345")).stdout.strip() == "5"
            await sb.files.make_dir("d")
            done = await sb.commands.run("pwd; echo $X", cwd="/workspace/d", envs={"X": "y"})
            assert done.stdout == "/workspace/d\ny\n"
            timed = await sb.commands.run("sleep 10", timeout=0.5)
            assert timed.timed_out and timed.exit_code == 124
            with pytest.raises(CommandError):
                await sb.commands.run("")
            with pytest.raises(UsageError):
                await sb.commands.run("true", timeout=100_000)

            # Cancelling the caller returns promptly; the sandbox stays usable.
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sb.commands.run("sleep 5", timeout=10), 0.5)
            assert time.monotonic() - started < 3
            assert (await sb.commands.run("echo still")).stdout == "still\n"

    asyncio.run(scenario())


def test_files(where: dict[str, str]) -> None:
    async def scenario() -> None:
        async with await AsyncSandbox.create(**where) as sb:
            entry = await sb.files.write("a/b.txt", "hello")
            assert entry.path == "/workspace/a/b.txt" and entry.size == 5
            assert await sb.files.read("a/b.txt") == "hello"
            assert await sb.files.read("a/b.txt", format="bytes") == b"hello"
            assert [e.name for e in await sb.files.list("a")] == ["b.txt"]
            assert (await sb.files.stat("a")).type == "dir"
            assert await sb.files.exists("a/b.txt") and not await sb.files.exists("nope")
            with pytest.raises(PathRefused):
                await sb.files.read("../../etc/passwd")
            await sb.commands.run("ln -s /etc/passwd leak")
            with pytest.raises(PathRefused):
                await sb.files.read("leak")
            await sb.files.rename("a/b.txt", "c.txt")
            assert await sb.files.read("c.txt") == "hello"
            await sb.files.remove("a")
            assert not await sb.files.exists("a")

            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                info = tarfile.TarInfo("app/main.py")
                info.size = 9
                tar.addfile(info, io.BytesIO(b"print(7)\n"))
            report = await sb.files.upload(buf.getvalue(), "/workspace/up")
            assert report["files"] == 1
            assert (await sb.commands.run("python3 up/app/main.py")).stdout == "7\n"
            archive = b"".join([chunk async for chunk in sb.files.download("/workspace/up")])
            assert "app/main.py" in tarfile.open(fileobj=io.BytesIO(archive)).getnames()

    asyncio.run(scenario())


def test_lifecycle_network_audit_and_errors(where: dict[str, str]) -> None:
    async def scenario() -> None:
        with pytest.raises(UsageError, match="unknown resource tier"):
            await AsyncSandbox.create(resources="xl", **where)
        with pytest.raises(SandboxNotFound):
            await AsyncSandbox.connect("sbx_000000000000", **where)
        sb = await AsyncSandbox.create(network={"allow": ["pypi.org"]}, labels={"k": "v"},
                                       **where)
        try:
            assert sb.id in {i.id for i in await AsyncSandbox.list(**where)}
            assert (await sb.network.get())["allow"] == ["pypi.org"]
            await sb.network.update(allow=["example.com"], deny=["bad.example.com"])
            assert await sb.network.get() == {"mode": "allowlist", "allow": ["example.com"],
                                              "deny": ["bad.example.com"]}
            await sb.set_timeout(600)
            run = await sb.commands.run("echo audited")
            types = [e.type for e in await sb.audit.events(command=run.command_id)]
            assert types == ["command.started", "command.output", "command.finished"]
            assert "sandbox.policy_changed" in {e.type for e in await sb.audit.events()}

            # aclose() detaches without destroying; connect() attaches again.
            await sb.aclose()
            with pytest.raises(UsageError, match="closed"):
                await sb.commands.run("true")
            sb = await AsyncSandbox.connect(sb.id, **where)
            assert (await sb.get_info()).labels == {"k": "v"}
        finally:
            await sb.kill()
        # A killed sandbox's trail stays readable through the same object.
        assert "sandbox.destroyed" in {e.type for e in await sb.audit.events()}
        with pytest.raises(UsageError, match="killed"):
            await sb.files.read("x")
        await sb.aclose()
        with pytest.raises(SandboxNotFound):
            await AsyncSandbox.connect(sb.id, **where)

    asyncio.run(scenario())


def test_commands_in_many_sandboxes_run_concurrently(where: dict[str, str]) -> None:
    async def scenario() -> None:
        sandboxes = await asyncio.gather(*(AsyncSandbox.create(**where) for _ in range(5)))
        try:
            started = time.monotonic()
            await sandboxes[0].commands.run("sleep 1")
            single = time.monotonic() - started

            outputs: list[list[str]] = [[] for _ in sandboxes]
            started = time.monotonic()
            results: list[Any] = await asyncio.gather(*(
                sb.commands.run(f"sleep 1; echo {n}", on_stdout=outputs[n].append)
                for n, sb in enumerate(sandboxes)))
            together = time.monotonic() - started
            assert [r.stdout for r in results] == [f"{n}\n" for n in range(5)]
            assert ["".join(o) for o in outputs] == [r.stdout for r in results]
            assert together < 3 * single, (together, single)
        finally:
            for sb in sandboxes:
                async with sb:
                    pass

    asyncio.run(scenario())
