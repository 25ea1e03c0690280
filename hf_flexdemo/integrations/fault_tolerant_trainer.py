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
- a healing node receives the global step, epoch and scheduler position with the parameters.
"""

from __future__ import annotations

import logging
import os

import torch

from ..config import FlexDeMoConfig
from ..fault_tolerance import NodeIdentity, import_torchft, node_replicas
from .accelerate_plugin import default_layout

logger = logging.getLogger(__name__)

LAST_LOGGED = "_globalstep_last_logged"
"""Private Trainer attribute (4.57 to 5.23): the step of the last log; the logged loss is the summed loss
over the steps since. A healing node's global step jumps, so it moves with it (checked in
tests/test_library_symbols.py)."""


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
    replicas.register("trainer", lambda: _trainer_position(trainer), lambda peer: _take_position(trainer, peer))
    replicas.describe(
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


def _take_position(trainer, peer: dict) -> None:
    jump = peer["global_step"] - trainer.state.global_step
    trainer.state.global_step = peer["global_step"]
    if hasattr(trainer, LAST_LOGGED):  # the next logged loss averages over the steps this node trained
        setattr(trainer, LAST_LOGGED, getattr(trainer, LAST_LOGGED) + jump)
    trainer.state.epoch = peer["epoch"]
    scheduler = trainer.lr_scheduler
    if scheduler is not None and peer["scheduler"] is not None:
        scheduler.load_state_dict(peer["scheduler"])
        # The optimizer reads lr from its groups, which the scheduler sets only when it steps.
        for group, lr in zip(trainer.optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
