"""The templates Corral knows how to build without a spec file."""

from __future__ import annotations

from .spec import TemplateSpec

__all__ = ["BUILTIN_SPECS"]

BUILTIN_SPECS: dict[str, TemplateSpec] = {
    "python": TemplateSpec(
        name="python",
        description="Python 3 with pip and venv, git, curl and a C toolchain for native wheels",
        packages=("build-essential", "ca-certificates", "curl", "git", "python3",
                  "python3-pip", "python3-venv"),
    ),
    # The code interpreter's kernels (corral._interpreter): IPython over python3, with the
    # libraries cells most often import; bash is in every Debian root. E2B's
    # ``code-interpreter-v1`` maps here.
    "code-interpreter": TemplateSpec(
        name="code-interpreter",
        description="Python 3 with IPython, numpy, pandas and matplotlib for run_code()",
        packages=("ca-certificates", "python3", "python3-ipython", "python3-matplotlib",
                  "python3-numpy", "python3-pandas"),
    ),
    "node": TemplateSpec(
        name="node",
        description="Node.js with npm",
        packages=("ca-certificates", "nodejs", "npm"),
    ),
}
