"""Hugging Face integrations: the Accelerate plugin and the Trainer glue.

``import hf_flexdemo`` imports neither library. It calls :func:`activate_on_import`: each
integration is installed as soon as its library is imported in this process (at once if it
already was), so ``optim="flexdemo"`` works in the stock Trainer whatever the import order,
and a plain FSDP2 program that never imports transformers or Accelerate gets the optimizer
alone, with nothing patched.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading

from .. import refusals

_INSTALLING: set[str] = set()  # the plugin's own imports fire the hook again: ignore those


def install_accelerate() -> None:
    if "accelerate" in _INSTALLING:
        return
    _INSTALLING.add("accelerate")
    try:
        from . import accelerate_plugin

        accelerate_plugin.install()
    finally:
        _INSTALLING.discard("accelerate")


def install_transformers() -> None:
    if "transformers" in _INSTALLING:
        return
    _INSTALLING.add("transformers")
    try:
        install_accelerate()  # the Trainer prepares its model through Accelerate
        from . import trainer

        trainer.install()
    finally:
        _INSTALLING.discard("transformers")


def install() -> None:
    """Make Accelerate and the Trainer FlexDeMo-aware now (idempotent)."""
    install_transformers()


_ON_IMPORT = {"accelerate": install_accelerate, "transformers": install_transformers}
_OWN = __name__ + "."
_LOCK = threading.RLock()
_own_depth = 0  # integration modules being executed right now (imported directly, not by install)
_deferred: list = []


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a library's install function right after the library's own module has executed.

    An integration module imported directly (``from hf_flexdemo.integrations.checkpoints
    import ...``) imports the library before it is complete itself; the install, which
    imports that module again, then waits until the integration module has finished.
    """

    def find_spec(self, fullname, path, target=None):
        if fullname not in _ON_IMPORT and not fullname.startswith(_OWN):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                if fullname in _ON_IMPORT:
                    _run_after_exec(spec.loader, _ON_IMPORT[fullname])
                else:
                    _count_own_exec(spec.loader)
                return spec
        return None


def _run_after_exec(loader, hook) -> None:
    original = loader.exec_module

    def exec_module(module):
        original(module)
        if _own_depth:
            _deferred.append(hook)
        else:
            hook()

    loader.exec_module = exec_module  # this module's loader instance only


def _count_own_exec(loader) -> None:
    original = loader.exec_module

    def exec_module(module):
        global _own_depth
        _own_depth += 1
        try:
            original(module)
        finally:
            _own_depth -= 1
        while not _own_depth and _deferred:
            _deferred.pop(0)()

    loader.exec_module = exec_module


def activate_on_import() -> None:
    """Install each integration now if its library is imported, else right after it is.

    Also makes an uncaught refusal print its message once instead of a traceback per process
    (:mod:`hf_flexdemo.refusals`).
    """
    refusals.install()
    with _LOCK:
        for name, hook in _ON_IMPORT.items():
            if name in sys.modules:
                hook()
        if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())
