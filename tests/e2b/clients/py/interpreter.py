"""Scenario 6, the code interpreter, through the official ``e2b_code_interpreter`` (latest/mid).

Usage: python interpreter.py
"""

from __future__ import annotations

from _steps import done, step
from e2b_code_interpreter import Sandbox

sb = step("create", lambda: Sandbox.create(timeout=240, envs={"CORRAL_T": "from-create"}),
          seconds=90)
step("id", lambda: sb.sandbox_id)


def run(code: str, **kw: object) -> dict[str, object]:
    out: list[str] = []
    err: list[str] = []
    ex = sb.run_code(code, on_stdout=lambda m: out.append(m.line),
                     on_stderr=lambda m: err.append(m.line), **kw)
    return {
        "text": ex.text,
        "count": ex.execution_count,
        "stdout": ex.logs.stdout, "stderr": ex.logs.stderr,
        "on_stdout": out, "on_stderr": err,
        "error": None if ex.error is None else {"name": ex.error.name,
                                                 "value": ex.error.value,
                                                 "traceback": ex.error.traceback[-500:]},
        "results": [{"formats": sorted(r.formats()), "is_main": r.is_main_result,
                     "png_head": (r.png or "")[:12], "html": (r.html or "")[:300],
                     "text": r.text} for r in ex.results],
    }


step("first_cell", lambda: run("x = 1"), seconds=90)  # may start the kernel
step("state_kept", lambda: run("x + 1"))
step("streams", lambda: run("import sys\nprint('to out')\nprint('to err', file=sys.stderr)"))
step("png", lambda: run("import matplotlib\nmatplotlib.use('Agg')\n"
                        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"),
     seconds=90)
step("dataframe", lambda: run("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})"),
     seconds=90)
step("zero_division", lambda: run("1/0"))
step("count_a", lambda: run("1"))
step("count_b", lambda: run("2"))
step("envs", lambda: run("import os\nos.environ.get('CI_VAR')", envs={"CI_VAR": "from envs"}))
step("cwd", lambda: run("import os\nos.getcwd()"))
step("create_envs", lambda: run("os.environ.get('CORRAL_T')"))  # E2B's global environment


def contexts() -> dict[str, object]:
    ctx = sb.create_code_context(cwd="/home/user")
    out: dict[str, object] = {"ctx": {"id": ctx.id, "language": ctx.language, "cwd": ctx.cwd}}
    out["set"] = run("y = 5", context=ctx)
    out["get"] = run("y", context=ctx)
    out["default_lacks"] = run("y")
    out["listed"] = [c.id for c in sb.list_code_contexts()]
    sb.restart_code_context(ctx)
    out["after_restart"] = run("y", context=ctx)
    sb.remove_code_context(ctx)
    out["listed_after_remove"] = [c.id for c in sb.list_code_contexts()]
    return out


step("contexts", contexts, seconds=90)
step("language_and_context", lambda: sb.run_code("1", language="python",
                                                 context=sb.create_code_context()))
step("bash", lambda: run("echo from-bash", language="bash"))
step("kill_sandbox", lambda: sb.kill())
done()
