"""The code interpreter: a warm cell, and create → first cell with the kernel started on demand,
beside a bare ``python3 -c`` run as a command in the same sandbox (the reference).

Run as root::

    .venv/bin/python bench/bench_code_interpreter.py [--runs N] [--out FILE] [--url URL]

Series (embedded, or through ``corral serve`` with ``--url``; base template, IPython from the
host's Debian packages):

* ``run_code_warm``: ``sb.run_code("1+1")`` on a context whose kernel is running.
* ``create_to_first_run_code``: ``Sandbox.create()`` then ``sb.run_code("1+1")`` (the kernel
  starts on demand: IPython's import is most of it); the sandbox is killed outside the timing.
* ``kernel_start``: the same first cell alone, the sandbox already created.
* reference ``python3_c``: ``sb.commands.run(["python3", "-c", "1+1"])`` in a warm sandbox —
  what a cell costs without a kernel (a fresh interpreter per cell, no state).
* reference ``commands_true``: ``sb.commands.run(["true"])``, the command floor.

Targets (issue 13): ``run_code_warm`` p50 ≤ 20 ms; ``create_to_first_run_code`` p50 ≤ 500 ms.

``--template`` (issue 37) measures the ``code-interpreter`` template instead, through the
official E2B SDK (``e2b-code-interpreter`` in ``.venv-e2b/latest``, driven by
``bench/e2b_driver.py`` as ``bench_e2b_sdk.py`` does): ``e2b_create_to_first_run_code_*`` and
``e2b_run_code_warm_*`` against two ``corral serve``, one mapping ``code-interpreter-v1`` to
the template (``_template``) and one to ``base`` as before (``_base``: 269 ms and 3.8 ms on the
idle machine), in interleaved rounds so load weighs on both alike; then through Corral's
remote SDK, each language's first cell in a fresh sandbox of the template
(``first_cell_<language>``: the kernel's start) and its warm cell (``warm_cell_<language>``);
and the template's build time and size. The template
is built in the bench's data directory (timed), or with ``--reuse-build HOME`` hard-linked
from a data directory that has it (its own build time reported)::

    .venv/bin/python bench/bench_code_interpreter.py --template [--reuse-build HOME]

Prints one JSON document (progress on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandbox import emit_report, log, summarize, teardown  # noqa: E402

from corral import Sandbox  # noqa: E402
from corral._control import manager as manager_mod  # noqa: E402
from corral._settings import Settings  # noqa: E402

UID_START = 2_075_000_000
TEMPLATE = "code-interpreter"
# The first cell of each kernel, and a warm one: what it prints or returns is checked.
CELLS = {"python": ("1+1", "2"), "javascript": ("1+1", "2"), "typescript": ("1+1", "2"),
         "r": ("1+1", "[1] 2"), "bash": ("true", None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="warm samples per series")
    parser.add_argument("--cold", type=int, default=10, help="create → first cell samples")
    parser.add_argument("--url", help="a corral serve to use instead of embedded")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    parser.add_argument("--template", action="store_true",
                        help="the code-interpreter template through the E2B SDK (issue 37)")
    parser.add_argument("--reuse-build", type=Path, metavar="HOME",
                        help="with --template: hard-link the template built in HOME")
    args = parser.parse_args(argv)
    if args.template:
        return template_main(args)
    settings = Settings(home=Path(tempfile.mkdtemp(prefix="corral-bench-code-")),
                        uid_start=UID_START, uid_count=1000)
    manager_mod.get_manager(settings)
    where: dict[str, Any] = {"url": args.url} if args.url else {"home": str(settings.home)}
    samples: dict[str, list[float]] = {k: [] for k in (
        "run_code_warm", "python3_c", "commands_true", "create_to_first_run_code",
        "kernel_start")}
    leftover: list[str] = []
    try:
        log(f"warm: {args.runs} runs per series")
        with Sandbox.create(**where) as sb:
            sb.run_code("1+1")
            for _ in range(5):
                sb.commands.run(["true"])
                sb.commands.run(["python3", "-c", "1+1"])
            for _ in range(args.runs):
                for name, call in (
                        ("run_code_warm", lambda: sb.run_code("1+1")),
                        ("python3_c", lambda: sb.commands.run(["python3", "-c", "1+1"])),
                        ("commands_true", lambda: sb.commands.run(["true"]))):
                    start = time.perf_counter()
                    call()
                    samples[name].append(time.perf_counter() - start)
        log(f"cold: {args.cold} sandboxes")
        for _ in range(args.cold):
            start = time.perf_counter()
            sb = Sandbox.create(**where)
            created = time.perf_counter()
            result = sb.run_code("1+1")
            done = time.perf_counter()
            sb.kill()
            sb.close()
            assert result.text == "2", result
            samples["create_to_first_run_code"].append(done - start)
            samples["kernel_start"].append(done - created)
    finally:
        leftover += teardown(settings)
    results = {name: summarize(values) for name, values in samples.items()}
    warm = results["run_code_warm"]["p50_ms"]
    cold = results["create_to_first_run_code"]["p50_ms"]
    report = {
        "benchmark": "code_interpreter",
        "transport": "remote" if args.url else "embedded",
        "results": results,
        "ratios": {"run_code_warm_vs_python3_c": round(warm / results["python3_c"]["p50_ms"], 3)},
        "targets": {"run_code_warm_p50_le_20ms": warm <= 20.0,
                    "create_to_first_run_code_p50_le_500ms": cold <= 500.0},
        "cleanup": {"ok": not leftover, "leftovers": leftover},
    }
    return emit_report(report, args.out)


def _template_build(env: dict[str, str], home: Path, reuse: Path | None) -> dict[str, Any]:
    """The template in ``home``: built (timed) or linked from ``reuse``; its build record."""
    templates = home / "templates"
    if reuse is not None:
        current = (reuse / "templates" / f"{TEMPLATE}.current").resolve()
        templates.mkdir(mode=0o711, exist_ok=True)
        subprocess.run(["cp", "-al", str(current), str(templates / current.name)], check=True)
        (templates / f"{TEMPLATE}.current").symlink_to(current.name)
        record = json.loads((current / "template.json").read_text())
        return {"reused_from": str(reuse), "build_s": round(record["build_s"], 1),
                "size_bytes": record["size_bytes"],
                "installed_packages": record.get("installed_packages")}
    log(f"building the {TEMPLATE} template (minutes)")
    start = time.perf_counter()
    built = subprocess.run([sys.executable, "-m", "corral", "templates", "build", TEMPLATE,
                            "--json"], env=env, capture_output=True, text=True, check=False)
    if built.returncode != 0:
        raise RuntimeError(f"template build: {built.stderr[-2000:]}")
    record = json.loads(built.stdout)
    return {"build_s": round(time.perf_counter() - start, 1),
            "size_bytes": record["size_bytes"],
            "installed_packages": record.get("installed_packages")}


class _Service:
    """``corral serve`` on its own data directory, with one tenant and its keys, and the
    official E2B SDK's driver process pointed at its E2B port."""

    def __init__(self, home: Path, uid_start: int, mapping: str) -> None:
        from bench_e2b_sdk import SRC

        home.chmod(0o711)
        self.settings = Settings(home=home, uid_start=uid_start, uid_count=1000)
        self.env = {**os.environ, "CORRAL_HOME": str(home), "CORRAL_UID_START": str(uid_start),
                    "CORRAL_UID_COUNT": "1000",
                    "PYTHONPATH": os.environ.get("PYTHONPATH") or str(SRC),
                    "CORRAL_E2B_TEMPLATES": f"base=base,code-interpreter-v1={mapping}"}
        for name in ("CORRAL_URL", "CORRAL_API_KEY"):
            self.env.pop(name, None)
        self.log = Path(tempfile.mkstemp(prefix="corral-bench-code-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self.driver: Any = None

    def start(self) -> None:
        import httpx
        from bench_e2b_sdk import Driver, corral, free_port

        corral(self.env, "tenants", "add", "bench", "--max-sandboxes", "50",
               "--commands-per-minute", "1000000")
        self.key = json.loads(corral(self.env, "keys", "create", "bench", "--json"))["key"]
        e2b_key = json.loads(corral(self.env, "keys", "create", "bench", "--e2b",
                                    "--json"))["key"]
        port, e2b_port = free_port(), free_port()
        with self.log.open("wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "corral", "serve", "--port", str(port), "--e2b-port",
                 str(e2b_port)], env=self.env, stdin=subprocess.DEVNULL, stdout=sink,
                stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"corral serve did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        self.driver = Driver(f"http://127.0.0.1:{e2b_port}", e2b_key)

    def stop(self) -> list[str]:
        if self.driver is not None:
            self.driver.close()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        manager_mod.get_manager(self.settings)
        return teardown(self.settings)


def template_main(args: argparse.Namespace) -> int:
    """The code-interpreter template beside the base template (``CORRAL_E2B_TEMPLATES`` as the
    E2B tests set it), each behind a service of its own, in interleaved rounds: the machine's
    load (other sessions, CI) weighs on both alike."""
    import random

    from bench_e2b_sdk import E2B_PYTHON

    if not E2B_PYTHON.exists():
        log(f"code_interpreter: {E2B_PYTHON} is missing: run scripts/e2b-sdks")
        return 2
    load_start = os.getloadavg()[0]
    services = {
        "base": _Service(Path(tempfile.mkdtemp(prefix="corral-bench-code-base-")),
                         UID_START + 1000, "base"),
        "template": _Service(Path(tempfile.mkdtemp(prefix="corral-bench-code-template-")),
                             UID_START, TEMPLATE),
    }
    report: dict[str, Any] = {"benchmark": "code_interpreter_template", "template": TEMPLATE,
                              "idle_base_template_before_ms": {"e2b_run_code_warm_p50": 3.8,
                                                               "e2b_create_to_first_p50": 269}}
    leftover: list[str] = []
    try:
        report["build"] = _template_build(services["template"].env,
                                          services["template"].settings.home, args.reuse_build)
        for service in services.values():
            service.start()
        rounds = max(1, args.cold)
        samples: dict[str, list[float]] = {}
        log(f"E2B SDK: {rounds} rounds of create -> first run_code and warm run_code")
        rng = random.Random(0)
        for _ in range(rounds):
            order = list(services)
            rng.shuffle(order)
            for which in order:
                driver = services[which].driver
                samples.setdefault(f"e2b_create_to_first_run_code_{which}", []).extend(
                    driver.ask("first_code", 1))
                samples.setdefault(f"e2b_run_code_warm_{which}", []).extend(
                    driver.ask("code", max(1, args.runs // rounds)))
        log("Corral SDK: each kernel's first and warm cell on the template")
        service = services["template"]
        for _ in range(rounds):
            with Sandbox.create(url=service.url, api_key=service.key, template=TEMPLATE) as sb:
                for language, (code, text) in CELLS.items():
                    start = time.perf_counter()
                    run = sb.run_code(code, language=language)
                    samples.setdefault(f"first_cell_{language}", []).append(
                        time.perf_counter() - start)
                    assert run.error is None and run.text == text, (language, run)
                    for _ in range(max(1, args.runs // rounds)):
                        start = time.perf_counter()
                        sb.run_code(code, language=language)
                        samples.setdefault(f"warm_cell_{language}", []).append(
                            time.perf_counter() - start)
                sb.kill()
        report["results"] = {name: summarize(values) for name, values in samples.items()}
        results = report["results"]
        report["ratios_template_vs_base"] = {
            kind: round(results[f"e2b_{kind}_template"]["p50_ms"]
                        / results[f"e2b_{kind}_base"]["p50_ms"], 3)
            for kind in ("create_to_first_run_code", "run_code_warm")}
    except Exception as exc:  # noqa: BLE001 - reported, then everything is cleaned up
        report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        log(f"code_interpreter: {report['error']}")
    finally:
        for service in services.values():
            leftover += service.stop()
    if "error" in report:
        report["server_logs"] = [str(s.log) for s in services.values()]
    else:
        for service in services.values():
            service.log.unlink(missing_ok=True)
    report["load_avg_1m"] = {"start": round(load_start, 2),
                             "end": round(os.getloadavg()[0], 2)}
    report["cleanup"] = {"ok": not leftover, "leftovers": leftover}
    status = emit_report(report, args.out)
    return status or (1 if "error" in report else 0)

if __name__ == "__main__":
    sys.exit(main())
