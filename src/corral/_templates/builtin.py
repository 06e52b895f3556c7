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
    "node": TemplateSpec(
        name="node",
        description="Node.js with npm",
        packages=("ca-certificates", "nodejs", "npm"),
    ),
}
