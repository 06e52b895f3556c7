"""The official E2B Python SDK against Corral, beside Corral's own remote SDK, in one run.

Run as root, after ``scripts/e2b-sdks`` (``scripts/bootstrap --test`` runs it)::

    .venv/bin/python bench/bench_e2b_sdk.py [--runs N] [--rounds R] [--first-code N] [--out FILE]

Against ``python -m corral serve --port P --e2b-port Q`` in a subprocess on 127.0.0.1 (its own
data directory and uid range, one tenant with a Corral key and an E2B key):

1. ``commands``: ``commands.run("true")`` through ``e2b`` 2.63.0 (``.venv-e2b/latest``, in a
   driver process: ``bench/e2b_driver.py``) and ``sb.commands.run("true")`` through
   ``corral.Sandbox`` over HTTP, in R interleaved rounds of N/R each, in a shuffled order.
   Target: E2B within 1.5x of Corral's own p50.
2. ``files``: ``files.write`` + ``files.read`` of 1 KB, the same way. Same target.
3. ``run_code``: ``run_code("1+1")`` on a warm default context (target p50 <= 20 ms) and
   ``Sandbox.create()`` → first ``run_code`` (the kernel started on demand; target <= 500 ms).

Prints one JSON document (progress on stderr). Everything it made is removed at the end and
checked for leftovers (exit status 1 if any).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import emit_report, log, machine_info, summarize, teardown  # noqa: E402

from corral import Sandbox  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

# Apart from the other benches (2_050_... to 2_080_...) and the tests (2_100_... and up).
UID_START = 2_090_000_000
E2B_PYTHON = ROOT / ".venv-e2b" / "latest" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "e2b_driver.py"
PAYLOAD = bytes(range(256)) * 4  # 1 KB
WARMUP = 5
TARGET_RATIO = 1.5
TARGET_WARM_CODE_MS = 20.0
TARGET_FIRST_CODE_MS = 500.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def corral(env: dict[str, str], *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "corral", *args], env=env, capture_output=True,
                         text=True, timeout=60, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"corral {' '.join(args)}: {out.stderr.strip()[-1000:]}")
    return out.stdout


class Driver:
    """The E2B SDK driver process (bench/e2b_driver.py in .venv-e2b/latest)."""

    def __init__(self, api: str, key: str) -> None:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": tempfile.gettempdir(),
               "E2B_API_KEY": key, "E2B_API_URL": api, "E2B_SANDBOX_URL": api,
               "E2B_DOMAIN": "corral.invalid", "E2B_CONNECTION_RETRIES": "0"}
        self.proc = subprocess.Popen([str(E2B_PYTHON), str(DRIVER)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ask(self, op: str, n: int) -> list[float]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(f"{op} {n}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the E2B driver exited ({self.proc.wait()}) during {op!r}")
        record = json.loads(line)
        if "error" in record:
            raise RuntimeError(f"E2B SDK, {op}: {record['error']}")
        return [float(s) for s in record["seconds"]]

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def own_cmd(sb: Sandbox, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        sb.commands.run("true")
        out.append(time.perf_counter() - t)
    return out


def own_files(sb: Sandbox, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        sb.files.write("bench.bin", PAYLOAD)
        got = sb.files.read("bench.bin", format="bytes")
        out.append(time.perf_counter() - t)
        assert got == PAYLOAD
    return out


def compare(driver: Driver, sb: Sandbox, runs: int, rounds: int, rng: random.Random,
            op: str) -> dict[str, Any]:
    own = own_cmd if op == "cmd" else own_files
    own(sb, WARMUP)
    driver.ask(op, WARMUP)
    e2b: list[float] = []
    mine: list[float] = []
    per_round = max(1, runs // rounds)
    for _ in range(rounds):
        order = ["e2b", "corral"]
        rng.shuffle(order)
        for who in order:
            if who == "e2b":
                e2b += driver.ask(op, per_round)
            else:
                mine += own(sb, per_round)
    e2b_s, mine_s = summarize(e2b), summarize(mine)
    ratio = float(e2b_s["p50_ms"]) / float(mine_s["p50_ms"])
    return {"e2b_sdk": e2b_s, "corral_sdk": mine_s, "p50_ratio": round(ratio, 3),
            "target_ratio": TARGET_RATIO, "meets_target": ratio <= TARGET_RATIO}


def target(summary: dict[str, float | int], p50_ms: float) -> dict[str, Any]:
    return {**summary, "target_p50_ms": p50_ms, "meets_target": summary["p50_ms"] <= p50_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="operations per SDK and series")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--first-code", type=int, default=10,
                        help="create -> first run_code samples (0: skip run_code)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the order shuffle")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    if min(args.runs, args.rounds) < 1 or args.first_code < 0:
        parser.error("--runs and --rounds must be at least 1, --first-code at least 0")
    if os.geteuid() != 0:
        log("e2b_sdk: run as root (sandboxes need namespaces, cgroups and mounts)")
        return 2
    if not E2B_PYTHON.exists():
        log(f"e2b_sdk: {E2B_PYTHON} is missing: run scripts/e2b-sdks")
        return 2
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    load_start = os.getloadavg()[0]
    started = time.time()
    home = Path(tempfile.mkdtemp(prefix="corral-bench-e2b-"))
    home.chmod(0o711)  # the sandboxes' uids pass through it
    settings = Settings(home=home, uid_start=UID_START, uid_count=1000)
    env = {**os.environ, "CORRAL_HOME": str(home), "CORRAL_UID_START": str(UID_START),
           "CORRAL_UID_COUNT": "1000", "PYTHONPATH": os.environ.get("PYTHONPATH") or str(SRC),
           "CORRAL_E2B_TEMPLATES": "code-interpreter-v1=base"}
    for name in ("CORRAL_URL", "CORRAL_API_KEY"):
        env.pop(name, None)
    report: dict[str, Any] = {"benchmark": "official E2B Python SDK vs Corral's own, one run"}
    server_log = Path(tempfile.mkstemp(prefix="corral-bench-e2b-", suffix=".log")[1])
    proc: subprocess.Popen[bytes] | None = None
    driver: Driver | None = None
    sb: Sandbox | None = None
    try:
        corral(env, "tenants", "add", "bench", "--max-sandboxes", "50",
               "--commands-per-minute", "1000000")
        own_key = json.loads(corral(env, "keys", "create", "bench", "--json"))["key"]
        e2b_key = json.loads(corral(env, "keys", "create", "bench", "--e2b", "--json"))["key"]
        port, e2b_port = free_port(), free_port()
        with server_log.open("wb") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "corral", "serve", "--port",
                                     str(port), "--e2b-port", str(e2b_port)],
                                    env=env, stdin=subprocess.DEVNULL, stdout=sink,
                                    stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"corral serve exited: {server_log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("corral serve did not start")
            time.sleep(0.1)
        log(f"e2b_sdk: server {url}, E2B on {e2b_port}, seed {seed}")
        driver = Driver(f"http://127.0.0.1:{e2b_port}", e2b_key)
        sb = Sandbox.create(url=url, api_key=own_key, timeout=1800)
        assert driver is not None and sb is not None

        def part(name: str, fn: Callable[[], dict[str, Any]]) -> None:
            # One failing part (a surface not served yet, say) does not hide the others.
            log(f"{name} ...")
            try:
                report[name] = fn()
            except Exception as exc:  # noqa: BLE001 - reported per part
                report[name] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
                report["error"] = "some parts failed"

        d, own = driver, sb
        part("commands_run_true", lambda: compare(d, own, args.runs, args.rounds, rng, "cmd"))
        part("files_write_read_1k", lambda: compare(d, own, args.runs, args.rounds, rng,
                                                    "files"))
        if args.first_code:
            part("run_code_warm", lambda: target(summarize(d.ask("code", args.runs)),
                                                 TARGET_WARM_CODE_MS))
            part("create_to_first_run_code", lambda: target(
                summarize(d.ask("first_code", args.first_code)), TARGET_FIRST_CODE_MS))
    except Exception as exc:  # noqa: BLE001 - reported, then everything is cleaned up
        report["error"] = f"{type(exc).__name__}: {exc}"
        log(f"e2b_sdk: {report['error']}")
    finally:
        if driver is not None:
            driver.close()
        if sb is not None:
            try:
                sb.kill()
            except Exception:  # noqa: BLE001 - the teardown below destroys it anyway
                pass
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        manager_mod.get_manager(settings)
        left = teardown(settings)
    if "error" in report or left:
        report["server_log"] = str(server_log)
    else:
        server_log.unlink(missing_ok=True)
    cgroups = "see bench_sandbox.py"
    report.update({
        "seed": seed, "warmup_runs": WARMUP,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "machine": machine_info("bwrap", cgroups, load_start),
        "cleanup": {"ok": not left, "leftovers": left},
    })
    status = emit_report(report, args.out)
    return status or (1 if "error" in report else 0)


if __name__ == "__main__":
    sys.exit(main())
