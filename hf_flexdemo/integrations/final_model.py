"""FlexDeMo's trained model, saved whole by ``Trainer.save_model`` whatever the FSDP state-dict setting.

FSDP2 with ``fsdp_state_dict_type: SHARDED_STATE_DICT`` (every shipped Accelerate config: sharded
checkpoints carry each replica's optimizer state) makes the stock ``save_model`` write no weights, no
config and no tokenizer. Here a FlexDeMo run's ``save_model`` into any folder but a ``checkpoint-N`` gathers
the full state dict on rank 0, which writes the Hub format (``model.safetensors``, sharded for big models,
``config.json``, the ``processing_class``), so ``push_to_hub`` pushes a model that ``from_pretrained``
loads. The checkpoints the Trainer writes for resuming (``checkpoint-N``) stay sharded. A run with another
optimizer gets the stock ``save_model``; :func:`save_whole_model` gives it the same save when asked for
(the ready-made scripts do, so that AdamW-HSDP's model loads as FlexDeMo's does).

- A model larger than rank 0's free host memory is not gathered: the folder gets the config and the
  tokenizer, and a warning gives the command that merges the newest complete checkpoint's shards.
- A folder that cannot be written, or a disk that fills up, stops every process with the path and
  the reason; the files are written into a hidden folder beside them first and moved in only when
  all are written, so an earlier model and every checkpoint stay whole.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoints import (
    CHECKPOINT_NAME,
    CheckpointStorageError,
    check_writable,
    newest_complete,
    storage_cause,
)
from .training_args import is_flexdemo

logger = logging.getLogger(__name__)

STAGING = ".flexdemo_saving"
"""Where rank 0 writes the model before moving it into place (inside the target folder: the same disk)."""
HEADROOM = 1.25
"""Free host memory rank 0 needs, as a multiple of the parameters' bytes (the gathered copy, and room to spare)."""
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
WEIGHT_PREFIXES = ("model-", "pytorch_model-")
MODEL_SHARDS = "pytorch_model_fsdp_0"
"""Accelerate's folder of the model's sharded state dict inside ``checkpoint-N``."""


def saves_sharded(trainer) -> bool:
    """Whether the Trainer's own saves hold sharded weights only (FSDP with a sharded state dict)."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return plugin is not None and "FULL_STATE_DICT" not in str(plugin.state_dict_type)


def is_checkpoint_folder(folder: str | os.PathLike) -> bool:
    return CHECKPOINT_NAME.match(Path(folder).name) is not None


def save_model(original, trainer, output_dir: str | None = None, _internal_call: bool = False) -> None:
    """``Trainer.save_model``: for FlexDeMo, :func:`save_whole_model`; for another optimizer, the stock method."""
    if not is_flexdemo(trainer.args):
        return original(trainer, output_dir, _internal_call)
    return save_whole_model(original, trainer, output_dir, _internal_call)


def save_whole_model(original, trainer, output_dir: str | None = None, _internal_call: bool = False) -> None:
    """The whole model in the Hub format into any folder but a ``checkpoint-N``, whatever the optimizer.

    ``original(trainer, output_dir, _internal_call)`` is the stock ``save_model``: it writes ``checkpoint-N``
    folders, and the model where the state dict is not sharded (into a folder checked to be writable)."""
    target = Path(output_dir or trainer.args.output_dir)
    if is_checkpoint_folder(target):
        return original(trainer, output_dir, _internal_call)
    if not saves_sharded(trainer):
        if trainer.args.should_save:
            check_writable(target)
        try:
            original(trainer, output_dir, _internal_call)
        except OSError as error:
            _raise_storage_error(error, target, trainer.args.output_dir, every_rank=False)
        return
    save_whole(trainer, target)
    if trainer.args.push_to_hub and not _internal_call:  # what the stock save_model does after saving
        revision = {"revision": trainer.args.hub_revision} if hasattr(trainer.args, "hub_revision") else {}
        trainer.push_to_hub(commit_message="Model save", **revision)


def save_whole(trainer, target: Path) -> None:
    """Gather the sharded model on rank 0 and write it into ``target`` (call on every process: collective)."""
    decision: list = [None]
    if _rank() == 0:
        try:
            check_writable(target)
            decision[0] = ("gather", None) if fits_in_memory(trainer.model) else ("too_big", None)
        except CheckpointStorageError as error:
            decision[0] = ("unwritable", str(error))
    _broadcast(decision)
    kind, message = decision[0]
    if kind == "unwritable":
        raise CheckpointStorageError(message, "the folder cannot be written", every_rank=True)
    if kind == "too_big":
        if _rank() == 0:
            logger.warning(too_big_message(trainer.model, target, trainer.args.output_dir))
        save_loadable(trainer, target, with_weights=False)
        return
    save_loadable(trainer, target, with_weights=True)


def save_loadable(trainer, target: str | os.PathLike, with_weights: bool) -> None:
    """Config and tokenizer into ``target``, and the gathered full weights if ``with_weights`` (collective).

    Rank 0 writes; every process raises the same :class:`CheckpointStorageError` if the write fails.
    """
    accelerator = trainer.accelerator
    state_dict = accelerator.get_state_dict(trainer.model) if with_weights else None  # gathers the shards
    failure: list = [None]
    if _rank() == 0:
        try:
            write_model(accelerator.unwrap_model(trainer.model), state_dict, Path(target), trainer)
        except Exception as error:  # safetensors' and torch's writers raise their own classes: read the cause
            cause = storage_cause(error, target)
            if cause is None:
                raise
            failure[0] = (storage_message(Path(target), trainer.args.output_dir, cause), cause)
    _broadcast(failure)
    if failure[0] is not None:
        raise CheckpointStorageError(failure[0][0], failure[0][1], every_rank=True)


def write_model(model, state_dict: dict[str, torch.Tensor] | None, target: Path, trainer=None) -> None:
    """Write ``model`` (with ``state_dict`` as its weights; ``None``: its config only) and ``trainer``'s
    ``processing_class`` into ``target``, whole or not at all: staged beside, then moved in."""
    staging = target / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        if state_dict is not None:
            args = getattr(trainer, "args", None)
            # transformers 4.x's save_safetensors=False asks for pytorch_model.bin; 5.x has no such setting.
            asked = {"safe_serialization": args.save_safetensors} if hasattr(args, "save_safetensors") else {}
            model.save_pretrained(staging, state_dict=state_dict, **asked)
        else:
            model.config.save_pretrained(staging)
        if trainer is not None and trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(staging)
        if trainer is not None:
            torch.save(trainer.args, staging / "training_args.bin")  # as the Trainer's own save does
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    written = {path.name for path in staging.iterdir()}
    if state_dict is not None:  # another layout's weights (a sharded save before a single file) must not stay
        for stale in target.iterdir():
            if stale.name not in written and _is_weight_file(stale.name):
                stale.unlink()
    for name in written:
        os.replace(staging / name, target / name)
    staging.rmdir()


def _is_weight_file(name: str) -> bool:
    return name in WEIGHT_FILES or (name.startswith(WEIGHT_PREFIXES) and name.endswith((".safetensors", ".bin")))


def parameter_bytes(model) -> int:
    """The full model's parameter bytes (a DTensor counts its global size)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def available_memory() -> int:
    """Host memory free for a new allocation on this machine, in bytes (Linux's MemAvailable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fits_in_memory(model, available: int | None = None) -> bool:
    """Whether rank 0 can hold the gathered model (:data:`HEADROOM` times its parameter bytes)."""
    available = available_memory() if available is None else available
    return parameter_bytes(model) * HEADROOM <= available


def too_big_message(model, target: Path, run_dir: str | os.PathLike, available: int | None = None) -> str:
    """The warning when the model is too large to gather: the command that merges the newest checkpoint."""
    available = available_memory() if available is None else available
    newest = newest_complete(Path(run_dir))
    gb = parameter_bytes(model) / 1e9
    head = (
        f"hf_flexdemo: the model's {gb:.1f} GB of parameters do not fit in rank 0's {available / 1e9:.1f} GB of free "
        f"host memory, so save_model wrote only the config and the tokenizer into {target}, no weights. "
    )
    if newest is None:
        return head + (
            "No complete checkpoint exists to merge: save one (--save_strategy steps) and merge its shards with "
            f"`accelerate merge-weights <output_dir>/checkpoint-N/{MODEL_SHARDS} {target}` on a machine with "
            "that much memory."
        )
    return head + (
        f"Merge the newest complete checkpoint's shards on a machine with that much memory: "
        f"`accelerate merge-weights {newest / MODEL_SHARDS} {target}` (it writes model.safetensors there)."
    )


def storage_message(target: Path, run_dir: str | os.PathLike, cause: str) -> str:
    newest = newest_complete(Path(run_dir))
    kept = f"the newest complete checkpoint, {newest}, is whole" if newest else "no checkpoint had been saved"
    merge = (
        f" (`accelerate merge-weights {newest / MODEL_SHARDS} {target}` rebuilds the model from it)" if newest else ""
    )
    return (
        f"save_model into {target.resolve()} failed: {cause}. Nothing was moved into it, so what it held before "
        f"is whole, and {kept}{merge}. Free space (or fix the rights), then save again."
    )


def _raise_storage_error(error: OSError, target: Path, run_dir, every_rank: bool):
    cause = storage_cause(error, target)
    if cause is None:
        raise error
    raise CheckpointStorageError(storage_message(target, run_dir, cause), cause, every_rank) from None


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast(box: list) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
