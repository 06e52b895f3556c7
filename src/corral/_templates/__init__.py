"""Templates built from Debian packages: specs, the mmdebstrap builder and the on-disk catalog.

The namespace backend turns a build into a sandbox root (``_backends/namespace/template.py``);
nothing here knows about sandboxes.
"""

from __future__ import annotations

from .builder import BuildResult, build_template
from .builtin import BUILTIN_SPECS
from .catalog import BuiltTemplate, current_build, list_builds, remove_builds
from .spec import TemplateFile, TemplateSpec, check_name, load_spec_file, parse_spec

__all__ = [
    "BUILTIN_SPECS",
    "BuildResult",
    "BuiltTemplate",
    "TemplateFile",
    "TemplateSpec",
    "build_template",
    "check_name",
    "current_build",
    "list_builds",
    "load_spec_file",
    "parse_spec",
    "remove_builds",
]
