"""A checkpoint checked against the FlexDeMo run that resumes it, before the Trainer loads anything.

``Trainer.train`` runs these for ``optim="flexdemo"`` only; a run with another optimizer resumes as stock
transformers does.

- :func:`check_checkpoint_model`: a checkpoint of another model (an OLMo2 ``checkpoint-2``
  resumed by the T5 script, or a T5 of another size) is refused once, naming both models;
  torch's loader would fail on every process ("Missing key in checkpoint state_dict:
  model.shared.weight.", or a size mismatch), each with its traceback.
- :func:`check_saved_settings`: a checkpoint trained with a setting, scheme or wire preset that was taken out
  (:mod:`hf_flexdemo.removed`) is refused, saying why and where the finding is; its state was made by code this
  version does not have (a removed scheme's shared state, say), so torch's loader would fail or train on it wrongly.
- :func:`settle_wire`: a run that names no wire records the default it trains with in its ``optim_args`` (and so in
  every checkpoint); resumed, it takes the wire its checkpoint trained with, so that a checkpoint of an earlier
  default keeps its wire. A run that names another wire than its checkpoint's is refused, naming both.
- :func:`stop_if_complete`: a relaunch of a run that reached ``max_steps`` (or
  ``num_train_epochs``) and saved its final state says so in one line and exits with nothing
  changed.
  The Trainer would resume it, train one step past ``max_steps`` and write another checkpoint;
  and a script that goes on to evaluate and save after ``train()`` would overwrite the final
  model.

They read what is on disk: the checkpoint's ``training_args.bin`` (the run's ``optim_args``), ``config.json`` (the scripts write it into every
checkpoint), the distributed checkpoint's metadata (``pytorch_model_fsdp_0/.metadata``, the
names and shapes of the saved tensors), and the ``trainer_state.json`` of the checkpoint and
of ``output_dir``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import DEFAULT_WIRE, OLD_DEFAULT_WIRE, WIRE_CHOICES, FlexDeMoConfig, parse_optim_args
from ..removed import REMOVED_SETTINGS, removed_reason

logger = logging.getLogger(__name__)

MODEL_FOLDER = "pytorch_model_fsdp_0"
"""Where Accelerate writes FSDP's sharded model state (``FSDP_MODEL_NAME`` + ``_0``)."""
STATE_PREFIX = "model."
"""Accelerate saves the model's state dict under this key of the distributed checkpoint."""


def check_checkpoint_model(checkpoint: Path, model: torch.nn.Module | None) -> None:
    """Raise ValueError if ``checkpoint`` holds another model than ``model`` (type, tensor names or shapes)."""
    if model is None:
        return
    run_type = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    saved_type = _saved_model_type(checkpoint)
    saved = _saved_shapes(checkpoint)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    problem = ""
    if saved_type is not None and saved_type != run_type:
        problem = (
            f"it holds a model of type {saved_type!r}, and this run trains one of type {run_type!r} "
            f"({type(model).__name__})"
        )
    elif saved is not None:
        missing = sorted(set(expected) - set(saved))
        reshaped = sorted(name for name in set(expected) & set(saved) if saved[name] != expected[name])
        if missing:
            problem = (
                f"this run's model of type {run_type!r} ({type(model).__name__}) has {len(missing)} tensors "
                f"the checkpoint lacks, such as {', '.join(missing[:3])}"
            )
        elif reshaped:
            name = reshaped[0]
            problem = (
                f"{len(reshaped)} tensors have other shapes than in this run's model of type {run_type!r}, "
                f"such as {name} (saved {list(saved[name])}, this run {list(expected[name])}): "
                "another size of the model"
            )
    if problem:
        raise ValueError(
            f"Resuming from {checkpoint} is refused: {problem}. Resume from a checkpoint of this model "
            "(--resume_from_checkpoint with the same script and model settings), or start afresh in another "
            "--output_dir."
        )


TRAINING_ARGS = "training_args.bin"
"""The Trainer pickles its ``TrainingArguments`` into every checkpoint under this name."""


def _saved_flexdemo_args(checkpoint: Path):
    """The checkpoint's ``TrainingArguments`` where its run trained FlexDeMo, else None."""
    try:
        # The run's own pickle (its TrainingArguments), as Trainer._load_rng_state reads the checkpoint's rng state.
        saved = torch.load(checkpoint / TRAINING_ARGS, weights_only=False)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, AttributeError, ImportError):
        # no file, a truncated one, or a pickle of classes this install lacks: nothing to check
        return None
    optim = getattr(saved, "optim", None)
    return saved if getattr(optim, "value", optim) == "flexdemo" else None  # an OptimizerNames member, or its name


def saved_optim_args(checkpoint: Path) -> str | None:
    """The ``optim_args`` the checkpoint's run was launched with, or None where it saved none (or no FlexDeMo)."""
    return getattr(_saved_flexdemo_args(checkpoint), "optim_args", None) or None


NAMES_A_WIRE = ("wire", *WIRE_CHOICES)
"""Settings that name a run's wire: one given, neither the default nor a checkpoint's wire is taken."""
WIRE_DECIDERS = ("scheme", *NAMES_A_WIRE)
"""The settings that decide a run's wire: its checkpoint's are read alone, so that a setting of another machine
(``kernels=triton`` saved on a GPU node) does not stop a resume on this one."""


def _wire_of(optim_args: str | None, where: str, old_default: bool = False) -> FlexDeMoConfig:
    """The wire ``optim_args`` train with (``old_default``: as before the default moved: a demo run that names no
    wire sends ``OLD_DEFAULT_WIRE``)."""
    try:
        given = {k: v for k, v in parse_optim_args(optim_args).items() if k in WIRE_DECIDERS}
        if old_default and not given.keys() & set(NAMES_A_WIRE):
            was = FlexDeMoConfig(**given)
            given |= {"wire": OLD_DEFAULT_WIRE} if was.wire == DEFAULT_WIRE else {}
        return FlexDeMoConfig(**given)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{where}: its optim_args {optim_args!r} name no wire this version reads: {error}") from None


def _names_a_wire(optim_args: str | None) -> bool:
    return bool(set(NAMES_A_WIRE) & set(parse_optim_args(optim_args)))


def _with(optim_args: str | None, setting: str) -> str:
    return ",".join(filter(None, (optim_args, setting)))


def _wire(config: FlexDeMoConfig) -> tuple:
    return tuple(getattr(config, key) for key in WIRE_CHOICES)


def _wire_setting(config: FlexDeMoConfig) -> str:
    """``wire=NAME``, or the knobs where no preset names the wire ("" for a scheme that sends no top-k)."""
    if config.wire is not None:
        return f"wire={config.wire}"
    if not config.traits.top_k:
        return ""
    keys = [key for key in WIRE_CHOICES if key != "value_dtype" or not config.value_bits]  # codes carry no dtype
    return ",".join(f"{key}={str(getattr(config, key)).lower()}" for key in keys)


def settle_wire(args, checkpoint: Path | None) -> None:
    """Write into ``args.optim_args`` the wire this run trains with, where it names none.

    A fresh run records the default (:data:`~hf_flexdemo.config.DEFAULT_WIRE`), so that its checkpoints say which
    wire they trained with. A resumed run takes its checkpoint's: the checkpoint's recorded wire, or for one saved
    before the wire was recorded with no wire named, the default of its time (``OLD_DEFAULT_WIRE``). A run that
    names a wire other than its checkpoint's is refused, naming both."""
    saved = _saved_flexdemo_args(checkpoint) if checkpoint is not None else None
    if saved is None:
        if not _names_a_wire(args.optim_args) and _wire_of(args.optim_args, "this run").wire == DEFAULT_WIRE:
            args.optim_args = _with(args.optim_args, f"wire={DEFAULT_WIRE}")
        return
    was = _wire_of(saved.optim_args or None, f"Resuming from {checkpoint}", old_default=True)
    if not _names_a_wire(args.optim_args):
        args.optim_args = _with(args.optim_args, _wire_setting(was))
        logger.info("Resuming %s with the wire it trained with: %s", checkpoint, _wire_setting(was))
        return
    now = _wire_of(args.optim_args, "this run")
    if _wire(now) != _wire(was):
        raise ValueError(
            f"Resuming from {checkpoint} is refused: it was trained with {_wire_setting(was)}, and this run asks "
            f"for {_wire_setting(now)}; a wire switched mid-run would train the rest on another wire than the "
            f"error feedback was built for. Resume with {_wire_setting(was)} in optim_args (or name no wire: the "
            "checkpoint's is taken), or start a new run in another --output_dir."
        )


def check_saved_settings(checkpoint: Path) -> None:
    """Raise ValueError if the checkpoint was trained with a setting or value that was taken out."""
    text = saved_optim_args(checkpoint)
    for item in (text or "").split(","):
        key, _, value = "".join(item.split()).partition("=")
        reason = removed_reason(key, value)
        if reason is not None:
            what = key if key in REMOVED_SETTINGS else f"{key}={value}"
            raise ValueError(
                f"Resuming from {checkpoint} is refused: it was trained with {key}={value}, and {what} was "
                f"removed: {reason} Resume it with that commit's code, or start a new run in another --output_dir."
            )


def _saved_model_type(checkpoint: Path) -> str | None:
    try:
        return json.loads((checkpoint / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def _saved_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]] | None:
    """``{tensor name: global shape}`` of a sharded model checkpoint, or None where there is none."""
    folder = checkpoint / MODEL_FOLDER
    if not (folder / ".metadata").is_file():
        return None
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {
        key.removeprefix(STATE_PREFIX): tuple(getattr(value, "size", ()))
        for key, value in metadata.items()
        if key.startswith(STATE_PREFIX)
    }


def completed_run(checkpoint: Path, args) -> str | None:
    """Why resuming ``checkpoint`` with ``args`` would train nothing new, or None.

    Complete means: the checkpoint reached ``max_steps`` (or ``num_train_epochs``), and the run
    went on to its end, where it saved its state into ``output_dir`` (``trainer.save_state()``,
    as the scripts here and Hugging Face's example scripts do after ``train()``). A run that
    stopped between its last checkpoint and its end is resumed, so that it finishes.
    """
    state = _read_json(checkpoint / "trainer_state.json")
    final = _read_json(Path(args.output_dir) / "trainer_state.json")
    if state is None or final is None:
        return None
    step, epoch = state.get("global_step", 0), state.get("epoch")
    if final.get("global_step", -1) < step:
        return None
    if args.max_steps > 0 and step >= args.max_steps:
        return f"{checkpoint.name} is at step {step} of --max_steps {args.max_steps}"
    if args.max_steps <= 0 and epoch is not None and epoch >= args.num_train_epochs:
        return f"{checkpoint.name} is at epoch {epoch:g} of --num_train_epochs {args.num_train_epochs:g}"
    return None


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stop_if_complete(checkpoint: Path, args) -> None:
    """Exit (status 0, nothing written) when ``checkpoint`` already finished the run ``args`` asks for."""
    reason = completed_run(checkpoint, args)
    if reason is None:
        return
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(
            f"hf_flexdemo: this run is complete: {reason}; nothing was trained or written. Raise --max_steps (or "
            "--num_train_epochs) to train on, or choose another --output_dir for a new run.",
            flush=True,
        )
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every process has decided before any leaves
        dist.destroy_process_group()
    raise SystemExit(0)
