"""The Trainer under ``fault_tolerance="torchft"``: each node its own job, one quorum of live nodes.

At ``Trainer(...)``, before any training:

- the node's identity and the Lighthouse address are read and checked
  (:class:`hf_flexdemo.fault_tolerance.NodeIdentity`), and the node joins the Lighthouse
  (an unreachable one is an error naming the address, within ``ft_timeout``);
- the launch must be one node (no ``dp_replicate`` dimension): nodes meet through torchft;
- the training data is split by node (``REPLICA_GROUP_ID`` of ``NUM_REPLICA_GROUPS``):
  each node's launch sees the whole dataset, and identical batches on every node would
  make the replicas one;
- ``output_dir`` becomes ``<output_dir>/node<ID>``: each node checkpoints its own state, and
  nodes that share a file system must not write the same checkpoint folders;
- a healing node receives the global step, epoch and scheduler position with the parameters;
- each checkpoint also holds torchft's committed-step count (:data:`QUORUM_FILE`), so that a
  node resumed from it heals only if the live nodes are ahead, and knows how far it got.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..config import FlexDeMoConfig
from ..fault_tolerance import ManagedReplicas, NodeIdentity, import_torchft, node_replicas
from ..optim.flexdemo import unwrap_flexdemo
from .accelerate_plugin import default_layout
from .checkpoints import CheckpointCallback

logger = logging.getLogger(__name__)

LAST_LOGGED = "_globalstep_last_logged"
"""Private Trainer attribute (4.57 to 5.23): the step of the last log; the logged loss is the summed loss
over the steps since. A healing node's global step jumps, so it moves with it (checked in
tests/test_library_symbols.py)."""
QUORUM_FILE = "flexdemo_quorum.json"
"""In each checkpoint of a fault-tolerant node: torchft's committed-step count when it was saved."""


def prepare_fault_tolerant_trainer(trainer, config: FlexDeMoConfig) -> None:
    identity = NodeIdentity.from_env(config.min_replicas)
    import_torchft()
    _refuse_multi_node_launch(trainer)
    args = trainer.args
    node_dir = os.path.join(args.output_dir, identity.name)
    if os.path.basename(os.path.normpath(args.output_dir)) != identity.name:
        args.output_dir = node_dir
        logger.info("FlexDeMo fault tolerance: %s writes its checkpoints to %s.", identity.name, node_dir)
    if trainer.train_dataset is not None:
        trainer.train_dataset = split_by_node(trainer.train_dataset, identity)
    device = trainer.accelerator.device
    replicas = node_replicas(config, device=device if device.type == "cuda" else None)
    position = NodePosition(replicas, trainer)
    # Before CheckpointCallback, whose marker must list the quorum file too.
    callbacks = trainer.callback_handler.callbacks
    at = next((i for i, c in enumerate(callbacks) if isinstance(c, CheckpointCallback)), len(callbacks))
    callbacks.insert(at, position)
    replicas.healing.register("trainer", position.serve, position.take)
    replicas.healing.describe(
        "trainer",
        lambda: {
            "max_steps": trainer.state.max_steps,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
        },
    )


def _refuse_multi_node_launch(trainer) -> None:
    config = getattr(trainer.accelerator, "parallelism_config", None)
    replicate = getattr(config, "dp_replicate_size", 1) if config is not None else 1
    nodes, _ = default_layout()
    if replicate > 1 or nodes > 1:
        raise ValueError(
            f"fault_tolerance='torchft' with a launch that spans {max(replicate, nodes)} nodes "
            f"(dp_replicate_size={replicate}, {nodes} machines): with fault tolerance each node is its own job and "
            "the nodes meet through torchft. Launch every node alone, e.g. `accelerate launch --config_file "
            "accelerate_configs/flexdemo_ft_node.yaml train_t5.py ...` with REPLICA_GROUP_ID set per node."
        )


def split_by_node(dataset, identity: NodeIdentity):
    """This node's share of the training data: the ``replica_group``-th of ``replica_groups`` equal parts.

    Equal, so that every node counts the same steps per epoch (a remainder is left out).
    """
    count, index = identity.replica_groups, identity.replica_group
    if count == 1:
        return dataset
    sized = hasattr(dataset, "__len__")
    if hasattr(dataset, "shard"):  # datasets.Dataset and IterableDataset
        part = dataset.shard(num_shards=count, index=index)
        if sized:
            part = part.select(range(len(dataset) // count))
    elif sized:
        part = torch.utils.data.Subset(dataset, range(index, len(dataset) // count * count, count))
    else:
        raise ValueError(
            f"fault_tolerance='torchft': the training data ({type(dataset).__name__}) has neither shard() nor a "
            "length, so it cannot be split by node and every node would train on the same batches. Pass a "
            "datasets.Dataset, a sized torch Dataset, or give each node its own part of the data."
        )
    size = len(part) if hasattr(part, "__len__") else "a stream"
    logger.info(
        "FlexDeMo fault tolerance: %s trains on part %d of %d of the data (%s).", identity.name, index, count, size
    )
    return part


def _trainer_position(trainer) -> dict:
    scheduler = trainer.lr_scheduler
    return {
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
    }


class NodePosition(TrainerCallback):
    """This node's place in the job: the position taken from a healing peer, and the one checkpoints keep.

    The Trainer recomputes ``state.epoch`` from its own loop counters after every step, so
    a healed node would fall back to the epoch it counted itself: the difference to the
    peer's is carried on at every step.

    A node that finished training serves the position it had before its last step: a late node that
    catches up from it then counts its own last step as the job's last one, and its loop ends there.
    """

    def __init__(self, replicas: ManagedReplicas, trainer):
        self.replicas, self.trainer = replicas, trainer
        self.epoch_offset = 0.0
        self.step_start: dict | None = None  # the position before this node's latest step, in the job's terms
        self.ended = False  # whether this node's training loop has ended

    def serve(self) -> dict:
        if self.replicas.end.finished and self.step_start is not None:
            return self.step_start | {"final": True}
        return _trainer_position(self.trainer)

    def take(self, peer: dict) -> None:
        """Take a healing peer's global step, epoch and scheduler position."""
        trainer = self.trainer
        # The peer's position at its round is the one before this step (a finished peer's: before its last).
        self.step_start = {key: value for key, value in peer.items() if key != "final"}
        if self.ended:  # a closing round after this node's loop ended: its own position stands
            return
        state = trainer.state
        jump = peer["global_step"] - state.global_step
        state.global_step = peer["global_step"]
        if hasattr(trainer, LAST_LOGGED):  # the next logged loss averages over the steps this node trained
            setattr(trainer, LAST_LOGGED, getattr(trainer, LAST_LOGGED) + jump)
        if peer["epoch"] is not None:
            own = (state.epoch or 0.0) - self.epoch_offset  # what the Trainer's loop counts
            self.epoch_offset = peer["epoch"] - own
            state.epoch = peer["epoch"]
        scheduler = trainer.lr_scheduler
        if scheduler is not None and peer["scheduler"] is not None:
            scheduler.load_state_dict(peer["scheduler"])
            # The optimizer reads lr from its groups, which the scheduler sets only when it steps.
            for group, lr in zip(trainer.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr

    def on_train_begin(self, args, state, control, **kw):
        self.ended = False
        self.replicas.end.start_training()

    def on_step_begin(self, args, state, control, **kw):
        self.step_start = _trainer_position(self.trainer)

    def on_step_end(self, args, state, control, **kw):
        if self.epoch_offset:
            state.epoch += self.epoch_offset

    def on_train_end(self, args, state, control, optimizer=None, **kw):
        self.ended = True
        self.replicas.quorum.check_trained()
        flexdemo = unwrap_flexdemo(optimizer)
        if flexdemo is not None and flexdemo.wrapped_by is not None:  # after the final synchronize() and replica
            flexdemo.wrapped_by.finish_training()  # check (FlexDeMoCallback comes first)
        note = self.replicas.ending_note()
        if note and args.process_index == 0:
            logger.warning(note)

    def on_save(self, args, state, control, **kw):
        if args.should_save:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            (folder / QUORUM_FILE).write_text(json.dumps(self.replicas.quorum.state_dict()))

    def resume(self, checkpoint: str) -> None:
        """Continue from ``checkpoint``: torchft's committed-step count as saved there."""
        path = Path(checkpoint) / QUORUM_FILE
        self.replicas.quorum.resume(json.loads(path.read_text()) if path.is_file() else None)


def resume_node(trainer, checkpoint: str) -> None:
    """Called when a fault-tolerant trainer resumes from ``checkpoint``, before its first quorum."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, NodePosition):
            callback.resume(checkpoint)
