"""The sign rule's decode-and-apply as torch operations: what :func:`.sign_decode.sign_decode` must equal.

The path ``kernels='torch'`` runs these same operations, spread over the scheme
(:meth:`hf_flexdemo.schemes.demo.DeMoScheme.apply`: decode, inverse DCT) and the rule
(:class:`hf_flexdemo.updates.sign.SignRule`: sign, ``p -= lr * step``)::

    C  = decode(every replica's (indices, values))   dense coefficients; 'selected': / replicas that sent each
    U  = IDCT(C)                                     per tile
    p *= decay                                       weight decay: decay = 1 - lr * weight_decay
    p -= lr * sign(U)                                (sign=False: lr * U in the parameter's dtype)

The last line is computed in float32 and rounded once to the parameter's dtype, as torch's CUDA ``_foreach_add_``
does; its CPU kernels round ``lr`` and weight decay's factor to the dtype of 16-bit parameters first, so for those,
and on the CPU only, the path ``kernels='torch'`` may land one unit of the last place away.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..compression import ChunkPlan, decode_replicas, from_coefficients


def sign_decode_torch(
    params: Sequence[torch.Tensor],
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
    plan: ChunkPlan,
    *,
    mode: str,
    lr: float,
    sign: bool,
    decay: float = 1.0,
) -> None:
    """Move ``params`` (one bucket's, ``plan`` stacked over them) by the sign rule on the replicas' ``parts``."""
    update = demo_decode_torch(parts, plan, mode=mode)
    if decay != 1.0:
        torch._foreach_mul_(list(params), decay)
    step = (update.sign_() if sign else update).to(params[0].dtype).view(len(params), -1)
    for p, s in zip(params, step.unbind(0)):  # in float32, rounded once (torch's CPU add would round lr to bf16)
        p.copy_(p.float().add_(s.view_as(p).float(), alpha=-lr))


def demo_decode_torch(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]], plan: ChunkPlan, *, mode: str, dtype=torch.float32
) -> torch.Tensor:
    """The decoded update, ``plan.rows x plan.cols`` in ``dtype``: the inverse DCT of the replicas' average."""
    return from_coefficients(decode_replicas(parts, plan, mode, dtype), plan, overwrite=True)
