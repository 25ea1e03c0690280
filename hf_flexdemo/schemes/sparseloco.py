"""SparseLoCo: DiLoCo's local steps, then a top-k, low-bit pseudo-gradient with error feedback.

Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo" (arXiv 2508.15706).
With ``theta`` the parameters at the last outer step (the anchor), per replica ``r``::

    inner (every step, local):  AdamW on the replica's own gradients
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

from ..compression import ChunkPlan, decode_replicas, flat_positions, select_topk
from ..config import FlexDeMoConfig
from .base import Collective, ParamSlot, StepContext
from .demo import DeMoScheme
from .diloco import DiLoCoScheme
from .momentum import momentum_dtype
from .sparse_wire import TopKWire

ERROR_FEEDBACK = "outer_error"


class SparseLoCoScheme(DiLoCoScheme):
    name = "sparseloco"
    collective = Collective.ALL_GATHER
    shared_keys = ("anchor", "last_outer_step")
    local_keys = ("exp_avg", "exp_avg_sq", ERROR_FEEDBACK)

    def __init__(self, config: FlexDeMoConfig):
        super().__init__(config)
        self.wire = TopKWire(config)

    def init_state(self, slot: ParamSlot) -> None:
        p = slot.param
        self.anchor(slot)
        for key in ("exp_avg", "exp_avg_sq", ERROR_FEEDBACK):
            slot.state.per_replica(key, lambda: torch.zeros_like(p, dtype=momentum_dtype(p)))
        slot.state.raw.setdefault("last_outer_step", torch.zeros((), dtype=torch.int64))

    @staticmethod
    def plan(slot: ParamSlot) -> ChunkPlan:
        return DeMoScheme.plan(slot)

    def local_step(self, slot: ParamSlot, ctx: StepContext) -> list[torch.Tensor]:
        if slot.grad is not None:
            self.inner_adamw(slot, ctx.step)
        if not ctx.replicate:
            return []
        p = slot.param
        plan = self.plan(slot)
        error = slot.state.per_replica(ERROR_FEEDBACK, lambda: torch.zeros_like(p, dtype=momentum_dtype(p)))
        error.mul_(self.config.outer_momentum).add_((self.anchor(slot) - p).to(error.dtype))
        slot.carried = plan
        if plan.n_tiles == 0:
            return []
        matrix = error.view(plan.rows, plan.cols)
        indices, values = select_topk(matrix, plan)
        sent, decoded = self.wire.encode(indices, values, plan, self.wire_dtype(slot), ctx.noise)
        matrix.view(-1).index_add_(0, flat_positions(indices, plan), decoded.reshape(-1).to(error.dtype), alpha=-1.0)
        return sent

    def apply(self, slot: ParamSlot, received: list[list[torch.Tensor]], ctx: StepContext) -> None:
        plan = slot.carried
        if plan is None:
            return
        p, anchor = slot.param, self.anchor(slot)
        if plan.n_tiles:
            parts = [self.wire.read(part, plan) for part in received]
            mean = decode_replicas(parts, plan, "mean", torch.float32).view(p.shape)
            p.copy_(anchor).sub_(mean.to(p.dtype), alpha=self.config.outer_lr)
        else:
            p.copy_(anchor)
        anchor.copy_(p)
        slot.state.raw["last_outer_step"].fill_(ctx.step)
