"""What the ready-made scripts share.

- argument parsing with ``--optim flexdemo`` by default and ``--preset`` defaults that any
  flag still overrides (``--hub_token`` moves to ``HF_TOKEN``, out of ``training_args.bin``;
  the seed is set before any model is built, so every process starts from the same weights);
- loadable checkpoints and final weights (FSDP2 with a sharded state dict saves neither
  weights, config nor tokenizer in ``checkpoint-N``; a pushed checkpoint gets gathered weights);
- the model card rendered from ``model_cards/flexdemo.md``;
- the Hub push, and a full disk or read-only output, each with one clear error that leaves
  the local files whole;
- the end-of-run summary: metrics and the inter-node bytes against AdamW with HSDP's dense bf16 all-reduce.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import importlib.metadata
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed
from huggingface_hub import ModelCard, ModelCardData, constants
from huggingface_hub.errors import HfHubHTTPError
from transformers import AutoConfig, HfArgumentParser, Trainer, TrainingArguments, set_seed

from hf_flexdemo import FlexDeMoCallback  # importing hf_flexdemo registers optim="flexdemo"
from hf_flexdemo.fault_tolerance import managed_replicas
from hf_flexdemo.integrations.checkpoints import (
    CheckpointStorageError,
    check_writable,
    exit_on_storage_error,
    newest_complete,
    storage_errors,
)
from hf_flexdemo.integrations.final_model import is_checkpoint_folder, save_loadable, save_whole_model, saves_sharded
from hf_flexdemo.integrations.trainer import (
    describe,
    is_flexdemo,
    layout,
    mark_mean_loss_model,
    node_count,
    node_label,
)
from hf_flexdemo.optim import unwrap_flexdemo
from hf_flexdemo.optim.counters import bf16_dense_bytes, x_fewer_than_bf16_dense

logger = logging.getLogger(__name__)

CARD_TEMPLATE = Path(__file__).resolve().parent.parent / "model_cards" / "flexdemo.md"


@dataclasses.dataclass
class ScriptArguments:
    """What every script takes besides TrainingArguments (each script sets its own defaults)."""

    preset: str = dataclasses.field(
        default="hub",
        metadata={"help": "'hub': the paper's model and data from the Hub; 'offline': a tiny model and shipped data."},
    )
    model_name_or_path: str = dataclasses.field(default="", metadata={"help": "Hub id or local path."})
    from_config: bool = dataclasses.field(default=False, metadata={"help": "Random weights from the model's config."})
    dataset_name: str = dataclasses.field(default="", metadata={"help": "Hub dataset id or local path."})
    eval_fraction: float = dataclasses.field(
        default=0.05, metadata={"help": "Held out when there is no validation split."}
    )
    max_train_samples: int | None = None
    max_eval_samples: int | None = None

    @property
    def offline(self) -> bool:
        return self.preset == "offline"


OFFLINE_DEFAULTS = dict(save_strategy="no", report_to="none", logging_steps=10, warmup_steps=10)
"""What every offline preset starts from (a short CPU demo)."""


def parse_arguments(
    types: Sequence[type], presets: dict[str, dict[str, Any]], common: dict[str, Any], argv: list[str] | None = None
):
    """``HfArgumentParser`` over ``types``; ``--preset`` picks defaults, explicit flags win."""
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--preset", default="hub")
    preset = probe.parse_known_args(argv)[0].preset
    if preset not in presets:
        raise ValueError(f"--preset={preset!r} is invalid; choose one of {sorted(presets)}.")
    parser = HfArgumentParser(types)
    base = OFFLINE_DEFAULTS if preset == "offline" else {}
    parser.set_defaults(**{"optim": "flexdemo", **machine_defaults(), **common, **base, **presets[preset]})
    parsed = parser.parse_args_into_dataclasses(args=argv)
    for args in parsed:
        if isinstance(args, TrainingArguments):
            if args.process_index == 0:
                try:
                    check_writable(args.output_dir)  # before the tokenizer or anything else is written
                except CheckpointStorageError as error:
                    raise SystemExit(str(error)) from None
            if args.hub_token:
                hide_token(args)
            # Before the model is built: every process must start from the same random weights.
            set_seed(args.seed)
    return parsed


def machine_defaults() -> dict[str, Any]:
    """What this machine needs whatever the preset: no pinned memory without an accelerator.

    torch's DataLoader warns on every process that pinning needs an accelerator; the Trainer's
    default (``dataloader_pin_memory=True``) would make every CPU run print it.
    """
    return {"dataloader_pin_memory": torch.accelerator.is_available()}


def hide_token(args: TrainingArguments) -> None:
    """Move ``--hub_token`` to ``HF_TOKEN``, out of everything that gets written or uploaded.

    The Trainer pickles TrainingArguments into ``training_args.bin`` and pushes that file,
    and wandb records the command line; huggingface_hub reads ``HF_TOKEN`` by itself.
    """
    os.environ["HF_TOKEN"] = args.hub_token
    sys.argv = [_redact(arg, args.hub_token) for arg in sys.argv]
    args.hub_token = None
    logger.warning("--hub_token was moved to HF_TOKEN for this run; prefer `hf auth login` or HF_TOKEN.")


def _redact(arg: str, token: str) -> str:
    return arg.replace(token, "<redacted>") if token in arg else arg


def hub_model(auto_class, args: ScriptArguments, **kwargs):
    """The checkpoint ``args.model_name_or_path``, or random weights from its config with ``--from_config``."""
    if args.from_config:
        return auto_class.from_config(AutoConfig.from_pretrained(args.model_name_or_path, **kwargs))
    return auto_class.from_pretrained(args.model_name_or_path, **kwargs)


def limit_samples(data, args: ScriptArguments) -> None:
    """Apply ``--max_train_samples`` / ``--max_eval_samples`` in place."""
    for split_name, limit in (("train", args.max_train_samples), ("validation", args.max_eval_samples)):
        if limit:
            data[split_name] = data[split_name].select(range(min(limit, len(data[split_name]))))


def card_info(args: ScriptArguments, description: str, data_text: str, tags: list[str]) -> dict[str, Any]:
    """What the model card says about the model and its data."""
    return {
        "model_description": description,
        "dataset_description": data_text,
        "datasets": None if args.offline else [args.dataset_name],
        "base_model": None if args.offline or args.from_config else args.model_name_or_path,
        "license": "apache-2.0",
        "tags": tags,
    }


def train_and_report(trainer: Trainer, headline: Sequence[str], derived=None) -> dict[str, float]:
    """Train, evaluate, save full weights and the card, push if asked, print the summary.

    ``derived(metrics)`` may add metrics computed from the evaluation (e.g. perplexity).
    """
    args = trainer.args
    try:
        with storage_errors(args.output_dir), hub_errors(args):  # checkpoint pushes fail at the end of train()
            trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
            report_failed_pushes(trainer)
            metrics = trainer.evaluate(metric_key_prefix="eval")
            if derived:
                extra = derived(metrics)
                metrics.update(extra)
                trainer.log(extra)
            trainer.log_metrics("eval", metrics)
            trainer.save_metrics("eval", metrics)
            trainer.save_state()  # trainer_state.json: the whole log history, beside the model
            save_full_model(trainer)
            trainer.create_model_card()
    except CheckpointStorageError as error:
        exit_on_storage_error(error)
    if args.push_to_hub:
        push_to_hub(trainer)
    print_summary(trainer, metrics, headline)
    finish_distributed(trainer)
    return metrics


_LEFT_THE_JOB = False


def finish_distributed(trainer: Trainer) -> None:
    """Leave the job's process groups together: a barrier, then ``destroy_process_group()``."""
    global _LEFT_THE_JOB
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        trainer.accelerator.wait_for_everyone()
        torch.distributed.destroy_process_group()
        _LEFT_THE_JOB = True


def exit_worker() -> None:
    """End a process of a distributed job that trained to the end: its exit handlers run (wandb, torchft,
    logging), then it exits without Python's teardown. A no-op in a process that was never one of several.

    torch's gloo groups outlive ``destroy_process_group()``: the device mesh and FSDP's state still hold
    them, and a gloo group has no ``shutdown()`` that stops its threads. A gloo worker thread that drops the
    last reference to a finished collective frees its tensors, which takes the GIL; if the interpreter's
    teardown has begun by then, Python ends the thread inside a ``noexcept`` destructor and the process
    aborts ("terminate called without an active exception", pytorch/pytorch#190489). A loaded machine
    widens the window. Without the teardown there is none.
    """
    # What the interpreter's exit does before its teardown, in its order: join the threads that are not
    # daemons (threading's own exit hooks first), then the exit handlers. CPython's; tests/test_library_symbols.py
    join_threads = getattr(threading, "_shutdown", None)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if not _LEFT_THE_JOB or join_threads is None or run_exit_handlers is None:
        return
    join_threads()
    run_exit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- saving, card, push --------------------------------------------------------------------


def save_full_model(trainer: Trainer) -> None:
    """Save full weights to ``output_dir`` (call on every process: gathering is collective).

    The scripts' ``save_model`` gathers them under a sharded state dict too, whatever the optimizer
    (:class:`ScriptTrainerMixin`). Called as the Trainer calls it itself, so that it does not push: the run's
    final push follows, with the card.
    """
    trainer.save_model(_internal_call=True)


class ScriptTrainerMixin:
    """Trainer mixin of the scripts: the same model and loss for every optimizer, loadable checkpoints, the model card.

    - ``import hf_flexdemo`` changes FlexDeMo runs only; the scripts also give their other optimizers (the
      AdamW-HSDP baseline) two of its changes, so that both train and save alike: a T5-family model is marked as
      averaging its own loss (:func:`~hf_flexdemo.integrations.trainer.mark_mean_loss_model`), and the final
      model is saved whole under a sharded state dict
      (:func:`~hf_flexdemo.integrations.final_model.save_whole_model`; the benchmarks fine-tune AdamW-HSDP's).
    - With a sharded state dict the Trainer's ``checkpoint-N`` holds only shards; here it also
      gets the config and the tokenizer, and gathered ``model.safetensors`` when checkpoints
      are pushed to the Hub (``--hub_strategy`` other than ``end``), so that every pushed
      revision is a model that loads.
    - The model card is rendered from ``model_cards/flexdemo.md``: the script sets
      ``trainer.card_info`` (``model_description``, ``dataset_description``, ``datasets``,
      ``base_model``, ``tags``) before training.
    """

    card_info: dict[str, Any] = {}

    def __init__(self, *args, **kwargs):
        mark_mean_loss_model(kwargs.get("model", args[0] if args else None))  # before the Trainer reads it
        super().__init__(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        report_failed_pushes(self)  # before the Trainer replaces the finished push with the next one
        stock = super().save_model  # for FlexDeMo, hf_flexdemo's save_model already
        save_whole_model(lambda _trainer, *args: stock(*args), self, output_dir, _internal_call)
        folder = output_dir or self.args.output_dir
        if _internal_call and saves_sharded(self) and is_checkpoint_folder(folder):
            pushed = self.args.push_to_hub and str(getattr(self.args.hub_strategy, "value", "")) != "end"
            save_loadable(self, folder, with_weights=pushed)

    def create_model_card(self, *args, **kwargs) -> None:
        if self.is_world_process_zero():
            path = Path(self.args.output_dir) / "README.md"
            render_model_card(self, self.card_info).save(path)


def render_model_card(trainer: Trainer, info: dict[str, Any]) -> ModelCard:
    args = trainer.args
    figures = comm_figures(trainer)
    metrics = {k: _fmt(v) for k, v in final_metrics(trainer.state.log_history).items()}
    card_data = ModelCardData(
        library_name="transformers",
        license=info.get("license"),
        base_model=info.get("base_model"),
        datasets=info.get("datasets"),
        tags=["flexdemo", "fsdp2", *info.get("tags", [])],
    )
    return ModelCard.from_template(
        card_data,
        template_path=str(CARD_TEMPLATE),
        model_name=Path(args.hub_model_id or args.output_dir).name,
        model_description=info.get("model_description", "a model"),
        dataset_description=info.get("dataset_description", ""),
        optimizer=describe(args) if is_flexdemo(args) else str(getattr(args.optim, "value", args.optim)),
        layout=layout(trainer),
        flexdemo=is_flexdemo(args),
        steps=trainer.state.global_step,
        bytes_sent=_bytes(figures["sent"]),
        dense_bytes=_bytes(figures["dense"]),
        ratio=f"{x_fewer_than_bf16_dense(figures['sent'], figures['dense']):.0f}x" if figures["sent"] else "n/a",
        metrics=metrics,
        hyperparameters={
            "learning_rate": args.learning_rate,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "total_train_batch_size": args.per_device_train_batch_size
            * args.gradient_accumulation_steps
            * args.world_size,
            "training_steps": trainer.state.global_step,
            "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
            "weight_decay": args.weight_decay,
            "max_grad_norm": args.max_grad_norm,
            "mixed_precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "no",
            "seed": args.seed,
        },
        versions={name: _version(name) for name in ("hf-flexdemo", "transformers", "accelerate", "torch", "datasets")},
    )


HTTP_CLIENT_MODULES = ("httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3")
"""Where huggingface_hub's transport errors come from (2.x raises httpx2's, which are not httpx's)."""


def is_hub_error(error: BaseException) -> bool:
    """A refused Hub request or a network failure on the way to the Hub."""
    if isinstance(error, HfHubHTTPError):
        return True
    return any(type(e).__module__.split(".")[0] in HTTP_CLIENT_MODULES for e in (error, error.__cause__) if e)


@contextlib.contextmanager
def hub_errors(args: TrainingArguments):
    """Turn a refused or failed Hub request into one clear error; local files stay as they are."""
    try:
        yield
    except Exception as error:
        if not is_hub_error(error):
            raise
        repo = args.hub_model_id or Path(args.output_dir).name
        raise SystemExit(
            f"The Hub at {constants.ENDPOINT} (repo {repo!r}) failed: {type(error).__name__}: {error}\n"
            f"Nothing local was lost: {local_files(args.output_dir)}. "
            "Fix the cause (token rights, repo name, network) and push again, e.g. "
            f"`hf upload {repo} {args.output_dir}`."
        ) from None


def local_files(output_dir: str) -> str:
    """What ``output_dir`` holds that a person would want back: the final model, the newest complete checkpoint."""
    root = Path(output_dir).resolve()
    held = ["the final model"] if (root / "model.safetensors").exists() else []
    newest = newest_complete(root)
    if newest is not None:
        held.append(f"the complete checkpoint {newest.name}")
    return f"{root} holds {' and '.join(held)}" if held else f"nothing had been trained into {root} yet"


def report_failed_pushes(trainer: Trainer) -> None:
    """Warn about checkpoint pushes that failed in the background (the Trainer never looks at them)."""
    push = getattr(trainer, "push_in_progress", None)
    for job in list(push.jobs) if push is not None else []:
        if job.done() and not job.cancelled() and job.exception() is not None and not getattr(job, "reported", False):
            job.reported = True
            logger.warning(
                "Pushing a checkpoint to the Hub at %s failed: %s: %s. Training goes on; the local checkpoints "
                "are whole, and the push at the end uploads the final model.",
                constants.ENDPOINT,
                type(job.exception()).__name__,
                job.exception(),
            )


def push_to_hub(trainer: Trainer) -> None:
    """The final push (model, tokenizer, card); on every process, like ``Trainer.push_to_hub``."""
    with hub_errors(trainer.args):
        trainer.push_to_hub(commit_message="End of training", blocking=True)


# -- figures -------------------------------------------------------------------------------


def final_metrics(log_history: list[dict[str, Any]]) -> dict[str, float]:
    """The last evaluation's metrics and the final training loss."""
    out: dict[str, float] = {}
    for entry in log_history:
        out.update(
            {k: v for k, v in entry.items() if k.startswith("eval_") and not k.endswith(("_runtime", "per_second"))}
        )
        if "train_loss" in entry:
            out["train_loss"] = entry["train_loss"]
    return out


def comm_figures(trainer: Trainer) -> dict[str, float]:
    """The inter-node bytes so far of :func:`node_label`'s node, and what the dense bf16 all-reduce would send."""
    callback = next((c for c in trainer.callback_handler.callbacks if isinstance(c, FlexDeMoCallback)), None)
    if callback is not None and callback.figures:
        return {"sent": callback.figures["flexdemo/bytes_sent"], "dense": callback.figures["flexdemo/dense_bytes"]}
    config = getattr(trainer.accelerator, "parallelism_config", None)
    replicas = config.dp_replicate_size if config is not None else 1
    numel = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    dense = bf16_dense_bytes(numel, replicas) * trainer.state.global_step
    return {"sent": dense, "dense": dense}


def print_summary(trainer: Trainer, metrics: dict[str, float], headline: Sequence[str]) -> None:
    """The end-of-run lines on the main process: headline metrics, then the bytes."""
    if not trainer.is_world_process_zero():
        return
    shown = " | ".join(f"{k.removeprefix('eval_')} {_fmt(metrics[k])}" for k in headline if k in metrics)
    figures = comm_figures(trainer)
    node = node_label(trainer)
    print(f"\n== {Path(trainer.args.output_dir).name}: {trainer.state.global_step} steps on {layout(trainer)}")
    print(f"   {shown}")
    flexdemo = f" with {describe(trainer.args)}" if is_flexdemo(trainer.args) else ""
    if node_count(trainer) == 1:
        print(f"   one node{flexdemo}: nothing crosses nodes, so no inter-node bytes to compare with AdamW with HSDP")
    elif flexdemo:
        fewer = x_fewer_than_bf16_dense(figures["sent"], figures["dense"])
        ratio = f": {fewer:.0f}x fewer than bf16 dense" if figures["sent"] else ""
        print(
            f"   inter-node bytes sent by {node}: {_bytes(figures['sent'])}{flexdemo}; "
            f"AdamW with HSDP's dense bf16 all-reduce would have sent {_bytes(figures['dense'])}{ratio}"
        )
    else:
        print(f"   inter-node bytes of {node}'s dense all-reduce (bf16 gradients): {_bytes(figures['dense'])}")
    replicas = managed_replicas(unwrap_flexdemo(trainer.optimizer))  # None: not FlexDeMo, or no optimizer
    if replicas is not None:
        print(f"   quorum of live nodes: {replicas.membership_story()}")
        if replicas.healing.catch_up_story():
            print(f"   behind and caught up: {replicas.healing.catch_up_story()}")
        if replicas.sit_out.story():
            print(f"   sat out: {replicas.sit_out.story()}")
        if replicas.quorum_wait_story():
            print(f"   waits for a quorum: {replicas.quorum_wait_story()}")


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} TB"


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
