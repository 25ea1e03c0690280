"""Who a process's replicas are, and whether they still hold the same parameters.

A *replica* is one copy of the model: in FlexDeMo's layout, one node whose processes
shard the model with FSDP. The processes that hold the same shard on every node form
this process's *replicate group*; FlexDeMo's inter-node traffic runs on it alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .dtensor_utils import local_tensor

logger = logging.getLogger(__name__)


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False):
    """``all_gather_into_tensor`` under its torch >= 2.13 name (the old one is deprecated there)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


REPLICATE_DIM_NAMES = ("dp_replicate", "replicate")
"""Mesh dimension names taken as the replicate dimension when none is given (Accelerate's first)."""


@dataclass(frozen=True)
class ReplicaTopology:
    """The replicate group of this process, and the device mesh it came from (if any)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    mesh: DeviceMesh | None = None
    replicate_dim: str | None = None

    @classmethod
    def single(cls) -> ReplicaTopology:
        return cls(group=None, size=1, rank=0)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, replicate_dim: str | None = None) -> ReplicaTopology:
        names = mesh.mesh_dim_names or ()
        if replicate_dim is None:
            replicate_dim = next((n for n in REPLICATE_DIM_NAMES if n in names), None)
            if replicate_dim is None:
                raise ValueError(
                    f"FlexDeMo: the device mesh has dimensions {names}, none of them named one of "
                    f"{REPLICATE_DIM_NAMES}. Pass replicate_dim= to name the inter-node dimension."
                )
        elif replicate_dim not in names:
            raise ValueError(f"FlexDeMo: replicate_dim={replicate_dim!r} is not a dimension of the mesh {names}.")
        sub = mesh[replicate_dim]
        return cls(
            group=sub.get_group(),
            size=sub.size(),
            rank=sub.get_local_rank(),
            mesh=mesh,
            replicate_dim=replicate_dim,
        )

    @property
    def is_replicated(self) -> bool:
        return self.size > 1

    @property
    def is_managed(self) -> bool:
        """Whether a fault-tolerance manager decides, per step, who the replicas are."""
        return False

    @property
    def device(self) -> torch.device:
        """Where this group's collectives take their tensors."""
        return collective_device(self.group)

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        """Every replica's ``tensor`` laid end to end in ``output`` (replica order)."""
        return all_gather_single(output, tensor, group=self.group, async_op=async_op)

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = False):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)


def check_layout(params: Iterable[torch.Tensor], topology: ReplicaTopology) -> None:
    """Refuse parameters laid out so that FSDP would exchange across nodes, or so that replicas' processes would
    train unsynchronized copies."""
    for p in params:
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            if topology.replicate_dim is not None and topology.replicate_dim in names:
                raise ValueError(
                    f"FlexDeMo: a parameter of shape {tuple(p.shape)} is replicated by FSDP over the "
                    f"{topology.replicate_dim!r} dimension (HSDP), so FSDP would all-reduce its gradients "
                    "across nodes. FlexDeMo owns the inter-node exchange: shard with "
                    f"fully_shard(module, mesh=mesh[<the other dims>]) instead."
                )
        elif topology.mesh is not None and topology.mesh.size() != topology.size:
            raise ValueError(
                f"FlexDeMo: a parameter of shape {tuple(p.shape)} is a plain tensor, but each replica spans "
                f"{topology.mesh.size() // topology.size} processes; those processes would train unsynchronized "
                "copies. Shard the model inside the node with FSDP2 (fully_shard(model, mesh=mesh[...]))."
            )


def parameter_fingerprint(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """An exact int64 checksum of the bits of the local shards (wrapping sums).

    Any single changed bit changes it, which is what a drift check needs; it is one
    pass over the parameters and costs no communication.
    """
    total = torch.zeros((), dtype=torch.int64)
    for t in tensors:
        t = local_tensor(t).detach()
        if t.numel() == 0:
            continue
        bits = t.contiguous().view(-1).view(_int_view_dtype(t.dtype))
        total += bits.sum(dtype=torch.int64).cpu()
    return total


def _int_view_dtype(dtype: torch.dtype) -> torch.dtype:
    size = torch.empty((), dtype=dtype).element_size()
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]


def replica_fingerprints(tensors: Iterable[torch.Tensor], topology: ReplicaTopology) -> list[int]:
    """The fingerprint of this process's shards on every replica, in replica order."""
    return gather_int64(int(parameter_fingerprint(tensors)), topology)


def gather_int64(value: int, topology: ReplicaTopology) -> list[int]:
    """Every replica's ``value`` (a signed 64-bit integer), in replica order: one 8-byte all-gather."""
    if not topology.is_replicated:
        return [value]
    gathered = torch.empty(topology.size, dtype=torch.int64, device=topology.device)
    work = topology.all_gather_into(gathered, torch.tensor([value], dtype=torch.int64, device=topology.device))
    if work is not None:
        work.wait()
    return [int(x) for x in gathered.cpu()]


def broadcast_from_first_replica(tensors: Iterable[torch.Tensor], topology: ReplicaTopology) -> None:
    """Overwrite every replica's local shards with replica 0's, in place."""
    if not topology.is_replicated:
        return
    src = dist.get_global_rank(topology.group, 0)
    for t in tensors:
        dist.broadcast(local_tensor(t).data, src=src, group=topology.group)


def start_from_first_replica(tensors: list[torch.Tensor], topology: ReplicaTopology) -> None:
    """Every replica takes replica 0's local shards, if the replicas' differ (said once, with their fingerprints)."""
    prints = replica_fingerprints(tensors, topology)
    if len(set(prints)) > 1:
        logger.warning(
            "FlexDeMo: replicas start from different parameters (fingerprints %s); "
            "copying replica 0's parameters to every replica.",
            prints,
        )
        broadcast_from_first_replica(tensors, topology)


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
