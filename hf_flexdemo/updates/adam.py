"""``adam``: divide the decoded update by a running root mean square of it, per entry.

The decoded update ``u`` carries the learning rate (the momentum folds in ``lr * grad``), so
the second moment is kept of ``g = u / lr``, an estimate on the gradient's own scale, and
``eps`` means what it means in Adam. At the ``t``-th update of the parameter::

    v  = beta2 * v + (1 - beta2) * g**2
    p -= lr * g / (sqrt(v / (1 - beta2**t)) + eps)     Adam's bias correction

There is no first moment: FlexDeMo's momentum (``decay``) is it, so ``betas[0]`` is unused.
A step with ``lr = 0`` (a warm-up's first) moves nothing and counts nothing. ``u`` is identical
on every replica, so ``v`` and ``t`` are too (shared state: checkpointed, copied by a healing
node); ``t`` is a tensor, so the correction costs no host synchronisation. The arithmetic is
:func:`hf_flexdemo.kernels.rule_step_torch.adam_step_torch` (``kernels='triton'``: one fused pass).
"""

from __future__ import annotations

import torch

from ..buckets import Bucket
from ..kernels import adam_stepper
from ..schemes.base import StepContext
from ..schemes.momentum import momentum_dtype
from .base import Decoded, UpdateRule

SECOND_MOMENT = "update_sq"
UPDATES = "update_count"


class AdamRule(UpdateRule):
    name = "adam"
    state_keys = (SECOND_MOMENT, UPDATES)

    def init_state(self, bucket: Bucket) -> None:
        self.second_moment(bucket)
        bucket.scalars(UPDATES, torch.float64)

    @staticmethod
    def second_moment(bucket: Bucket) -> torch.Tensor:
        return bucket.shared(SECOND_MOMENT, momentum_dtype(bucket.slots[0].param))

    def apply(self, decoded: list[Decoded], ctx: StepContext) -> None:
        for item in decoded:
            bucket = item.bucket
            assert item.where is None, "update='adam' takes whole updates (random/striding are refused)"
            lr = bucket.group["lr"]
            if lr == 0:  # nothing moves (weight decay neither); g = u / lr is undefined
                continue
            beta2 = bucket.group["betas"][1]
            v = self.second_moment(bucket)
            t = bucket.scalars(UPDATES, torch.float64).add_(1)
            # Each parameter's own count (equal within a bucket unless a checkpoint says otherwise).
            correction = (1 - torch.pow(beta2, t)).to(v.dtype)
            step = adam_stepper(self.kernels_for(bucket))
            step(
                bucket.params, item.update, v, correction, lr=lr, beta2=beta2, eps=bucket.group["eps"], decay=item.decay
            )
