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
    # Go modules download through the egress gateway (GOPROXY's host allowed) or come vendored;
    # git for modules fetched from version control.
    "go": TemplateSpec(
        name="go",
        description="Go with its toolchain, git and a C toolchain for cgo",
        packages=("ca-certificates", "gcc", "git", "golang-go", "libc6-dev"),
    ),
    # The microVM tier's ``base``: on the other tiers ``base`` is the host's own /usr (6 GB),
    # which a VM cannot share without 9p (and 9p blocks migration), so the microVM tier boots a
    # small Debian root of its own (corral._backends.microvm.rootimage).
    "microvm-base": TemplateSpec(
        name="microvm-base",
        description="The microVM tier's base root: python3, requests, curl, procps, iproute2",
        # bubblewrap: the isolation suite probes user namespaces with it, as an attacker would.
        packages=("bash", "bubblewrap", "ca-certificates", "coreutils", "curl", "iproute2",
                  "mount", "procps", "python3", "python3-requests", "strace", "util-linux"),
    ),
}
