"""The import contracts' lists keep up with the code: a new control-plane module is private
to the control plane unless it is added to the façade (``_control/plane.py``)."""

from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path

import corral._control

ROOT = Path(__file__).resolve().parents[2]


def _contract(contract_id: str) -> dict[str, object]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return next(c for c in config["tool"]["importlinter"]["contracts"]
                if c["id"] == contract_id)


def test_every_control_plane_module_but_the_facade_is_protected() -> None:
    modules = {f"corral._control.{m.name}" for m in pkgutil.iter_modules(corral._control.__path__)}
    public = {"corral._control.plane", "corral._control.requests"}
    protected = set(_contract("control-plane-facade")["protected_modules"])  # type: ignore[arg-type]
    assert protected == modules - public
