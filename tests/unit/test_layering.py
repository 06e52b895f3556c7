"""Structure the redesign promises, checked over the source with ``ast``: the backend protocol
names no host location, and no two modules of ``corral`` import each other (at run time)."""

from __future__ import annotations

import ast
from pathlib import Path

import corral

SRC = Path(corral.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in SRC.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: module level, ``try``/``if`` blocks included,
    ``if TYPE_CHECKING`` and function bodies (deliberately lazy) left out."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody,
                              *(h.body for h in node.handlers)):
                    visit(block)
    visit(tree.body)
    return found


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in MODULES}
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES}
    if target in MODULES and len(found) < len(node.names):
        found.add(target)
    return found


def _parse(path: Path) -> ast.Module:
    source = path.read_text()
    try:
        return ast.parse(source, str(path))
    except SystemError:
        # CPython 3.11 keeps the AST constructor's recursion depth in interpreter-wide state:
        # with other threads running Python meanwhile (daemon threads left by earlier tests in
        # this session), a good file can fail with "AST constructor recursion depth mismatch"
        # (python/cpython#106905; pytest-dev/pytest#10763). Parsed again, it parses.
        return ast.parse(source, str(path))


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = _parse(path)
        graph[module] = set().union(*(_targets(module, n) for n in _runtime_imports(tree)))
        graph[module].discard(module)
    return graph


def test_no_import_cycle_between_modules() -> None:
    graph = _graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_graph_sees_real_imports() -> None:
    """Guard against a checker that passes because it finds nothing."""
    graph = _graph()
    assert "corral.backends" in graph["corral._backends._linux.host"]
    assert "corral._backends._linux.cgroups" in graph["corral._backends.namespace.backend"]


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
