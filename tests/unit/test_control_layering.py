"""The control plane, the audit layer and the server depend one way: no import cycle among
their modules, the services never reach back into the Manager, and the audit layer knows
nothing above it. Read from the source (ast), so no root and no import side effects."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
OWNED = ("corral._control", "corral._audit", "corral._server")


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, *, typing_too: bool = False) -> set[str]:
    """Modules imported when ``path`` is imported: top level, outside ``if TYPE_CHECKING``
    (inside too with ``typing_too``: a type-only import still says who knows whom)."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) \
                and not typing_too:
            continue
        for child in ast.walk(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                break  # a local import runs later, not at import time
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package
                for _ in range(child.level - 1):
                    base = base.rpartition(".")[0]
                target = ".".join(p for p in (base if child.level else "", child.module or "")
                                  if p)
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in child.names)
    return found


def _graph(*, typing_too: bool = False) -> dict[str, set[str]]:
    modules = {_module(p): p for p in (SRC / "corral").rglob("*.py")}
    return {name: {m for m in _runtime_imports(path, typing_too=typing_too)
                   if m in modules and m != name}
            for name, path in modules.items() if name.startswith(OWNED)}


@pytest.mark.parametrize("typing_too", [False, True], ids=["runtime", "with-type-imports"])
def test_no_import_cycle_in_the_control_plane_audit_or_server(typing_too: bool) -> None:
    # With type-only imports too: a TYPE_CHECKING import hides an object-graph cycle (the
    # Manager made a ProcessTable that called the Manager back) from the runtime graph only.
    graph = _graph(typing_too=typing_too)
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt in graph and state.get(nxt) is None:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if state.get(name) is None:
            visit(name, [name])


def test_no_service_imports_the_manager() -> None:
    graph = _graph()
    for name, imports in graph.items():
        if name.startswith("corral._control.") and name != "corral._control.manager":
            assert "corral._control.manager" not in imports, name


def test_processes_know_only_the_runner_protocol() -> None:
    imports = _runtime_imports(SRC / "corral" / "_control" / "processes.py", typing_too=True)
    assert not any(m.startswith(("corral._control.manager", "corral._control.commands",
                                 "corral._control.sandboxes")) for m in imports), imports
