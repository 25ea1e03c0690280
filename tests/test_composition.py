"""The optimizer is made of parts that keep to their contracts (issue 48).

- No class in ``hf_flexdemo`` reads an attribute of ``self`` that neither it nor a class it derives from
  defines: a part that needs another's data receives it (the mixins that read the optimizer's attributes are gone).
- A part that holds another through a ``Protocol`` (``self.pipeline: StepPipeline``) reads only what the protocol
  declares, and the optimizer provides all of it.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from pathlib import Path

import pytest
import torch

from hf_flexdemo import FlexDeMo
from hf_flexdemo.fault_tolerance.pipeline import StepPipeline

pytestmark = [pytest.mark.unit, pytest.mark.lowest]

PACKAGE = Path(__file__).resolve().parents[1] / "hf_flexdemo"


@functools.cache
def _classes() -> list[tuple[type, ast.ClassDef]]:
    """Every class of the package with its syntax tree. Imported when a test runs, not at collection: the kernel
    tests set TRITON_INTERPRET before anything imports triton."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and isinstance(getattr(module, node.name, None), type):
                found.append((getattr(module, node.name), node))
    return found


def _self_attributes(node: ast.AST, contexts: tuple[type, ...]) -> set[str]:
    return {
        sub.attr
        for sub in ast.walk(node)
        if isinstance(sub, ast.Attribute)
        and isinstance(sub.value, ast.Name)
        and sub.value.id == "self"
        and isinstance(sub.ctx, contexts)
    }


def _defined(cls: type) -> set[str]:
    """What ``cls`` and its bases define: class attributes and methods, and every ``self.x`` they assign."""
    names = set()
    for base in cls.__mro__:
        names |= set(vars(base))
        try:
            source = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError):  # a builtin
            continue
        names |= _self_attributes(source, (ast.Store, ast.Del))
        names |= {
            item.target.id
            for item in source.body[0].body
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
        }
    return names


def _protocol_members(protocol: type) -> set[str]:
    """A protocol's attributes (annotated) and methods."""
    return {name for name in vars(protocol) if not name.startswith("_")} | set(protocol.__annotations__)


def test_no_class_reads_an_attribute_it_neither_defines_nor_receives():
    foreign = {}
    for cls, node in _classes():
        missing = _self_attributes(node, (ast.Load,)) - _defined(cls)
        if missing:
            foreign[f"{cls.__module__}.{cls.__qualname__}"] = sorted(missing)
    assert foreign == {}, "classes that read attributes created elsewhere (pass them in instead)"
    assert len(_classes()) > 60  # the walk reached the package


def test_a_part_reads_the_optimizer_only_through_the_step_pipeline_and_the_optimizer_provides_it():
    members = _protocol_members(StepPipeline)
    readers = 0
    for cls, node in _classes():
        held = {  # self.x: StepPipeline = ...
            item.target.attr
            for item in ast.walk(node)
            if isinstance(item, ast.AnnAssign)
            and isinstance(item.target, ast.Attribute)
            and isinstance(item.annotation, ast.Name)
            and item.annotation.id == StepPipeline.__name__
        }
        for name in held:
            readers += 1
            used = {
                sub.attr
                for sub in ast.walk(node)
                if isinstance(sub, ast.Attribute)
                and isinstance(sub.value, ast.Attribute)
                and isinstance(sub.value.value, ast.Name)
                and sub.value.value.id == "self"
                and sub.value.attr == name
            }
            assert used <= members, f"{cls.__qualname__} reads {sorted(used - members)} outside StepPipeline"
    assert readers >= 2  # the quorum rounds and the replica state
    opt = FlexDeMo([torch.nn.Parameter(torch.zeros(4, 4))], elementwise=[])
    opt.attach(None)  # the layout is decided: ``store`` exists
    assert {name for name in members if not hasattr(opt, name)} == set()
    assert all(callable(getattr(opt, name)) for name in vars(StepPipeline) if not name.startswith("_"))


def test_the_check_sees_a_mixin_that_reads_its_hosts_attributes():
    mixin = ast.parse("class Mixin:\n    def total(self):\n        return self.state['x'] + self.own\n").body[0]
    assert _self_attributes(mixin, (ast.Load,)) == {"state", "own"}
    assert "state" not in _defined(object)
