"""Random and Striding: replicate a subset of momentum entries chosen the same way on every replica.

Both send the momentum's values at ``~rate`` of its entries and no indices: every replica
derives the same positions. The values are averaged with an all-reduce, subtracted from
the momentum (error feedback), and only those entries of the parameter move, by
``lr * sign(mean)``. The subset has one entry per block of ``g = round(1 / rate)``
consecutive entries of the flattened local shard:

- ``random``: a uniformly drawn entry of each block, from a generator seeded with
  ``(seed, step)`` that every replica shares;
- ``striding``: entry ``offset`` of each block, with the offset advancing by one per
  replication, so every entry is sent once every ``g`` replications.

One replica: no communication; the chosen entries move by the sign of the replica's own
momentum there.
"""

from __future__ import annotations

import math
from abc import abstractmethod

import torch

from .base import Collective, Decoded, ParamSlot, StepContext
from .momentum import MomentumScheme


class SubsetScheme(MomentumScheme):
    collective = Collective.ALL_REDUCE

    @property
    def block(self) -> int:
        return max(1, round(1 / self.config.rate))

    @abstractmethod
    def positions(self, numel: int, ctx: StepContext, device: torch.device) -> torch.Tensor:
        """Flat int64 positions, one per block of ``self.block`` entries."""

    def local_step(self, slot: ParamSlot, ctx: StepContext) -> list[torch.Tensor]:
        m = self.accumulate(slot)
        if not ctx.replicate or m.numel() == 0:
            return []
        where = self.positions(m.numel(), ctx, m.device)
        flat = m.view(-1)
        values = flat[where].to(self.wire_dtype(slot))
        flat.index_add_(0, where, values.to(m.dtype), alpha=-1.0)
        slot.carried = where
        return [values]

    def apply(self, slot: ParamSlot, received: list[torch.Tensor], ctx: StepContext) -> Decoded | None:
        where = slot.carried
        return None if where is None else Decoded(slot, received[0], where=where)


class RandomScheme(SubsetScheme):
    name = "random"

    def positions(self, numel: int, ctx: StepContext, device: torch.device) -> torch.Tensor:
        block = self.block
        blocks = math.ceil(numel / block)
        starts = torch.arange(blocks, dtype=torch.int64) * block
        sizes = (numel - starts).clamp_(max=block)
        draws = torch.rand(blocks, generator=ctx.generator, dtype=torch.float64)
        offsets = (draws * sizes).long().clamp_(max=sizes - 1)
        return (starts + offsets).to(device)


class StridingScheme(SubsetScheme):
    name = "striding"

    def positions(self, numel: int, ctx: StepContext, device: torch.device) -> torch.Tensor:
        block = self.block
        replication = ctx.step // self.config.replicate_every - 1
        offset = replication % block
        # A tail block shorter than the offset sends nothing this time; it is covered in later turns.
        return torch.arange(offset, max(numel, offset), block, dtype=torch.int64, device=device)
