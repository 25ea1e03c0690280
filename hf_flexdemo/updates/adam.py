"""``adam``: divide the decoded update by a running root mean square of it, per entry.

The decoded update ``u`` carries the learning rate (the momentum folds in ``lr * grad``), so
the second moment is kept of ``g = u / lr``, an estimate on the gradient's own scale, and
``eps`` means what it means in Adam. At the ``t``-th update of the parameter::

    v  = beta2 * v + (1 - beta2) * g**2
    p -= lr * g / (sqrt(v / (1 - beta2**t)) + eps)     Adam's bias correction

There is no first moment: FlexDeMo's momentum (``decay``) is it, so ``betas[0]`` is unused.
A step with ``lr = 0`` (a warm-up's first) moves nothing and counts nothing. ``u`` is identical
on every replica, so ``v`` and ``t`` are too (shared state: checkpointed, copied by a healing
node); ``t`` is a tensor, so the correction costs no host synchronisation.
"""

from __future__ import annotations

import torch

from ..schemes.base import ParamSlot, StepContext
from ..schemes.momentum import momentum_dtype
from .base import Decoded, UpdateRule

SECOND_MOMENT = "update_sq"
UPDATES = "update_count"


class AdamRule(UpdateRule):
    name = "adam"
    state_keys = (SECOND_MOMENT, UPDATES)

    def init_state(self, slot: ParamSlot) -> None:
        self.second_moment(slot)
        if UPDATES not in slot.state.raw:
            slot.state.raw[UPDATES] = torch.zeros((), dtype=torch.float64, device=slot.param.device)

    @staticmethod
    def second_moment(slot: ParamSlot) -> torch.Tensor:
        p = slot.param
        return slot.state.shared(SECOND_MOMENT, lambda: torch.zeros_like(p, dtype=momentum_dtype(p)))

    def apply(self, decoded: list[Decoded], ctx: StepContext) -> None:
        for item in decoded:
            slot = item.slot
            assert item.where is None, "update='adam' takes whole updates (random/striding are refused)"
            lr = slot.group["lr"]
            if lr == 0:  # nothing moves; g = u / lr is undefined
                continue
            beta2 = slot.group["betas"][1]
            v = self.second_moment(slot)
            t = slot.state.raw[UPDATES].add_(1)
            g = item.update.view(v.shape).to(v.dtype).div_(lr)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denominator = (v / (1 - torch.pow(beta2, t))).sqrt_().add_(slot.group["eps"])
            self.subtract(item, g.div_(denominator))
