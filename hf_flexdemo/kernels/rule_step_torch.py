"""The update rules' pass over a bucket's parameters as torch operations: what :mod:`.rule_step` must equal, and
what the path ``kernels='torch'`` runs (:class:`hf_flexdemo.updates.base.UpdateRule`,
:class:`hf_flexdemo.updates.adam.AdamRule`)::

    p  = decay * p                                                   weight decay, decay = 1 - lr * weight_decay
    add_step:   p += alpha * step                                    step rounded to p's dtype first
    adam_step:  g  = u / lr
                v  = beta2 * v + (1 - beta2) * g**2                  v: the rule's second moment, float32
                p -= lr * g / (sqrt(v / correction) + eps)           correction: 1 - beta2**t, per parameter

``step``, ``u`` and ``v`` hold the bucket's parameters' entries in order (``count * numel``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def add_step_torch(params: Sequence[torch.Tensor], step: torch.Tensor, alpha: float, decay: float = 1.0) -> None:
    """``p = decay * p + alpha * step`` for each of ``params`` (one shape), one foreach operation each (their fast
    path wants one dtype)."""
    if decay != 1.0:
        torch._foreach_mul_(list(params), decay)
    steps = step.to(params[0].dtype).reshape(len(params), *params[0].shape).unbind(0)
    torch._foreach_add_(list(params), list(steps), alpha=alpha)


def adam_step_torch(
    params: Sequence[torch.Tensor],
    update: torch.Tensor,
    second_moment: torch.Tensor,
    correction: torch.Tensor,
    *,
    lr: float,
    beta2: float,
    eps: float,
    decay: float = 1.0,
) -> None:
    """The adam rule's step (module doc); ``update`` is overwritten, ``second_moment`` updated in place."""
    v = second_moment
    g = update.view(v.shape).to(v.dtype).div_(lr)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denominator = (v / correction.view(-1, *([1] * (v.dim() - 1)))).sqrt_().add_(eps)
    add_step_torch(params, g.div_(denominator), -lr, decay)
