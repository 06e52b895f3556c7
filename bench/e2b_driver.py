"""The official E2B Python SDK's half of ``bench/bench_e2b_sdk.py``; runs inside
``.venv-e2b/latest`` (standard library + ``e2b`` + ``e2b_code_interpreter`` only, never Corral).

A line protocol on stdin/stdout, so the orchestrator can interleave its rounds with Corral's own
SDK in one run: each request line is ``OP N`` and each answer one JSON line
``{"op": OP, "seconds": [...]}`` (or ``{"op": OP, "error": "..."}``). Ops:

* ``cmd N``: ``commands.run("true")`` N times in one sandbox;
* ``files N``: ``files.write`` + ``files.read`` of 1 KB N times;
* ``code N``: ``run_code("1+1")`` N times on the default context (warmed first);
* ``first_code N``: N times ``Sandbox.create()`` (code interpreter) → first ``run_code``, then
  kill (the kill is not timed);
* ``quit``.
"""

from __future__ import annotations

import json
import sys
import time

from e2b import Sandbox
from e2b_code_interpreter import Sandbox as CodeSandbox

PAYLOAD = bytes(range(256)) * 4  # 1 KB


def answer(record: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def main() -> None:
    sb = Sandbox.create(timeout=1800)
    code: CodeSandbox | None = None
    try:
        for line in sys.stdin:
            op, _, arg = line.strip().partition(" ")
            n = int(arg or 1)
            if op == "quit":
                return
            seconds: list[float] = []
            try:
                if op == "cmd":
                    for _ in range(n):
                        t = time.perf_counter()
                        sb.commands.run("true")
                        seconds.append(time.perf_counter() - t)
                elif op == "files":
                    for _ in range(n):
                        t = time.perf_counter()
                        sb.files.write("/home/user/bench.bin", PAYLOAD)
                        got = sb.files.read("/home/user/bench.bin", format="bytes")
                        seconds.append(time.perf_counter() - t)
                        assert bytes(got) == PAYLOAD
                elif op == "code":
                    if code is None:
                        code = CodeSandbox.create(timeout=1800)
                        code.run_code("1+1")  # the kernel's start is not part of "warm"
                    for _ in range(n):
                        t = time.perf_counter()
                        ex = code.run_code("1+1")
                        seconds.append(time.perf_counter() - t)
                        assert ex.text == "2", ex
                elif op == "first_code":
                    for _ in range(n):
                        t = time.perf_counter()
                        fresh = CodeSandbox.create(timeout=300)
                        ex = fresh.run_code("1+1")
                        seconds.append(time.perf_counter() - t)
                        fresh.kill()
                        assert ex.text == "2", ex
                else:
                    raise ValueError(f"unknown op {op!r}")
            except Exception as exc:  # noqa: BLE001 - reported to the orchestrator
                answer({"op": op, "error": f"{type(exc).__name__}: {exc}"[:1000]})
                continue
            answer({"op": op, "seconds": seconds})
    finally:
        sb.kill()
        if code is not None:
            code.kill()


if __name__ == "__main__":
    main()
