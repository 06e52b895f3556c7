"""The templates Corral knows how to build without a spec file."""

from __future__ import annotations

from .spec import TemplateFile, TemplateSpec

__all__ = ["BUILTIN_SPECS"]

BUILTIN_SPECS: dict[str, TemplateSpec] = {
    "python": TemplateSpec(
        name="python",
        description="Python 3 with pip and venv, git, curl and a C toolchain for native wheels",
        packages=("build-essential", "ca-certificates", "curl", "git", "python3",
                  "python3-pip", "python3-venv"),
    ),
    # The code interpreter's kernels (corral._kernels): IPython over python3 with the data
    # stack generated code imports, node (JavaScript, and TypeScript through Debian's tsc
    # module), R (r-base-core; plots through its cairo png device) and bash, which is in every
    # Debian root; plus pip, git and curl, as in E2B's template. E2B's ``code-interpreter-v1``
    # maps here. All from Debian bookworm (no recommends): 697 packages, 1.9 GB, built in about
    # 4-6 min on 2 cores (bench/README.md). R is ~40 MB of it; scipy's dependency on pythran
    # brings g++, boost's headers and python3-dev (~0.5 GB), which pip's native builds use too.
    "code-interpreter": TemplateSpec(
        name="code-interpreter",
        description="Python 3 (IPython and the data stack), Node.js with TypeScript, R, bash, "
                    "pip, git and curl for run_code()",
        packages=(
            "ca-certificates", "curl", "git",
            "python3", "python3-pip", "python3-venv", "python3-ipython",
            "python3-numpy", "python3-pandas", "python3-matplotlib", "python3-seaborn",
            "python3-scipy", "python3-sklearn", "python3-requests", "python3-openpyxl",
            "python3-bs4", "python3-plotly",
            "nodejs", "npm", "node-typescript",
            "r-base-core",
        ),
        files=(
            # Debian's pip refuses every install into its python3 (PEP 668: "externally
            # managed"), --user ones too. The sandbox's root is read-only anyway, so pip falls
            # back to a user install into $HOME/.local, the workspace, where the kernel looks
            # (python_driver adds the user site): this only lets it. A venv is unaffected. The
            # index comes from the sandbox's pypi preset (PIP_INDEX_URL, which ranks above this
            # file); without one the sandbox has no network and pip says it cannot connect.
            TemplateFile(path="/etc/pip.conf", content=(
                "[global]\n"
                "break-system-packages = true\n"
                "disable-pip-version-check = true\n")),
        ),
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
