"""Imports inside hf_flexdemo point one way: no module imports, directly or through others, one that imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.lowest]

PACKAGE = Path(__file__).resolve().parents[1] / "hf_flexdemo"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except what ``if TYPE_CHECKING:`` holds (never imported at run time)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield from (node for stmt in child.orelse for node in [stmt, *runtime_nodes(stmt)])
            continue
        yield child
        yield from runtime_nodes(child)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports at run time (function-level imports too)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    return {name for name in found if name in modules and name != here}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once, as the modules along it."""
    found, done = [], set()

    def visit(name: str, trail: list[str]) -> None:
        for target in sorted(graph[name]):
            if target in trail:
                found.append(trail[trail.index(target) :] + [target])
            elif target not in done:
                visit(target, [*trail, target])
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    return found


def test_no_module_imports_one_that_imports_it():
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: imports_of(path, set(paths)) for name, path in paths.items()}
    # A package that re-exports its own modules is not a circle with them: drop module -> its own package.
    graph = {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in graph.items()}
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(circle) for circle in found)
