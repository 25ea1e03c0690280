"""DiLoCo: H local AdamW steps per replica, then an outer Nesterov step on the averaged change.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
(arXiv 2311.08105). With ``theta`` the parameters at the last outer step (the anchor)::

    inner (every step, local):  AdamW on the replica's own gradients
    outer (every H steps):      delta = mean over replicas of (theta - p)   pseudo-gradient
                                v     = mu * v + delta
                                p     = theta - outer_lr * (delta + mu * v)  Nesterov
                                theta = p

Replicas differ between outer steps and are bitwise identical right after one. The inner
Adam moments stay local (per replica); anchor and outer momentum are the same everywhere.

One replica: no communication; the outer step applies the replica's own pseudo-gradient,
which makes it a Lookahead-style optimizer around AdamW.
"""

from __future__ import annotations

import torch

from ..state_store import StateStore, StateView
from .base import Collective, ParamSlot, ReplicationScheme, StepContext
from .momentum import momentum_dtype


class DiLoCoScheme(ReplicationScheme):
    name = "diloco"
    collective = Collective.ALL_REDUCE
    shared_keys = ("anchor", "outer_momentum", "last_outer_step")
    local_keys = ("exp_avg", "exp_avg_sq")
    moves_parameters_locally = True

    def is_replication_step(self, step: int, forced: bool = False) -> bool:
        return forced or step % self.config.inner_steps == 0

    def replicas_match(self, state: StateView, step: int) -> bool:
        return int(state.raw.get("last_outer_step", 0)) == step

    def needs_sync(self, state: StateView, step: int) -> bool:
        return not self.replicas_match(state, step)

    def init_state(self, slot: ParamSlot) -> None:
        p = slot.param
        self.anchor(slot)  # the parameters before the first inner step
        for key in ("exp_avg", "exp_avg_sq"):
            slot.state.per_replica(key, lambda: torch.zeros_like(p, dtype=momentum_dtype(p)))
        slot.state.shared("outer_momentum", lambda: torch.zeros_like(p))
        slot.state.raw.setdefault("last_outer_step", torch.zeros((), dtype=torch.int64))

    def healed(self, param: torch.Tensor, state: StateView) -> None:
        # Restart the inner loop from the anchor: the peer's inner progress is the peer's to send.
        if "anchor" in state.raw:  # (at step 0 the peer has none yet: its parameters are the anchor)
            param.copy_(StateStore.local(state.raw["anchor"], param))

    def local_step(self, slot: ParamSlot, ctx: StepContext) -> list[torch.Tensor]:
        if slot.grad is not None:
            self.inner_adamw(slot, ctx.step)
        if not ctx.replicate:
            return []
        anchor = self.anchor(slot)
        slot.carried = True
        return [(anchor - slot.param).to(self.wire_dtype(slot))]

    def apply(self, slot: ParamSlot, received: list[torch.Tensor], ctx: StepContext) -> None:
        if not slot.carried:
            return
        p, mu = slot.param, self.config.outer_momentum
        anchor = self.anchor(slot)
        velocity = slot.state.shared("outer_momentum", lambda: torch.zeros_like(p))
        delta = received[0].to(p.dtype)
        velocity.mul_(mu).add_(delta)
        p.copy_(anchor).sub_(delta.add_(velocity, alpha=mu), alpha=self.config.outer_lr)
        anchor.copy_(p)
        slot.state.raw["last_outer_step"].fill_(ctx.step)

    @staticmethod
    def anchor(slot: ParamSlot) -> torch.Tensor:
        return slot.state.shared("anchor", lambda: slot.param.detach().clone())

    @staticmethod
    def inner_adamw(slot: ParamSlot, step: int) -> None:
        """One AdamW step without weight decay (the optimizer already applied the decoupled decay)."""
        p, g, group = slot.param, slot.grad, slot.group
        beta1, beta2 = group["betas"]
        exp_avg = slot.state.per_replica("exp_avg", lambda: torch.zeros_like(p, dtype=momentum_dtype(p)))
        exp_avg_sq = slot.state.per_replica("exp_avg_sq", lambda: torch.zeros_like(p, dtype=momentum_dtype(p)))
        g = g.to(exp_avg.dtype)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1, bias2 = 1 - beta1**step, 1 - beta2**step
        denom = (exp_avg_sq.sqrt() / bias2**0.5).add_(group["eps"])
        p.addcdiv_(exp_avg.to(p.dtype), denom.to(p.dtype), value=-group["lr"] / bias1)
