"""FlexDeMo's settings read from ``TrainingArguments``: the one place the Trainer glue and the callback share.

``optim="flexdemo"`` takes the standard flags (``--learning_rate``, ``--weight_decay``,
``--adam_beta1/2`` and ``--adam_epsilon`` for DiLoCo's inner AdamW) plus ``optim_args`` for
FlexDeMo's own settings. Both :mod:`.trainer` and :mod:`.callback` import from here, never
from each other.
"""

from __future__ import annotations

import functools
from typing import Any

from transformers import TrainingArguments

from ..config import OWN_KEYS, FlexDeMoConfig, parse_optim_args
from ..removed import REMOVED_SETTINGS

OPTIM_NAME = "flexdemo"
FROM_TRAINING_ARGUMENTS = {
    "lr": "--learning_rate",
    "weight_decay": "--weight_decay",
    "betas": "--adam_beta1 / --adam_beta2",
    "eps": "--adam_epsilon",
}


def is_flexdemo(args: TrainingArguments) -> bool:
    return str(getattr(args.optim, "value", args.optim)) == OPTIM_NAME


def flexdemo_kwargs(args: TrainingArguments) -> dict[str, Any]:
    """FlexDeMo's keyword arguments for ``args`` (a copy); raises ValueError on bad ``optim_args``."""
    return dict(_settings(*_read_from(args))[0])


def flexdemo_config(args: TrainingArguments) -> FlexDeMoConfig:
    """FlexDeMo's settings for ``args``, validated; read once for the same arguments (do not change it)."""
    return _settings(*_read_from(args))[1]


def _read_from(args: TrainingArguments) -> tuple:
    """What FlexDeMo's settings depend on: a script may change ``args`` between two reads."""
    betas = (args.adam_beta1, args.adam_beta2)
    return args.optim_args, args.learning_rate, args.weight_decay, betas, args.adam_epsilon


@functools.lru_cache(maxsize=8)
def _settings(optim_args, lr, weight_decay, betas, eps) -> tuple[dict[str, Any], FlexDeMoConfig]:
    overrides = parse_optim_args(optim_args)
    for key, flag in FROM_TRAINING_ARGUMENTS.items():
        if key in overrides:
            raise ValueError(f"FlexDeMo optim_args: set {key!r} with the standard TrainingArguments flag {flag}.")
    kwargs = {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps, **overrides}
    return kwargs, FlexDeMoConfig(**kwargs)  # validated now, with the same messages as the optimizer


def describe(args: TrainingArguments) -> str:
    """One line naming the optimizer, its ``wire`` preset if one was named, and the settings that act (for logs
    and model cards): ``FlexDeMo(wire='2bit', scheme='demo', topk=...)``."""
    config = flexdemo_config(args)
    preset = [f"wire={config.wire!r}"] if config.wire is not None else []
    return "FlexDeMo(" + ", ".join(preset + [f"{k}={getattr(config, k)!r}" for k in config.acting_settings()]) + ")"


def check_training_arguments(args: TrainingArguments) -> None:
    """What the arguments alone decide, refused when ``TrainingArguments`` is built: before a script loads data.

    ``optim_args`` against FlexDeMo's settings (with ``--learning_rate``, ``--weight_decay``, the betas and
    epsilon), FlexDeMo's settings under another optimizer. What needs the model or the mesh is checked when the
    Trainer is built.
    """
    if is_flexdemo(args):
        flexdemo_config(args)  # ValueError with the optimizer's own message
    else:
        refuse_flexdemo_args_for_other_optimizers(args)


def refuse_flexdemo_args_for_other_optimizers(args: TrainingArguments) -> None:
    """``--optim adamw_torch --optim_args topk=32`` would train AdamW and drop the FlexDeMo settings."""
    text = args.optim_args or ""
    keys = {item.partition("=")[0].strip() for item in text.split(",")}
    own = sorted(keys & {*OWN_KEYS, *REMOVED_SETTINGS})  # a removed setting too (shared_indices): FlexDeMo's
    if own:
        optim = getattr(args.optim, "value", args.optim)
        raise ValueError(
            f"optim_args={text!r} sets FlexDeMo's {own}, but optim={optim!r} would ignore them. "
            f"Write --optim flexdemo to train with FlexDeMo, or drop {own} from --optim_args."
        )
