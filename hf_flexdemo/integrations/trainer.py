"""``optim="flexdemo"`` for the stock ``transformers.Trainer``.

Transformers validates ``TrainingArguments.optim`` against the ``OptimizerNames`` enum and
looks the name up in ``transformers.trainer_optimizer._OPTIMIZER_HANDLERS``; neither has a
public registry, so :func:`install` adds a member and a handler (every patch is listed in
:mod:`.patches`). The handler builds FlexDeMo from the standard flags (``--learning_rate``,
``--weight_decay``, ``--adam_beta1/2`` and ``--adam_epsilon`` for DiLoCo's inner AdamW) plus
``optim_args`` for FlexDeMo's own settings.

Everything else acts on FlexDeMo runs only (``optim="flexdemo"``, :func:`is_flexdemo`): a Trainer with any
other optimizer gets the stock methods, untouched, as if ``hf_flexdemo`` were not imported (the same callbacks,
resume and overwrite behaviour, ``save_model`` and ``bf16``). The one exception is a refusal: FlexDeMo's own
keys in ``optim_args`` under another optimizer, which would drop them silently
(:func:`refuse_flexdemo_args_for_other_optimizers`). The Accelerate plugin (:mod:`.accelerate_plugin`) is
another matter: a launch with this package's Accelerate configs keeps the layout they set (FSDP2 on CPU, gloo)
for every optimizer, since AdamW-HSDP on ``accelerate_configs/cpu_2x2.yaml`` is the benchmarks' baseline.

A FlexDeMo Trainer gets :class:`FlexDeMoCallback` and :class:`CheckpointCallback` through its public callback
list, ahead of the reporters (whose ``on_log`` then sees FlexDeMo's figures); the model card's optimizer line
names FlexDeMo, its settings and the layout; T5-family models are marked as averaging their own loss (see
:func:`mark_mean_loss_model`), a trap of transformers 5.x that scales T5's loss by processes and accumulation
steps. It also gets crash-safe checkpoints (:mod:`.checkpoints`): ``train`` resumes from the
newest *complete* checkpoint for ``resume_from_checkpoint="auto"`` or ``True`` (and after an
automatic restart, or when an earlier run's checkpoints are in ``output_dir``), and a worker
stops when its launcher dies (:mod:`hf_flexdemo.elastic`). ``save_model`` writes the whole model in the Hub
format under any FSDP state-dict setting (:mod:`.final_model`). Bad ``optim_args`` are refused when
``TrainingArguments`` is built, before a script loads data. ``TrainingArguments(optim="flexdemo", bf16=True)``
on a machine without an accelerator trains in bf16 on the CPU (:func:`_bf16_on_cpu`) instead of
failing on every process.
"""

from __future__ import annotations

import enum
import logging
import os
import types
from pathlib import Path
from typing import Any

import torch
import transformers.trainer

from .. import elastic, refusals
from ..config import FlexDeMoConfig
from ..fault_tolerance.rounds import managed_replicas
from ..optim import FlexDeMo, unwrap_flexdemo
from ..updates import check_saved_inner_step, check_saved_state_keys, elementwise_parameters
from .accelerate_plugin import check_flexdemo_layout, fp16_refusal
from .callback import FlexDeMoCallback
from .checkpoints import CheckpointCallback, check_writable, resolve_resume, storage_errors
from .final_model import save_model
from .patches import applies, located, wrap
from .resume import check_checkpoint_model, check_saved_settings, settle_wire, stop_if_complete
from .simulation import check_simulation_args
from .training_args import (
    OPTIM_NAME,
    check_training_arguments,
    describe,
    flexdemo_config,
    flexdemo_kwargs,
    is_flexdemo,
    refuse_flexdemo_args_for_other_optimizers,
)

__all__ = [
    "OPTIM_NAME",
    "describe",
    "flexdemo_kwargs",
    "install",
    "is_flexdemo",
    "layout",
    "mark_mean_loss_model",
    "node_count",
    "node_label",
]

logger = logging.getLogger(__name__)

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
MEAN_LOSS_MODEL_TYPES = ("t5", "mt5", "umt5", "longt5", "switch_transformers")
"""Models whose forward takes ``**kwargs`` but averages its own loss, ignoring ``num_items_in_batch``."""


def layout(trainer) -> str:
    """``"2 nodes x 2 processes"`` from the trainer's Accelerate layout, or the fault-tolerant job's nodes."""
    identity = fault_tolerant_identity(trainer)
    if identity is not None:  # each node is its own launch: the job has NUM_REPLICA_GROUPS of them
        nodes = f"{_count(identity.replica_groups, 'node')} x {_count(trainer.accelerator.num_processes, 'process')}"
        return f"{nodes} (fault-tolerant; this is {node_label(trainer)})"
    config = getattr(trainer.accelerator, "parallelism_config", None)
    if config is None:
        return f"1 node x {_count(trainer.accelerator.num_processes, 'process')}"
    return f"{_count(config.dp_replicate_size, 'node')} x {_count(config.dp_shard_size, 'process')}"


def node_count(trainer) -> int:
    """How many nodes (replicas) the trainer's job has: 1 means nothing crosses nodes."""
    identity = fault_tolerant_identity(trainer)
    if identity is not None:
        return identity.replica_groups
    config = getattr(trainer.accelerator, "parallelism_config", None)
    return config.dp_replicate_size if config is not None else 1


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}{'es' if noun.endswith('s') else 's'}"


def node_label(trainer) -> str:
    """The node whose figures this process reports: ``"node 0"``, or this node in a fault-tolerant job."""
    identity = fault_tolerant_identity(trainer)
    return f"node {identity.replica_group if identity is not None else 0}"


def fault_tolerant_identity(trainer):
    """This node's :class:`~hf_flexdemo.fault_tolerance.NodeIdentity` under fault tolerance, else ``None``."""
    replicas = managed_replicas(unwrap_flexdemo(getattr(trainer, "optimizer", None)))
    return replicas.identity if replicas is not None else None


def _flexdemo_handler(ctx) -> tuple[type, dict[str, Any]]:
    kwargs = flexdemo_kwargs(ctx.args)
    if flexdemo_config(ctx.args).update == "orthogonal" and ctx.model is not None:
        kwargs["elementwise"] = elementwise_parameters(ctx.model)  # embeddings and heads: the adam rule
    kwargs.pop("weight_decay")  # the Trainer passes it per parameter group
    return FlexDeMo, kwargs


def _add_enum_member(enum_cls: type[enum.Enum], name: str, value: str) -> enum.Enum:
    """Python's enums take no new member after their class is made: this does what the class statement does."""
    if value in enum_cls._value2member_map_:
        return enum_cls(value)
    member = str.__new__(enum_cls, value)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    if hasattr(enum_cls, "_add_member_"):  # Python >= 3.12
        enum_cls._add_member_(name, member)
    else:
        type.__setattr__(enum_cls, name, member)
        enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    if name not in enum_cls._member_names_:
        enum_cls._member_names_.append(name)
    return member


def mark_mean_loss_model(model) -> bool:
    """Tell the Trainer that a T5-family model averages its own loss (``accepts_loss_kwargs=False``).

    Otherwise transformers 5.x sees ``**kwargs`` in ``forward``, expects a summed loss, and
    multiplies the mean by the number of processes and by the accumulation steps.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if TRANSFORMERS_MAJOR < 5:  # 4.x: T5's forward takes no **kwargs, so its loss is already taken as averaged
        return False
    if model_type not in MEAN_LOSS_MODEL_TYPES or hasattr(model, "accepts_loss_kwargs"):
        return False
    model.accepts_loss_kwargs = False
    logger.info("hf_flexdemo: %s averages its own loss; marked accepts_loss_kwargs=False.", type(model).__name__)
    return True


def _training_arguments_post_init(original, self, *args, **kwargs):
    """``TrainingArguments.__post_init__``: for FlexDeMo, :func:`_bf16_on_cpu` before it; for every optimizer,
    :func:`check_training_arguments` after it (once ``optim`` is the enum member; a script has loaded no data
    yet), which under another optimizer only refuses FlexDeMo's keys in ``optim_args``."""
    if is_flexdemo(self):  # before the original: optim may still be the plain string here
        _bf16_on_cpu(self)
    original(self, *args, **kwargs)
    check_training_arguments(self)


def _bf16_on_cpu(self) -> None:
    """FlexDeMo's ``--bf16`` without an accelerator trains in bf16 on the CPU instead of failing on every process.

    transformers refuses ``bf16`` without a bf16 GPU unless ``use_cpu`` is set ("Your setup doesn't
    support bf16/gpu"), which every process of a launch raises with its traceback; the GPU commands
    of docs/launching.md carry ``--bf16``. torch autocasts to bf16 on CPU and FSDP2 runs it over gloo, so this
    sets ``use_cpu`` and says so once per machine. Another optimizer's ``bf16`` is left to transformers.
    """
    if (self.bf16 or self.bf16_full_eval) and not self.use_cpu and not torch.accelerator.is_available():
        self.use_cpu = True
        if os.environ.get("LOCAL_RANK", "0") == "0":
            logger.warning(
                "hf_flexdemo: bf16=True on a machine without a GPU: training in bf16 on the CPU (torch's CPU "
                "autocast; use_cpu=True is set for it). Drop --bf16 to train in float32, which is often faster on "
                "CPUs without bf16 instructions."
            )


def _trainer_init(original, self, *args, **kwargs):
    training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
    if training_args is None or not is_flexdemo(training_args):  # no args: the Trainer's default, AdamW
        if training_args is not None:
            refuse_flexdemo_args_for_other_optimizers(training_args)  # a script may have set them after building
        return original(self, *args, **kwargs)
    refusals.install()  # above a hook installed since import (a script's own wandb.init)
    mark_mean_loss_model(kwargs["model"] if "model" in kwargs else (args[0] if args else None))
    elastic.check_restart_setup()  # before any data is loaded
    if training_args.output_dir:  # the Trainer creates it: a raw OSError otherwise
        check_writable(training_args.output_dir)
    original(self, *args, **kwargs)
    _add_own_callbacks(self)
    elastic.exit_with_launcher()
    _refuse_before_training(self)
    config = flexdemo_config(self.args)
    if config.fault_tolerant:
        from .fault_tolerant_trainer import prepare_fault_tolerant_trainer

        prepare_fault_tolerant_trainer(self, config)


OWN_CALLBACKS = (FlexDeMoCallback, CheckpointCallback)


def _add_own_callbacks(trainer) -> None:
    """FlexDeMo's callbacks right after the Trainer's default ones, ahead of the reporters and the user's (a
    FlexDeMo Trainer only).

    A callback the user passed already (``callbacks=[FlexDeMoCallback(check_every=10)]``) is moved there rather than
    doubled. Ahead of the reporters, FlexDeMo's figures are in the logs that wandb and TensorBoard write.
    """
    callbacks = trainer.callback_handler.callbacks
    defaults = tuple(transformers.trainer.DEFAULT_CALLBACKS)
    at = next((i for i, callback in enumerate(callbacks) if not isinstance(callback, defaults)), len(callbacks))
    for kind in reversed(OWN_CALLBACKS):
        given = next((callback for callback in callbacks if isinstance(callback, kind)), None)
        if given is not None:
            callbacks.remove(given)
        callbacks.insert(at, given if given is not None else kind())


def _refuse_before_training(trainer) -> None:
    """What FlexDeMo cannot train is refused at the Trainer's construction, before any data is loaded."""
    args = trainer.args
    kwargs = flexdemo_kwargs(args)  # bad optim_args fail here
    check_simulation_args(args, kwargs.get("simulate_replicas", 1))
    if args.fp16:
        raise ValueError(fp16_refusal("fp16=True", "bf16=True"))
    check_flexdemo_layout(trainer.accelerator.state)


def _trainer_train(original, self, resume_from_checkpoint=None, *args, **kwargs):
    """Resume from the newest *complete* checkpoint (``"auto"``/``True``, an automatic restart, or an earlier run's).

    A checkpoint of another model is refused, and one that already finished the run ends it
    with nothing changed (:mod:`.resume`). Another optimizer's run is the stock ``train``, untouched."""
    if not is_flexdemo(self.args):
        return original(self, resume_from_checkpoint, *args, **kwargs)
    overwrite = getattr(self.args, "overwrite_output_dir", None)  # transformers 4.x only
    # Also refuses an unwritable output_dir.
    resume = resolve_resume(self.args.output_dir, resume_from_checkpoint, overwrite=overwrite)
    if resume is not None:
        check_checkpoint_model(Path(resume), self.model)
        stop_if_complete(Path(resume), self.args)
    if resume is not None:
        check_saved_settings(Path(resume))  # before the rules: a removed one is the cause to name
    settle_wire(self.args, None if resume is None else Path(resume))
    if resume is not None:
        config = flexdemo_config(self.args)
        _check_resumed_rules(Path(resume), config)
        if config.fault_tolerant:
            from .fault_tolerant_trainer import resume_node

            resume_node(self, resume)
    with storage_errors(self.args.output_dir):
        return original(self, resume, *args, **kwargs)


def _check_resumed_rules(checkpoint: Path, config: FlexDeMoConfig) -> None:
    """A sharded checkpoint's update rules against this run's, before torch's loader fails or drops state.

    Accelerate writes FSDP's sharded optimizer state as a distributed checkpoint in ``optimizer_0``
    (a full state dict reaches ``FlexDeMo.load_state_dict``, which checks it there)."""
    folder = checkpoint / "optimizer_0"
    if not (folder / ".metadata").is_file():
        return
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    if config.traits.outer_steps:  # their inner step keeps its state in the scheme's entries
        check_saved_inner_step(keys, config.update, where=str(checkpoint))
    else:
        check_saved_state_keys(keys, config.update, where=str(checkpoint))


def _card_hyperparameters(original, trainer) -> dict[str, Any]:
    hyperparameters = original(trainer)
    if is_flexdemo(trainer.args):
        hyperparameters["optimizer"] = f"{describe(trainer.args)} on {layout(trainer)}"
    return hyperparameters


def _register_handler(member: enum.Enum) -> None:
    """Tell the Trainer how to build FlexDeMo for ``optim="flexdemo"`` (no public registry exists).

    transformers >= 5 looks the name up in ``trainer_optimizer._OPTIMIZER_HANDLERS``;
    4.x (4.57) has one static ``Trainer.get_optimizer_cls_and_kwargs`` instead, wrapped here.
    """
    if applies("transformers.trainer_optimizer._OPTIMIZER_HANDLERS"):
        _, _, handlers = located("transformers.trainer_optimizer._OPTIMIZER_HANDLERS")
        handlers[member] = _flexdemo_handler
        return

    def get_optimizer_cls_and_kwargs(original, args, model=None):
        if is_flexdemo(args):
            return _flexdemo_handler(types.SimpleNamespace(args=args, model=model))
        return original(args, model)

    wrap("transformers.Trainer.get_optimizer_cls_and_kwargs", get_optimizer_cls_and_kwargs)


_INSTALLED = False


def install() -> None:
    """Register ``optim="flexdemo"`` and wrap the Trainer for FlexDeMo runs (idempotent; the list: :mod:`.patches`).

    Each wrapper hands a run with another optimizer to the original method untouched."""
    global _INSTALLED
    if _INSTALLED:
        return
    _, _, optimizer_names = located("transformers.training_args.OptimizerNames")
    _register_handler(_add_enum_member(optimizer_names, OPTIM_NAME.upper(), OPTIM_NAME))
    wrap("transformers.modelcard.extract_hyperparameters_from_trainer", _card_hyperparameters)
    # Before __init__: callbacks run after the data is loaded; train(): a callback is too late
    # to choose the checkpoint that train() loads.
    wrap("transformers.TrainingArguments.__post_init__", _training_arguments_post_init)
    wrap("transformers.Trainer.__init__", _trainer_init)
    wrap("transformers.Trainer.train", _trainer_train)
    wrap("transformers.Trainer.save_model", save_model)  # FlexDeMo's whole model, also under a sharded state dict
    _INSTALLED = True
