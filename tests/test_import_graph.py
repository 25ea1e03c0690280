"""Imports inside hf_flexdemo, and among the scripts under benchmarks/, point one way: no module imports, directly or
through others, one that imports it; and no benchmark a user runs imports a research study.

Every import counts: at module level, inside functions (imported later, still a dependency) and under
``if TYPE_CHECKING:`` (never run, but two modules whose annotations name each other are one idea split in two).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.lowest]

PACKAGE = Path(__file__).resolve().parents[1] / "hf_flexdemo"
BENCHMARKS = PACKAGE.parent / "benchmarks"
USER_BENCHMARKS = ("step", "link", "fault_tolerance")
"""The folders of benchmarks/ a user runs (BENCHMARKS.md); the research studies are ``RESEARCH_STUDIES``."""
RESEARCH_STUDIES = ("quality", "probes")


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


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_the_optimizer_core_reaches_neither_fault_tolerance_nor_the_integrations():
    """Fault tolerance wraps the step from outside (fault_tolerance/rounds.py), and the optimizer never imports
    transformers or Accelerate: nothing under hf_flexdemo.optim reaches those modules, even through others."""
    graph = import_graph(PACKAGE)
    outside = ("hf_flexdemo.fault_tolerance", "hf_flexdemo.integrations")
    for name in (m for m in graph if m.split(".")[:2] == ["hf_flexdemo", "optim"]):
        found = sorted(m for m in reaches(graph, name) if ".".join(m.split(".")[:2]) in outside)
        assert not found, f"{name} reaches {found}"
    assert "hf_flexdemo.optim.in_flight" in reaches(graph, "hf_flexdemo.fault_tolerance.rounds")  # the walk works


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


def script_graph(folder: Path) -> dict[str, set[str]]:
    """Script -> the scripts it imports, each named by its path under ``folder`` without ``.py``.

    Scripts are run by path, not as a package: one imports another by its bare name once the other's folder is on
    ``sys.path`` (its own folder is; another it inserts, ``sys.path.insert(0, ...)``). A name is the one script of
    that name under ``folder`` (:func:`test_every_benchmark_script_has_its_own_name`); every import counts."""
    paths = {path.relative_to(folder).with_suffix("").as_posix(): path for path in sorted(folder.rglob("*.py"))}
    by_name = {path.stem: name for name, path in paths.items()}
    graph = {}
    for name, path in paths.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                imported.add(node.module.partition(".")[0])
        graph[name] = {by_name[stem] for stem in imported if stem in by_name} - {name}
    return graph


def test_every_benchmark_script_has_its_own_name():
    """Two scripts of one name: which one ``import name`` gets would hang on the order of ``sys.path``."""
    stems = [path.stem for path in BENCHMARKS.rglob("*.py")]
    assert len(stems) == len(set(stems)), sorted(stem for stem in set(stems) if stems.count(stem) > 1)


def test_no_benchmark_script_imports_one_that_imports_it():
    graph = script_graph(BENCHMARKS)
    assert "quality/long_run" in graph["quality/long_report"]  # the sibling imports resolve
    assert "harness" in graph["step/optimizer_step"]  # and those of a folder put on sys.path
    found = circles(graph)
    assert not found, "import circles under benchmarks/:\n" + "\n".join(" -> ".join(circle) for circle in found)


def test_no_user_benchmark_imports_a_research_study():
    """What a user runs stands apart from the studies: a piece both need lives with the user's benchmarks (a
    study may import those)."""
    graph = script_graph(BENCHMARKS)
    reached = {}

    def reach(name: str) -> set[str]:
        if name not in reached:
            reached[name] = set()
            for target in graph[name]:
                reached[name] |= {target} | reach(target)
        return reached[name]

    found = [
        f"{name} -> {target}"
        for name in graph
        if name.split("/")[0] in USER_BENCHMARKS
        for target in sorted(reach(name))
        if target.split("/")[0] in RESEARCH_STUDIES
    ]
    assert not found, "user benchmarks importing research studies:\n" + "\n".join(found)


def test_a_circle_between_scripts_of_two_folders_is_found(tmp_path):
    """A script that puts another folder on sys.path and imports its script inside a function, which imports the
    first back by name: the circle ``long_run.py`` once dodged with imports inside its functions."""
    (tmp_path / "stages").mkdir()
    (tmp_path / "entry").mkdir()
    (tmp_path / "entry" / "study.py").write_text(
        "import sys\nfrom pathlib import Path\n\nimport matplotlib.pyplot\n\n"
        'sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stages"))\n\n\n'
        "def main():\n    import stage\n"
    )
    (tmp_path / "stages" / "stage.py").write_text("from study import launch\n")
    (tmp_path / "stages" / "alone.py").write_text("import json\n")
    graph = script_graph(tmp_path)
    assert graph == {"entry/study": {"stages/stage"}, "stages/stage": {"entry/study"}, "stages/alone": set()}
    assert circles(graph) == [["entry/study", "stages/stage", "entry/study"]]
