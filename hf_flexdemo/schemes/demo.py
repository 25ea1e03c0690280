"""DeMo: send the top-k DCT coefficients of each momentum tile, apply the sign of their average.

Per replication step and parameter::

    Q     = DCT(m)                       chunked, orthonormal DCT-II
    q     = top-k of Q per tile          the fast-moving components
    m    -= IDCT(q)                      error feedback: what was sent leaves the momentum
    Q_avg = decode(q from all replicas)  mean over the replicas that picked a coefficient
    p    -= lr * sign(IDCT(Q_avg))      the group's update rule (hf_flexdemo.updates)

The DCT is linear and orthonormal, so the momentum is kept as its coefficients ``Q``:
``Q = decay * Q + lr * DCT(grad)``, and error feedback is ``Q -= q``. That is the same
rule with one transform fewer per step (two instead of three). The state entry
``momentum_dct`` holds ``Q`` laid out like the parameter (see :mod:`..compression`); a bucket's
tensors are stacked by rows, so each phase is one operation on all of them.

One replica: no communication; the update is the sign of the replica's own top-k
reconstruction (the momentum and error feedback still work as above).
"""

from __future__ import annotations

import torch

from ..buckets import Bucket, ParamSlot
from ..compression import ChunkPlan, decode_replicas, flat_positions, from_coefficients, select_topk, to_coefficients
from ..config import FlexDeMoConfig
from .base import Collective, Decoded, StepContext
from .momentum import MomentumScheme
from .sparse_wire import TopKWire

TILE_STATE = "dct_tiles"
"""Per-rank (tile_rows, tile_cols) the coefficients were computed with."""


class DeMoScheme(MomentumScheme):
    name = "demo"
    collective = Collective.ALL_GATHER
    momentum_key = "momentum_dct"

    def __init__(self, config: FlexDeMoConfig):
        super().__init__(config)
        self.wire = TopKWire(config)

    def init_state(self, bucket: Bucket) -> None:
        super().init_state(bucket)
        for slot in bucket.slots:
            if TILE_STATE not in slot.state.raw:
                plan = self.tensor_plan(slot.param.shape, bucket.group)
                tiles = slot.state.counters(TILE_STATE, 2)
                tiles.copy_(torch.tensor([plan.tile_rows, plan.tile_cols]))

    def check_state(self, slot: ParamSlot) -> None:
        plan = self.tensor_plan(slot.param.shape, slot.group)
        tiles = slot.state.counters(TILE_STATE, 2)
        if tiles.tolist() != [plan.tile_rows, plan.tile_cols]:
            raise RuntimeError(
                f"FlexDeMo: the momentum of a parameter of local shape {tuple(slot.param.shape)} was saved with "
                f"DCT tiles {tuple(tiles.tolist())}, but this layout gives {(plan.tile_rows, plan.tile_cols)}. "
                "Resume with the same number of processes per node (the same FSDP shards) as the checkpoint."
            )

    @staticmethod
    def tensor_plan(shape: torch.Size, group: dict) -> ChunkPlan:
        """How one tensor of local ``shape`` is tiled."""
        return ChunkPlan.for_shape(shape, group["chunk"], group["topk"])

    @classmethod
    def plan(cls, bucket: Bucket) -> ChunkPlan:
        """The bucket's tensors stacked by rows: each keeps its own tiles."""
        return cls.tensor_plan(bucket.shape, bucket.group).stacked(bucket.count)

    def accumulate(self, bucket: Bucket) -> torch.Tensor:
        """``Q = decay * Q + lr * DCT(grad)``; returns ``Q`` as a ``(rows, cols)`` view of the stack."""
        plan = self.plan(bucket)
        q = self.momentum(bucket).view(plan.rows, plan.cols)
        if plan.n_tiles:
            q.mul_(bucket.group["decay"]).add_(to_coefficients(bucket.grad, plan), alpha=bucket.group["lr"])
        return q

    def local_step(self, bucket: Bucket, ctx: StepContext) -> list[torch.Tensor]:
        q = self.accumulate(bucket)
        plan = self.plan(bucket)
        if not ctx.replicate:
            return []
        bucket.carried = plan
        if plan.n_tiles == 0:  # empty shards send nothing, but their (empty) update still reaches the rule
            return []
        indices, values = select_topk(q, plan)
        sent, decoded = self.wire.encode(indices, values, plan, self.wire_dtype(bucket), ctx.noise)
        # Subtract what travels (as the receivers will decode it) so the rounding error stays in Q.
        q.view(-1).index_add_(0, flat_positions(indices, plan), decoded.reshape(-1).to(q.dtype), alpha=-1.0)
        return sent

    def empty_update(self, bucket: Bucket) -> Decoded:
        """Empty shards' update: the rule still sees it, since orthogonal moves a node's shards to their owners."""
        return Decoded(bucket, self.momentum(bucket).new_zeros(bucket.count * bucket.numel))

    def apply(self, bucket: Bucket, received: list[list[torch.Tensor]], ctx: StepContext) -> Decoded | None:
        plan = bucket.carried
        if plan is None:
            return None
        if plan.n_tiles == 0:
            return self.empty_update(bucket)
        dtype = self.momentum(bucket).dtype
        parts = [self.wire.read(part, plan) for part in received]
        coefficients = decode_replicas(parts, plan, self.config.decode, dtype)
        return Decoded(bucket, from_coefficients(coefficients, plan, overwrite=True).view(-1))
