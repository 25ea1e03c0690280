"""Random and Striding: replicate a subset of momentum entries chosen the same way on every replica.

Both send the momentum's values at ``~rate`` of its entries and no indices: every replica
derives the same positions. The values are averaged with an all-reduce, subtracted from
the momentum (error feedback), and only those entries of the parameter move, by
``lr * sign(mean)``. The subset has one entry per block of ``g = round(1 / rate)``
consecutive entries of the bucket's flattened local shards (one parameter's after another's):

- ``random``: a uniformly drawn entry of each block, from a generator seeded with
  ``(seed, step, the tensor's place in the optimizer)`` that every replica shares;
- ``striding``: entry ``offset`` of each block, with the offset advancing by one per
  replication, so every entry is sent once every ``g`` replications.

One replica: no communication; the chosen entries move by the sign of the replica's own
momentum there.
"""

from __future__ import annotations

import math
from abc import abstractmethod

import torch

from ..buckets import Bucket
from ..scheme_traits import SchemeTraits
from .base import Collective, Decoded, StepContext
from .momentum import MomentumScheme


def tensor_seed(seed: int, step: int, index: int) -> int:
    """The seed of one tensor's draws at one step: every replica derives the same, in any order."""
    return (seed * 1_000_003 + step) * 1_000_033 + index


class SubsetScheme(MomentumScheme):
    collective = Collective.ALL_REDUCE

    @property
    def block(self) -> int:
        return max(1, round(1 / self.config.rate))

    @abstractmethod
    def tensor_positions(self, bucket: Bucket, ctx: StepContext) -> torch.Tensor:
        """Each tensor's flat int64 positions, one per block of ``self.block`` entries: ``(count, blocks)``,
        or ``(1, blocks)`` when every tensor takes the same ones."""

    def positions(self, bucket: Bucket, ctx: StepContext) -> torch.Tensor:
        """Flat positions in the bucket: each tensor's own, offset by where the tensor starts."""
        starts = torch.arange(bucket.count, dtype=torch.int64).unsqueeze(1) * bucket.numel
        return (starts + self.tensor_positions(bucket, ctx)).reshape(-1).to(bucket.device)

    def local_step(self, bucket: Bucket, ctx: StepContext) -> list[torch.Tensor]:
        m = self.accumulate(bucket)
        if not ctx.replicate or m.numel() == 0:
            return []
        where = self.positions(bucket, ctx)
        flat = m.view(-1)
        values = flat[where].to(self.wire_dtype(bucket))
        flat.index_add_(0, where, values.to(m.dtype), alpha=-1.0)
        bucket.carried = where
        return [values]

    def apply(self, bucket: Bucket, received: list[torch.Tensor], ctx: StepContext) -> Decoded | None:
        where = bucket.carried
        return None if where is None else Decoded(bucket, received[0], where=where)


class RandomScheme(SubsetScheme):
    name = "random"
    traits = SchemeTraits(per_step=True, replayable=True, subset=True, seeded=True)

    def tensor_positions(self, bucket: Bucket, ctx: StepContext) -> torch.Tensor:
        numel, block = bucket.numel, self.block
        blocks = math.ceil(numel / block)
        starts = torch.arange(blocks, dtype=torch.int64) * block
        sizes = (numel - starts).clamp_(max=block)
        # Drawn on the host, per tensor: a tensor's draws do not depend on how the tensors are bucketed.
        seeds = [tensor_seed(self.config.seed, ctx.step, slot.index) for slot in bucket.slots]
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        draws = torch.stack([torch.rand(blocks, generator=g, dtype=torch.float64) for g in generators])
        return starts + (draws * sizes).long().clamp_(max=sizes - 1)


class StridingScheme(SubsetScheme):
    name = "striding"
    traits = SchemeTraits(per_step=True, replayable=True, subset=True)

    def tensor_positions(self, bucket: Bucket, ctx: StepContext) -> torch.Tensor:
        block = self.block
        replication = ctx.step // self.config.replicate_every - 1
        offset = replication % block
        # A tail block shorter than the offset sends nothing this time; it is covered in later turns.
        return torch.arange(offset, max(bucket.numel, offset), block, dtype=torch.int64).unsqueeze(0)
