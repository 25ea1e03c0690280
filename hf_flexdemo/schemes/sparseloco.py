"""SparseLoCo: DiLoCo's local steps, then a top-k, low-bit pseudo-gradient with error feedback.

Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo" (arXiv 2508.15706).
With ``theta`` the parameters at the last outer step (the anchor), per replica ``r``::

    inner (every step, local):  AdamW on the replica's own gradients (update='orthogonal': Muon's, see diloco)
    outer (every H steps):      delta_r = theta - p                     pseudo-gradient
                                e_r     = beta * e_r + delta_r           error feedback (local)
                                s_r     = Q(top-k of e_r per tile)       what travels
                                e_r    -= s_r                            what is not sent stays
                                p       = theta - outer_lr * mean_r(s_r) sparse aggregation
                                theta   = p

The error-feedback accumulator ``e_r`` takes the place of DiLoCo's outer momentum (the
paper's observation); ``beta`` is ``outer_momentum``. Tiles are the same ``chunk x chunk``
tiles as DeMo's, in the parameter's own domain (no DCT); ``Q`` is ``value_bits`` (the paper
uses 2) and its rounding error stays in ``e_r``. The mean over replicas counts a position
that a replica did not send as zero. One packed all-gather per outer step.

One replica: no communication; the outer step applies the replica's own sparse, quantized
pseudo-gradient. Checkpointed state: the anchor (shared), the inner Adam moments and the
error feedback (per replica), the step of the last outer step.
"""

from __future__ import annotations

import torch

from ..buckets import Bucket
from ..compression import ChunkPlan, decode_replicas, flat_positions, select_topk
from ..config import FlexDeMoConfig
from ..scheme_traits import SchemeTraits
from .base import Collective, StepContext
from .demo import tile_plan
from .diloco import DiLoCoScheme
from .momentum import momentum_dtype
from .sparse_wire import TopKWire

ERROR_FEEDBACK = "outer_error"


class SparseLoCoScheme(DiLoCoScheme):
    name = "sparseloco"
    collective = Collective.ALL_GATHER
    traits = SchemeTraits(outer_steps=True, top_k=True)
    shared_keys = ("anchor", "last_outer_step")
    local_keys = ("exp_avg", "exp_avg_sq", ERROR_FEEDBACK)

    def __init__(self, config: FlexDeMoConfig):
        super().__init__(config)
        self.wire = TopKWire(config)

    def init_state(self, bucket: Bucket) -> None:
        self.anchor(bucket)
        self.init_inner_state(bucket)
        bucket.per_replica(ERROR_FEEDBACK, momentum_dtype(bucket.slots[0].param))
        bucket.scalars("last_outer_step", torch.int64)

    def plan(self, bucket: Bucket) -> ChunkPlan:
        return tile_plan(bucket.shape, bucket.group, self.config).stacked(bucket.count)

    def local_step(self, bucket: Bucket, ctx: StepContext) -> list[torch.Tensor]:
        if not ctx.replicate:
            return []
        plan = self.plan(bucket)
        error = bucket.per_replica(ERROR_FEEDBACK, momentum_dtype(bucket.slots[0].param))
        error.mul_(self.config.outer_momentum).add_((self.anchor(bucket) - bucket.stacked_params()).to(error.dtype))
        bucket.carried = plan
        if plan.n_tiles == 0:
            return []
        matrix = error.view(plan.rows, plan.cols)
        indices, values = select_topk(matrix, plan)
        sent, decoded = self.wire.encode(indices, values, plan, self.wire_dtype(bucket), ctx.noise)
        matrix.view(-1).index_add_(0, flat_positions(indices, plan), decoded.reshape(-1).to(error.dtype), alpha=-1.0)
        return sent

    def apply(self, bucket: Bucket, received: list[list[torch.Tensor]], ctx: StepContext) -> None:
        plan = bucket.carried
        if plan is None:
            return
        anchor = self.anchor(bucket)
        if plan.n_tiles:
            parts = [self.wire.read(part, plan) for part in received]
            mean = decode_replicas(parts, plan, "mean", torch.float32).view(anchor.shape)
            anchor.sub_(mean.to(bucket.dtype), alpha=self.config.outer_lr)
        bucket.copy_to_params(anchor)
        bucket.scalars("last_outer_step", torch.int64).fill_(ctx.step)
