"""The stock transformers.Trainer with optim="flexdemo", launched by `accelerate launch` in tests.

Runs one or more training runs in the same processes (``--runs t5:flexdemo,t5:adamw_torch``)
and writes ``<output_dir>/<run>/result_rank<N>.json`` with the losses, the bytes that
crossed simulated nodes, and the replicas' parameter checksums.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch.distributed as dist
from support.comm_spy import CommSpy
from support.tiny_hf import dataset, tiny_model, tokenizer
from transformers import HfArgumentParser, Trainer, TrainingArguments, default_data_collator, set_seed

import hf_flexdemo  # noqa: F401  (registers optim="flexdemo" and the Accelerate plugin)
from hf_flexdemo.optim import unwrap_flexdemo
from hf_flexdemo.topology import ReplicaTopology, replica_fingerprints


@dataclasses.dataclass
class Runs:
    runs: str = dataclasses.field(default="t5:flexdemo", metadata={"help": "model:optim,... run in order"})
    processes_per_node: int = 2
    then_resume: str = dataclasses.field(
        default="",
        metadata={"help": "after the runs: one of them again from its checkpoint (<run>/checkpoint-N), into resumed/"},
    )
    then_resume_with: str = dataclasses.field(
        default="",
        metadata={"help": "last: the same checkpoint resumed with these optim_args instead, into other_rule/"},
    )


def model_card_optimizer(trainer: Trainer) -> str:
    from transformers.modelcard import extract_hyperparameters_from_trainer

    return str(extract_hyperparameters_from_trainer(trainer).get("optimizer"))


def run_one(model_kind: str, optim: str, args: TrainingArguments, tok, spy: CommSpy, resume: str | None) -> dict:
    out = Path(args.output_dir)
    set_seed(args.seed)
    model = tiny_model(model_kind, len(tok))
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset(model_kind, tok), data_collator=default_data_collator
    )
    spy.clear()
    with spy.watching():
        trainer.train(resume_from_checkpoint=resume)
    inter = spy.inter_node()
    params = list(trainer.model.parameters())
    flex = unwrap_flexdemo(trainer.optimizer)
    topology = ReplicaTopology.from_mesh(trainer.accelerator.torch_device_mesh, "dp_replicate")
    reductions = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor")
    result = {
        "run": f"{model_kind}:{optim}",
        "log_history": trainer.state.log_history,
        # FlexDeMo's packed exchange: one uint8 all-gather on the replicate group per step.
        "flexdemo_wire_bytes": sum(c["bytes"] for c in inter if c["dtype"] == "torch.uint8"),
        "flexdemo_exchanges": sum(1 for c in inter if c["dtype"] == "torch.uint8"),
        "inter_node_reduction_bytes": sum(c["bytes"] for c in inter if c["op"] in reductions),
        "flexdemo_counted_bytes": flex.total_stats.bytes_sent if flex else None,
        "replica_fingerprints": replica_fingerprints(params, topology),
        "grad_bytes_local": sum(p.to_local().numel() * p.to_local().element_size() for p in params),
        "model_card_optimizer": model_card_optimizer(trainer),
    }
    (out / f"result_rank{dist.get_rank()}.json").write_text(json.dumps(result))
    return result


def main() -> None:
    parser = HfArgumentParser((Runs, TrainingArguments))
    runs, base = parser.parse_args_into_dataclasses()
    tok = tokenizer()
    spy = CommSpy(processes_per_node=runs.processes_per_node)
    root = Path(base.output_dir)
    planned = [(*item.split(":"), item.replace(":", "_"), base.optim_args, base.resume_from_checkpoint) for item in
               runs.runs.split(",")]  # fmt: skip
    if runs.then_resume:  # in the same processes: one start-up fewer than a launch of its own
        model_kind, optim = Path(runs.then_resume).parent.name.split("_", 1)
        checkpoint = str(root / runs.then_resume)
        planned.append((model_kind, optim, "resumed", base.optim_args, checkpoint))
        if runs.then_resume_with:
            planned.append((model_kind, optim, "other_rule", runs.then_resume_with, checkpoint))
    for model_kind, optim, name, optim_args, resume in planned:
        optim_args = optim_args if optim == "flexdemo" else None  # FlexDeMo's keys are refused for others
        args = dataclasses.replace(base, optim=optim, optim_args=optim_args, output_dir=str(root / name))
        run_one(model_kind, optim, args, tok, spy, resume)
    if dist.is_initialized():  # leave together, as the training scripts do (script_utils.finish_distributed): a
        dist.barrier()  # process that exits while a peer's gloo connections are up can make it abort at exit
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
