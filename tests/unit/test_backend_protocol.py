"""What the backend protocol promises, read from the source: it names no host location, and a
tier's name is declared once. Who may import whom is import-linter's ([tool.importlinter] in
pyproject.toml; scripts/test runs ``lint-imports``)."""

from __future__ import annotations

import ast
from pathlib import Path

import corral

SRC = Path(corral.__file__).parent


def test_the_backend_protocol_names_no_host_location() -> None:
    tree = ast.parse((SRC / "backends.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert not imported & {"socket", "pathlib", "os"}, imported
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not names & {"Path", "PurePath", "socket"}, names & {"Path", "PurePath", "socket"}
    protocol = next(node for node in tree.body
                    if isinstance(node, ast.ClassDef) and node.name == "IsolationBackend")
    methods = {n.name for n in protocol.body if isinstance(n, ast.FunctionDef)}
    assert {"files", "egress_endpoint", "allocate_uid"} <= methods
    assert not {"workspace_root", "open_listener"} & methods


def test_a_tier_name_is_declared_once() -> None:
    from typing import get_args

    from corral._backends import BACKENDS
    from corral._settings import Settings
    from corral.backends import BackendName

    assert set(BACKENDS) == set(get_args(BackendName))
    assert Settings.model_fields["backend"].annotation == BackendName
