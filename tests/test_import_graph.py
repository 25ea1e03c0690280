"""Imports inside hf_flexdemo point one way: no module imports, directly or through others, one that imports it.

Every import counts: at module level, inside functions (imported later, still a dependency) and under
``if TYPE_CHECKING:`` (never run, but two modules whose annotations name each other are one idea split in two).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.lowest]

PACKAGE = Path(__file__).resolve().parents[1] / "hf_flexdemo"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str], package_dir: Path = PACKAGE) -> set[str]:
    """The package's modules that ``path`` imports anywhere: module level, functions, ``if TYPE_CHECKING:``."""
    here = module_name(path, package_dir)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
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


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    paths = {module_name(path, package): path for path in package.rglob("*.py")}
    graph = {name: imports_of(path, set(paths), package) for name, path in paths.items()}
    # A package that re-exports its own modules is not a circle with them: drop module -> its own package.
    return {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in graph.items()}


def test_no_module_imports_one_that_imports_it():
    found = circles(import_graph(PACKAGE))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(circle) for circle in found)


def test_a_circle_only_type_annotations_close_is_found(tmp_path):
    """The circle counters.py and flexdemo.py once made: one imports the other, which names it under TYPE_CHECKING."""
    package = tmp_path / "pkg"
    (package / "optim").mkdir(parents=True)
    (package / "__init__.py").write_text("from .optim.step import Step\n")
    (package / "optim" / "__init__.py").write_text("")
    (package / "optim" / "step.py").write_text("from .counters import Counters\n\n\nclass Step(Counters): ...\n")
    (package / "optim" / "counters.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .step import Step\n"
    )
    assert circles(import_graph(package)) == [["pkg.optim.step", "pkg.optim.counters", "pkg.optim.step"]]
