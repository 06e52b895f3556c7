"""The code interpreter's in-sandbox drivers, shipped as Python source and run inside the
sandbox as a declared background process (``python3 -I -u -c <source> <cwd> <language>``):
nothing is written into the workspace. ``python_driver.py`` speaks the JSON-lines protocol
described in its docstring for Python (IPython, or a plain fallback), bash and
JavaScript (node with a persistent vm context, when the template has node)."""

from __future__ import annotations

from functools import cache
from importlib import resources

__all__ = ["driver_source"]


@cache
def driver_source() -> str:
    """The driver's source text, as ``python3 -c`` runs it."""
    return resources.files(__package__).joinpath("python_driver.py").read_text("utf-8")
