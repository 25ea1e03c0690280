"""DiLoCo: H local steps per replica (AdamW, or Muon's), then an outer Nesterov step on the averaged change.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
(arXiv 2311.08105). With ``theta`` the parameters at the last outer step (the anchor)::

    inner (every step, local):  AdamW on the replica's own gradients
    outer (every H steps):      delta = mean over replicas of (theta - p)   pseudo-gradient
                                v     = mu * v + delta
                                p     = theta - outer_lr * (delta + mu * v)  Nesterov
                                theta = p

Replicas differ between outer steps and are bitwise identical right after one. The inner
Adam moments stay local (per replica); anchor and outer momentum are the same everywhere.

With ``update='orthogonal'`` the inner step of each matrix is Muon's instead of AdamW's: the replica's own
momentum ``m = beta1 * m + (1 - beta1) * g``, Nesterov's ``g + beta1 * (m - g)``, orthogonalized by the
orthogonal rule (:mod:`hf_flexdemo.updates.orthogonal`, which deals a node's shards out to their owners);
everything else, embeddings and heads included, keeps the inner AdamW.

One replica: no communication; the outer step applies the replica's own pseudo-gradient,
which makes it a Lookahead-style optimizer around its inner step.
"""

from __future__ import annotations

import torch

from ..buckets import Bucket
from ..scheme_traits import SchemeTraits
from ..state_store import StateStore, StateView
from .base import Collective, Decoded, ReplicationScheme, StepContext
from .momentum import momentum_dtype


class DiLoCoScheme(ReplicationScheme):
    name = "diloco"
    collective = Collective.ALL_REDUCE
    traits = SchemeTraits(outer_steps=True)
    shared_keys = ("anchor", "outer_momentum", "last_outer_step")
    local_keys = ("exp_avg", "exp_avg_sq")
    moves_parameters_locally = True

    def is_replication_step(self, step: int, forced: bool = False) -> bool:
        return forced or step % self.config.inner_steps == 0

    def replicas_match(self, state: StateView, step: int) -> bool:
        return int(state.raw.get("last_outer_step", 0)) == step

    def needs_sync(self, state: StateView, step: int) -> bool:
        return not self.replicas_match(state, step)

    def init_state(self, bucket: Bucket) -> None:
        self.anchor(bucket)  # the parameters before the first inner step
        self.init_inner_state(bucket)
        bucket.shared("outer_momentum", bucket.dtype)
        bucket.scalars("last_outer_step", torch.int64)

    @staticmethod
    def orthogonal_inside(bucket: Bucket) -> bool:
        """Whether the replica's own step on ``bucket`` is the orthogonal rule's (``update='orthogonal'``, matrices)."""
        return bucket.group["update"] == "orthogonal" and len(bucket.full_shape) == 2

    def init_inner_state(self, bucket: Bucket) -> None:
        """The inner step's moments, per replica: AdamW's two, or the orthogonal rule's momentum alone."""
        keys = ("exp_avg",) if self.orthogonal_inside(bucket) else ("exp_avg", "exp_avg_sq")
        for key in keys:
            bucket.per_replica(key, momentum_dtype(bucket.slots[0].param))

    def healed(self, param: torch.Tensor, state: StateView) -> None:
        # Restart the inner loop from the anchor: the peer's inner progress is the peer's to send.
        if "anchor" in state.raw:  # (at step 0 the peer has none yet: its parameters are the anchor)
            param.copy_(StateStore.local(state.raw["anchor"], param))

    def inner_step(self, bucket: Bucket, ctx: StepContext) -> Decoded | None:
        if bucket.grad is None:
            return None
        if not self.orthogonal_inside(bucket):
            self.inner_adamw(bucket, ctx.step)
            return None
        beta1 = bucket.group["betas"][0]
        momentum = bucket.per_replica("exp_avg", momentum_dtype(bucket.slots[0].param))
        grad = bucket.grad.to(momentum.dtype)
        momentum.lerp_(grad, 1 - beta1)
        return Decoded(bucket, dense=grad.lerp_(momentum, beta1).view(-1))  # Nesterov, as Muon

    def local_step(self, bucket: Bucket, ctx: StepContext) -> list[torch.Tensor]:
        if not ctx.replicate:
            return []
        anchor = self.anchor(bucket)
        bucket.carried = True
        return [(anchor - bucket.stacked_params()).to(self.wire_dtype(bucket)).view(-1)]

    def apply(self, bucket: Bucket, received: list[torch.Tensor], ctx: StepContext) -> None:
        if not bucket.carried:
            return
        mu = self.config.outer_momentum
        anchor = self.anchor(bucket)
        velocity = bucket.shared("outer_momentum", bucket.dtype)
        delta = received[0].view(anchor.shape).to(bucket.dtype)
        velocity.mul_(mu).add_(delta)
        anchor.sub_(delta.add_(velocity, alpha=mu), alpha=self.config.outer_lr)
        bucket.copy_to_params(anchor)
        bucket.scalars("last_outer_step", torch.int64).fill_(ctx.step)

    @staticmethod
    def anchor(bucket: Bucket) -> torch.Tensor:
        return bucket.shared("anchor", bucket.dtype, lambda slot: slot.param.detach().clone())

    @staticmethod
    def inner_adamw(bucket: Bucket, step: int) -> None:
        """One AdamW step without weight decay (the optimizer already applied the decoupled decay)."""
        group = bucket.group
        beta1, beta2 = group["betas"]
        dtype = momentum_dtype(bucket.slots[0].param)
        exp_avg = bucket.per_replica("exp_avg", dtype)
        exp_avg_sq = bucket.per_replica("exp_avg_sq", dtype)
        g = bucket.grad.to(exp_avg.dtype)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1, bias2 = 1 - beta1**step, 1 - beta2**step
        denom = (exp_avg_sq.sqrt() / bias2**0.5).add_(group["eps"])
        numerators, denominators = bucket.unstacked(exp_avg.to(bucket.dtype)), bucket.unstacked(denom.to(bucket.dtype))
        torch._foreach_addcdiv_(bucket.params, numerators, denominators, -group["lr"] / bias1)
