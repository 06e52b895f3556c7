"""The code-interpreter template's kernels through the official ``e2b_code_interpreter``
(issue 37): a figure as a cell's last expression, JavaScript, TypeScript and R cells, and a
language Corral has no kernel for.

Usage: python kernels.py
"""

from __future__ import annotations

from _steps import done, step
from e2b_code_interpreter import Sandbox

sb = step("create", lambda: Sandbox.create(timeout=240), seconds=90)
step("id", lambda: sb.sandbox_id)


def run(code: str, **kw: object) -> dict[str, object]:
    ex = sb.run_code(code, **kw)
    return {
        "text": ex.text, "stdout": ex.logs.stdout, "stderr": ex.logs.stderr,
        "error": None if ex.error is None else {"name": ex.error.name, "value": ex.error.value},
        "results": [{"formats": sorted(r.formats()), "is_main": r.is_main_result,
                     "png_head": (r.png or "")[:12], "text": r.text} for r in ex.results],
    }


step("figure_last", lambda: run("import matplotlib.pyplot as plt\n"
                                "fig, ax = plt.subplots()\nax.plot([1, 3, 2])\nfig"),
     seconds=90)
step("js", lambda: run("const v = await Promise.resolve(41)\nv + 1", language="js"),
     seconds=60)
step("ts", lambda: run("const n: number = 21\nn * 2", language="ts"), seconds=60)
step("r", lambda: run("x <- 41\nx + 1", language="r"), seconds=60)
step("r_plot", lambda: run("plot(1:10)", language="r"), seconds=60)
step("java", lambda: run("System.out.println(1);", language="java"))
step("kill_sandbox", lambda: sb.kill())
done()
