"""The driver's JavaScript, TypeScript and R kernels, driven directly (no sandbox) with the
host's node and R (``scripts/bootstrap --test`` installs nodejs, node-typescript and
r-base-core; skipped with the reason without them): a runtime missing from the template is
refused naming the template that has it, and what a cell writes to its kernel's own pipe
cannot pass for the kernel (the stream is the tenant's to write, as the driver's own is)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from corral._kernels import driver_source

from .test_interpreter_driver import PYTHON, Driver

needs_node = pytest.mark.skipif(shutil.which("node") is None,
                                reason="node is not installed on this host "
                                       "(scripts/bootstrap --test installs nodejs)")
needs_r = pytest.mark.skipif(shutil.which("Rscript") is None,
                             reason="R is not installed on this host "
                                    "(scripts/bootstrap --test installs r-base-core)")


@pytest.mark.parametrize(("language", "runtime"), [("javascript", "node"),
                                                   ("typescript", "node"), ("r", "R")])
def test_a_missing_runtime_names_the_template_that_has_it(language: str, runtime: str) -> None:
    # A PATH with python3 and bash but no node or Rscript, as a template without them.
    bin_dir = Path(tempfile.mkdtemp(prefix="corral-driver-bin-"))
    try:
        for tool in ("python3", "bash"):
            (bin_dir / tool).symlink_to(shutil.which(tool, path="/usr/bin:/bin") or tool)
        out = subprocess.run([PYTHON, "-I", "-u", "-c", driver_source(), str(bin_dir),
                              language], env={"PATH": str(bin_dir)}, capture_output=True,
                             text=True, timeout=30, stdin=subprocess.DEVNULL)
    finally:
        shutil.rmtree(bin_dir, ignore_errors=True)
    messages = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert out.returncode == 3 and [m["ev"] for m in messages] == ["fatal"], out
    said = messages[0]["message"]
    assert f"the {language} kernel could not start: {runtime} is not installed" in said
    assert "the code-interpreter template has it" in said


@needs_node
def test_javascript_state_await_redeclaration_and_a_forged_line() -> None:
    driver = Driver("javascript")
    try:
        driver.run("const a = 1; let b = [a]; function twice(x) { return 2 * x }")
        events = driver.run("const a = await Promise.resolve(20)\ntwice(a) + b.length")
        assert [e["data"]["text/plain"] for e in events if e["ev"] == "result"] == ["41"]
        # Lines written to the kernel's own pipe by the cell: not JSON, or not a message.
        forged = driver.run("const fs = require('fs'), fd = Number(process.argv[1])\n"
                            "fs.writeSync(fd, 'not json\\n[1]\\n{\"no\": 1}\\n')\n'after'")
        assert [e["ev"] for e in forged] == ["count", "result", "end"]
        assert forged[1]["data"] == {"text/plain": "'after'"}
    finally:
        driver.close()


@needs_r
def test_r_state_plots_and_a_forged_frame_restarts_the_kernel() -> None:
    driver = Driver("r")
    try:
        assert driver.ready["kernel"] == "r"
        events = driver.run("x <- 41\nx + 1")
        assert [e["data"]["text/plain"] for e in events if e["ev"] == "result"] == ["[1] 42"]
        plot = [e for e in driver.run("plot(1:3)") if e["ev"] == "result"]
        assert len(plot) == 1 and plot[0]["main"] is False
        assert plot[0]["data"]["image/png"].startswith("iVBORw0KGgo")
        # The cell writes to the kernel's pipe: the driver cannot follow the stream any more,
        # says so, and ends (the host starts a fresh kernel for the next cell).
        forged = driver.run(
            "cons <- as.data.frame(showConnections(all = TRUE))\n"
            "n <- as.integer(rownames(cons)[grepl('/proc/self/fd', cons$description)][1])\n"
            "con <- getConnection(n)\nwriteBin(charToRaw('garbage\\n'), con)\nflush(con)")
        errors = [e for e in forged if e["ev"] == "error"]
        assert [e["name"] for e in errors] == ["KernelExited"], forged
        assert "written to by the cell" in errors[0]["value"]
        assert driver.proc.wait(timeout=10) == 0
    finally:
        driver.close()
