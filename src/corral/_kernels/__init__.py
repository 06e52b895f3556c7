"""The code interpreter's in-sandbox drivers, shipped as source and run inside the sandbox as a
declared background process (``python3 -I -u -c <source> <cwd> <language>``): nothing is
written into the workspace. ``python_driver.py`` speaks the JSON-lines protocol described in
its docstring for Python (IPython, or a plain fallback) and bash itself, and for JavaScript and
TypeScript (``node_kernel.js``, when the template has node) and R (``r_kernel.R``, when it has
Rscript) through their runtimes, which it starts as its children."""

from __future__ import annotations

from functools import cache
from importlib import resources

__all__ = ["driver_source"]


@cache
def driver_source() -> str:
    """The driver's source text, as ``python3 -c`` runs it: the other runtimes' kernels in
    ``_SOURCES`` first, then ``python_driver.py``."""
    files = resources.files(__package__)
    sources = {"node": files.joinpath("node_kernel.js").read_text("utf-8"),
               "r": files.joinpath("r_kernel.R").read_text("utf-8")}
    driver = files.joinpath("python_driver.py").read_text("utf-8")
    return f"_SOURCES = {sources!r}\n{driver}"
