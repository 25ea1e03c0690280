"""One node of a fault-tolerant job: the stock Trainer, optim="flexdemo", fault_tolerance=torchft.

Launched once per node by tests/test_fault_tolerance.py (`accelerate launch`, its own
session so that the test can SIGKILL the whole node). Writes, per process:

- ``progress_rank<N>.jsonl``: one line per step (global step, committed steps, live replicas, time);
- ``result_rank<N>.json`` at the end: losses, the checksum of the final parameter shards, the epoch;

and the scripts' end-of-run summary (``training_scripts/script_utils.print_summary``).

``--kill_node_in_exchange_at N`` (test only): at the first step from N on whose quorum holds
every node, this node SIGKILLs itself (launcher and every process) inside the step's
exchange, before its payload is out: the other nodes are in the collective waiting for it.
``--corrupt_at N`` (test only): at step N this node changes one parameter entry on its own.
``--die_while_serving_when PATH`` (test only): while PATH exists, the first node asked for the
live state by a healing peer dies right then (the test creates PATH once the nodes it means
to keep alive train together, so a peer that is only slow to start does not set it off).
``--slow_while PATH`` (test only): each step takes ``--slow_step_s`` seconds more (1) while PATH
exists, so that a late or relaunched peer, taking up to that many seconds per remaining step to
start, finds this node still training.
``--hold_while PATH`` (test only): a step that starts while PATH exists waits until it is gone (its quorum
not yet joined under join_quorum=when_ready), so that a test can keep this node late for as long as it needs.
``--late_vote_when PATH`` (test only): once PATH exists, rank 0 of this node comes to one step's commit vote
``ft_timeout`` + 1 s late, as a process whose exchange waited out ``ft_timeout`` while its sibling's succeeded;
it then removes PATH.
``--record_samples`` (test only): ``samples_rank<N>.jsonl`` gets one line per batch drawn, the
hashes of its samples, so that a test can tell which node read what.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
from script_utils import print_summary  # training_scripts/, on the workers' path
from support.ft_nodes import kill_node
from support.tiny_hf import dataset, sample_hash, tiny_model, tokenizer
from transformers import (
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

import hf_flexdemo  # noqa: F401  (registers optim="flexdemo")
from hf_flexdemo.fault_tolerance.collectives import QuorumGroup
from hf_flexdemo.fault_tolerance.quorum import StepQuorum
from hf_flexdemo.fault_tolerance.rounds import QuorumRounds, managed_replicas
from hf_flexdemo.optim import unwrap_flexdemo
from hf_flexdemo.topology import parameter_fingerprint


@dataclasses.dataclass
class WorkerArgs:
    model: str = "olmo2"
    step_delay: float = 0.0
    kill_node_in_exchange_at: int = 0
    die_while_serving_when: str = ""
    corrupt_at: int = 0
    slow_while: str = ""
    slow_step_s: float = 1.0
    hold_while: str = ""
    late_vote_when: str = ""
    record_samples: bool = False
    train_rows: int = 256


def recording(collate, path: Path):
    """``collate``, writing the hashes of every batch it is given to ``path`` first."""

    def collate_and_record(features):
        with path.open("a") as f:
            f.write(json.dumps([sample_hash(feature["input_ids"]) for feature in features]) + "\n")
        return collate(features)

    return collate_and_record


class Progress(TrainerCallback):
    def __init__(self, path: Path, worker: WorkerArgs):
        self.path, self.delay, self.corrupt_at = path, worker.step_delay, worker.corrupt_at
        self.slow_while = Path(worker.slow_while) if worker.slow_while else None
        self.slow_step_s = worker.slow_step_s
        self.hold_while = Path(worker.hold_while) if worker.hold_while else None

    def on_optimizer_step(self, args, state, control, model=None, **kw):
        if self.corrupt_at and state.global_step + 1 >= self.corrupt_at:  # one bit of drift, behind the quorum's back
            next(model.parameters()).data.view(-1)[0] += 1e-3
            self.corrupt_at = 0

    def on_step_end(self, args, state, control, optimizer=None, **kw):
        replicas = managed_replicas(unwrap_flexdemo(optimizer))
        line = {
            "step": state.global_step,
            "committed": replicas.step,
            "replicas": replicas.topology().size,
            "time": time.time(),
        }
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def on_pre_optimizer_step(self, args, state, control, **kw):
        # Slow inside the step, once its quorum is joined: the peers wait in the exchange (up to ft_timeout). Slowed
        # between steps instead, a node would miss quorums whenever it is later than the Lighthouse's join timeout.
        if self.delay:
            time.sleep(self.delay)
        if self.slow_while is not None and self.slow_while.exists():
            time.sleep(self.slow_step_s)
        while self.hold_while is not None and self.hold_while.exists():
            time.sleep(0.05)


def kill_node_in_exchange(trainer: Trainer, at_step: int) -> None:
    """Die mid-exchange: in the quorum of the step, every process of this node SIGKILLed in the collective."""
    for name in ("all_gather_into", "all_reduce_sum"):
        original = getattr(QuorumGroup, name)

        def die_in_exchange(self, *tensors, _original=original):
            replicas = managed_replicas(unwrap_flexdemo(trainer.optimizer))
            everyone = replicas.topology().size == replicas.identity.replica_groups
            if trainer.state.global_step + 1 >= at_step and everyone and dist.get_rank() == 0:
                kill_node(os.getppid())  # the launcher, this process and its siblings
            return _original(self, *tensors)

        setattr(QuorumGroup, name, die_in_exchange)


def die_while_serving(armed: Path, once: Path) -> None:
    """Die when asked for the live state (a peer heals from this node) while ``armed`` exists.

    Only the first node to serve dies (it creates ``once``); another node serves normally.
    """
    original = QuorumRounds.replica_state

    def serve_then_die(self):
        state = original(self)
        if armed.exists():
            try:
                once.open("x").close()
            except FileExistsError:
                return state
            kill_node(os.getppid())
        return state

    QuorumRounds.replica_state = serve_then_die


def late_vote(trainer: Trainer, armed: Path) -> None:
    """Rank 0 votes ``ft_timeout`` + 1 s late at the first step after ``armed`` appears; its siblings vote on time."""
    original = StepQuorum.commit

    def commit_late(self, trained: bool) -> bool:
        if dist.get_rank() == 0 and armed.exists():
            time.sleep(unwrap_flexdemo(trainer.optimizer).config.ft_timeout + 1)
            armed.unlink()
        return original(self, trained)

    StepQuorum.commit = commit_late


def main() -> None:
    worker, args = HfArgumentParser((WorkerArgs, TrainingArguments)).parse_args_into_dataclasses()
    tok = tokenizer()
    set_seed(args.seed)
    model = tiny_model(worker.model, len(tok))
    base = Path(args.output_dir)  # shared by the nodes of a test
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset(worker.model, tok, rows=worker.train_rows),
        data_collator=default_data_collator,
    )
    out = Path(trainer.args.output_dir)  # <output_dir>/node<ID>
    out.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank()
    if worker.record_samples:
        trainer.data_collator = recording(default_data_collator, out / f"samples_rank{rank}.jsonl")
    progress = Progress(out / f"progress_rank{rank}.jsonl", worker)
    trainer.add_callback(progress)
    if worker.kill_node_in_exchange_at:
        kill_node_in_exchange(trainer, worker.kill_node_in_exchange_at)
    if worker.die_while_serving_when:
        die_while_serving(Path(worker.die_while_serving_when), base / "served_and_died")
    if worker.late_vote_when:
        late_vote(trainer, Path(worker.late_vote_when))
    trainer.train()
    params = [p for p in trainer.model.parameters()]
    result = {
        "losses": [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h],
        "fingerprint": int(parameter_fingerprint(params)),
        "global_step": trainer.state.global_step,
        "committed": managed_replicas(unwrap_flexdemo(trainer.optimizer)).step,
        "epoch": trainer.state.epoch,
        "samples_per_step": [
            (h["step"], h["flexdemo/samples_per_step"]) for h in trainer.state.log_history if "loss" in h
        ],
        "round_seconds": [
            {k.removeprefix("flexdemo/seconds_"): v for k, v in h.items() if k.startswith("flexdemo/seconds_")}
            for h in trainer.state.log_history
            if "loss" in h
        ],
    }
    (out / f"result_rank{rank}.json").write_text(json.dumps(result))
    print_summary(trainer, {}, ())


if __name__ == "__main__":
    sys.exit(main())
