"""Every change hf_flexdemo makes inside transformers and Accelerate, in one list.

Neither library has a public hook for these jobs (an optimizer name for ``TrainingArguments.optim``, the FSDP2 layout
FlexDeMo needs, the checkpoint ``train()`` resumes from). Each one is an entry of :data:`PATCHES` and is applied
through :func:`wrap` or :func:`located`, which refuse a target that is not listed. So this file is the whole
list a library release can break, and ``tests/test_library_symbols.py`` checks every entry against the installed
versions: the target exists, and after ``import hf_flexdemo`` each entry that applies to the version is in place.

A library newer than the versions an entry was checked on is said once in the log (the patch is still applied: the
test suite of the newer release is what tells). A target the release moved stops the install with the entry's name.

The Trainer's patches act on FlexDeMo runs (``optim="flexdemo"``) only: each hands a run with another optimizer to
the original untouched, so such a Trainer behaves as stock transformers (refusing only FlexDeMo's keys in its
``optim_args``). The Accelerate patches act on every launch, whatever the optimizer: a launch with this package's
Accelerate configs keeps the layout they set (FSDP2 on CPU, gloo), which the AdamW-HSDP baseline trains on too.

Outside the two libraries, ``hf_flexdemo`` adds an import hook (:mod:`hf_flexdemo.integrations`, so that installing
waits for the library's import) and wraps ``sys.excepthook`` once per process (:mod:`hf_flexdemo.refusals`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Patch:
    target: str
    """The patched symbol's full dotted name."""
    change: str
    """What is done to it: ``wrapped`` (the original still runs), ``member added``, ``entry added``."""
    why: str
    checked: tuple[str, str]
    """Versions of the target's library it was checked on: the lowest supported, and the newest."""
    applies_below: str | None = None
    """Only for library versions below this one (a symbol a later major version replaced)."""
    applies_from: str | None = None
    """Only for library versions from this one on."""

    @property
    def library(self) -> str:
        return self.target.partition(".")[0]

    def applies(self, version: str) -> bool:
        here = Version(version)
        below = self.applies_below is None or here < Version(self.applies_below)
        return below and (self.applies_from is None or here >= Version(self.applies_from))


ACCELERATE = ("1.10.1", "1.16.0")
FIRST_OF_5 = "5.0.0.dev0"
"""transformers' 5.x line from its first pre-release on, which has the optimizer table."""
TRANSFORMERS = ("4.57.1", "5.24.0")

PATCHES: tuple[Patch, ...] = (
    Patch(
        "accelerate.state.PartialState.__init__",
        "wrapped",
        "a distributed launch on a machine without an accelerator runs on CPU with gloo, instead of N processes "
        "that each train alone (every optimizer)",
        ACCELERATE,
    ),
    Patch(
        "accelerate.utils.FullyShardedDataParallelPlugin.__post_init__",
        "wrapped",
        "FSDP1 on CPU and FSDP1 spellings under FSDP2 are refused with a message that says what to write (every "
        "optimizer)",
        ACCELERATE,
    ),
    Patch(
        "accelerate.state.AcceleratorState.__init__",
        "wrapped",
        "FSDP stays FSDP on a machine without a GPU (Accelerate turns it into DDP without a word), for every "
        "optimizer: AdamW-HSDP on cpu_2x2.yaml is the baseline",
        ACCELERATE,
    ),
    Patch(
        "accelerate.Accelerator.prepare",
        "wrapped",
        "FSDP2 shards inside a node only when the optimizer is FlexDeMo, which then gets the replicate dimension",
        ACCELERATE,
    ),
    Patch(
        "transformers.TrainingArguments.__post_init__",
        "wrapped",
        "optim='flexdemo' with bf16=True on a machine without a GPU trains in bf16 on the CPU instead of failing on "
        "every process; bad optim_args are refused when the arguments are built, before a script loads data (under "
        "another optimizer: FlexDeMo's keys only, the rest is stock)",
        TRANSFORMERS,
    ),
    Patch(
        "transformers.Trainer.__init__",
        "wrapped",
        "a FlexDeMo Trainer: refusals before any data is loaded, FlexDeMo's callbacks ahead of the reporters, the "
        "torchft node (another optimizer's Trainer is stock, but for FlexDeMo's keys in optim_args)",
        TRANSFORMERS,
    ),
    Patch(
        "transformers.Trainer.train",
        "wrapped",
        "a FlexDeMo run resumes from the newest complete checkpoint; a checkpoint of another model or another rule "
        "is refused (another optimizer's run: the stock train)",
        TRANSFORMERS,
    ),
    Patch(
        "transformers.Trainer.save_model",
        "wrapped",
        "a FlexDeMo run's final model is saved whole in the Hub format (gathered on rank 0) also under a sharded FSDP "
        "state dict, where the stock method writes no weights (another optimizer's run: the stock save)",
        TRANSFORMERS,
    ),
    Patch(
        "transformers.modelcard.extract_hyperparameters_from_trainer",
        "wrapped",
        "the model card's optimizer line names FlexDeMo, its acting settings and the layout",
        TRANSFORMERS,
    ),
    Patch(
        "transformers.training_args.OptimizerNames",
        "member added",
        "TrainingArguments validates optim against this enum: optim='flexdemo' becomes a member",
        TRANSFORMERS,
    ),
    Patch(
        "transformers.trainer_optimizer._OPTIMIZER_HANDLERS",
        "entry added",
        "the Trainer builds its optimizer from this table: optim='flexdemo' builds FlexDeMo",
        TRANSFORMERS,
        applies_from=FIRST_OF_5,
    ),
    Patch(
        "transformers.Trainer.get_optimizer_cls_and_kwargs",
        "wrapped",
        "transformers 4.x builds its optimizer here (no table): optim='flexdemo' builds FlexDeMo",
        TRANSFORMERS,
        applies_below=FIRST_OF_5,
    ),
)
"""Every patch into transformers and Accelerate, in the order they are applied."""

_BY_TARGET = {patch.target: patch for patch in PATCHES}
_APPLIED: set[str] = set()
_SAID_NEWER: set[str] = set()


def library_version(library: str) -> str:
    return importlib.import_module(library).__version__


def located(target: str) -> tuple[Any, str, Any]:
    """``(owner, attribute, value)`` of a listed target, checked: refused if unlisted, for this version, or moved.

    The caller applies the change; the target then counts as applied (:func:`applied`).
    """
    patch = _BY_TARGET.get(target)
    if patch is None:
        raise RuntimeError(f"hf_flexdemo: {target} is patched but not listed in {__name__}.PATCHES; list it there.")
    version = library_version(patch.library)
    if not patch.applies(version):
        raise RuntimeError(f"hf_flexdemo: {target} does not apply to {patch.library} {version} (see its entry).")
    owner, name = _owner_of(target)
    if owner is None or not hasattr(owner, name):
        raise RuntimeError(
            f"hf_flexdemo: {patch.library} {version} has no {target}, which hf_flexdemo patches ({patch.why}); it "
            f"was checked on {patch.library} {patch.checked[0]} to {patch.checked[1]}. Install a version in that "
            "range, or a newer hf_flexdemo."
        )
    if Version(version) > Version(patch.checked[1]) and patch.library not in _SAID_NEWER:
        _SAID_NEWER.add(patch.library)
        logger.info(
            "hf_flexdemo: %s %s is newer than the %s its patches were checked on (%s lists them).",
            patch.library, version, patch.checked[1], __name__,
        )  # fmt: skip
    _APPLIED.add(target)
    return owner, name, getattr(owner, name)


def wrap(target: str, wrapper: Callable) -> None:
    """Replace the listed function or method ``target`` by ``wrapper(original, *args, **kwargs)`` (a method's
    ``self`` comes first in ``args``; a static method stays static)."""
    owner, name, original = located(target)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        return wrapper(original, *args, **kwargs)

    static = isinstance(owner, type) and isinstance(inspect.getattr_static(owner, name), staticmethod)
    setattr(owner, name, staticmethod(wrapped) if static else wrapped)


def applies(target: str) -> bool:
    """Whether the listed ``target`` is patched on the installed version of its library."""
    patch = _BY_TARGET[target]
    return patch.applies(library_version(patch.library))


def applied() -> frozenset[str]:
    """The targets patched in this process so far."""
    return frozenset(_APPLIED)


def _owner_of(target: str) -> tuple[Any, str]:
    """The object that holds ``target``'s last name (the longest importable module prefix, then attributes), or
    ``None`` if one of the names between moved."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:-1]:
            if not hasattr(owner, part):
                return None, parts[-1]
            owner = getattr(owner, part)
        return owner, parts[-1]
    raise RuntimeError(f"hf_flexdemo: no module of {target} imports")
